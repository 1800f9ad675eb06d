"""The fused decoding steps' library, built and loaded (docs/decoding.md, "Fused in C on the CPU"): the C++ source
beside this file compiled by ``torch.utils.cpp_extension`` once per machine and version into the build cache (keyed
by the sources, the flags, torch, Python, the compiler and the CPU, under the trust rules of
:mod:`attnzoo.buildcache`), checked against its manifest and loaded by every later process, the ops' fake kernels
registered, the build lock renewed in a forked child, and :func:`status`: whether :mod:`.fused`'s steps run, or
why not (no compiler and no build, ``ATTNZOO_FUSED_DECODE=0``, a failed build, a setting that does not parse, a
damaged cache, another process holding the build lock past ``ATTNZOO_FUSED_LOCK_TIMEOUT``). Nothing raises out of
:func:`library` or :func:`status` (but an interrupt): a failure is one status line naming the variable or file,
and the torch steps run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .. import buildcache as build
from . import layout

_SOURCE = Path(__file__).with_name("fused_decode.cpp")
_BODY = "fused_decode_body.h"
_FLAGS = ["-O3", "-fopenmp"]
_LIBRARY, _MANIFEST = "fused_decode.so", "manifest.json"
#: seconds a process waits for the build lock another process holds (building the same key, or stopped with
#: Ctrl-Z) before it runs the torch steps instead: ``ATTNZOO_FUSED_LOCK_TIMEOUT`` (a build takes about 30 s on a
#: 2-core host, several times that under AddressSanitizer or a loaded machine)
_LOCK_TIMEOUT = 300.0
_LOCK = threading.Lock()
_LOADED: tuple[Ops | None, str | None] | None = None  # (the loaded ops, why not)
#: namespace -> the key of the library whose ops are registered under it in this process (a second library, e.g.
#: built from other sources, registers its ops under a namespace of its own)
_NAMESPACES: dict[str, str] = {}
_LIBRARIES: dict[str, Ops] = {}  # key -> the library loaded in this process (a library is never loaded twice)
_KEPT: list[int] = []  # the descriptors libraries were loaded through, kept open so their names stay unique


def _fresh_lock_in_child() -> None:
    """After a fork: the lock may have been held by a thread building, which the child does not have."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


class Ops:
    """The loaded ops: ``op(kernel)`` is the op overload of a ``KernelRule.kernel`` (or ``"append"``);
    ``namespace`` (``attnzoo`` unless another library already took it in this process), ``path`` (the library in
    the cache), ``built`` (True when this process compiled it)."""

    def __init__(self, namespace: str, path: Path, built: bool, key: str) -> None:
        self.namespace, self.path, self.built, self.key = namespace, path, built, key
        ns = getattr(torch.ops, namespace)
        self.ops = {kernel: getattr(ns, op).default for kernel, op in layout.KERNELS.items()}

    def op(self, kernel: str):
        return self.ops[kernel]

    def __repr__(self) -> str:
        return f"Ops({self.namespace!r}, {str(self.path)!r}, built={self.built})"


class _BuildFailed(Exception):
    pass


class _Unusable(Exception):
    """A setting or a file the library cannot be configured, built or loaded with: the status line (one line,
    naming it)."""


def _shown(value: str) -> str:
    """An environment variable's value as a status line shows it: quoted, escaped (one line), at most 200 chars."""
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _words(var: str) -> list[str]:
    """``$var`` split as a shell splits it; :class:`_Unusable` naming it if it does not parse."""
    given = os.environ.get(var, "")
    try:
        return shlex.split(given)
    except ValueError as exc:
        raise _Unusable(f"{var}={_shown(given)} does not parse as shell words ({exc}); fix or unset it") from None


def _compiler() -> list[str] | None:
    """The C++ compiler: ``$CXX``, else ``$CC`` (gcc and clang compile a ``.cpp`` as C++), else ``c++``, ``g++`` or
    ``clang++`` on the path; None if there is none. :class:`_Unusable` for a ``$CXX`` (``$CC``) that does not parse
    or names no command."""
    for var in ("CXX", "CC"):
        if os.environ.get(var):
            words = _words(var)
            if not words:
                raise _Unusable(f"{var}={_shown(os.environ[var])} names no compiler; set it to one, or unset it")
            return words
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return [found] if found else None


def _cache_root() -> Path:
    """The build cache's directory, checked (:func:`attnzoo.buildcache.cache_root`); :class:`_Unusable` naming the
    variable that chose it when it cannot be used."""
    for var in ("ATTNZOO_FUSED_CACHE_DIR", "ATTNZOO_CACHE_DIR"):
        if given := os.environ.get(var):
            try:
                return build.cache_root(Path(given).expanduser())
            except (build.CacheError, OSError, RuntimeError) as exc:  # RuntimeError: ~user of no user
                raise _Unusable(f"{var}={_shown(given)} cannot be the build cache: {_one_line(exc)}") from None
    return build.cache_root(build.cache_dir())


def _one_line(exc: BaseException) -> str:
    """The first line of ``exc`` (at most 300 characters), its type's name where it says nothing; the advice
    ``set ATTNZOO_CACHE_DIR`` reads ``set ATTNZOO_FUSED_CACHE_DIR`` where that variable chose the directory."""
    lines = str(exc).strip().splitlines()
    text = lines[0][:300] if lines else type(exc).__name__
    if os.environ.get("ATTNZOO_FUSED_CACHE_DIR"):
        text = text.replace("ATTNZOO_CACHE_DIR (or --cache-dir)", "ATTNZOO_FUSED_CACHE_DIR")
        text = text.replace("ATTNZOO_CACHE_DIR", "ATTNZOO_FUSED_CACHE_DIR")
    return text


def _lock_timeout() -> float:
    """``$ATTNZOO_FUSED_LOCK_TIMEOUT`` seconds (``inf``: no limit), else :data:`_LOCK_TIMEOUT`."""
    given = os.environ.get("ATTNZOO_FUSED_LOCK_TIMEOUT", "")
    if not given.strip():
        return _LOCK_TIMEOUT
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise _Unusable(f"ATTNZOO_FUSED_LOCK_TIMEOUT={_shown(given)} is not a number of seconds >= 0; fix or "
                        f"unset it")
    return seconds


def _machine() -> str:
    """The CPU the library is built for (``-march=native``): its model and feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "flags", "Features", "CPU implementer", "CPU part") and name not in fields:
            fields[name] = value.strip()
    return platform.machine() + " " + json.dumps(fields, sort_keys=True)


def _compiler_id(cxx: list[str]) -> str:
    """The compiler as the key sees it: its command, and the file it runs (path, size, mtime: an upgrade is another
    compiler) without running it."""
    found = shutil.which(cxx[0])
    try:
        st = os.stat(found)
    except (OSError, TypeError):  # TypeError: None, not found
        return shlex.join(cxx) + " (not found)"
    return f"{shlex.join(cxx)} {os.path.realpath(found)} {st.st_size} {st.st_mtime_ns}"


def _given_flags() -> list[str]:
    return _words("ATTNZOO_FUSED_CFLAGS")  # e.g. -fsanitize=address for a check


def _key(sources: dict[str, bytes], cxx: list[str], flags: list[str], namespace: str | None) -> str:
    data = {"sources": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(sources.items())},
            "flags": flags, "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None),
            "cxx11_abi": torch.compiled_with_cxx11_abi(), "python": sys.version.split()[0],
            "compiler": _compiler_id(cxx), "machine": _machine(), "namespace": namespace}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _compile() -> tuple[Ops | None, str | None]:
    """The ops, loaded from the build cache or built into it now; or None and why not (one line). Raises nothing
    but what interrupts (KeyboardInterrupt, SystemExit)."""
    try:
        return _set_up()
    except _Unusable as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever else fails: a line, and the torch steps
        return None, f"the fused C steps could not be set up: {type(exc).__name__}: {_one_line(exc)}"


def _configured() -> tuple[dict[str, bytes], list[str] | None, list[str], str, str, str]:
    """What the library is built from, as this process's settings say: (the sources, the compiler or None, the
    flags, the namespace of its ops, the key without the namespace, the key). :class:`_Unusable` for a setting
    that does not parse, OSError for a source that cannot be read."""
    sources = {"fused_decode.cpp": _SOURCE.read_bytes(), _BODY: (_SOURCE.parent / _BODY).read_bytes()}
    cxx = _compiler()
    flags = [*_FLAGS, *_given_flags()]
    base = _key(sources, cxx or ["none"], flags, None)
    namespace = "attnzoo" if _NAMESPACES.get("attnzoo", base) == base else f"attnzoo_{base[:12]}"
    sources["fused_decode_ops.h"] = layout.header(namespace).encode()
    return sources, cxx, flags, namespace, base, _key(sources, cxx or ["none"], flags, namespace)


def _set_up() -> tuple[Ops | None, str | None]:
    if os.environ.get("ATTNZOO_FUSED_DECODE", "1").strip() == "0":
        return None, "switched off (ATTNZOO_FUSED_DECODE=0)"
    try:
        sources, cxx, flags, namespace, base, key = _configured()
    except OSError as exc:
        return None, f"cannot read the fused step's source: {exc}"
    if key in _LIBRARIES:
        return _LIBRARIES[key], None
    damaged = None  # why the build in the cache for this key, if there is one, is not used
    try:
        root = _cache_root()
        found = _cached(root, key)
        built = False
        if not isinstance(found, tuple):
            damaged = found
            if cxx is None:
                return None, (f"no C++ compiler found (set CXX to one) and no build for this machine in {root}"
                              + _unused(damaged))
            timeout = _lock_timeout()
            with _locked(root, key, timeout):
                found = _cached(root, key)
                if not isinstance(found, tuple):
                    damaged = found
                    found = _build(root, key, sources, cxx, flags)
                    built = True
    except build.LockTimeout as exc:
        return None, (f"{_one_line(exc)}, waiting for its build (ATTNZOO_FUSED_LOCK_TIMEOUT={timeout:g}); a later "
                      f"process loads that build from the cache")
    except build.CacheError as exc:
        return None, f"the build cache cannot be used: {_one_line(exc)}"
    except _BuildFailed as exc:
        given = os.environ.get("ATTNZOO_FUSED_CFLAGS", "").strip()
        with_flags = f" with ATTNZOO_FUSED_CFLAGS={_shown(given)}" if given else ""
        return None, f"{shlex.join(cxx)} could not compile {_SOURCE.name}{with_flags}: {exc}" + _unused(damaged)
    except OSError as exc:  # a directory above the cache, what the compiler wrote, writing it into the cache
        return None, f"the build cache cannot be used: {_one_line(exc)}"
    path, library = found
    try:
        if library is not None:
            _load(path, library)
        _register_fakes(namespace)
        ops = Ops(namespace, path, built, key)
    except Exception as exc:  # noqa: BLE001 - ctypes' OSError, torch's RuntimeError, ...: a line
        if library is not None and library not in _KEPT:
            with contextlib.suppress(OSError):
                os.close(library)
        return None, f"the built library {path} did not load: {_one_line(exc)}"
    _NAMESPACES[namespace] = base
    _LIBRARIES[key] = ops
    return ops, None


def _unused(damaged: str | None) -> str:
    return "" if damaged is None else f"; the build in the cache is not used: {damaged}"


@contextlib.contextmanager
def _locked(root: Path, key: str, timeout: float):
    directory = root / "fused-decode"
    build.checked_dir(directory, create=True)
    waiting = (f" (building the fused decoding steps, or stopped); the torch steps run instead after {timeout:g} s "
               f"(ATTNZOO_FUSED_LOCK_TIMEOUT)")
    with build.locked(directory / f"{key[:32]}.lock", timeout, waiting):
        yield


def _cached(root: Path, key: str) -> tuple[Path, int] | str | None:
    """The cached library for ``key`` as (its path, an open descriptor of it whose bytes match the manifest); None
    when there is none; or, when there is one that is damaged, why it is not used (one line naming the file).
    :class:`CacheError` for what must not be followed or trusted."""
    if not build.checked_dir(root / "fused-decode"):
        return None
    directory = root / "fused-decode" / key[:32]
    if not build.checked_dir(directory):
        return None
    file = directory / _MANIFEST
    try:
        data = build.read_file(file)
    except OSError as exc:  # a directory there: os.fdopen refuses it before read_file looks at what it opened
        raise build.failed(file, "read it", exc) from None
    if data is None:
        return f"{file}: missing"
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # not UTF-8 (UnicodeDecodeError), not JSON, nested too deep
        return f"{file}: not a manifest ({type(exc).__name__}: {_one_line(exc)[:100]})"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return f"{file}: not this build's manifest (no key, or another)"
    digest_wanted = manifest.get("library")
    if not isinstance(digest_wanted, str):
        return f"{file}: no sha256 of the library"
    path = directory / _LIBRARY
    fd = _open_checked(path)
    if fd is None:
        return f"{path}: missing"
    digest = hashlib.sha256()
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        os.close(fd)
        raise build.failed(path, "read it", exc) from None
    if digest.hexdigest() != digest_wanted:
        os.close(fd)
        return f"{path}: its sha256 is not its manifest's"
    return path, fd


def _open_checked(path: Path) -> int | None:
    """``path`` opened without following a symbolic link, a regular file no other user owns or can write."""
    try:
        fd = os.open(path, os.O_RDONLY | build.NONBLOCK | build.NOFOLLOW | build.CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise build.symlink_error(path) from None
        raise build.failed(path, "read it", exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise build.CacheError(f"{path}: not a regular file, where attnzoo keeps one; remove it {build.FIX}")
        build.check_trusted(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _load(path: Path, fd: int) -> None:
    """Load the library through the descriptor whose bytes were checked (no second lookup of the path; the
    descriptor stays open, so that no later library is loaded under its name)."""
    import ctypes

    name = f"/proc/self/fd/{fd}"
    if not os.path.exists(name):  # no /proc: the path, checked a moment ago
        os.close(fd)
        name = str(path)
    else:
        _KEPT.append(fd)
    ctypes.CDLL(name)
    torch.ops.loaded_libraries.add(str(path))


def _native(cxx: list[str]) -> list[str]:
    """``-march=native`` where the compiler knows it."""
    try:
        done = subprocess.run([*cxx, "-march=native", "-x", "c++", "-E", "-o", os.devnull, os.devnull],
                              capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["-march=native"] if done.returncode == 0 else []


def _build(root: Path, key: str, sources: dict[str, bytes], cxx: list[str], flags: list[str]) -> tuple[Path, None]:
    """Compile the library in a private temporary directory (``torch.utils.cpp_extension``, which loads it into
    this process), then write it and its manifest into the cache, whole or not at all."""
    if shutil.which(cxx[0]) is None:
        raise _BuildFailed(f"{cxx[0]}: not found")
    try:
        from torch.utils import cpp_extension
    except Exception as exc:  # noqa: BLE001 - setuptools missing or broken: a line, and the torch steps
        raise _BuildFailed(f"torch.utils.cpp_extension does not import: {exc}") from None
    cflags = [*_native(cxx), *flags]
    ldflags = [f for f in flags if f != "-O3"]
    if not cxx[0].endswith("++"):
        ldflags.append("-lstdc++")
    directory = root / "fused-decode" / key[:32]
    name = f"attnzoo_fused_{key[:16]}"
    saved = os.environ.get("CXX")
    with tempfile.TemporaryDirectory(prefix="attnzoo-fused-") as tmp:  # mode 0700: private to this user
        for file, data in sources.items():
            Path(tmp, file).write_bytes(data)
        os.environ["CXX"] = shlex.join(cxx)  # cpp_extension's compiler (this process's environment, for the build)
        try:
            built = cpp_extension.load(name, [str(Path(tmp, "fused_decode.cpp"))], extra_cflags=cflags,
                                       extra_ldflags=ldflags, build_directory=tmp, verbose=False, with_cuda=False,
                                       is_python_module=False)
        except Exception as exc:  # noqa: BLE001 - the compiler's first error, on one line
            raise _BuildFailed(_first_error(str(exc))) from None
        finally:
            if saved is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = saved
        data = Path(built if isinstance(built, str) else Path(tmp, f"{name}.so")).read_bytes()
    build.checked_dir(directory, create=True)
    build.write_atomic(directory / _LIBRARY, data)
    manifest = {"key": key, "library": hashlib.sha256(data).hexdigest(), "torch": torch.__version__,
                "compiler": _compiler_id(cxx), "flags": cflags,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    build.write_atomic(directory / _MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return directory / _LIBRARY, None


def _first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith(("FAILED", "ninja", "subprocess", "Error building")):
            return line[:200]
    return (lines[-1] if lines else "failed")[:200]


_FAKES: set[str] = set()


def _register_fakes(namespace: str) -> None:
    """The ops' fake kernels: the output's shape and dtype from q (B, H, 1, D), nothing else, so torch.compile and
    FakeTensorMode trace through them (the mutated buffers keep their shapes). Every tensor argument must be on the
    device of the op's first (q, or k for the append), as the kernel requires (ValueError, one line, naming it):
    a meta q with buffers on the CPU would otherwise return a meta tensor and write nothing."""
    if namespace in _FAKES:
        return
    for kernel, op in layout.KERNELS.items():
        names = [name for name, _ in layout.OPS[op][0]]
        torch.library.register_fake(f"{namespace}::{op}", _fake(op, names, kernel != "append"))
    _FAKES.add(namespace)


def _fake(op: str, names: list[str], returns: bool):
    def fake(*args, **kwargs):
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        tensors = [(name, given[name]) for name in names if isinstance(given.get(name), torch.Tensor)]
        first, device = tensors[0][0], tensors[0][1].device
        for name, t in tensors[1:]:
            if t.device != device:
                raise ValueError(f"{op}: {name} is on {t.device}, {first} on {device}: the op's tensors must all be "
                                 f"on one device")
        if returns:
            q = given["q"]
            return q.new_empty(q.shape)  # contiguous, as the kernel makes it
        return None

    return fake


def library() -> Ops | None:
    """The fused ops (loaded, or built, on the first call in this process), or None: :func:`status` says why."""
    global _LOADED
    if _LOADED is None:
        with _LOCK:
            if _LOADED is None:
                _LOADED = _compile()
    return _LOADED[0]


def status() -> str:
    """One line: whether the blocked backend's lean decoding steps on the CPU run fused, or why not."""
    ops = library()
    if ops is not None:
        how = "built now" if ops.built else "loaded from the build cache"
        return (f"fused C steps (torch ops {ops.namespace}::*_step, {how}, {torch.get_num_threads()} threads) for "
                f"selective, sink_window, h2o and tova in float32/float64")
    return f"torch lean steps: the fused C steps are unavailable: {_LOADED[1]}"

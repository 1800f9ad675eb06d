"""Build artifacts: generated Triton kernel sources, cached on disk and keyed by what they depend on.

An artifact is a directory ``<cache>/<key>/`` holding ``kernels.py`` and ``kernels_backward.py`` (the generated
forward and backward sources) and ``manifest.json`` (spec name and hash, versions, each source's sha256). The key
is the sha256 of the spec hash, the attnzoo version, the Triton and torch versions, the generator version and a
fingerprint of the template and of the spec's transforms' lowerings (a plugin that changes a fragment gets a new
key). The cache directory is ``$ATTNZOO_CACHE_DIR``, or the per-user cache directory (``platformdirs``).

Trust: the code that runs is the code generated now. The sources are generated in the process (deterministic,
under a millisecond; once per key and process) and imported from memory (:func:`load_kernels`); the files on disk
are an artifact for people and for ``--compile-for``, never imported. An artifact whose files differ from the
sources generated now is damaged and rewritten. Nothing in the cache is followed through a symbolic link (files
and locks are opened with ``O_NOFOLLOW``, directories checked with ``lstat``), and a cache directory, artifact
directory or file that another user can write (or owns; root excepted) is refused with one line saying how to fix
it (:class:`CacheError`), as ssh's ``StrictModes`` refuses such files; nothing is overwritten then.

Building follows check → lock → check → write: files are written to a temporary name and renamed (atomic), the
manifest last, so a reader sees a whole artifact or none; a file lock per key keeps concurrent builds of one key
from colliding.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.abc
import importlib.util
import json
import os
import secrets
import stat
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from ...errors import AttnzooError
from ...plan import Plan
from ...registry import get_registry
from ...spec import load_spec

#: the generated sources of an artifact, by part: the forward kernels load on first use, the backward ones on the
#: first backward pass
SOURCES = {"forward": "kernels.py", "backward": "kernels_backward.py"}
MANIFEST = "manifest.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted where a file belongs must not hang the open
_CLOEXEC = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_FIX = "or set ATTNZOO_CACHE_DIR to a directory only you can write"


class CacheError(AttnzooError):
    """The artifact cache cannot be used safely or at all (a symbolic link, something another user can write, not
    a directory, not writable). One line: the path, what is wrong, how to fix it."""


def cache_dir() -> Path:
    """Where artifacts live: ``$ATTNZOO_CACHE_DIR`` or the per-user cache directory."""
    env = os.environ.get("ATTNZOO_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("attnzoo"))


def triton_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:  # noqa: BLE001 - not installed (or broken metadata): no version to key on
        return None


def toolchain() -> dict[str, Any]:
    from .codegen import GENERATOR_VERSION

    return {"attnzoo": __version__, "generator": GENERATOR_VERSION, "torch": torch.__version__,
            "triton": triton_version()}


def artifact_key(spec, plan=None, registry=None) -> str:
    """sha256 of the spec hash, every version the generated source depends on, and the generator's fingerprint
    of the template and of the spec's transforms' lowerings."""
    from .codegen import fingerprint

    plan = plan or Plan.from_spec(spec, registry or get_registry())
    data = json.dumps({"spec": spec.hash, **toolchain(), "lowering": fingerprint(plan)}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()


@dataclass
class Artifact:
    spec_name: str
    key: str
    directory: Path
    manifest: dict[str, Any]
    hit: bool  # True when it was already in the cache, whole and identical to the sources generated now
    sources: dict[str, bytes] = field(default_factory=dict, repr=False)  # file name -> the source generated now

    @property
    def source_path(self) -> Path:
        """The forward kernels' source."""
        return self.directory / SOURCES["forward"]

    def path(self, part: str) -> Path:
        return self.directory / SOURCES[part]


# -- what the cache trusts ----------------------------------------------------------------------------------------
def _trusted_owners() -> set[int]:
    """Who may own the cache and what it holds: this user and root (ssh's ``StrictModes``)."""
    return {0, os.getuid()}


@functools.cache
def _private_group(gid: int, uid: int) -> bool:
    """True if user ``uid`` is the only member of group ``gid`` (a user private group, where umask 002 is usual),
    so that group write is the owner's own (Debian's reading of ssh's ``StrictModes``)."""
    import grp
    import pwd

    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    primary = {p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid}
    return primary <= {uid} and set(group.gr_mem) <= {user.pw_name} and bool(primary or group.gr_mem)


def _writable_by_others(st: os.stat_result) -> int:
    """The mode bits through which a user other than the owner can write (0: none)."""
    bits = st.st_mode & stat.S_IWOTH
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, st.st_uid):
        bits |= stat.S_IWGRP
    return bits


def check_trusted(path: Path, st: os.stat_result) -> None:
    """Refuse ``path`` (:class:`CacheError`) if a user other than this one or root owns it or can write it."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes (Windows)
        return
    if st.st_uid not in _trusted_owners():
        raise CacheError(f"{path}: owned by another user (uid {st.st_uid}), so attnzoo will not use it; remove it "
                         f"{_FIX}")
    if _writable_by_others(st):
        raise CacheError(f"{path}: other users can write it (mode {stat.filemode(st.st_mode)}), so attnzoo will "
                         f"not use it; fix: chmod go-w {path}, {_FIX}")


def _symlink(path: Path) -> CacheError:
    return CacheError(f"{path}: a symbolic link, which attnzoo never follows in its cache; remove it "
                      f"(rm {path}) {_FIX}")


def _failed(path: Path, doing: str, exc: OSError) -> CacheError:
    return CacheError(f"{path}: cannot {doing} ({exc.strerror or exc}); {_FIX.removeprefix('or ')}")


def _drop_others_write(path: Path | int) -> None:
    """Take away the write bits another user would have on what we just created (a umask of 000, say), so the
    cache never holds what it would refuse."""
    if not hasattr(os, "getuid"):
        return
    st = os.stat(path)
    if bits := _writable_by_others(st):
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~bits)


def _mkdir_private(path: Path, shown: Path, doing: str) -> None:
    """Create directory ``path`` (the umask applies, as to any directory) with no write bit another user would
    have; nothing if it exists; :class:`CacheError` naming ``shown`` otherwise."""
    try:
        os.mkdir(path, 0o777)
        _drop_others_write(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _failed(shown, doing, exc) from None


def checked_dir(path: Path, create: bool = False) -> bool:
    """Check that ``path`` is a real directory (not a symbolic link) that only its owner, this user or root, can
    write; created first when ``create``. False if it is absent (and not created); :class:`CacheError` otherwise."""
    if create:
        _mkdir_private(path, path, "create this directory")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise _failed(path, "read this directory", exc) from None
    if stat.S_ISLNK(st.st_mode):
        raise _symlink(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{path}: not a directory, where attnzoo keeps one; remove it {_FIX}")
    check_trusted(path, st)
    return True


def cache_root(root: Path) -> Path:
    """``root`` as a cache directory: created if absent; refused (:class:`CacheError`, one line) if it is not a
    directory, or it or a directory above it can be written by another user (a sticky one such as /tmp excepted
    above it). The cache directory itself may be a symbolic link (as ``~/.cache`` often is): its target is checked."""
    root = Path(root)
    missing = []
    for path in (root, *root.parents):
        if os.path.lexists(path):
            break
        missing.append(path)
    for path in reversed(missing):  # as ``mkdir -p``, never writable by others
        _mkdir_private(path, root, "create the cache directory")
    try:
        real = Path(os.path.realpath(root))
        st = os.stat(real)
    except OSError as exc:
        raise _failed(root, "use it as the cache directory", exc) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{root}: not a directory, so it cannot be the cache directory; set ATTNZOO_CACHE_DIR (or "
                         f"--cache-dir) to a directory")
    check_trusted(root, st)
    for parent in real.parents:  # whoever can write a directory above can replace the cache
        pst = os.stat(parent)
        if not (pst.st_mode & stat.S_ISVTX and pst.st_uid in _trusted_owners()):
            check_trusted(parent, pst)
    return root


def read_file(path: Path) -> bytes | None:
    """The bytes of ``path``, a regular file in the cache, opened without following a symbolic link; None if it
    is absent. :class:`CacheError` for a symbolic link, not a regular file, or one another user can write."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise _symlink(path) from None
        raise _failed(path, "read it", exc) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file, where attnzoo keeps one; remove it {_FIX}")
        check_trusted(path, st)
        return f.read()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary name, then a rename), with the mode an ordinary file gets
    (``0o666`` less the umask, less any write bit another user would have), so a cache shared by CI jobs of one
    user stays readable by all of them. Never replaces a symbolic link, nor a file another user can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise _failed(path, "write it", exc) from None
    else:
        if stat.S_ISLNK(st.st_mode):
            raise _symlink(path)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file, where attnzoo keeps one; remove it {_FIX}")
        check_trusted(path, st)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    while True:  # mkstemp's names, but not its 0o600: os.open applies the umask to 0o666
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise _failed(path.parent, "write in it", exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            _drop_others_write(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a rename: replaces the name, never writes through it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def _locked(path: Path):
    """Hold the lock file ``path`` (created if absent; never followed through a symbolic link, never truncated)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: filelock's own lock
        from filelock import FileLock

        with FileLock(str(path)):
            yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NONBLOCK | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise _symlink(path) from None
        raise _failed(path, "create this lock file", exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file, where attnzoo keeps a lock file; remove it {_FIX}")
        if st.st_uid == os.getuid():
            _drop_others_write(fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# -- build ----------------------------------------------------------------------------------------------------
_generated: dict[str, dict[str, bytes]] = {}  # key -> the sources generated in this process, by file name


def generated_sources(plan, key: str) -> dict[str, bytes]:
    """``plan``'s generated sources by file name, generated once per key and process (the key covers everything
    the generated text depends on)."""
    from .codegen import generate

    if key not in _generated:
        _generated[key] = {SOURCES[part]: text.encode() for part, text in generate(plan).items()}
    return _generated[key]


def _try_load(directory: Path, key: str, spec_name: str, sources: dict[str, bytes]) -> Artifact | None:
    """The artifact in ``directory`` if it is whole and its files are the sources generated now; None if absent
    or damaged. :class:`CacheError` for anything that must not be followed or trusted."""
    if not checked_dir(directory):
        return None
    for name, data in sources.items():
        if read_file(directory / name) != data:
            return None
    try:
        manifest = json.loads(read_file(directory / MANIFEST) or b"")
    except ValueError:
        return None
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()}
    if not isinstance(manifest, dict) or manifest.get("key") != key or manifest.get("sources") != digests:
        return None
    return Artifact(spec_name, key, directory, manifest, hit=True, sources=sources)


def build(spec, registry=None, root: Path | None = None, force: bool = False, plan=None) -> Artifact:
    """The artifact of ``spec`` (a path, registered name or Spec): its sources generated now, written to the cache
    unless the cache already holds exactly them.

    Raises ValueError when the spec cannot be lowered to Triton (the reasons name the transforms), and
    :class:`CacheError` (one line) for a cache that cannot be used safely. ``plan`` (optional) is the spec already
    resolved against its registry.
    """
    if plan is None:
        registry = registry or get_registry()
        plan = Plan.from_spec(load_spec(spec, registry=registry), registry)
    loaded = plan.spec
    key = artifact_key(loaded, plan)
    sources = generated_sources(plan, key)
    root = cache_root(cache_dir() if root is None else Path(root))
    directory = root / key[:32]
    if not force and (found := _try_load(directory, key, loaded.name, sources)) is not None:
        return found
    with _locked(root / f"{key[:32]}.lock"):
        if not force and (found := _try_load(directory, key, loaded.name, sources)) is not None:
            return found
        checked_dir(directory, create=True)
        manifest = {
            "key": key, "spec": loaded.name, "spec_hash": loaded.hash, **toolchain(),
            "sources": {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for name, data in sources.items():
            write_atomic(directory / name, data)
        write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return Artifact(loaded.name, key, directory, manifest, hit=False, sources=sources)


# -- load -----------------------------------------------------------------------------------------------------
class _InMemory(importlib.abc.Loader):
    """Runs a generated source from its text in memory, and hands that text to whoever reads a kernel's source:
    ``inspect`` (Triton's ``@jit``, its interpreter) asks the module's loader through ``linecache``, as the name
    given to the code (``<file> (in memory)``) is no file."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.filename = filename

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        exec(compile(self.text, self.filename, "exec"), module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.text


_modules: dict[str, Any] = {}


def kernel_module_name(key: str, part: str, interpreted: bool) -> str:
    """The module name a spec's generated ``part`` is imported as (Triton's hooks see kernels by module)."""
    return f"attnzoo_kernels_{key[:16]}_{part}{'_interp' if interpreted else ''}"


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``; CPU checking mode)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load_kernels(spec, registry=None, root: Path | None = None, plan=None, part: str = "forward"):
    """The module of ``spec``'s ``part`` ("forward" or "backward") kernels, run from the source generated now
    (never imported from the cache's file): built if absent, loaded once per process (and per interpreter mode,
    which Triton reads when the kernels are defined)."""
    artifact = build(spec, registry, root, plan=plan)
    name = kernel_module_name(artifact.key, part, interpreting())
    if name not in _modules:
        loader = _InMemory(artifact.sources[SOURCES[part]].decode(), f"{artifact.path(part)} (in memory)")
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        sys.modules[name] = module  # triton resolves the kernels' globals through the module
        try:
            loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[name] = module
    return _modules[name]

"""Ahead-of-time compilation: a spec's kernels compiled at build time for named GPUs, loaded at run time.

``attnzoo build --compile-for 90`` runs the triton backend's own launch code on CPU tensors as if on an sm_90 GPU,
with the kernels replaced by recorders (:func:`capture`): a batch call with its backward pass, the same with a
key mask (padding), a prefill and a decode step. Every recorded launch is specialised exactly as Triton's
launcher specialises it on the GPU (:func:`specialise`: argument types, pointer alignment, constexprs, compile
options), compiled with Triton's GPU compiler (no GPU needed) into the artifact, under
``compiled/sm_<arch>/triton/`` in Triton's own cache layout, and listed in ``compiled/sm_<arch>/index.json`` with
the compile hash that Triton computes for it.

At run time, before the first launch on a GPU of compute capability ``arch``, the backend copies those files into
Triton's cache directory (:func:`install`); Triton's launcher then finds each kernel there instead of compiling
it. A jit-cache hook (:func:`_on_compile`) sees every kernel Triton is about to compile: when it is one of a
spec's kernels whose hash is not among the stored ones (never compiled for this GPU, another head dim or dtype,
another Triton, a changed option), it warns with :class:`KernelCompileWarning`, naming the spec, the kernel and
the command that would compile it ahead of time, and lets Triton compile it.

The generated kernels do not specialise on sizes (``codegen.SIZES``): one compiled kernel serves every sequence
length, batch and head count, so the variants are the dtype, the head dim and the call's kind (with or without a
key mask, the accumulator's initial carry in prefill, the decode kernel). Cases outside the captured ones
(positions that do not increase, say) compile on first use, with the warning.

Trust: the ``compiled/`` directories and files are checked as the rest of the artifact (``build.py``): never a
symbolic link, nothing another user can write or own. Triton's launcher takes a stored kernel only under the
compile hash it computes now from the generated source, the options and the target, so a stored kernel is never
used for another source. The cubins' contents are not verified: they are trusted as Triton trusts its own cache
directory, into which they are copied (an entry Triton's cache already holds is kept, not replaced).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

COMPILED = "compiled"
INDEX = "index.json"
_TRITON_FILES = "triton"


class KernelCompileWarning(RuntimeWarning):
    """A spec's kernel is compiled on first use because no build-time compiled kernel matches it."""


def arch_dir(artifact_dir: Path, arch: int) -> Path:
    return Path(artifact_dir) / COMPILED / f"sm_{arch}"


def parse_arch(text: str | int) -> int:
    """90, "90", "sm_90" or "9.0" -> 90."""
    raw = str(text).strip().lower().removeprefix("sm_")
    if "." in raw:
        major, _, minor = raw.partition(".")
        raw = major + minor
    if not raw.isdigit() or not 50 <= int(raw) < 200:
        raise ValueError(f"--compile-for {text!r}: expected a CUDA compute capability such as 80, 90 or sm_90")
    return int(raw)


#: the dtypes the kernels take on a GPU (as :meth:`TritonBackend.supports` says; float64 is declined)
DTYPES = ("float32", "float16", "bfloat16")


def targets(archs, dtypes, head_dims) -> tuple[list[int], list[torch.dtype], list[int]]:
    """``--compile-for``'s architectures, ``--dtype``'s names and ``--head-dim``'s sizes, checked before anything
    is built or compiled: ValueError (one line) for an unknown architecture, a dtype the kernels do not take, a
    head dim below 1, or a process in Triton's interpreter."""
    parsed = [parse_arch(a) for text in archs for a in str(text).split(",") if a.strip()]
    if not parsed:
        raise ValueError("--compile-for: expected a CUDA compute capability such as 80, 90 or sm_90")
    for name in dtypes:
        if name not in DTYPES:
            why = " (float64: the kernels accumulate in float32)" if name == "float64" else ""
            raise ValueError(f"--dtype {name}: the triton kernels take {', '.join(DTYPES[:-1])} or {DTYPES[-1]}{why}")
    for head_dim in head_dims:
        if head_dim < 1:
            raise ValueError(f"--head-dim {head_dim}: a head dim is a number of channels, at least 1 (e.g. 64, 128)")
    from .build import interpreting

    if interpreting():
        raise ValueError("--compile-for needs a process without TRITON_INTERPRET=1")
    return parsed, [getattr(torch, name) for name in dict.fromkeys(dtypes)], list(dict.fromkeys(head_dims))


def gpu_target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


# -- capture ----------------------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One kernel launch the backend made, recorded instead of run."""

    part: str  # "forward" or "backward" (which generated module)
    name: str  # the kernel's name, e.g. "_fwd"
    fn: Any    # the JITFunction
    args: tuple
    kwargs: dict
    case: str  # which captured call made it


@dataclass
class _Recorder:
    """Stands in for a generated kernels module: ``recorder._fwd[grid](...)`` records the launch."""

    module: Any
    part: str
    launches: list
    case: list = field(default_factory=lambda: [""])

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    recorder.launches.append(Launch(recorder.part, name, fn, args, dict(kwargs), recorder.case[0]))
                return launch

        return _Grid()


def capture(backend, plan, arch: int, dtype: torch.dtype, head_dim: int, registry=None) -> list[Launch]:
    """The launches the triton backend makes on a GPU of compute capability ``arch`` for ``dtype`` and
    ``head_dim``: batch forward and backward (with and without a key mask), prefill and a decode step."""
    from ...decode.create import new_cache
    from ...decode.step import held_step
    from ...transforms.base import Dims

    launches: list[Launch] = []
    case = [""]
    gen = torch.Generator().manual_seed(0)
    b, h, n = 2, 2, 40
    dims = Dims(h, head_dim, h)

    def tensors(count):
        return [torch.randn(b, h, count, head_dim, generator=gen).to(dtype) for _ in range(3)]

    def grouped(count, grad):
        params = plan.init_params(dims, dtype=dtype)
        for p in params.values():
            p.requires_grad_(grad)
        inputs = {key: torch.randn(b, h, count, generator=gen).to(dtype) for key in plan.token_inputs()}
        like = torch.empty(0, dtype=dtype)
        return plan.add_inputs(plan.split_params(params, dims, like), inputs or None, b, h, count, like)

    with backend.aot_target(arch, lambda module, part: _Recorder(module, part, launches, case)):
        positions = torch.arange(1, n + 1).expand(b, n)
        padding = torch.ones(b, n, dtype=torch.bool)
        padding[1, :7] = False
        for label, mask in (("batch", None), ("batch with key mask", padding)):
            case[0] = label
            q, k, v = (t.requires_grad_() for t in tensors(n))
            out = backend.forward(plan, q, k, v, grouped(n, True), positions, mask)
            out.float().sum().backward()
        if plan.causal:
            with torch.no_grad():
                cache = new_cache(plan, b)
                case[0] = "prefill"
                held_step(plan, backend, *tensors(n), cache, grouped(n, False), evict_first=False)
                case[0] = "decode"
                held_step(plan, backend, *tensors(1), cache, grouped(1, False), evict_first=False)
    return launches


# -- specialisation and hashes ----------------------------------------------------------------------------------
@dataclass
class Compilation:
    """What Triton compiles for one launch: its source (an ``ASTSource``), options, target and compile hash."""

    name: str
    src: Any
    options: Any
    target: Any
    hash: str
    constants: dict

    def label(self) -> str:
        return variant_label(self.name, self.constants)


def variant_label(name: str, constants: dict) -> str:
    """``_fwd[BLOCK_M=64, ..., HAS_KMASK=False]``: a kernel and its constexpr flags, as warnings and rows name it."""
    flags = {str(k[0] if isinstance(k, tuple) else k): v for k, v in constants.items()}
    shown = [f"{k}={v}" for k, v in flags.items() if k.isupper() and v is not None]
    return f"{name}[{', '.join(shown)}]"


def _names(fn) -> list[str]:
    return [p.name for p in fn.params]


def compile_hash(fn, signature, constexprs, attrs, options, target) -> tuple[Any, str]:
    """(ASTSource, hash) exactly as ``triton.compile`` computes them (the name of the cache entry)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.cache import get_cache_key

    backend = make_backend(target)
    src = ASTSource(fn, signature, constexprs, attrs)
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    return src, hashlib.sha256(key.encode("utf-8")).hexdigest()


def specialise(launch: Launch, arch: int) -> Compilation:
    """The compilation Triton's launcher (``JITFunction.run``) makes of ``launch`` on an sm_``arch`` GPU: the same
    binder, the same argument packing, the same options; only the target is given rather than read from a GPU."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = gpu_target(arch)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, extra = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, extra)
    src, digest = compile_hash(fn, signature, constexprs, attrs, options, target)
    named = {(_names(fn)[path[0]] if len(path) == 1 else path): value for path, value in constexprs.items()}
    return Compilation(launch.name, src, options, target, digest, named)


# -- build time -------------------------------------------------------------------------------------------------
def compile_for(backend, plan, artifact_dir: Path, arch: int, dtype: torch.dtype, head_dim: int,
                shared_limit: int | None = None, registry=None) -> list[dict]:
    """Compile ``plan``'s kernels for sm_``arch`` into the artifact and add them to its index. One row per
    distinct compilation: kernel (with its constexprs), cases, hash, shared memory, seconds, error or None."""
    import time

    import triton

    from .build import checked_dir, triton_version, write_atomic

    targets([arch], [str(dtype).removeprefix("torch.")], [head_dim])  # before anything is stored
    directory = arch_dir(artifact_dir, arch)
    files = directory / _TRITON_FILES
    for path in (directory.parent, directory, files):  # never through a symbolic link, never another user's
        checked_dir(path, create=True)
    index = read_index(artifact_dir, arch) or {"entries": {}}
    compilations: dict[str, tuple[Compilation, list[str]]] = {}
    for launch in capture(backend, plan, arch, dtype, head_dim, registry):
        comp = specialise(launch, arch)
        compilations.setdefault(comp.hash, (comp, []))[1].append(launch.case)
    rows = []
    with triton_cache(str(files)):
        for digest, (comp, cases) in compilations.items():
            start = time.perf_counter()
            row = {"kernel": comp.name, "variant": comp.label(), "cases": sorted(set(cases)), "hash": digest,
                   "shared": None, "limit": shared_limit, "error": None}
            try:
                compiled = triton.compile(comp.src, target=comp.target, options=comp.options.__dict__)
                row["shared"] = compiled.metadata.shared
            except Exception as exc:  # noqa: BLE001 - reported per kernel, one line
                row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            row["seconds"] = time.perf_counter() - start
            if row["error"] is None and shared_limit is not None and row["shared"] > shared_limit:
                row["error"] = f"needs {row['shared']} B of shared memory, sm_{arch} has {shared_limit} B"
            if row["error"] is None:
                index["entries"][digest] = {"kernel": comp.name, "variant": row["variant"], "cases": row["cases"],
                                            "dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim,
                                            "shared": row["shared"]}
            rows.append(row)
    index.update(spec=plan.spec.name, arch=arch, triton=triton_version())
    write_atomic(directory / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return rows


def read_index(artifact_dir: Path, arch: int) -> dict | None:
    """The index of the kernels compiled for sm_``arch``, or None if there is none (or it is damaged). The
    directories and the file are checked as the artifact is (no symbolic link, nothing another user can write:
    ``build.CacheError`` otherwise)."""
    from .build import checked_dir, read_file

    directory = arch_dir(artifact_dir, arch)
    if not all(checked_dir(path) for path in (directory.parent, directory)):
        return None
    try:
        index = json.loads(read_file(directory / INDEX) or b"")
    except ValueError:
        return None
    return index if isinstance(index, dict) and isinstance(index.get("entries"), dict) else None


# -- run time ---------------------------------------------------------------------------------------------------
@dataclass
class _Expected:
    spec: str
    arch: int
    hashes: set[str]
    why_missing: str  # said when a kernel's hash is not among ``hashes``


#: the dtype and head dim of the call launching kernels in this thread (set by the backend), for the message
CALL = threading.local()
_EXPECTED: dict[str, _Expected] = {}  # generated module name -> what was compiled at build time
_WARNED: set[tuple[str, str]] = set()
_LOCK = threading.Lock()
_HOOKED: list[Any] = []  # [the hook that was there before ours] once ours is installed


def install(artifact_dir: Path, arch: int, modules: list[str], spec_name: str, cache_dir: str | None = None
            ) -> int:
    """Make the kernels compiled at build time for sm_``arch`` visible to Triton's launcher (copied into its
    cache directory, ``cache_dir`` or Triton's own), and register ``modules`` (the spec's generated module names)
    with the compile hook. Returns how many compiled kernels were installed."""
    from triton import knobs

    from .build import checked_dir

    index = read_index(artifact_dir, arch)
    files = arch_dir(artifact_dir, arch) / _TRITON_FILES
    hashes: set[str] = set()
    if index is None or not checked_dir(files):
        why = f"no kernels were compiled for sm_{arch} at build time"
    else:
        why = f"not among the {len(index['entries'])} kernels compiled for sm_{arch} at build time"
        target = Path(cache_dir or knobs.cache.dir)
        try:
            target.mkdir(parents=True, exist_ok=True)
            for entry in sorted(files.iterdir()):
                if entry.is_symlink() or not entry.is_dir() or (target / entry.name).exists():
                    continue  # a symbolic link is never followed; what Triton's cache holds already, it keeps
                _copy_compiled(entry, target / entry.name)
            hashes = set(index["entries"])
        except OSError as exc:  # Triton's cache not writable, say: the kernels compile on first use, with the warning
            why = f"not installed from the build-time kernels for sm_{arch} ({exc.strerror or exc})"
    with _LOCK:
        for module in modules:
            _EXPECTED[module] = _Expected(spec_name, arch, hashes, why)
        _hook()
    return len(hashes)


def _copy_compiled(entry: Path, target: Path) -> None:
    """Copy one kernel's directory of Triton's cache layout (its cubin, metadata and IRs) into Triton's cache,
    checked as the artifact is (``build.CacheError`` for what another user can write); Triton's lock and temporary
    files stay behind, and a symbolic link is never followed."""
    from .build import check_trusted, checked_dir

    checked_dir(entry)
    for item in entry.iterdir():
        if not item.is_symlink():
            check_trusted(item, item.lstat())
    shutil.copytree(entry, target, ignore=lambda directory, names: [
        name for name in names if name == "lock" or ".tmp" in name or os.path.islink(os.path.join(directory, name))])


def _hook() -> None:
    """Install :func:`_on_compile` as Triton's jit-cache hook, keeping (and calling) any hook already there."""
    from triton import knobs

    if _HOOKED and knobs.runtime.jit_cache_hook is _on_compile:
        return
    _HOOKED[:] = [knobs.runtime.jit_cache_hook]
    knobs.runtime.jit_cache_hook = _on_compile


def _on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **extra):
    """Triton calls this before compiling a kernel it has not in memory. For a spec's kernel, warn when the
    kernel was not compiled at build time; never stops the compilation (unless a hook installed before ours
    does)."""
    module = getattr(fn.module, "__name__", fn.module) if fn is not None else None
    expected = _EXPECTED.get(module)
    if expected is not None:
        try:
            check_compiled(expected, fn.name, fn.jit_function, compile)
        except Exception as exc:  # noqa: BLE001 - a check that fails must never stop a kernel from compiling
            warnings.warn(f"attnzoo triton: could not check whether kernel {fn.name} of spec '{expected.spec}' was "
                          f"compiled at build time ({type(exc).__name__}: {exc}); compiling it", KernelCompileWarning,
                          stacklevel=2)
    previous = _HOOKED[0] if _HOOKED else None
    if previous is not None:
        return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                        already_compiled=already_compiled, **extra)
    return None


def check_compiled(expected: _Expected, name: str, jit_function, compile: dict) -> bool:
    """True if the compilation Triton is about to make (the hook's ``compile`` argument) was compiled at build
    time; otherwise warn once per spec and kernel variant, and return False."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    data = json.loads(compile["specialization_data"])
    target = GPUTarget(**data["target"])
    options = make_backend(target).parse_options({k: tuple(v) if isinstance(v, list) else v
                                                  for k, v in data["options"].items()})
    _, digest = compile_hash(jit_function, compile["signature"], compile["constants"], compile["configs"][0],
                             options, target)
    if digest in expected.hashes:
        return True
    names = _names(jit_function)
    consts = {(names[path[0]] if isinstance(path, tuple) and len(path) == 1 else str(path)): value
              for path, value in compile["constants"].items()}
    label = variant_label(name, consts)
    dtype, head_dim = getattr(CALL, "case", (None, None))
    dtype = str(dtype).removeprefix("torch.") if dtype is not None else "<dtype>"
    with _LOCK:
        if (expected.spec, digest) in _WARNED:
            return False
        _WARNED.add((expected.spec, digest))
    warnings.warn(f"attnzoo triton: spec '{expected.spec}' kernel {label} for sm_{target.arch} ({dtype}) is "
                  f"{expected.why_missing}; compiling it now (seconds). To compile it ahead of time: attnzoo build "
                  f"{expected.spec} --compile-for {target.arch} --dtype {dtype} --head-dim {head_dim or '<D>'}",
                  KernelCompileWarning, stacklevel=2)
    return False


@contextmanager
def triton_cache(directory: str):
    """Triton's cache directory set to ``directory`` for the block (tests, gpu_check's cold/warm timings)."""
    from triton import knobs

    with knobs.cache.scope():
        knobs.cache.dir = str(directory)
        yield

"""Fused decoding steps on the CPU: one C call per fast step (docs/decoding.md, "A step validated once").

A torch fast step (:mod:`attnzoo.decode.fast`: selective attention, sink + window, H2O, TOVA at their budget) is
some 15-25 small torch operations, each costing more than the attention over a small cache. Here each is one call
into C (``fused_decode.c`` and ``fused_decode_body.h`` beside this file): the evictor's victim, the new token into
its slot, attention over the held tokens and the scores updated in place, for float32 and float64 on the CPU. The C
body is each evictor's rule written a second time; its options come from the evictor (``Evictor.kernel_rule``),
and :func:`attnzoo.decode.check.check_fast_step` holds it to the Python rule.

The C source is compiled once per process, by the first step that can use it, with the system's C compiler
(``$CC``, else ``cc``, ``gcc`` or ``clang``; ``$ATTNZOO_FUSED_CFLAGS`` adds flags, e.g. ``-fsanitize=address``)
into a private temporary directory that is removed as soon as the library is loaded: nothing compiled is ever
read back from a shared place. Without a compiler, or with
``ATTNZOO_FUSED_DECODE=0``, the torch lean steps run: the same maths, slower. :func:`status` says which and why
(``attnzoo explain SPEC --mode decode`` prints it), and ``KVCache.lean_step_kind`` which one a cache takes.

What a step assumes is checked here in Python before the C code sees a pointer, as torch checks a view before it
reads one: the buffers the step writes (keys, values, positions, scores: plain CPU tensors of the dtype, no negative
or conjugate bit, no two elements in one place, a storage that covers every element the step touches) once when they
change, by identity and by address (a storage freed or resized through a view moves its address); the query, key
and value (a plain ``torch.Tensor``, not a subclass, a fake or a meta tensor; dtype, shape, strides, no negative bit
(float32 and float64 cannot carry the conjugate bit), a storage covering the view) at every call, as torch pays for
every call's inputs. A storage that does not cover its view is refused with one line (a ValueError, from
:func:`check_inputs`, which the torch lean steps run too); anything else unexpected takes the torch lean step.

The library is compiled under a lock that a fork would leave held in the child (the thread compiling does not exist
there): a handler registered with ``os.register_at_fork`` gives the child a fresh lock, so a child that needs the
library compiles its own.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .state import FastStep, check_inputs, extent

_SOURCE = Path(__file__).with_name("fused_decode.c")
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd"]
_LOCK = threading.Lock()
_LOADED: tuple[ctypes.CDLL | None, str | None] | None = None  # (library, why not)


def _fresh_lock_in_child() -> None:
    """After a fork: the lock may have been held by a thread compiling, which the child does not have."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)

#: indices of the layout block (the LAY_* enum of fused_decode.c)
(_B, _HKV, _G, _D, _M, _K, _KSB, _KSH, _V, _VSB, _VSH, _P, _PSB, _PSH, _S, _SSB, _SSH, _W,
 _OPT0, _OPT1, _OPT2, _OPT3, _SIZE) = range(23)
_STEPS = ("selective", "sink_window", "scoring")
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _compiler() -> list[str] | None:
    given = os.environ.get("CC")
    if given:
        return shlex.split(given)
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _compile() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("ATTNZOO_FUSED_DECODE", "1").strip() == "0":
        return None, "switched off (ATTNZOO_FUSED_DECODE=0)"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC to one)"
    with tempfile.TemporaryDirectory(prefix="attnzoo-fused-") as tmp:  # mode 0700: private to this user
        target = Path(tmp) / "fused_decode.so"
        why = "no attempt"
        given = shlex.split(os.environ.get("ATTNZOO_FUSED_CFLAGS", ""))  # e.g. -fsanitize=address for a check
        for extra in (["-march=native"], []):  # built for this machine; the plain build where that flag is unknown
            command = [*cc, *_FLAGS, *extra, *given, str(_SOURCE), "-o", str(target), "-lm"]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                why = f"{type(exc).__name__}: {exc}"
                continue
            if done.returncode == 0:
                try:
                    lib = ctypes.CDLL(str(target))
                except OSError as exc:
                    return None, f"the compiled library did not load: {exc}"
                return _bind(lib), None
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            why = lines[-1].strip() if lines else f"exit status {done.returncode}"
        return None, f"{' '.join(cc)} could not compile {_SOURCE.name}: {why[:200]}"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.attnzoo_fused_layout_size() != _SIZE:
        raise RuntimeError("fused_decode.c and fused_decode.py disagree on the layout block")
    p, i = ctypes.c_void_p, ctypes.c_int64
    for step in _STEPS:
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"attnzoo_{step}_{suffix}")
            fn.argtypes = [p, p, i, i, p, i, i, p, i, i, p, i, p, ctypes.c_double]
            fn.restype = ctypes.c_int
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"attnzoo_append_{suffix}")
        fn.argtypes = [p, i, p, i, i, p, i, i, i, p]
        fn.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled steps (compiled on the first call in this process), or None: :func:`status` says why."""
    global _LOADED
    if _LOADED is None:
        with _LOCK:
            if _LOADED is None:
                _LOADED = _compile()
    return _LOADED[0]


def _disjoint(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share memory (strides sorted ascending, each past the span of the smaller ones:
    sufficient, and what every buffer the cache makes satisfies); an expanded view (a stride 0) fails."""
    span = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if st <= span:
            return False
        span += st * (n - 1)
    return True


def _plain(t) -> bool:
    """A tensor whose data_ptr() is its elements as they read: a torch.Tensor itself (a subclass, a fake tensor
    or a __torch_dispatch__ wrapper has no such memory), on the CPU, with no negative or conjugate bit."""
    return type(t) is torch.Tensor and t.is_cpu and not t.is_neg() and not t.is_conj()


def status() -> str:
    """One line: whether the blocked backend's lean decoding steps on the CPU run fused in C, or why not."""
    lib = library()
    if lib is not None:
        return "fused C steps (compiled once per process) for selective, sink_window, h2o and tova in float32/float64"
    return f"torch lean steps: the fused C steps are unavailable: {_LOADED[1]}"


class FusedStep(FastStep):
    """A fast step in C for one cache: ``step(q, k, v, cache) -> out``, with its torch form ``torch_step`` (the
    same maths, calling the evictor's Python rule) taken, its inputs checked (:class:`~.state.FastStep`), for
    anything the C code was not laid out for.

    ``kernel``: "selective", "sink_window" or "scoring"; ``options``: the step's four options (fused_decode.c);
    ``state``: the name of the per-token score the step updates, or None; ``spare``: 1 when the step uses the slot
    after the held ones (H2O, TOVA)."""

    kind = "fused"

    def __init__(self, name: str, ready, torch_step, kernel: str, fn_by_dtype: dict, scale: float,
                 options: tuple[int, int, int, int], state: str | None, spare: int) -> None:
        super().__init__(name, ready, torch_step)
        self.kernel = kernel
        self.fn_by_dtype = fn_by_dtype
        self.scale = float(scale)
        self.options = options
        self.state = state
        self.spare = spare
        self.layout = (ctypes.c_int64 * _SIZE)()
        self.address = ctypes.addressof(self.layout)
        self.held: tuple = ()  # the tensors the layout points into, kept alive and compared by identity
        self.fn = None
        self.shapes: tuple = ()
        self.extents: tuple = ()
        self.nexts: torch.Tensor | None = None  # the cache's per-row next positions last checked

    def _scores(self, cache):
        if self.state is None:
            return None
        return cache._state_buf.get(self.state) if self.spare else cache._state.get(self.state)

    def _lay_out(self, cache, need: int | None = None) -> bool:
        """Fill the layout block for the cache's buffers as they are now; False if the C code cannot take them.
        ``need``: the slots the buffers must have (default: the tokens held and the step's spare slot)."""
        keys, values, pos, scores = cache._k, cache._v, cache._pos, self._scores(cache)
        b, hkv, _, d = keys.shape
        m = cache._m
        need = m + self.spare if need is None else need
        dtype = keys.dtype
        rows = [keys, values]
        per_token = [pos] + ([scores] if scores is not None else [])
        if (dtype not in _SUFFIX or (self.state is not None and scores is None) or cache.step_state.geometry is None
                or not all(_plain(t) for t in rows + per_token)
                or any(t.dim() != 4 or t.dtype != dtype or t.shape[:2] != (b, hkv) or t.shape[2] < need
                       or t.shape[3] != d or t.stride(3) != 1 or t.stride(2) != d for t in rows)
                or any(t.dim() != 3 or t.shape[:2] != (b, hkv) or t.shape[2] < need or t.stride(2) != 1
                       for t in per_token)
                or pos.dtype != torch.int64 or (scores is not None and scores.dtype != dtype) or m < 1
                or not all(_disjoint(t) for t in rows + per_token)):  # the step writes every one of them
            return False
        for name, t in zip(("keys", "values", "positions", "scores"), rows + per_token, strict=False):
            if extent(t) > t.untyped_storage().nbytes():
                raise ValueError(f"the cache's {name} buffer no longer covers its tokens (its storage was freed or "
                                 f"resized through a view?): start a new cache")
        h = cache.step_state.geometry[0]
        if self.kernel == "selective" and not (self.options[0] < m and self.options[1] < hkv
                                             and self.options[2] < h // hkv):
            return False  # the victim is chosen after the skipped slots; the selector head is one of the query heads
        lay = self.layout
        lay[_B], lay[_HKV], lay[_G], lay[_D], lay[_M] = b, hkv, h // hkv, d, m
        lay[_K], lay[_KSB], lay[_KSH] = keys.data_ptr(), keys.stride(0), keys.stride(1)
        lay[_V], lay[_VSB], lay[_VSH] = values.data_ptr(), values.stride(0), values.stride(1)
        lay[_P], lay[_PSB], lay[_PSH] = pos.data_ptr(), pos.stride(0), pos.stride(1)
        if scores is not None:
            lay[_S], lay[_SSB], lay[_SSH] = scores.data_ptr(), scores.stride(0), scores.stride(1)
        else:
            lay[_S] = lay[_SSB] = lay[_SSH] = 0
        work = torch.empty((h // hkv + 1) * (m + 1), dtype=dtype)  # every head's logits, a row of scores
        lay[_W] = work.data_ptr()
        lay[_OPT0], lay[_OPT1], lay[_OPT2], lay[_OPT3] = self.options
        self.fn = self.fn_by_dtype[dtype]
        self.shapes = (torch.Size((b, h, 1, d)), torch.Size((b, hkv, 1, d)), dtype, keys.element_size())
        self.extents = (b - 1, h - 1, hkv - 1, d)  # an input's elements end (b-1)*sb + (heads-1)*sh + d past its start
        self.held = (keys, values, pos, scores, m, work, _addresses(keys, values, pos, scores))
        return True

    def __call__(self, q, k, v, cache):
        held, keys, values, pos, scores = self.held, cache._k, cache._v, cache._pos, self._scores(cache)
        if not (held and held[0] is keys and held[1] is values and held[2] is pos and held[3] is scores
                and held[4] == cache._m and held[6] == (keys.data_ptr(), values.data_ptr(), pos.data_ptr(),
                                                        0 if scores is None else scores.data_ptr())
                ) and not self._lay_out(cache):
            self.held = ()
            return FastStep.__call__(self, q, k, v, cache)
        qshape, kvshape, dtype, itemsize = self.shapes
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
            return FastStep.__call__(self, q, k, v, cache)  # a subclass, a fake tensor: data_ptr() is no data
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        # float32/float64 only (the dtype check): the conjugate bit, which only complex dtypes carry, cannot be set
        if (q.dtype != dtype or k.dtype != dtype or v.dtype != dtype or q.shape != qshape or k.shape != kvshape
                or v.shape != kvshape or qs[3] != 1 or ks[3] != 1 or vs[3] != 1 or not q.is_cpu or not k.is_cpu
                or not v.is_cpu or q.is_neg() or k.is_neg() or v.is_neg()):
            return FastStep.__call__(self, q, k, v, cache)
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        b1, h1, hkv1, d = self.extents
        qst, kst, vst = q.untyped_storage(), k.untyped_storage(), v.untyped_storage()
        if (qp + (b1 * qs[0] + h1 * qs[1] + d) * itemsize > qst.data_ptr() + qst.nbytes()
                or kp + (b1 * ks[0] + hkv1 * ks[1] + d) * itemsize > kst.data_ptr() + kst.nbytes()
                or vp + (b1 * vs[0] + hkv1 * vs[1] + d) * itemsize > vst.data_ptr() + vst.nbytes()):
            check_inputs(q, k, v)  # raises its one line
            return self.torch_step(q, k, v, cache)
        found = self._next_rows(cache, qshape[0])  # one position per row: the C step moves each on in place
        if found is None:
            return self.torch_step(q, k, v, cache)  # its inputs checked above
        scalar, rows = found
        out = torch.empty(qshape, dtype=dtype)  # every element written (the C step first fills it with NaN)
        self.fn(self.address, qp, qs[0], qs[1], kp, ks[0], ks[1], vp, vs[0], vs[1], out.data_ptr(), scalar, rows,
                self.scale)
        cache.kernel_stepped(rows != 0)
        return out

    def _next_rows(self, cache, batch: int) -> tuple[int, int] | None:
        """(the next position of every row, 0) or (0, the address of the per-row next positions), or None when
        the C code cannot read them."""
        nxt = cache._next
        if isinstance(nxt, int):
            return nxt, 0
        if nxt is self.nexts or self._rows_fit(nxt, batch):
            return 0, nxt.data_ptr()
        return None

    def _rows_fit(self, nxt: torch.Tensor, batch: int) -> bool:
        """Whether the cache's per-row next positions can be read and moved on by the C step: (B,) int64,
        contiguous, on the CPU (the cache owns it: ``KVCache.next_position`` copies in and out)."""
        if (_plain(nxt) and nxt.dtype == torch.int64 and nxt.shape == (batch,) and nxt.is_contiguous()
                and extent(nxt) <= nxt.untyped_storage().nbytes()):
            self.nexts = nxt
            return True
        return False


class FusedAppend(FusedStep):
    """The plain fast step (no evictor, no transforms) with its append fused: the new token's key, value and
    position written by one C call (three torch copies otherwise), then ``attend(q, cache, scale)`` over the
    tokens held (which masks a left-padded batch's padding)."""

    def __init__(self, ready, torch_step, fn_by_dtype: dict, attend, scale: float) -> None:
        super().__init__("plain", ready, torch_step, "append", fn_by_dtype, scale, (0, 0, 0, 0), None, 1)
        self.attend = attend
        self.capacity = 0

    def __call__(self, q, k, v, cache):
        m = cache._m
        if m + 1 > cache._k.shape[2]:
            cache._grow(m + 1)
        held, keys, values, pos = self.held, cache._k, cache._v, cache._pos
        if (not (held and held[0] is keys and held[1] is values and held[2] is pos
                 and held[6] == (keys.data_ptr(), values.data_ptr(), pos.data_ptr(), 0)) or m >= self.capacity):
            if not self._lay_out(cache, need=m + 1):
                self.held = ()
                return FastStep.__call__(self, q, k, v, cache)
            self.capacity = min(t.shape[2] for t in self.held[:3])
        qshape, kvshape, dtype, itemsize = self.shapes
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
            return FastStep.__call__(self, q, k, v, cache)
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        found = self._next_rows(cache, kvshape[0])
        if (found is None or k.dtype != dtype or v.dtype != dtype or k.shape != kvshape or v.shape != kvshape
                or q.shape != qshape or ks[3] != 1 or vs[3] != 1 or not k.is_cpu or not v.is_cpu
                or k.is_neg() or v.is_neg()):  # float32/float64: no conjugate bit (see FusedStep)
            return FastStep.__call__(self, q, k, v, cache)
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        b1, h1, hkv1, d = self.extents
        qst, kst, vst = q.untyped_storage(), k.untyped_storage(), v.untyped_storage()
        # q goes to torch's attention (any strides, its negative bit resolved there); its storage is checked here,
        # as some of torch's kernels read it without making a view
        if (qp + (b1 * qs[0] + h1 * qs[1] + (d - 1) * qs[3] + 1) * itemsize > qst.data_ptr() + qst.nbytes()
                or kp + (b1 * ks[0] + hkv1 * ks[1] + d) * itemsize > kst.data_ptr() + kst.nbytes()
                or vp + (b1 * vs[0] + hkv1 * vs[1] + d) * itemsize > vst.data_ptr() + vst.nbytes()):
            check_inputs(q, k, v)  # raises its one line
            return self.torch_step(q, k, v, cache)
        self.fn(self.address, m, kp, ks[0], ks[1], vp, vs[0], vs[1], *found)
        cache.kernel_appended(found[1] != 0)
        return self.attend(q, cache, self.scale)


def _addresses(keys, values, pos, scores) -> tuple[int, int, int, int]:
    """Where the buffers' elements are now: a storage freed or resized (through a view the cache handed out) moves
    its address, so a step compares these with the layout's before the C code writes through it."""
    return (keys.data_ptr(), values.data_ptr(), pos.data_ptr(), 0 if scores is None else scores.data_ptr())


def _functions(kind: str, cache) -> dict | None:
    """The compiled ``attnzoo_<kind>_*`` functions by dtype, or None when the fused steps are unavailable
    (:func:`status`) or the cache is not on the CPU in float32/float64."""
    if cache._k is None or cache._k.device.type != "cpu" or cache._k.dtype not in _SUFFIX:
        return None
    lib = library()
    if lib is None:
        return None
    return {dtype: getattr(lib, f"attnzoo_{kind}_{suffix}") for dtype, suffix in _SUFFIX.items()}


def offer_append(ready, torch_step, attend, cache, scale: float) -> FastStep:
    """The plain fast step ``torch_step`` with its append fused (:class:`FusedAppend`), or the torch step alone
    (a :class:`~.state.FastStep`: its inputs checked) when the C steps are unavailable."""
    fns = _functions("append", cache)
    return FastStep("plain", ready, torch_step) if fns is None else FusedAppend(ready, torch_step, fns, attend, scale)


def offer(name: str, ready, torch_step, cache, scale: float, kernel: str, options=(0, 0, 0, 0),
          state: str | None = None, spare: int = 0) -> FastStep:
    """The fast step ``name`` in C (kernel ``kernel`` with ``options``, padded to four) for ``cache``, or its torch
    form ``torch_step`` alone (a :class:`~.state.FastStep`; see :func:`_functions`)."""
    fns = _functions(kernel, cache)
    if fns is None:
        return FastStep(name, ready, torch_step)
    options = (tuple(int(x) for x in options) + (0, 0, 0, 0))[:4]
    return FusedStep(name, ready, torch_step, kernel, fns, scale, options, state, spare)

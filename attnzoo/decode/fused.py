"""The fused decoding steps on the CPU (docs/decoding.md, "Fused in C on the CPU"): each fast step of
:mod:`attnzoo.decode.fast` (selective, sink + window, H2O, TOVA, the plain step's append) as one call of a torch op
from :mod:`.fused_build`'s library, its arguments laid out by name from :mod:`.layout`, and the checks made before
C++ sees a pointer: the buffers the op writes (plain CPU tensors of the dtype, no negative or conjugate bit, no two
elements in one place, a storage covering every element, compared by identity and address at every step) and q, k
and v plain ``torch.Tensor`` s on the CPU. Anything else, or a refusal by the op (a one-line ValueError before it
reads anything), takes the step's torch form, which checks its inputs' storages. The op keeps torch's rules for
in-place ops besides (fused_decode.cpp): nothing it writes requires grad under grad mode or is an inference tensor
outside inference mode, no argument overlaps one it writes, and it bumps the version of what it writes. The cache's
own buffers keep these rules (detached; allocated apart, or one ring page's disjoint sections), so its steps take
the op.
"""

from __future__ import annotations

import torch

from . import fused_build, layout
from .state import FastStep, check_inputs, extent

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


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


class FusedStep(FastStep):
    """A fast step in C++ for one cache: ``step(q, k, v, cache) -> out``, with its torch form ``torch_step`` (the
    same maths, calling the evictor's Python rule) taken, its inputs checked (:class:`~.state.FastStep`), for
    anything the op was not laid out for.

    ``kernel``: "selective", "sink_window" or "scoring"; ``op``: its op overload; ``options``: the op's options by
    name (:func:`.layout.named_options`); ``state``: the name of the per-token score the step updates, or None;
    ``spare``: 1 when the step uses the slot after the held ones (H2O, TOVA)."""

    kind = "fused"

    def __init__(self, name: str, ready, torch_step, kernel: str, op, scale: float, options: dict,
                 state: str | None, spare: int) -> None:
        super().__init__(name, ready, torch_step)
        self.kernel = kernel
        self.op = op
        self.scale = float(scale)
        self.options = options
        self.state = state
        self.spare = spare
        self.held: tuple = ()  # the tensors the op writes, kept alive and compared by identity
        self.fixed: tuple = ()  # the op's arguments after those of each call, in its schema's order
        self.nexts: torch.Tensor | None = None  # the cache's per-row next positions last checked

    def _scores(self, cache):
        if self.state is None:
            return None
        return (cache.score_buffers if self.spare else cache.held_scores).get(self.state)

    def _lay_out(self, cache, need: int | None = None) -> bool:
        """Check the cache's buffers as they are now and fix the op's arguments for them; False if the op cannot
        take them. ``need``: the slots the buffers must have (default: the tokens held and the step's spare slot)."""
        keys, values, pos, m, _ = cache.slot_buffers()
        scores = self._scores(cache)
        b, hkv, _, d = keys.shape
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
        options = self.options
        if self.kernel == "selective" and not (int(options["protect_first"]) < m and options["selector_kv_head"] < hkv
                                             and options["selector_in_group"] < h // hkv):
            return False  # the victim is chosen after the skipped slots; the selector head is one of the query heads
        op_name = layout.KERNELS[self.kernel]
        given = {"keys": keys, "values": values, "positions": pos, **options}
        if op_name != "append_step":
            given.update(held=m, scale=self.scale)
            if scores is not None:
                given["scores"] = scores
        self.fixed = layout.order(op_name, self.op._schema, given)
        self.held = (keys, values, pos, scores, m, None, _addresses(keys, values, pos, scores))
        return True

    def __call__(self, q, k, v, cache):
        held, scores = self.held, self._scores(cache)
        keys, values, pos, m, nxt = cache.slot_buffers()
        if not (held and held[0] is keys and held[1] is values and held[2] is pos and held[3] is scores
                and held[4] == m and held[6] == (keys.data_ptr(), values.data_ptr(), pos.data_ptr(),
                                                        0 if scores is None else scores.data_ptr())
                ) and not self._lay_out(cache):
            self.held = ()
            return FastStep.__call__(self, q, k, v, cache)
        # a subclass, a fake tensor: data_ptr() is no data; a meta tensor would reach the fake kernel
        if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
                or not q.is_cpu or not k.is_cpu or not v.is_cpu):
            return FastStep.__call__(self, q, k, v, cache)
        if isinstance(nxt, int):
            scalar, rows = nxt, None
        elif nxt is self.nexts or self._rows_fit(nxt, keys.shape[0]):
            scalar, rows = 0, nxt  # one position per row: the op moves each on in place
        else:
            return FastStep.__call__(self, q, k, v, cache)
        try:
            out = self.op(q, k, v, scalar, rows, *self.fixed)
        except ValueError:  # the op checks every tensor before it reads one: a dtype, shape, stride or storage
            return FastStep.__call__(self, q, k, v, cache)  # its inputs' storages checked, or the torch step
        cache.kernel_stepped(rows is not None)
        return out

    def _rows_fit(self, nxt: torch.Tensor, batch: int) -> bool:
        """Whether the cache's per-row next positions can be read and moved on by the op: (B,) int64, contiguous,
        on the CPU (the cache owns it: ``KVCache.next_position`` copies in and out)."""
        if (_plain(nxt) and nxt.dtype == torch.int64 and nxt.shape == (batch,) and nxt.is_contiguous()
                and extent(nxt) <= nxt.untyped_storage().nbytes()):
            self.nexts = nxt
            return True
        return False


class FusedAppend(FusedStep):
    """The plain fast step (no evictor, no transforms) with its append fused: the new token's key, value and
    position written by one op call (three torch copies otherwise), then ``attend(q, cache, scale)`` over the
    tokens held (which masks a left-padded batch's padding)."""

    def __init__(self, ready, torch_step, op, attend, scale: float) -> None:
        super().__init__("plain", ready, torch_step, "append", op, scale, {}, None, 1)
        self.attend = attend
        self.capacity = 0

    def __call__(self, q, k, v, cache):
        keys, values, pos, m, nxt = cache.slot_buffers()
        if m + 1 > keys.shape[2]:
            cache.make_room(m + 1)
            keys, values, pos, m, nxt = cache.slot_buffers()
        held = self.held
        if (not (held and held[0] is keys and held[1] is values and held[2] is pos
                 and held[6] == (keys.data_ptr(), values.data_ptr(), pos.data_ptr(), 0)) or m >= self.capacity):
            if not self._lay_out(cache, need=m + 1):
                self.held = ()
                return FastStep.__call__(self, q, k, v, cache)
            self.capacity = min(t.shape[2] for t in self.held[:3])
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
            return FastStep.__call__(self, q, k, v, cache)
        if isinstance(nxt, int):
            scalar, rows = nxt, None
        elif nxt is self.nexts or self._rows_fit(nxt, keys.shape[0]):
            scalar, rows = 0, nxt
        else:
            return FastStep.__call__(self, q, k, v, cache)
        # q goes to torch's attention (any strides, its negative bit resolved there); its storage is checked here,
        # as some of torch's kernels read it without making a view
        if not q.is_cpu or q.dim() != 4 or q.dtype != keys.dtype or q.shape[0] != keys.shape[0]:
            return FastStep.__call__(self, q, k, v, cache)
        (b, h, n, d), (s0, s1, s2, s3) = q.shape, q.stride()
        qst = q.untyped_storage()
        if b and h and n and d and (q.storage_offset() + (b - 1) * s0 + (h - 1) * s1 + (n - 1) * s2
                                    + (d - 1) * s3 + 1) * q.element_size() > qst.nbytes():
            check_inputs(q, k, v)  # raises its one line
        try:
            self.op(k, v, scalar, rows, m, *self.fixed)
        except ValueError:
            return FastStep.__call__(self, q, k, v, cache)
        cache.kernel_appended(rows is not None)
        return self.attend(q, cache, self.scale)


def _addresses(keys, values, pos, scores) -> tuple[int, int, int, int]:
    """Where the buffers' elements are now: a storage freed or resized (through a view the cache handed out) moves
    its address, so a step compares these with the layout's before the op writes through it."""
    return (keys.data_ptr(), values.data_ptr(), pos.data_ptr(), 0 if scores is None else scores.data_ptr())


def _op(kind: str, cache):
    """The op of ``kind``, or None when the fused steps are unavailable (:func:`.fused_build.status`) or the cache
    is not on the CPU in float32/float64."""
    keys = cache.slot_buffers()[0]
    if keys is None or keys.device.type != "cpu" or keys.dtype not in _SUFFIX:
        return None
    ops = fused_build.library()
    return None if ops is None else ops.op(kind)


def offer_append(ready, torch_step, attend, cache, scale: float) -> FastStep:
    """The plain fast step ``torch_step`` with its append fused (:class:`FusedAppend`), or the torch step alone
    (a :class:`~.state.FastStep`: its inputs checked) when the fused steps are unavailable."""
    op = _op("append", cache)
    return FastStep("plain", ready, torch_step) if op is None else FusedAppend(ready, torch_step, op, attend, scale)


def offer(name: str, ready, torch_step, cache, scale: float, kernel: str, options=(), state: str | None = None,
          spare: int = 0, **more) -> FastStep:
    """The fast step ``name`` as the op of ``kernel`` for ``cache``, given the evictor's rule ``options`` (a tuple in
    the order of :data:`.layout.RULE_OPTIONS`, or a mapping by name) and the spec's options by name (``more``: the
    selector head), or its torch form ``torch_step`` alone (a :class:`~.state.FastStep`; see :func:`_op`)."""
    op = _op(kernel, cache)
    if op is None:
        return FastStep(name, ready, torch_step)
    return FusedStep(name, ready, torch_step, kernel, op, scale, layout.named_options(kernel, options, **more),
                     state, spare)

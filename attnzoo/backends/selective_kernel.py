"""A fused CPU path for selective attention under a plain causal mask: forward and backward by query blocks.

Forward: queries go in spans of up to four blocks (:func:`forward_span`). For each block, only the selector head's
logits are computed besides the attention itself: its selection S, then -F (the carry of earlier blocks plus the
exclusive cumulative sum over the block's queries) written into the span's mask. Each span then takes two calls
of torch's flash-attention CPU op with that additive mask: the keys before the span (no causal mask needed), and
the span's own keys with the op's causal flag (which skips the tiles above the diagonal); the two are merged by
their log-sum-exps, which are kept for the backward pass.

Backward: the blocks in reverse. Each recomputes its probabilities from the saved log-sum-exp in tiles of 4 heads
× 1,024 keys (:func:`_tiles_backward`: a tile stays in cache between the products that make and use it), and
carries the gradient of the running column sums (the "reverse carry") back into earlier blocks' selector
logits. Extra state: the carry before each block, O(N · N / block) per batch row, and the log-sum-exp, O(H · N);
the forward's span mask is O(span · N) and transient.

The flash op is private (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``). Whether it is usable is
decided once per dtype, by a probe on tiny inputs, with and without its causal flag, checked against the eager
maths (:func:`flash_available`): when the op is missing, its signature changed or its results differ,
:func:`flash_block` computes the same two results eagerly and warns once, saying why. An error from a real call
(out of memory, say) propagates: it never switches the process to the slow path.

Numerics: the carry and F are summed in at least float32 (``accumulator_dtype``, docs/backends.md), the log-sum-exp
is kept in that dtype too; -F is rounded to the input dtype once, where it enters the logits as the additive mask.
The forward and the backward compute -F with the same function from the same carries, so the backward's
probabilities are the forward's.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import accumulator_dtype
from ..transforms.base import PointwiseSelection

#: names the phases for torch's profiler (benchmarks/selective_phases.py); next to nothing when it is off
_phase = torch.profiler.record_function

#: Probe verdicts per dtype: True (use the op) or False (eager). Tests reset it.
_PROBED: dict[torch.dtype, bool] = {}


def _flash_op(q, k, v, mask, scale, causal=False):
    """torch's private op: (out (B, H, Bq, D), lse (B, H, Bq)). A wrapper so the probe and tests can replace it.
    ``causal``: also hide key j > query i (top-left aligned: used on square blocks only)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)[:2]


def _eager_block(q, k, v, mask, scale, causal=False):
    logits = (q @ k.transpose(-1, -2)) * scale + mask
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu_(1)
        logits = logits.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)) @ v, lse


def _probe(dtype: torch.dtype) -> str | None:
    """Why the op cannot be used for ``dtype`` (missing, another signature, wrong results), or None if it can."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen).to(dtype) for _ in range(3))
    mask = torch.randn(1, 1, 3, 3, generator=gen).to(dtype)
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 5e-2
    for causal in (False, True):
        try:
            with torch.no_grad():
                out, lse = _flash_op(q, k, v, mask, 0.5, causal)
        except (AttributeError, NotImplementedError, RuntimeError, TypeError) as exc:
            return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        want_out, want_lse = _eager_block(q.double(), k.double(), v.double(), mask.double(), 0.5, causal)
        if (not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor)
                or out.shape != want_out.shape or lse.shape != want_lse.shape
                or not torch.allclose(out.double(), want_out, rtol=tol, atol=tol)
                or not torch.allclose(lse.double(), want_lse, rtol=tol, atol=tol)):
            return (f"its results on a probe {'with' if causal else 'without'} its causal flag differ from softmax "
                    f"attention (its contract changed)")
    return None


def flash_available(dtype: torch.dtype) -> bool:
    """Whether :func:`flash_block` uses torch's private op for ``dtype``: probed on the first call for each dtype,
    with a RuntimeWarning that says why when it cannot."""
    if dtype not in _PROBED:
        why = _probe(dtype)
        _PROBED[dtype] = why is None
        if why is not None:
            warnings.warn(f"attnzoo blocked backend: torch's private flash-attention CPU op is unusable for "
                          f"{str(dtype).removeprefix('torch.')} ({why}); using the eager equivalent (slower)",
                          RuntimeWarning, stacklevel=3)
    return _PROBED[dtype]


def flash_block(q, k, v, mask, scale, causal=False):
    """(out, lse) of softmax(q k^T * scale + mask) v; q (B, H, Bq, D), k/v (B, H, Nk, D), mask (B, 1, Bq, Nk);
    ``causal``: key j > query i hidden too (for square blocks).

    Errors of the op itself propagate (the probe already showed it works for this dtype)."""
    if flash_available(q.dtype):
        return _flash_op(q, k, v, mask, scale, causal)
    return _eager_block(q, k, v, mask, scale, causal)


class SelectiveCausal(torch.autograd.Function):
    """out = softmax(q k^T * scale - F, causal) v with F from selector head ``sel``: the accumulator's selection
    given as a pointwise function of that head's logits (``AccumulatorTransform.pointwise``, e.g. selective
    attention's ReLU).

    Inputs are the already row-scaled q (B, H, N, D) and k, v (B, H_kv, N, D); positions are 1..N shifted by
    ``first_position - 1`` (BOS is column 0 only when ``first_position == 1``). It is one diagonal
    :class:`Pair` with no carry: :func:`pair_forward`, then :func:`pair_backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, sel, pointwise, first_position, block):
        b, h, n, d = q.shape
        group = h // k.shape[1]
        ke = k.repeat_interleave(group, dim=1) if group > 1 else k
        ve = v.repeat_interleave(group, dim=1) if group > 1 else v
        pair = Pair(scale, sel, pointwise, block, negligible_f(q, ke, scale), diagonal=True,
                    bos=pointwise.exclude_first and first_position == 1)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, n), float("nan"), dtype=accumulator_dtype(q.dtype), device=q.device)
        carries: list[torch.Tensor] = []
        pair_forward(pair, q, ke, ve, q.new_zeros(b, n, dtype=lse.dtype), out, lse, carries)
        ctx.save_for_backward(q, ke, ve, out, lse, *carries)
        ctx.meta = (pair, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, ke, ve, out, lse, *carries = ctx.saved_tensors
        pair, group = ctx.meta
        dtype = q.dtype
        if dtype in (torch.float16, torch.bfloat16):  # recompute and accumulate in float32
            q, ke, ve, out, lse, grad_out = (t.float() for t in (q, ke, ve, out, lse, grad_out))
            carries = [c.float() for c in carries]
        b, h, n, d = q.shape
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
        neg_delta = -(grad_out * out).sum(-1, keepdim=True)  # (B, H, N, 1)
        pair_backward(pair, q, ke, ve, grad_out, lse, neg_delta, carries, dq, dk, dv, q.new_zeros(b, n))
        if group > 1:
            dk = dk.view(b, h // group, group, n, d).sum(2)
            dv = dv.view(b, h // group, group, n, d).sum(2)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None


@dataclass(frozen=True)
class Pair:
    """A block of queries against a block of keys, the unit of selective attention in this kernel: the whole
    sequence (:class:`SelectiveCausal`) or, under context parallelism, one chunk of queries against one chunk of
    keys (``attnzoo.distributed``). ``diagonal``: the keys are the queries' own tokens (as many, causal);
    otherwise every key precedes every query. ``bos``: the first key is the protected BOS (never selected).
    ``limit``: the negligible bound on F (:func:`negligible_f`) for these queries and keys. ``sel``: the selector
    query head (queries and keys are given with H heads: GQA keys already repeated)."""

    scale: float
    sel: int
    pointwise: PointwiseSelection
    block: int
    limit: float
    diagonal: bool
    bos: bool

    def own(self, nq: int, nk: int) -> tuple[int, int]:
        """(the keys before the queries' own, the queries' own keys): (nk - nq, nq) on the diagonal, (nk, 0) off
        it."""
        return (nk - nq, nq) if self.diagonal else (nk, 0)

    def keys(self, carry, nq: int, nk: int, start: int, stop: int) -> Keys:
        """The keys queries [start, stop) of the pair visit: the earlier keys still live, then their own."""
        first, own = self.own(nq, nk)
        if not own:
            return Keys.live(carry, first, first, self.limit)
        return Keys.live(carry, first + start, first + stop, self.limit)

    def upto(self, keys: Keys, nq: int, nk: int, hi: int) -> Keys:
        """The keys of ``keys`` that a block of the span ending before query ``hi`` may select."""
        first, own = self.own(nq, nk)
        return keys.upto(first + hi) if own else keys

    def selection(self, q_sel, k_sel, bq, has_first):
        return _selection(q_sel, k_sel, bq, self.scale, self.pointwise, self.bos and has_first, self.diagonal)


def pair_forward(pair: Pair, q, ke, ve, carry, out, lse, carries: list | None = None, accumulate: bool = False,
                 span: int | None = None) -> None:
    """The pair's attention: queries q (B, H, nq, D) against keys and values ke, ve (B, H, nk, D) with -F from
    ``carry`` (B, nk; the column sums of S over every earlier query, not changed) plus the pair's own S; writes
    the output (normalised over these keys) into ``out`` and its log-sum-exp into ``lse`` ((B, H, nq), -inf where
    a query has no live key), or with ``accumulate`` merges them, span by span, into what ``out`` and ``lse``
    hold (the attention over other keys: no output of the whole pair is held). ``carries``: the running carry
    before each block of ``pair.block`` queries is appended (what :func:`pair_backward` needs). ``span``: queries
    per flash call (default :func:`forward_span`)."""
    b, h, nq, d = q.shape
    nk = ke.shape[2]
    wide = carry.dtype
    carry = carry.clone()
    span = span or forward_span(pair.block, b, nk)
    buffer = torch.empty(b * min(span, nq) * nk, dtype=q.dtype, device=q.device)  # one mask for every span
    for start in range(0, nq, span):
        stop = min(start + span, nq)
        with _phase("forward: live keys"):  # the earlier keys still worth visiting, then the span's
            keys = pair.keys(carry, nq, nk, start, stop)
        # -F for the span's queries against those keys; each block of ``block`` queries computes its part
        # from its own carry, exactly as the backward pass recomputes it
        mask = buffer[:b * (stop - start) * keys.count].view(b, stop - start, keys.count)
        for lo in range(start, stop, pair.block):
            hi = min(lo + pair.block, stop)
            upto = pair.upto(keys, nq, nk, hi)
            if carries is not None:
                carries.append(carry[:, :upto.stop].clone())
            if upto.count == 0:
                continue
            with _phase("forward: selection"):
                s = pair.selection(q[:, pair.sel, lo:hi], upto.take(ke[:, pair.sel], 1), hi - lo, upto.has_first)[0]
            with _phase("forward: -F and carry"):
                _neg_f_into(mask[:, lo - start:hi - start], s, upto.take(carry, 1), pair.limit)
                upto.add_into(carry, s.sum(dim=2, dtype=wide), 1)
        if accumulate:  # this span's attention, then merged into what out and lse hold
            o = torch.empty(b, h, stop - start, d, dtype=q.dtype, device=q.device)
            l = torch.empty(b, h, stop - start, dtype=wide, device=q.device)
            _span_attention(q[:, :, start:stop], ke, ve, keys, mask.unsqueeze(1), pair.scale, 0, stop - start, o,
                            l, pair.diagonal)
            _accumulate(out[:, :, start:stop], lse[:, :, start:stop], o, l)
        else:
            _span_attention(q, ke, ve, keys, mask.unsqueeze(1), pair.scale, start, stop, out, lse, pair.diagonal)


def _accumulate(out, lse, o, l) -> None:
    """Merge attention (o, l) over more keys into (out, lse), in place, by log-sum-exp (-inf: no key). The
    sharded path's merge too (``attnzoo.distributed.pairs``)."""
    total = torch.logaddexp(lse, l.to(lse.dtype))
    finite = torch.isfinite(total)
    old = torch.where(finite, torch.exp(lse - total), 0.0).unsqueeze(-1).to(out.dtype)
    new = torch.where(finite, torch.exp(l.to(lse.dtype) - total), 0.0).unsqueeze(-1).to(out.dtype)
    out.mul_(old).add_(o * new)
    lse.copy_(total)


def pair_backward(pair: Pair, q, ke, ve, grad_out, lse, neg_delta, carries, dq, dk, dv, dcarry) -> None:
    """The pair's share of the gradients, from the gradient of the final output ``grad_out`` and the final
    output's log-sum-exp ``lse`` and -(grad_out · out) ``neg_delta`` (B, H, nq, 1) (final: over every key, so the
    pair's probabilities are exp(logits - F - lse), as ring attention's backward). Adds into dq (B, H, nq, D), dk
    and dv (B, H, nk, D), and into ``dcarry`` (B, nk), which comes in holding the gradient of the pair's column
    sums of S (from later queries' F) and leaves holding that plus the gradient of the incoming carry."""
    b, h, nq, d = q.shape
    nk = ke.shape[2]
    sel = pair.sel
    starts = list(range(0, nq, pair.block))
    for index in reversed(range(len(starts))):
        start = starts[index]
        stop = min(start + pair.block, nq)
        carry = carries[index]
        with _phase("backward: live keys"):
            keys = pair.keys(carry, nq, nk, start, stop)
        if keys.count == 0:
            continue
        with _phase("backward: selection"):
            s, l_sel = pair.selection(q[:, sel, start:stop], keys.take(ke[:, sel], 1), stop - start, keys.has_first)
        with _phase("backward: -F"):
            neg_f = torch.empty(b, stop - start, keys.count, dtype=q.dtype, device=q.device)
            _neg_f_into(neg_f, s, keys.take(carry, 1), pair.limit)
        with _phase("backward: softmax tiles"):
            k_c, v_c = keys.take(ke, 2), keys.take(ve, 2)
            dk_c, dv_c = keys.grad_buffer(dk, 2), keys.grad_buffer(dv, 2)
            # dL/dF (queries × keys), summed over heads: F enters every head's logits with a minus sign
            d_f = _tiles_backward(q[:, :, start:stop], k_c, v_c, grad_out[:, :, start:stop], lse[:, :, start:stop],
                                  neg_delta[:, :, start:stop], neg_f, pair.scale, dq[:, :, start:stop], dk_c, dv_c,
                                  pair.diagonal)
            keys.add_into(dk, dk_c, 2, buffer=True)
            keys.add_into(dv, dv_c, 2, buffer=True)
        with _phase("backward: reverse carry and selector"):
            # F = carry + exclusive cumsum over queries of S; the next carry = carry + sums over queries of S
            d_f = d_f.transpose(1, 2)  # (B, Nk, Bq), like S^T
            total = d_f.sum(dim=2, keepdim=True)
            d_s = total - torch.cumsum(d_f, dim=2) + keys.take(dcarry, 1)[:, :, None].to(d_f.dtype)
            keys.add_into(dcarry, total[:, :, 0].to(dcarry.dtype), 1)
            d_sel = d_s.mul_(_exclude(pair.pointwise.derivative(l_sel), stop - start, pair.pointwise,
                                      pair.bos and keys.has_first, pair.diagonal))
            _selector_grads(pair, d_sel, q[:, sel, start:stop], keys, ke[:, sel], dq[:, sel, start:stop],
                            dk[:, sel])


def _selector_grads(pair: Pair, d_sel, q_sel, keys: Keys, k_sel, dq_sel, dk_sel) -> None:
    """dq_sel (B, Bq, D) and dk_sel (B, nk, D) from d_sel = dL/d(selector logits)^T (B, keys.count, Bq)."""
    keys.add_into(dk_sel, (d_sel @ q_sel) * pair.scale, 1)
    dq_sel += (d_sel.transpose(-1, -2) @ keys.take(k_sel, 1)) * pair.scale


def pair_colsums(pair: Pair, q_sel, k_sel, colsum, base=None) -> None:
    """Add into ``colsum`` (B, nk) the column sums of the pair's S: selector queries q_sel (B, nq, D), keys k_sel
    (B, nk, D). ``base`` (B, nk): a lower bound on the carry into these queries (None: 0); a key whose bound plus
    its column sum so far reaches ``pair.limit`` is left out from then on, as :func:`pair_forward` leaves it out
    (its F is negligible for every later query, and its carry stays past the bound)."""
    nq, nk = q_sel.shape[1], k_sel.shape[1]
    first, own = pair.own(nq, nk)
    for lo in range(0, nq, pair.block):
        hi = min(lo + pair.block, nq)
        carry = colsum if base is None else colsum + base
        keys = Keys.live(carry, first + (lo if own else 0), first + (hi if own else 0), pair.limit)
        if keys.count == 0:
            continue
        s = pair.selection(q_sel[:, lo:hi], keys.take(k_sel, 1), hi - lo, keys.has_first)[0]
        keys.add_into(colsum, s.sum(dim=2, dtype=colsum.dtype), 1)


def pair_later(pair: Pair, q_sel, k_sel, later, dq_sel, dk_sel) -> None:
    """The gradient of the pair's S through later queries' F: ``later`` (B, nk) is dL/d(the pair's column sums
    of S); adds into dq_sel (B, nq, D) and dk_sel (B, nk, D). Keys whose ``later`` is 0 in every row (past the
    negligible bound, or with no later query) are skipped."""
    nq, nk = q_sel.shape[1], k_sel.shape[1]
    first, own = pair.own(nq, nk)
    live = (later != 0).any(dim=0)
    for lo in range(0, nq, pair.block):
        hi = min(lo + pair.block, nq)
        stop = first + (hi if own else 0)
        index = live[:stop].nonzero().squeeze(1)
        if index.numel() == 0:
            continue
        dense = index.numel() > 0.8 * stop
        keys = Keys(stop, stop) if dense else Keys(stop, stop, index, index.numel())
        l_sel = (keys.take(k_sel, 1) @ q_sel[:, lo:hi].transpose(-1, -2)) * pair.scale
        # the diagonal block's exclusions apply to the last (hi - lo) keys only when every key is kept
        d_sel = pair.pointwise.derivative(l_sel)
        if dense:
            d_sel = _exclude(d_sel, hi - lo, pair.pointwise, pair.bos, pair.diagonal)
        else:
            _exclude_indexed(d_sel, index, first + lo, pair, own)
        d_sel.mul_(keys.take(later, 1)[:, :, None].to(d_sel.dtype))
        _selector_grads(pair, d_sel, q_sel[:, lo:hi], keys, k_sel, dq_sel[:, lo:hi], dk_sel)


def _exclude_indexed(t, index, first_query_key: int, pair: Pair, own: int) -> None:
    """:func:`_exclude` for the keys ``index`` (ascending) of a block whose first query's own key is
    ``first_query_key``: key j is excluded for query i (0-based in the block) when j > first_query_key + i
    (j >= unless self-selection is allowed), and BOS."""
    if own:
        query = torch.arange(t.shape[2], device=t.device)
        limit = first_query_key + query - (1 if pair.pointwise.exclude_self else 0)
        t.masked_fill_(index[:, None] > limit[None, :], 0.0)
    if pair.bos and int(index[0]) == 0:
        t[:, 0] = 0


class Keys:
    """The keys a block of queries [start, stop) visits: every key < stop, or (:meth:`live`) only the earlier
    keys whose F is under the negligible bound in some batch row, then the block's own keys. A key's F only grows
    with the query, so a key left out is negligible for every later query too (exp(-104) of the row's largest,
    :func:`negligible_f`): leaving it out changes no float32 result, and it is what selective attention's
    pruning does. Its carry then stops growing (it stays past the bound), in the forward and backward alike."""

    def __init__(self, start: int, stop: int, index: torch.Tensor | None = None, before: int | None = None):
        self.start, self.stop, self.index = start, stop, index
        self.before = start if index is None else before  # how many of the keys come before ``start``
        self.count = stop if index is None else index.numel()

    @classmethod
    def live(cls, carry, start: int, stop: int, limit: float, keep: float = 0.8) -> Keys:
        """Left out only when at most ``keep`` of the earlier keys are live (otherwise gathering costs more than
        it saves)."""
        if start == 0 or limit == math.inf:
            return cls(start, stop)
        alive = (carry[:, :start] < limit).any(dim=0).nonzero().squeeze(1)
        if alive.numel() > keep * start:
            return cls(start, stop)
        index = torch.cat([alive, torch.arange(start, stop, device=carry.device)])
        return cls(start, stop, index, alive.numel())

    @property
    def has_first(self) -> bool:
        """Whether key 0 (BOS) is the first of these keys."""
        return self.index is None or (self.index.numel() > 0 and int(self.index[0]) == 0)

    def upto(self, hi: int) -> Keys:
        """The keys before ``hi`` (a block inside a span: the earlier live keys, then the span's keys up to hi)."""
        if self.index is None:
            return Keys(self.start, hi)
        return Keys(self.start, hi, self.index[:self.before + hi - self.start], self.before)

    def earlier(self) -> Keys:
        """The keys before ``start``."""
        if self.index is None:
            return Keys(0, self.start)
        return Keys(0, self.start, self.index[:self.before], self.before)

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.index is None:
            return t.narrow(dim, 0, self.stop)
        return t.index_select(dim, self.index)

    def grad_buffer(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Where gradients for these keys accumulate: a view of ``t`` or a zero buffer (see :meth:`add_into`)."""
        if self.index is None:
            return t.narrow(dim, 0, self.stop)
        shape = list(t.shape)
        shape[dim] = self.count
        return t.new_zeros(shape)

    def add_into(self, t: torch.Tensor, values: torch.Tensor, dim: int, buffer: bool = False) -> None:
        """t[keys] += values along ``dim`` (nothing to do for a :meth:`grad_buffer` view)."""
        if self.index is None:
            if not buffer:
                t.narrow(dim, 0, self.stop).add_(values)
            return
        t.index_add_(dim, self.index, values)


#: heads and keys per tile of the backward pass: a tile's probabilities (4 × 256 × 1024 float32, 4 MiB) stay
#: in cache between the products that make and use them, which made the backward pass 1.4-1.5x faster than one
#: (B, H, block, N) tensor per block (AMD EPYC, 2 threads, N = 4096)
TILE_HEADS = 4
TILE_KEYS = 1024


def _tiles_backward(q, k, v, grad_out, lse, neg_delta, neg_f, scale, dq, dk, dv, diagonal=True):
    """The softmax backward of a block of queries (q, grad_out, lse, neg_delta, dq: (B, H, Bq, ·)) against its
    keys (k, v, dk, dv: (B, H, Nk, ·), the block's own keys last), in tiles of heads and keys: adds into dq, dk,
    dv and returns -sum over heads of dL/dlogits, i.e. dL/dF (B, Bq, Nk).

    ``neg_f`` is -F (B, Bq, Nk). The tile's probabilities are exp(logits - F - lse), with the exponent clamped
    above the subnormal range (exp of a large F would otherwise run through subnormals, slow on CPU; such
    probabilities are below 1e-34 either way) and exactly 0 for future keys. Off the ``diagonal`` every key
    precedes every query (no own keys)."""
    b, h, bq, d = q.shape
    nk = k.shape[2]
    diagonal = nk - bq if diagonal else nk  # where the block's own keys start
    floor = math.log(torch.finfo(q.dtype).tiny) + 7.0
    # key tiles: the last one holds the whole diagonal block
    firsts = list(range(0, max(diagonal, 1), TILE_KEYS))
    bounds = list(zip(firsts, [*firsts[1:], nk], strict=True))
    future = torch.ones(bq, bq, dtype=torch.bool, device=q.device).triu_(1)
    d_f = torch.empty(b, bq, nk, dtype=q.dtype, device=q.device)
    for h0 in range(0, h, TILE_HEADS):
        h1 = min(h0 + TILE_HEADS, h)
        heads, m = slice(h0, h1), (h1 - h0) * b

        def rows(t, lo=0, hi=None, _heads=heads, _m=m):
            t = t[:, _heads, lo:hi]
            return t.reshape(_m, t.shape[2], t.shape[3])

        q_blk, g_blk, nd_blk = rows(q), rows(grad_out), rows(neg_delta)
        lse_blk = lse[:, heads, :, None]
        dq_blk = torch.zeros(m, bq, d, dtype=q.dtype, device=q.device)
        for c0, c1 in bounds:
            k_t, v_t = rows(k, c0, c1), rows(v, c0, c1)
            bias = (neg_f[:, None, :, c0:c1] - lse_blk).reshape(m, bq, c1 - c0)
            p = torch.baddbmm(bias, q_blk, k_t.transpose(1, 2), alpha=scale)  # logits - F - lse
            p.clamp_min_(floor).exp_()
            if c1 > diagonal:  # the diagonal block: exactly 0 above the diagonal
                p[..., diagonal - c0:].masked_fill_(future, 0.0)
            dv[:, heads, c0:c1] += (p.transpose(1, 2) @ g_blk).view(b, h1 - h0, c1 - c0, d)
            dl = p.mul_(torch.baddbmm(nd_blk, g_blk, v_t.transpose(1, 2)))  # dL/dlogits = p (dp - delta)
            dq_blk.baddbmm_(dl, k_t, alpha=scale)
            dk[:, heads, c0:c1] += (dl.transpose(1, 2) @ q_blk).view(b, h1 - h0, c1 - c0, d) * scale
            summed = dl.view(b, h1 - h0, bq, c1 - c0).sum(1)
            if h0 == 0:
                torch.neg(summed, out=d_f[:, :, c0:c1])
            else:
                d_f[:, :, c0:c1].sub_(summed)
        dq[:, heads] += dq_blk.view(b, h1 - h0, bq, d)
    return d_f


def _selection(q_sel, k_sel, bq, scale, pointwise, bos, diagonal=True):
    """A block's selection, transposed: S^T (B, Nk, Bq) = the pointwise selection of the selector logits where
    a query may select a key (strictly earlier, or itself unless ``exclude_self``; never BOS, the first key,
    when ``bos``), and those logits l^T. ``q_sel`` (B, Bq, D) are the block's selector queries, ``k_sel``
    (B, Nk, D) its keys, the block's own keys last (none off the ``diagonal``).

    Keys run along rows so that the cumulative sum over queries is along the contiguous last dim (much faster
    on CPU than a cumulative sum across rows)."""
    l_sel = (k_sel @ q_sel.transpose(-1, -2)) * scale
    return _exclude(pointwise.value(l_sel), bq, pointwise, bos, diagonal), l_sel


def _exclude(t, bq, pointwise, bos, diagonal=True):
    """Zero, in place, the pairs no query may select: on the diagonal block (the last ``bq`` keys, when
    ``diagonal``) key j needs j < i (j <= i unless ``exclude_self``), and BOS (the first key) when ``bos``."""
    if diagonal:
        t[:, t.shape[1] - bq:].triu_(1 if pointwise.exclude_self else 0)
    if bos:
        t[:, 0] = 0
    return t


def forward_span(block: int, batch: int, n: int) -> int:
    """How many queries one forward step hands to the flash op: up to 4 blocks (the op runs 256-row tiles from
    768 queries up, and the span's keys before it need no causal mask), while the span's mask, (B, span, N),
    stays under 16M elements."""
    blocks = max(1, min(4, (1 << 24) // max(1, batch * n * block)))
    return block * blocks


#: what -F becomes past :func:`negligible_f` (finite: a row of the keys before a span that is all negligible then
#: gets weight exp(-1e30) = 0 in the merge, where -inf would give the flash op's fully masked row, out 0, lse 0)
NEGLIGIBLE = -1e30


def negligible_f(q, k, scale) -> float:
    """An F past which a key's probability is below e^-104 of its row's largest, for every query: with
    L = scale · max|q| · max|k|, a row's largest exponent is at least its own key's logit (F = 0 there), so
    logit_ij - F_ij - max_i <= 2L - F_ij. In float32 exp(-104) is 0, so replacing such an F by
    :data:`NEGLIGIBLE` changes nothing; in float64 it changes a probability by less than 1e-45. It keeps exp away
    from its subnormal range, which is slow on CPU. ``inf`` when an input is not finite."""
    bound = 2.0 * scale * float(q.norm(dim=-1).amax()) * float(k.norm(dim=-1).amax()) + 104.0
    return bound if math.isfinite(bound) else math.inf


def _neg_f_into(out, s, carry, limit=math.inf):
    """Write -F (queries × keys, the rows of ``out`` (B, Bq, Nk_out)) of one block: ``s`` is its S^T (B, Nk, Bq),
    ``carry`` (B, Nk) the carry before it; an F of ``limit`` or more (:func:`negligible_f`) becomes
    :data:`NEGLIGIBLE`. Keys from Nk on are future keys for every query of the block: they get 0 (the causal flag
    hides them). -F is rounded to ``out``'s dtype once; a half-precision -F that would
    overflow is clamped to the dtype's lowest finite value (such a key gets probability 0 either way)."""
    nk = s.shape[1]
    # -F^T (B, Nk, Bq) = the cumulative sum over queries of [-carry, -S(query 0), ..., -S(query Bq - 2)]
    neg_t = torch.empty(s.shape, dtype=carry.dtype, device=s.device)
    torch.neg(carry, out=neg_t[:, :, 0])
    torch.neg(s[:, :, :-1], out=neg_t[:, :, 1:])
    neg_t.cumsum_(dim=2)
    if limit != math.inf:
        F.threshold(neg_t, -limit, NEGLIGIBLE, inplace=True)
    if out.dtype != neg_t.dtype:
        neg_t = neg_t.clamp_min_(torch.finfo(out.dtype).min).to(out.dtype)
    for row in range(out.shape[0]):  # the 2-D transposing copy is a fast kernel; the batched one is not
        out[row, :, :nk].copy_(neg_t[row].t())
    out[:, :, nk:] = 0


def _span_attention(q, ke, ve, keys, mask, scale, start, stop, out, lse, diagonal=True):
    """Attention of queries [start, stop) against ``keys`` with the additive mask (B, 1, Bq, keys.count): the
    keys before the span in one call without a causal mask, the span's own keys (a square, the last columns) in
    one call with the op's causal flag (which skips the tiles above the diagonal), merged by their
    log-sum-exps. Off the ``diagonal`` there are no own keys: the earlier ones only (output 0 and log-sum-exp
    -inf when none is live)."""
    q_blk = q[:, :, start:stop]
    before = keys.before
    if not diagonal:
        if before == 0:
            out[:, :, start:stop] = 0.0
            lse[:, :, start:stop] = float("-inf")
            return
        with _phase("forward: flash, earlier keys"):
            out[:, :, start:stop], lse[:, :, start:stop] = flash_block(
                q_blk, keys.take(ke, 2), keys.take(ve, 2), mask, scale)
        return
    own = slice(keys.start, keys.stop)
    with _phase("forward: flash, the span's keys"):
        out_d, lse_d = flash_block(q_blk, ke[:, :, own], ve[:, :, own], mask[..., before:], scale, causal=True)
    if before == 0:
        out[:, :, start:stop], lse[:, :, start:stop] = out_d, lse_d
        return
    earlier = keys.earlier()
    with _phase("forward: flash, earlier keys"):
        out_a, lse_a = flash_block(q_blk, earlier.take(ke, 2), earlier.take(ve, 2), mask[..., :before], scale)
    with _phase("forward: merge"):
        _merge(out_a, lse_a, out_d, lse_d, out[:, :, start:stop], lse[:, :, start:stop])


def _merge(out_a, lse_a, out_d, lse_d, out, lse):
    """Write into ``out`` and ``lse`` the attention over both key sets from each one's output and lse."""
    # lse_d is finite (every query sees itself, with F = 0); lse_a is about -1e30 for a query whose earlier keys
    # are all negligible (their weight is then 0)
    diff = lse_a.to(lse.dtype) - lse_d.to(lse.dtype)
    # out = (e^lse_a out_a + e^lse_d out_d) / (e^lse_a + e^lse_d) = out_d + sigmoid(lse_a - lse_d) (out_a - out_d)
    weight = torch.sigmoid(diff).unsqueeze(-1)
    out.copy_(torch.lerp(out_d, out_a, weight.to(out_d.dtype)))
    lse.copy_(lse_d.to(lse.dtype) + F.softplus(diff))

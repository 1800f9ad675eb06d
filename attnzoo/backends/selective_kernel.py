"""A fused CPU path for selective attention under a plain causal mask: forward and backward by query blocks.

Forward: queries go in spans of up to four blocks (:func:`forward_span`). For each block, only the selector head's
logits are computed besides the attention itself: its selection S, then -F (the carry of earlier blocks plus the
exclusive cumulative sum over the block's queries) written into the span's mask. Each span then takes two calls
of torch's flash-attention CPU op with that additive mask: the keys before the span (no causal mask needed), and
the span's own keys with the op's causal flag (which skips the tiles above the diagonal); the two are merged by
their log-sum-exps, which are kept for the backward pass.

Backward: the blocks in reverse. Each recomputes its probabilities from the saved log-sum-exp in tiles of 4 heads
× 1,024 keys (:func:`tiles_backward`: a tile stays in cache between the products that make and use it), and
carries the gradient of the running column sums (the "reverse carry") back into earlier blocks' selector
logits. Extra state: the carry before each block, O(N · N / block) per batch row, and the log-sum-exp, O(H · N);
the forward's span mask is O(span · N) and transient.

The flash op, the key selection and the tiles are in ``selective_tiles.py``.

Numerics: the carry and F are summed in at least float32 (``accumulator_dtype``, docs/backends.md), the log-sum-exp
is kept in that dtype too; -F is rounded to the input dtype once, where it enters the logits as the additive mask.
The forward and the backward compute -F with the same function from the same carries, so the backward's
probabilities are the forward's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.numerics import accumulator_dtype
from ..transforms.base import PointwiseSelection
from .selective_tiles import (  # noqa: F401 - Keys, negligible_f, flash_available and flash_block are used by name
    NEGLIGIBLE,
    Keys,
    block_selection,
    exclude_unselectable,
    flash_available,
    flash_block,
    forward_span,
    neg_f_into,
    negligible_f,
    phase,
    span_attention,
    tiles_backward,
)


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


#: the query block of :func:`selective_prefill`: 64 and 128 measured fastest (forward, float32, B1 H4 H_kv 2 D64,
#: one thread, one ad-hoc run: N = 512 about 0.95x SDPA's causal call at either, N = 1024 and 2048 1.1x and 1.2x at
#: 64, 1.2x and 1.3x at 128, 256 slower at every N)
PREFILL_BLOCK = 64


def selective_prefill(q, k, v, scale, sel, pointwise, first_position, block=PREFILL_BLOCK):
    """The forward of :class:`SelectiveCausal` with no gradient, and the carry after the last query: returns
    (out (B, H, N, D), the column sums of S over every query (B, N) in ``accumulator_dtype``), what a prompt into an
    empty decode cache needs (the running F its keys start decoding with). Inputs as :class:`SelectiveCausal`'s
    (row-scaled, GQA keys and values not repeated).

    Each block of ``block`` queries is one product for the selector head's S, its -F (the carry plus the exclusive
    cumulative sum over the block's queries) written into the block's additive mask, -inf above the diagonal, and
    one ``scaled_dot_product_attention`` call over the keys up to the block's last query: no state is saved and no
    log-sum-exp merged, so short prompts (a served request's) run at about the cost of SDPA's causal call. Every key
    is visited (no negligible bound), so the carry is exact for every key: eviction ranks keys by it."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    wide = accumulator_dtype(q.dtype)
    bos = pointwise.exclude_first and first_position == 1
    out = torch.empty_like(q)
    carry = q.new_zeros(b, n, dtype=wide)
    buffer = torch.empty(b * min(block, n) * n, dtype=q.dtype, device=q.device)
    above = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
    q_sel, k_sel = q[:, sel], k[:, sel // group]
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        s = block_selection(q_sel[:, lo:hi], k_sel[:, :hi], hi - lo, scale, pointwise, bos)[0]  # S^T (B, hi, Bq)
        mask = buffer[:b * (hi - lo) * hi].view(b, hi - lo, hi)
        neg_f_into(mask, s, carry[:, :hi])
        mask[:, :, lo:].masked_fill_(above[:hi - lo, :hi - lo], float("-inf"))
        out[:, :, lo:hi] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], attn_mask=mask.unsqueeze(1), scale=scale,
            enable_gqa=group > 1)
        carry[:, :hi] += s.sum(dim=2, dtype=wide)
    return out, carry


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

    @property
    def bos_apart(self) -> bool:
        """Whether the BOS key is taken apart from the others (off the diagonal: :func:`_bos_forward`)."""
        return self.bos and not self.diagonal

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
        return block_selection(q_sel, k_sel, bq, self.scale, self.pointwise, self.bos and has_first, self.diagonal)


def pair_forward(pair: Pair, q, ke, ve, carry, out, lse, carries: list | None = None, accumulate: bool = False,
                 span: int | None = None, final: torch.Tensor | None = None) -> None:
    """The pair's attention: queries q (B, H, nq, D) against keys and values ke, ve (B, H, nk, D) with -F from
    ``carry`` (B, nk; the column sums of S over every earlier query, not changed) plus the pair's own S; writes
    the output (normalised over these keys) into ``out`` and its log-sum-exp into ``lse`` ((B, H, nq), -inf where
    a query has no live key), or with ``accumulate`` merges them, span by span, into what ``out`` and ``lse``
    hold (the attention over other keys: no output of the whole pair is held). ``carries``: the running carry
    before each block of ``pair.block`` queries is appended (what :func:`pair_backward` needs). ``span``: queries
    per flash call (default :func:`forward_span`); off the diagonal a span ends early at a block where at most
    half of its live keys are left (their F grew past the bound), so that later blocks do not visit dead keys.
    ``final`` (B, nk): receives the carry after the pair's last query; on the diagonal, whose incoming carry is 0,
    that is the pair's column sums of S (what :func:`pair_colsums` adds, up to keys past the bound)."""
    if pair.bos_apart:  # the BOS key apart: one product for every query, then the other keys
        _bos_forward(pair, q, ke, ve, carry[:, :1], out, lse, accumulate)
        if carries is not None:  # the BOS key's F first, then what the other keys' blocks keep
            carries.append(carry[:, :1].clone())
        if final is not None:
            final[:, :1] = carry[:, :1]
        if ke.shape[2] > 1:
            pair_forward(replace(pair, bos=False), q, ke[:, :, 1:], ve[:, :, 1:], carry[:, 1:], out, lse,
                         carries, accumulate=True, span=span, final=None if final is None else final[:, 1:])
        return
    b, h, nq, d = q.shape
    nk = ke.shape[2]
    wide = carry.dtype
    carry = carry.clone()
    span = span or forward_span(pair.block, b, nk)
    buffer = torch.empty(b * min(span, nq) * nk, dtype=q.dtype, device=q.device)  # one mask for every span
    start = 0
    while start < nq:
        stop = min(start + span, nq)
        with phase("forward: live keys"):  # the earlier keys still worth visiting, then the span's
            keys = pair.keys(carry, nq, nk, start, stop)
        # -F for the span's queries against those keys; each block of ``block`` queries computes its part
        # from its own carry, exactly as the backward pass recomputes it
        mask = buffer[:b * (stop - start) * keys.count].view(b, stop - start, keys.count)
        for lo in range(start, stop, pair.block):
            if lo > start and not pair.diagonal and keys.count and _dying(carry, keys, pair.limit):
                stop = lo  # the next span starts here, with the keys still live
                mask = mask[:, :stop - start]
                break
            hi = min(lo + pair.block, stop)
            upto = pair.upto(keys, nq, nk, hi)
            if carries is not None:
                carries.append(carry[:, :upto.stop].clone())
            if upto.count == 0:
                continue
            with phase("forward: selection"):
                s = pair.selection(q[:, pair.sel, lo:hi], upto.take(ke[:, pair.sel], 1), hi - lo, upto.has_first)[0]
            with phase("forward: -F and carry"):
                neg_f_into(mask[:, lo - start:hi - start], s, upto.take(carry, 1), pair.limit)
                upto.add_into(carry, s.sum(dim=2, dtype=wide), 1)
        if accumulate:  # this span's attention, then merged into what out and lse hold
            o = torch.empty(b, h, stop - start, d, dtype=q.dtype, device=q.device)
            l = torch.empty(b, h, stop - start, dtype=wide, device=q.device)
            span_attention(q[:, :, start:stop], ke, ve, keys, mask.unsqueeze(1), pair.scale, 0, stop - start, o,
                           l, pair.diagonal)
            merge_lse(out[:, :, start:stop], lse[:, :, start:stop], o, l)
        else:
            span_attention(q, ke, ve, keys, mask.unsqueeze(1), pair.scale, start, stop, out, lse, pair.diagonal)
        start = stop
    if final is not None:
        final.copy_(carry)


def _dying(carry, keys: Keys, limit: float) -> bool:
    """Off the diagonal, whether at most half of the span's live ``keys`` are still under the bound."""
    return 2 * int((keys.take(carry, 1) < limit).any(dim=0).sum()) <= keys.count


def _bos_logits(pair: Pair, q, ke, f0):
    """Off the diagonal, the BOS key's logits (B, H, nq) in the dtype of ``f0``: q k_0 * scale - F_0, with F_0
    (B, 1) the carry into the pair (it does not grow inside it: BOS is never selected)."""
    logits = (q @ ke[:, :, :1].transpose(-1, -2))[..., 0].to(f0.dtype) * pair.scale
    return logits - f0[:, None]


def _bos_forward(pair: Pair, q, ke, ve, f0, out, lse, accumulate: bool) -> None:
    """Off the diagonal, the BOS key alone (never selected, so its F is its carry, 0 under sharding): attention
    over one key is its value, with the key's logit as log-sum-exp. Keys whose F only grows are left out block by
    block (:meth:`Keys.live`); the BOS never is, so off the diagonal it would keep every block of queries busy for
    one key: it takes one product for all of them instead."""
    logits = _bos_logits(pair, q, ke, f0)
    o = ve[:, :, :1].expand_as(q)
    if accumulate:
        merge_lse(out, lse, o, logits)
    else:
        out.copy_(o)
        lse.copy_(logits)


def _bos_backward(pair: Pair, q, ke, ve, f0, grad_out, lse, neg_delta, dq, dk, dv, dcarry) -> None:
    """The BOS key's share of :func:`pair_backward` off the diagonal (see :func:`_bos_forward`): its probability
    p = exp(logit - lse) for every query, then dv_0 += p g, dL/dlogit = p (g . v_0 - delta), which reaches q, k_0
    and, with a minus sign, the carry F_0 (no selector gradient: BOS is never selected)."""
    p = torch.exp(_bos_logits(pair, q, ke, f0.to(lse.dtype)) - lse)  # (B, H, nq)
    dv[:, :, 0] += torch.einsum("bhq,bhqd->bhd", p.to(q.dtype), grad_out)
    dl = p * ((grad_out @ ve[:, :, :1].transpose(-1, -2))[..., 0] + neg_delta[..., 0]).to(p.dtype)
    dq += dl.to(q.dtype)[..., None] * ke[:, :, :1] * pair.scale
    dk[:, :, 0] += torch.einsum("bhq,bhqd->bhd", dl.to(q.dtype), q) * pair.scale
    dcarry[:, 0] -= dl.sum(dim=(1, 2)).to(dcarry.dtype)


def merge_lse(out, lse, o, l) -> None:
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
    if pair.bos_apart:  # the BOS key apart, as the forward took it (its F first in ``carries``)
        _bos_backward(pair, q, ke, ve, carries[0], grad_out, lse, neg_delta, dq, dk, dv, dcarry)
        if ke.shape[2] > 1:
            pair_backward(replace(pair, bos=False), q, ke[:, :, 1:], ve[:, :, 1:], grad_out, lse, neg_delta,
                          carries[1:], dq, dk[:, :, 1:], dv[:, :, 1:], dcarry[:, 1:])
        return
    b, h, nq, d = q.shape
    nk = ke.shape[2]
    sel = pair.sel
    starts = list(range(0, nq, pair.block))
    for index in reversed(range(len(starts))):
        start = starts[index]
        stop = min(start + pair.block, nq)
        carry = carries[index]
        with phase("backward: live keys"):
            keys = pair.keys(carry, nq, nk, start, stop)
        if keys.count == 0:
            continue
        with phase("backward: selection"):
            s, l_sel = pair.selection(q[:, sel, start:stop], keys.take(ke[:, sel], 1), stop - start, keys.has_first)
        with phase("backward: -F"):
            neg_f = torch.empty(b, stop - start, keys.count, dtype=q.dtype, device=q.device)
            neg_f_into(neg_f, s, keys.take(carry, 1), pair.limit)
        with phase("backward: softmax tiles"):
            k_c, v_c = keys.take(ke, 2), keys.take(ve, 2)
            dk_c, dv_c = keys.grad_buffer(dk, 2), keys.grad_buffer(dv, 2)
            # dL/dF (queries × keys), summed over heads: F enters every head's logits with a minus sign
            d_f = tiles_backward(q[:, :, start:stop], k_c, v_c, grad_out[:, :, start:stop], lse[:, :, start:stop],
                                 neg_delta[:, :, start:stop], neg_f, pair.scale, dq[:, :, start:stop], dk_c, dv_c,
                                 pair.diagonal)
            keys.add_into(dk, dk_c, 2, buffer=True)
            keys.add_into(dv, dv_c, 2, buffer=True)
        with phase("backward: reverse carry and selector"):
            # F = carry + exclusive cumsum over queries of S; the next carry = carry + sums over queries of S
            d_f = d_f.transpose(1, 2)  # (B, Nk, Bq), like S^T
            total = d_f.sum(dim=2, keepdim=True)
            d_s = total - torch.cumsum(d_f, dim=2) + keys.take(dcarry, 1)[:, :, None].to(d_f.dtype)
            keys.add_into(dcarry, total[:, :, 0].to(dcarry.dtype), 1)
            d_sel = d_s.mul_(exclude_unselectable(pair.pointwise.derivative(l_sel), stop - start, pair.pointwise,
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
    if pair.bos_apart:  # BOS is never selected: its column sum stays 0
        pair_colsums(replace(pair, bos=False), q_sel, k_sel[:, 1:], colsum[:, 1:],
                     None if base is None else base[:, 1:])
        return
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
    if pair.bos_apart:  # BOS is never selected: no gradient through its S
        pair_later(replace(pair, bos=False), q_sel, k_sel[:, 1:], later[:, 1:], dq_sel, dk_sel[:, 1:])
        return
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
            d_sel = exclude_unselectable(d_sel, hi - lo, pair.pointwise, pair.bos, pair.diagonal)
        else:
            _exclude_indexed(d_sel, index, first + lo, pair, own)
        d_sel.mul_(keys.take(later, 1)[:, :, None].to(d_sel.dtype))
        _selector_grads(pair, d_sel, q_sel[:, lo:hi], keys, k_sel, dq_sel[:, lo:hi], dk_sel)


def _exclude_indexed(t, index, first_query_key: int, pair: Pair, own: int) -> None:
    """:func:`exclude_unselectable` for the keys ``index`` (ascending) of a block whose first query's own key is
    ``first_query_key``: key j is excluded for query i (0-based in the block) when j > first_query_key + i
    (j >= unless self-selection is allowed), and BOS."""
    if own:
        query = torch.arange(t.shape[2], device=t.device)
        limit = first_query_key + query - (1 if pair.pointwise.exclude_self else 0)
        t.masked_fill_(index[:, None] > limit[None, :], 0.0)
    if pair.bos and int(index[0]) == 0:
        t[:, 0] = 0

"""Selective pairs on the blocked backend's fused CPU kernel (``backends/selective_kernel.py``): each (query
chunk, key chunk) pair is one :class:`~attnzoo.backends.selective_kernel.Pair`, forward and backward, the same
code that runs the whole sequence in one process. What is distributed stays here: the selector pass (the column
sums of S of every chunk, a ring of the selector head's keys), the carries scanned along the sequence, the merge
by log-sum-exp, and the reverse carry, whose share from later chunks (the gradient of S through their F) is a
second, selector-only ring once the reverse scan is done."""

from __future__ import annotations

import math

import torch

from ..backends.blocked import _pointwise
from ..backends.selective_kernel import Pair, flash_available, pair_backward, pair_colsums, pair_forward, pair_later
from ..cache import accumulator_dtype
from ..transforms.base import Slot
from .carry import _scan
from .exchange import _Blocks
from .layout import _Config
from .pairs import _block, _merge, _Walk, pair_queries


def fused_pairs(cfg: _Config, qs: torch.Tensor, bos_rows: torch.Tensor) -> bool:
    """Whether every pair of this call runs the fused selective kernel: causal, an accumulator whose selection is
    pointwise in one selector head with no parameters (what ``blocked`` fuses), no logits or mask transform and
    no per-token feature, float32/float64 on the CPU (where the kernel's flash op is usable), and the batch rows
    agree on whether the first token is the protected BOS (``bos_rows``: whether each row's first position is
    1)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    return (plan.causal and acc is not None and _pointwise(acc) is not None and not plan.many(Slot.LOGITS)
            and not plan.many(Slot.MASK) and not cfg.feature_keys and qs.device.type == "cpu"
            and qs.dtype in (torch.float32, torch.float64) and flash_available(qs.dtype)
            and bool((bos_rows == bos_rows[0]).all()))


class _Pairs:
    """The fixed parts of every pair of one call: the selector head, its key head, the pointwise selection, the
    largest query and local key norms (for each pair's negligible bound on F)."""

    def __init__(self, cfg: _Config, qs, ks, bos: bool) -> None:
        acc = cfg.plan.one(Slot.ACCUMULATOR)
        self.cfg = cfg
        self.group = qs.shape[1] // ks.shape[1]
        self.sel = acc.heads()[0]
        self.sel_kv = self.sel // self.group
        self.pointwise = _pointwise(acc)
        self.bos = bos and self.pointwise.exclude_first
        self.q_max = float(qs.norm(dim=-1).amax()) if qs.numel() else 0.0
        self.k_max = float(ks.norm(dim=-1).amax()) if ks.numel() else 0.0

    def pair(self, c: int, cb: int, keys: torch.Tensor | None) -> Pair:
        """The pair of query chunk ``c`` and key chunk ``cb`` (keys (B, H_kv, nk, D) for the bound; None: no
        bound, the selector pass). The bound on F: a query's largest exponent is at least its own key's logit
        (F = 0 there, and its own key is local), so with L = scale · max|q| · max(max|k| local, in the chunk),
        an F over 2L + 104 leaves a probability under e^-104 of the row's largest (``negligible_f``)."""
        limit = math.inf
        if keys is not None and keys.numel():
            bound = 2.0 * self.cfg.scale * self.q_max * max(self.k_max, float(keys.norm(dim=-1).amax())) + 104.0
            limit = bound if math.isfinite(bound) else math.inf
        return Pair(self.cfg.scale, self.sel, self.pointwise, self.cfg.block_size, limit, diagonal=c == cb,
                    bos=self.bos and cb == 0)

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.group, dim=1) if self.group > 1 else t

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        if self.group == 1:
            return t
        b, h, n, d = t.shape
        return t.view(b, h // self.group, self.group, n, d).sum(2)

    def selector_block(self, ks, pos) -> dict[str, torch.Tensor]:
        return {"k": ks[:, self.sel_kv:self.sel_kv + 1], "pos": pos}


def fused_forward(cfg: _Config, qs, ks, vs, pos, bos: bool, keep: bool):
    """(out, lse, the carries into each local chunk (B, N), the carries before each block of each pair (kept for
    the backward when ``keep``)); the sink is joined by the caller."""
    b, h, n, d = qs.shape
    pairs = _Pairs(cfg, qs, ks, bos)
    wide = accumulator_dtype(qs.dtype)
    walk = _Walk(cfg, pos)
    # the selector pass: every local chunk's column sums of S over the whole sequence's keys, then the scan
    table = {c: qs.new_zeros(b, cfg.layout.seq_len, dtype=wide) for c in cfg.layout.owned(cfg.rank)}
    for src, blk in _Blocks(cfg, "selector")(pairs.selector_block(ks, pos)):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            width = chunk.stop - chunk.start
            pair_colsums(pairs.pair(c, cb, None), qs[:, pairs.sel, pair_queries(blocks)], blk["k"][:, 0, chunk],
                         table[c][:, gstart:gstart + width])
    carries = _scan(cfg, table, reverse=False)
    out = torch.zeros_like(qs)
    lse = torch.full((b, h, n), float("-inf"), dtype=qs.dtype, device=qs.device)
    kept: dict[tuple[int, int], list[torch.Tensor]] = {}
    for src, blk in _Blocks(cfg, "kv")(_block(ks, vs, pos, {})):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            rows = pair_queries(blocks)
            width = chunk.stop - chunk.start
            pair = pairs.pair(c, cb, blk["k"][:, :, chunk])
            q = qs[:, :, rows]
            o = torch.full_like(q, float("nan"))
            l = torch.full(q.shape[:3], float("nan"), dtype=wide, device=q.device)
            block_carries: list[torch.Tensor] | None = [] if keep else None
            pair_forward(pair, q, pairs.expand(blk["k"][:, :, chunk]), pairs.expand(blk["v"][:, :, chunk]),
                         carries[c][:, gstart:gstart + width], o, l, block_carries)
            _merge(out[:, :, rows], lse[:, :, rows], o, l.to(lse.dtype))
            if block_carries is not None:
                kept[(c, cb)] = block_carries
    return out, lse, carries, kept


def fused_backward(cfg: _Config, qs, ks, vs, pos, out, lse, carries, kept, d_out, bos: bool):
    """(dq, dk, dv) from the final output and log-sum-exp (the sink included): each pair's share of the softmax
    gradients and the reverse carry inside it (:func:`pair_backward`), the reverse scan of what reaches each
    chunk's carries, then the selector-only ring that carries it into the earlier chunks' S
    (:func:`pair_later`)."""
    pairs = _Pairs(cfg, qs, ks, bos)
    wide = accumulator_dtype(qs.dtype)
    walk = _Walk(cfg, pos)
    d_out = d_out.contiguous()
    neg_delta = -(d_out * out).sum(-1, keepdim=True)
    d_q = torch.zeros_like(qs)
    reach = {c: torch.zeros_like(t) for c, t in carries.items()}
    kv = _Blocks(cfg, "kv")
    for src, blk, g_blk in kv.with_grads(_block(ks, vs, pos, {}), ["k", "v"]):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            rows = pair_queries(blocks)
            width = chunk.stop - chunk.start
            pair = pairs.pair(c, cb, blk["k"][:, :, chunk])
            ke, ve = pairs.expand(blk["k"][:, :, chunk]), pairs.expand(blk["v"][:, :, chunk])
            dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
            dcarry = qs.new_zeros(qs.shape[0], width, dtype=wide)
            pair_backward(pair, qs[:, :, rows], ke, ve, d_out[:, :, rows], lse[:, :, rows], neg_delta[:, :, rows],
                          kept[(c, cb)], d_q[:, :, rows], dk, dv, dcarry)
            g_blk["k"][:, :, chunk] += pairs.fold(dk)
            g_blk["v"][:, :, chunk] += pairs.fold(dv)
            reach[c][:, gstart:gstart + width] += dcarry
    later = _scan(cfg, reach, reverse=True)
    selector = _Blocks(cfg, "selector")
    for src, blk, g_blk in selector.with_grads(pairs.selector_block(ks, pos), ["k"]):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            width = chunk.stop - chunk.start
            rows = pair_queries(blocks)
            pair_later(pairs.pair(c, cb, None), qs[:, pairs.sel, rows], blk["k"][:, 0, chunk],
                       later[c][:, gstart:gstart + width], d_q[:, pairs.sel, rows], g_blk["k"][:, 0, chunk])
    d_k = kv.returned["k"]
    d_k[:, pairs.sel_kv] += selector.returned["k"][:, 0]
    return d_q, d_k, kv.returned["v"]

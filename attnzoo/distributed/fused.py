"""Selective pairs on the blocked backend's fused CPU kernel (``backends/selective_kernel.py``): each (query
chunk, key chunk) pair is one :class:`~attnzoo.backends.selective_kernel.Pair`, forward and backward, the same
code that runs the whole sequence in one process. What is distributed stays here: the selector pass (the column
sums of S of every chunk, a ring of the selector head's keys; a diagonal pair, whose carry is 0, runs its whole
forward there, and its final carry is its column sums), the carries scanned along the sequence, the merge
by log-sum-exp, and the reverse carry, whose share from later chunks (the gradient of S through their F) is a
second, selector-only ring once the reverse scan is done."""

from __future__ import annotations

import math

import torch

from ..backends.blocked import fusable_pointwise
from ..backends.selective_kernel import Pair, flash_available, pair_backward, pair_colsums, pair_forward, pair_later
from ..core.numerics import accumulator_dtype
from ..transforms.base import Slot
from .carry import scan_chunks
from .exchange import KeyBlocks, all_gather, token_dim
from .layout import ShardConfig
from .pairs import PairWalk, key_block, pair_queries


def fused_pairs(cfg: ShardConfig, qs: torch.Tensor, bos_rows: torch.Tensor) -> bool:
    """Whether every pair of this call runs the fused selective kernel: causal, an accumulator whose selection is
    pointwise in one selector head with no parameters (what ``blocked`` fuses), no logits or mask transform and
    no per-token feature, float32/float64 on the CPU (where the kernel's flash op is usable), and the batch rows
    agree on whether the first token is the protected BOS (``bos_rows``: whether each row's first position is
    1)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    return (plan.causal and acc is not None and fusable_pointwise(acc) is not None and not plan.many(Slot.LOGITS)
            and not plan.many(Slot.MASK) and not cfg.feature_keys and qs.device.type == "cpu"
            and qs.dtype in (torch.float32, torch.float64) and flash_available(qs.dtype)
            and bool((bos_rows == bos_rows[0]).all()))


def negligible_bound(cfg: ShardConfig, qs, ks) -> float:
    """The whole sequence's bound on F past which a key is negligible (``selective_kernel.negligible_f``, with the
    largest query and key norms of every rank: one all-gather of two numbers), the same on every rank: a key
    whose F reaches it is left out of every later query's attention, on whichever rank, so its carry may stop
    growing there (the selector pass leaves it out too)."""
    mine = torch.tensor([float(qs.norm(dim=-1).amax()) if qs.numel() else 0.0,
                         float(ks.norm(dim=-1).amax()) if ks.numel() else 0.0], dtype=torch.float64)
    q_max, k_max = (float(x) for x in all_gather(mine, cfg.group, cfg.world, "meta").amax(dim=0))
    bound = 2.0 * cfg.scale * q_max * k_max + 104.0
    return bound if math.isfinite(bound) else math.inf


class _Pairs:
    """The fixed parts of every pair of one call: the selector head, its key head, the pointwise selection and
    the negligible bound on F (:func:`negligible_bound`)."""

    def __init__(self, cfg: ShardConfig, qs, ks, bos: bool, limit: float) -> None:
        acc = cfg.plan.one(Slot.ACCUMULATOR)
        self.cfg, self.limit = cfg, limit
        self.group = qs.shape[1] // ks.shape[1]
        self.sel = acc.heads()[0]
        self.sel_kv = self.sel // self.group
        self.pointwise = fusable_pointwise(acc)
        self.bos = bos and self.pointwise.exclude_first

    def pair(self, c: int, cb: int, gstart: int) -> Pair:
        """The pair of query chunk ``c`` and key chunk ``cb`` (or the part of it from global token ``gstart``)."""
        return Pair(self.cfg.scale, self.sel, self.pointwise, self.cfg.block_size, self.limit, diagonal=c == cb,
                    bos=self.bos and gstart == 0)

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.group, dim=1) if self.group > 1 else t

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        if self.group == 1:
            return t
        b, h, n, d = t.shape
        return t.view(b, h // self.group, self.group, n, d).sum(2)

    def selector_block(self, ks, pos) -> dict[str, torch.Tensor]:
        return {"k": ks[:, self.sel_kv:self.sel_kv + 1], "pos": pos}


class _Sent:
    """The keys each rank's block sends to the others: those still under the negligible bound, in some batch row,
    after their own chunk's queries (the diagonal pair's column sums of S, which every rank has after the selector
    pass's all-gather; BOS is never selected). A key past it there is past it for every later query, on whichever
    rank (F only grows): no other rank's pair would visit it, so it never leaves its rank. Every rank computes the
    same index sets from the same sums. With no bound (an input not finite) every key is sent, as every key is
    visited."""

    def __init__(self, cfg: ShardConfig, tables: dict[int, torch.Tensor], limit: float) -> None:
        self.cfg = cfg
        self.index: list[torch.Tensor] = []  # per rank: the local indices of the keys it sends
        self.spans: list[list[tuple[int, int, int, torch.Tensor]]] = []  # per rank: (chunk, start, stop, global keys)
        for r in range(cfg.world):
            index, spans, at = [], [], 0
            for cb, lstart, lstop, gstart in cfg.layout.local_chunks(r):
                past = tables[cb][:, gstart:gstart + lstop - lstart] >= limit  # NaN is not past: it is sent
                live = (~past).any(dim=0).nonzero().squeeze(1) if math.isfinite(limit) else \
                    torch.arange(lstop - lstart, device=past.device)
                index.append(live + lstart)
                spans.append((cb, at, at + live.numel(), live + gstart))
                at += live.numel()
            self.index.append(torch.cat(index))
            self.spans.append(spans)
        self.sizes = [i.numel() for i in self.index]

    def compact(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's block (keys and values, or the selector's key rows; with positions) as the others receive
        it: its sent keys only."""
        rank = self.cfg.rank
        if self.sizes[rank] == self.cfg.layout.local_size(rank):  # every key is sent
            return mine
        return {name: t.index_select(token_dim(name) % t.dim(), self.index[rank]) for name, t in mine.items()}

    def pairs(self, src: int, start: int, count: int):
        """(query chunk, key chunk, the keys' slice in the piece of ``src``'s sent block holding its keys [start,
        start + count), their global indices, the query chunk's local rows) for every pair of this rank's chunks
        with that piece (every key precedes every query of a later chunk)."""
        for cb, lo, hi, keys in self.spans[src]:
            a, b = max(lo, start), min(hi, start + count)
            if a >= b:
                continue
            for c, qstart, qstop, _ in self.cfg.layout.local_chunks(self.cfg.rank):
                if c > cb:
                    yield c, cb, slice(a - start, b - start), keys[a - lo:b - lo], slice(qstart, qstop)


def fused_forward(cfg: ShardConfig, qs, ks, vs, pos, bos: bool, keep: bool):
    """(out, lse, the carries into each local chunk (B, N), what the backward needs: the carries before each
    block of each pair (when ``keep``), the negligible bound, the walk and the keys sent (:class:`_Sent`)); the
    sink is joined by the caller."""
    b, h, n, d = qs.shape
    limit = negligible_bound(cfg, qs, ks)
    pairs = _Pairs(cfg, qs, ks, bos, limit)
    wide = accumulator_dtype(qs.dtype)
    walk = PairWalk(cfg, pos)
    # the selector pass: every local chunk's column sums of S over the whole sequence's keys, then the scan.
    # A key whose F is past the bound is left out: any column sums of chunks between the key's and the queries'
    # bound its carry from below. Those of this rank's earlier chunks (pairs come with the earlier query chunk
    # first), and, for other ranks' keys, the sums every rank computed over its own keys (its first step),
    # all-gathered once that step is done (B x N per chunk)
    owned = cfg.layout.owned(cfg.rank)
    table = {c: qs.new_zeros(b, cfg.layout.seq_len, dtype=wide) for c in owned}
    theirs: dict[int, torch.Tensor] = {}
    piece = None if keep else cfg.piece  # without a backward: other ranks' keys in pieces
    out = torch.zeros_like(qs)
    lse = torch.full((b, h, n), float("-inf"), dtype=qs.dtype, device=qs.device)
    kept: dict[tuple[int, int], list[torch.Tensor]] = {}

    def forward(c, cb, first, k, v, rows, carry, final=None):
        # merged into out and lse span by span; without a backward, one block of queries per flash call (the
        # span's -F mask is the largest transient)
        block_carries: list[torch.Tensor] | None = [] if keep else None
        pair_forward(pairs.pair(c, cb, first), qs[:, :, rows], pairs.expand(k), pairs.expand(v), carry,
                     out[:, :, rows], lse[:, :, rows], block_carries, accumulate=True,
                     span=None if keep else cfg.block_size, final=final)
        if block_carries is not None:
            kept[(c, cb)] = block_carries

    for src, blk, start in KeyBlocks(cfg, "selector").pieces(pairs.selector_block(ks, pos), piece):
        if src != cfg.rank and not theirs:
            every = all_gather(torch.stack([table[c] for c in owned]), cfg.group, cfg.world, "selector")
            theirs = {c: every[r, i] for r in range(cfg.world) if r != cfg.rank
                      for i, c in enumerate(cfg.layout.owned(r))}
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"], start):
            keys = slice(gstart, gstart + chunk.stop - chunk.start)
            if c == cb:  # a diagonal pair's carry is 0 (no earlier query selects its keys): its forward now,
                # whose final carry is its column sums
                forward(c, cb, gstart, ks[:, :, chunk], vs[:, :, chunk], pair_queries(blocks),
                        qs.new_zeros(b, keys.stop - keys.start, dtype=wide), final=table[c][:, keys])
                continue
            earlier = [table[e][:, keys] for e in owned if e < c]
            earlier += [t[:, keys] for e, t in theirs.items() if cb <= e < c]
            pair_colsums(pairs.pair(c, cb, gstart), qs[:, pairs.sel, pair_queries(blocks)], blk["k"][:, 0, chunk],
                         table[c][:, keys], sum(earlier) if earlier else None)
    sent = _Sent(cfg, {**theirs, **table}, limit) if cfg.world > 1 else None
    carries = scan_chunks(cfg, table, reverse=False)
    own = key_block(ks, vs, pos, {})
    kv = KeyBlocks(cfg, "kv", sent.sizes if sent else None)
    for src, blk, start in kv.pieces(sent.compact(own) if sent else own, piece):
        if src == cfg.rank:  # this rank's own pairs on its whole block (the diagonal ones ran above)
            for c, cb, gstart, chunk, blocks in walk.pairs(src, pos):
                if c != cb:
                    forward(c, cb, gstart, ks[:, :, chunk], vs[:, :, chunk], pair_queries(blocks),
                            carries[c][:, gstart:gstart + chunk.stop - chunk.start])
            continue
        for c, cb, chunk, keys, rows in sent.pairs(src, start, blk["k"].shape[2]):
            forward(c, cb, int(keys[0]), blk["k"][:, :, chunk], blk["v"][:, :, chunk], rows,
                    carries[c].index_select(1, keys))
    return out, lse, carries, (kept, limit, walk, sent)


def fused_backward(cfg: ShardConfig, qs, ks, vs, pos, out, lse, carries, kept, d_out, bos: bool):
    """(dq, dk, dv) from the final output and log-sum-exp (the sink included): each pair's share of the softmax
    gradients and the reverse carry inside it (:func:`pair_backward`), the reverse scan of what reaches each
    chunk's carries, then the selector-only ring that carries it into the earlier chunks' S
    (:func:`pair_later`). Other ranks' keys come as the forward received them (:class:`_Sent`), and their
    gradients go home the same way."""
    kept, limit, walk, sent = kept  # the forward's walk (its pairs are already found) and keys sent
    pairs = _Pairs(cfg, qs, ks, bos, limit)
    wide = accumulator_dtype(qs.dtype)
    d_out = d_out.contiguous()
    neg_delta = -(d_out * out).sum(-1, keepdim=True)
    d_q = torch.zeros_like(qs)
    d_k, d_v = torch.zeros_like(ks), torch.zeros_like(vs)
    reach = {c: torch.zeros_like(t) for c, t in carries.items()}

    def backward(c, cb, first, k, v, rows, dk_into, dv_into):
        ke, ve = pairs.expand(k), pairs.expand(v)
        dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
        dcarry = qs.new_zeros(qs.shape[0], k.shape[2], dtype=wide)
        pair_backward(pairs.pair(c, cb, first), qs[:, :, rows], ke, ve, d_out[:, :, rows], lse[:, :, rows],
                      neg_delta[:, :, rows], kept[(c, cb)], d_q[:, :, rows], dk, dv, dcarry)
        dk_into += pairs.fold(dk)
        dv_into += pairs.fold(dv)
        return dcarry

    own = key_block(ks, vs, pos, {})
    kv = KeyBlocks(cfg, "kv", sent.sizes if sent else None)
    for src, blk, g_blk in kv.with_grads(sent.compact(own) if sent else own, ["k", "v"]):
        if src == cfg.rank:  # this rank's own pairs on its whole block
            for c, cb, gstart, chunk, blocks in walk.pairs(src, pos):
                width = chunk.stop - chunk.start
                reach[c][:, gstart:gstart + width] += backward(
                    c, cb, gstart, ks[:, :, chunk], vs[:, :, chunk], pair_queries(blocks), d_k[:, :, chunk],
                    d_v[:, :, chunk])
            continue
        for c, cb, chunk, keys, rows in sent.pairs(src, 0, blk["k"].shape[2]):
            reach[c].index_add_(1, keys, backward(c, cb, int(keys[0]), blk["k"][:, :, chunk],
                                                  blk["v"][:, :, chunk], rows, g_blk["k"][:, :, chunk],
                                                  g_blk["v"][:, :, chunk]))
    if sent is not None:  # the other ranks' shares of this rank's sent keys
        d_k.index_add_(2, sent.index[cfg.rank], kv.returned["k"])
        d_v.index_add_(2, sent.index[cfg.rank], kv.returned["v"])
    later = scan_chunks(cfg, reach, reverse=True)
    # the selector ring carries the sent keys too: a key another rank's F never sees has no gradient from it
    selector = KeyBlocks(cfg, "selector", sent.sizes if sent else None)
    mine = pairs.selector_block(ks, pos)
    d_sel = torch.zeros_like(mine["k"])
    for src, blk, g_blk in selector.with_grads(sent.compact(mine) if sent else mine, ["k"]):
        if src == cfg.rank:
            for c, cb, gstart, chunk, blocks in walk.pairs(src, pos):
                rows = pair_queries(blocks)
                pair_later(pairs.pair(c, cb, gstart), qs[:, pairs.sel, rows], mine["k"][:, 0, chunk],
                           later[c][:, gstart:gstart + chunk.stop - chunk.start], d_q[:, pairs.sel, rows],
                           d_sel[:, 0, chunk])
            continue
        for c, cb, chunk, keys, rows in sent.pairs(src, 0, blk["k"].shape[2]):
            pair_later(pairs.pair(c, cb, int(keys[0])), qs[:, pairs.sel, rows], blk["k"][:, 0, chunk],
                       later[c].index_select(1, keys), d_q[:, pairs.sel, rows], g_blk["k"][:, 0, chunk])
    if sent is not None:
        d_sel.index_add_(2, sent.index[cfg.rank], selector.returned["k"])
    d_k[:, pairs.sel_kv] += d_sel[:, 0]
    return d_q, d_k, d_v

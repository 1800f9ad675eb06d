"""What crosses the shard boundaries in sequence order: the accumulator's carry (an exclusive scan of the
chunks' column sums of S, forward; the reverse scan of F's gradient, backward) and the running sums of cumulative
per-token features."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.numerics import accumulator_dtype
from ..transforms.base import Dims, Slot, TokenRows
from .exchange import GatherChunks, KeyBlocks, count_sent, recv, send, tensor_bytes
from .layout import Layout, ShardConfig
from .pairs import PairWalk, block_key_features, key_block, pair_selection, selector_kv_heads


def scan_chunks(cfg: ShardConfig, table: dict[int, torch.Tensor], reverse: bool) -> dict[int, torch.Tensor]:
    """Exclusive scan of per-chunk tensors in sequence order (``reverse``: from the end), through the chunks'
    owners in turn: ``out[c] = sum of table[c']`` over the chunks c' before c (after c when reversed)."""
    layout, rank = cfg.layout, cfg.rank
    order = list(range(layout.num_chunks))
    if reverse:
        order.reverse()
    like = next(iter(table.values()))
    running = torch.zeros_like(like)
    out = {}
    for i, c in enumerate(order):
        if layout.owner(c) != rank:
            continue
        if i > 0 and layout.owner(order[i - 1]) != rank:
            running = torch.empty_like(like)
            recv(running, layout.owner(order[i - 1]), cfg.group)
        out[c] = running.clone()
        running = running + table[c]
        if i < len(order) - 1 and layout.owner(order[i + 1]) != rank:
            count_sent("carry", tensor_bytes(running))
            send(running, layout.owner(order[i + 1]), cfg.group)
    return out


# -- per-token features ---------------------------------------------------------------------------------------------
def sharded_features(plan, qs, ks, vs, pos, grouped, layout: Layout, rank: int, group) -> dict[str, torch.Tensor]:
    """The spec's per-token features of this rank's tokens, (B, H, n) each in at least float32; cumulative ones
    summed along the whole sequence: within each chunk, plus the totals of every earlier chunk (all-gathered,
    with a gradient back to the ranks that own them)."""
    out: dict[str, torch.Tensor] = {}
    b, h, n, _ = qs.shape
    rows = TokenRows(qs, ks, vs, pos, None, Dims(h, qs.shape[3], ks.shape[1]))
    chunks = layout.local_chunks(rank)
    for t in plan.composition.feature_transforms():
        for name, value in (t.features(rows, grouped[t.kind]) or {}).items():
            if tuple(value.shape) != (b, h, n):
                raise ValueError(f"transform '{t.kind}': feature '{name}' has shape {tuple(value.shape)}, "
                                 f"expected (B, H, N) = {(b, h, n)}")
            value = value.to(torch.promote_types(value.dtype, torch.float32))
            if name in t.cumulative:
                pieces = [value[..., start:stop].cumsum(-1) for _, start, stop, _ in chunks]
                totals = torch.stack([p[..., -1] for p in pieces])  # (chunks held, B, H)
                every = GatherChunks.apply(totals, group, layout.world_size, rank)  # (R, chunks held, B, H)
                by_chunk = {c: every[r, i] for r in range(layout.world_size) for i, c in enumerate(layout.owned(r))}
                ordered = torch.stack([by_chunk[c] for c in range(layout.num_chunks)])
                before = F.pad(ordered.cumsum(0)[:-1], (0, 0, 0, 0, 1, 0))  # exclusive, sequence order
                value = torch.cat([p + before[c][..., None] for p, (c, *_) in zip(pieces, chunks, strict=True)],
                                  dim=-1)
            out[f"{t.kind}.{name}"] = value
    return out


def selector_colsums(cfg: ShardConfig, qs, pos, ks, features, params) -> dict[int, torch.Tensor]:
    """The selector pass: the column sums of S of every local query chunk over the whole sequence's keys, (B, N)
    per chunk (a ring of the selector's key rows alone)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    dims = Dims(h, d, ks.shape[1])
    wide = accumulator_dtype(qs.dtype)
    table = {c: qs.new_zeros(b, cfg.layout.seq_len, dtype=wide) for c in cfg.layout.owned(cfg.rank)}
    mine = key_block(ks.index_select(1, selector_kv_heads(plan, acc, dims, ks.device)), None, pos, features)
    del mine["v"]
    walk = PairWalk(cfg, pos)
    for src, blk in KeyBlocks(cfg, "selector")(mine):
        for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            kchunk, pchunk = blk["k"][:, :, chunk], blk["pos"][:, chunk]
            for qb, keys in blocks:
                s = pair_selection(plan, acc, qs[:, :, qb], kchunk[:, :, keys], pos[:, qb], pchunk[:, keys], dims,
                                   {k: t[..., qb] for k, t in features.items()}, block_key_features(blk, keys, chunk),
                                   params, cfg.scale)
                table[c][:, gstart + keys.start:gstart + keys.stop] += s.to(wide).sum(dim=2)[:, 0]
    return table

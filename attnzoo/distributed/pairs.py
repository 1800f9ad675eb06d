"""The maths of one (query block, key range) pair: logits with the logits transforms, the selection S, F from
the incoming carry, the merge by log-sum-exp, and the walk over a rank's query blocks and a block's chunks."""

from __future__ import annotations

import torch

from ..backends.selective_kernel import merge_lse  # noqa: F401 - the merge by log-sum-exp, one implementation
from ..core.composition import checked_logits
from ..core.flash import flash_available, flash_pair, flash_pair_grads  # noqa: F401 - re-exported for attend.py
from ..core.numerics import f_from_s, subtract_f
from ..transforms.base import Dims, Slot
from .layout import ShardConfig


def _key_range(plan, qpos: torch.Tensor, kpos: torch.Tensor) -> tuple[int, int] | None:
    """The keys (a slice of kpos, ascending) some query at qpos may see under causality and the masks' bounds, or
    None when there is none. The same rule in every pass, so forward and backward visit the same pairs."""
    nk = kpos.shape[-1]
    stop = int((kpos <= qpos.max()).sum(-1).max()) if plan.causal else nk
    earliest = plan.composition.earliest_key(int(qpos.min()))
    start = int((kpos < earliest).sum(-1).min()) if earliest is not None else 0
    return (start, stop) if start < stop else None


def pair_selection(plan, acc, qs, ksel, qpos, kpos, dims, qfeat, kfeat, params, scale):
    """S (B, 1, nq, nk) from the queries (B, H, nq, D) and the selector's key rows ksel (B, len(heads), nk, D),
    the logits of the selector heads alone through the logits slot (as ``Composition.selection``)."""
    ctx = plan.composition.context(qpos, kpos.unsqueeze(1), dims, None, qfeat, kfeat)
    allowed = plan.composition.allowed(ctx, None)
    index, sel_allowed, sel_ctx = plan.composition.selector_view(acc, allowed, ctx)
    logits = (qs.index_select(1, index) @ ksel.transpose(-1, -2)) * scale
    for t in plan.many(Slot.LOGITS):
        logits = checked_logits(t, t.apply(logits, sel_ctx, params[t.kind]), logits)
    return acc.selection(logits, sel_allowed, sel_ctx, params[acc.kind])


def selector_kv_heads(plan, acc, dims: Dims, device) -> torch.Tensor:
    """The key/value head of each of the accumulator's selector heads (GQA: query head // group size)."""
    group = dims.num_heads // dims.num_kv_heads
    return torch.tensor([i // group for i in acc.heads()], device=device)


def eager_pair(plan, params, q, k, v, qpos, kpos, qfeat, kfeat, carry, scale):
    """Queries (B, H, nq, D) at qpos (B, nq) against keys and values (B, H_kv, nk, D) at kpos (B, nk), with the
    features of each and the accumulator's carry (B, nk) into this query block (None without one). Returns (the
    output normalised over these keys (B, H, nq, D), its log-sum-exp (B, H, nq), -inf for a row with no key here,
    the column sums of S (B, nk) or None)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = h // hkv
    dims = Dims(h, d, hkv)
    ctx = plan.composition.context(qpos, kpos.unsqueeze(1), dims, None, qfeat, kfeat)
    allowed = plan.composition.allowed(ctx, None).expand(b, -1, nq, nk)
    logits = (q.reshape(b, hkv, group * nq, d) @ k.transpose(-1, -2)).reshape(b, h, nq, nk) * scale
    for t in plan.many(Slot.LOGITS):
        logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
    colsum = None
    acc = plan.one(Slot.ACCUMULATOR)
    if acc is not None:
        ksel = k.index_select(1, selector_kv_heads(plan, acc, dims, k.device))
        s = pair_selection(plan, acc, q, ksel, qpos, kpos, dims, qfeat, kfeat, params, scale)
        f = f_from_s(s, carry)
        colsum = s.to(f.dtype).sum(dim=2)[:, 0]
        logits = subtract_f(logits, f)  # in F's (wider) dtype, rounded once
    has = allowed.any(-1, keepdim=True)
    masked = logits.masked_fill(~allowed, float("-inf")).masked_fill(~has, 0.0)
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    p = torch.exp(masked - lse).masked_fill(~allowed, 0.0)
    out = (p.reshape(b, hkv, group * nq, nk) @ v).reshape(b, h, nq, d)
    return out, lse[..., 0].masked_fill(~has[..., 0], float("-inf")), colsum


def flash_pairs(cfg: ShardConfig, qs: torch.Tensor) -> bool:
    """Whether every pair of this call is plain softmax attention (causal, no logits, mask, accumulator or
    per-token feature inside the pairs; row maps and the sink are applied outside them) in float32/float64 on the
    CPU: then a pair is torch's CPU flash-attention kernel, forward and backward (:func:`flash_pair`,
    :func:`flash_pair_grads`), instead of the eager pair (:func:`eager_pair`) and its autograd."""
    plan = cfg.plan
    return (plan.causal and not plan.many(Slot.LOGITS) and not plan.many(Slot.MASK)
            and plan.one(Slot.ACCUMULATOR) is None and not cfg.feature_keys and qs.device.type == "cpu"
            and qs.dtype in (torch.float32, torch.float64) and flash_available(qs.dtype))


def pair_queries(blocks) -> slice:
    """The query rows of a pair's blocks, as one slice (they are consecutive)."""
    return slice(blocks[0][0].start, blocks[-1][0].stop)


def partial_weight(l: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """exp(l - total), 0 where the partial row had no key."""
    return torch.where(torch.isfinite(l), torch.exp(l - total), 0.0)


class PairWalk:
    """The work of one rank: every (local query block, key range of a source chunk) pair the masks leave."""

    def __init__(self, cfg: ShardConfig, pos: torch.Tensor) -> None:
        self.cfg, self.pos = cfg, pos
        self._seen: dict[tuple[int, int, int], list] = {}  # every pass of one call visits the same pairs

    def query_blocks(self, start: int, stop: int) -> list[slice]:
        step = self.cfg.block_size
        return [slice(s, min(s + step, stop)) for s in range(start, stop, step)]

    def pairs(self, src: int, kpos: torch.Tensor, start: int = 0):
        """(query chunk, source chunk, its global start, its local slice in the block, [(query block, key
        slice within the chunk)]) for the pairs with at least one visible key. The block holds the source's
        tokens from ``start`` on (a piece, ``KeyBlocks.pieces``): a chunk it holds part of is that part (its
        global start and slice are the part's). A source's positions are the same in every pass of one call: its
        pairs are found once (a sync per query block) and kept."""
        end = start + kpos.shape[-1]
        if (src, start, end) not in self._seen:
            self._seen[(src, start, end)] = list(self._find(src, kpos, start, end))
        yield from self._seen[(src, start, end)]

    def _find(self, src: int, kpos: torch.Tensor, start: int, end: int):
        layout = self.cfg.layout
        for c, qstart, qstop, _ in layout.local_chunks(self.cfg.rank):
            for cb, kstart, kstop, gstart in layout.local_chunks(src):
                if self.cfg.plan.causal and cb > c:
                    continue  # positions increase along the sequence (checked): every key is after every query
                lo, hi = max(kstart, start), min(kstop, end)
                if lo >= hi:
                    continue
                kstart, kstop, gstart = lo - start, hi - start, gstart + lo - kstart
                chunk_pos = kpos[:, kstart:kstop]
                blocks = []
                for qb in self.query_blocks(qstart, qstop):
                    keys = _key_range(self.cfg.plan, self.pos[:, qb], chunk_pos)
                    if keys is not None:
                        blocks.append((qb, slice(*keys)))
                if blocks:
                    yield c, cb, gstart, slice(kstart, kstop), blocks


def unpack_rest(cfg: ShardConfig, rest):
    """(features by key, parameters by transform kind and short name) from the sharded attention's extra inputs
    ``rest``: the features in ``cfg.feature_keys`` order, then the pair slots' parameters in ``cfg.param_keys``
    order."""
    nf = len(cfg.feature_keys)
    features = dict(zip(cfg.feature_keys, rest[:nf], strict=True))
    params: dict[str, dict[str, torch.Tensor]] = {t.kind: {} for t in cfg.plan.transforms}
    for (kind, short), t in zip(cfg.param_keys, rest[nf:], strict=True):
        params[kind][short] = t
    return features, params


def key_block(ks, vs, pos, features) -> dict[str, torch.Tensor]:
    """A rank's block of keys as it travels between ranks: keys ``k``, values ``v``, positions ``pos`` and each
    feature as ``f:<name>``."""
    return {"k": ks, "v": vs, "pos": pos, **{f"f:{name}": t for name, t in features.items()}}


def block_key_features(block, keys: slice, chunk: slice) -> dict[str, torch.Tensor]:
    """The features (by name) of the keys ``keys`` of the chunk ``chunk`` of ``block`` (:func:`key_block`)."""
    return {name[2:]: t[..., chunk][..., keys] for name, t in block.items() if name.startswith("f:")}

"""The sharded attention as an autograd function: the forward over every block of keys merged by
log-sum-exp, and the backward that recomputes every pair and sends the key and value gradients home with the
blocks."""

from __future__ import annotations

import torch

from ..core.numerics import accumulator_dtype
from ..transforms.base import Dims, Slot
from .carry import scan_chunks, selector_colsums
from .exchange import KeyBlocks
from .fused import fused_backward, fused_forward
from .kernel_pairs import triton_backward, triton_forward
from .layout import ShardConfig
from .pairs import (
    PairWalk,
    block_key_features,
    eager_pair,
    flash_pair,
    flash_pair_grads,
    key_block,
    merge_lse,
    pair_queries,
    pair_selection,
    partial_weight,
    selector_kv_heads,
    unpack_rest,
)


def _forward(cfg: ShardConfig, qs, ks, vs, pos, features, params):
    """(out, lse, the carries into each local chunk, what the fused pairs keep for the backward)."""
    plan = cfg.plan
    b, h, n, d = qs.shape
    kept = None
    if cfg.triton is not None:
        out, lse, carries = triton_forward(cfg, cfg.triton, qs, ks, vs, pos, params)
    elif cfg.fused:
        out, lse, carries, kept = fused_forward(cfg, qs, ks, vs, pos, cfg.bos, cfg.keep)
    else:
        out, lse, carries = _pairs_forward(cfg, qs, ks, vs, pos, features, params)
    sink = plan.composition.sink(torch.arange(h, device=qs.device).view(1, -1, 1, 1), params, qs)
    if sink is not None:
        total = torch.logaddexp(lse, sink[..., 0].expand_as(lse))
        out.mul_(partial_weight(lse, total).unsqueeze(-1))
        lse = total
    return out, lse, carries, kept


def _pairs_forward(cfg: ShardConfig, qs, ks, vs, pos, features, params):
    """The flash or eager pairs: (out, lse, the carries into each local chunk)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    carries = (scan_chunks(cfg, selector_colsums(cfg, qs, pos, ks, features, params), reverse=False)
               if acc is not None else {})
    out = torch.zeros_like(qs)
    lse = torch.full((b, h, n), float("-inf"), dtype=qs.dtype, device=qs.device)
    walk = PairWalk(cfg, pos)
    piece = None if cfg.keep else cfg.piece  # without a backward: other ranks' keys in pieces
    for src, blk, start in KeyBlocks(cfg, "kv").pieces(key_block(ks, vs, pos, features), piece):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"], start):
            kchunk, vchunk, pchunk = blk["k"][:, :, chunk], blk["v"][:, :, chunk], blk["pos"][:, chunk]
            if cfg.flash:  # the whole pair of chunks in one kernel call
                rows = pair_queries(blocks)
                o, l = flash_pair(qs[:, :, rows], kchunk, vchunk, cb == c, cfg.scale)
                merge_lse(out[:, :, rows], lse[:, :, rows], o, l.to(lse.dtype))
                continue
            carry = carries[c][:, gstart:gstart + pchunk.shape[-1]].clone() if acc is not None else None
            for qb, keys in blocks:
                o, l, colsum = eager_pair(plan, params, qs[:, :, qb], kchunk[:, :, keys], vchunk[:, :, keys],
                                          pos[:, qb], pchunk[:, keys], {k: t[..., qb] for k, t in features.items()},
                                          block_key_features(blk, keys, chunk),
                                          carry[:, keys] if carry is not None else None, cfg.scale)
                merge_lse(out[:, :, qb], lse[:, :, qb], o, l)
                if colsum is not None:
                    carry[:, keys] += colsum
    return out, lse, carries


class ShardedAttend(torch.autograd.Function):
    """The sharded attention of the transformed rows (row maps and features are applied outside, with autograd):
    inputs qs, ks, vs (this rank's), positions, the features (B, H, n), the pair slots' parameters."""

    @staticmethod
    def forward(ctx, cfg, qs, ks, vs, pos, *rest):
        features, params = unpack_rest(cfg, rest)
        out, lse, carries, kept = _forward(cfg, qs, ks, vs, pos, features, params)
        ctx.cfg = cfg
        ctx.kept = kept
        ctx.chunks = list(carries)
        ctx.save_for_backward(qs, ks, vs, pos, out, lse, *rest, *carries.values())
        return out

    @staticmethod
    def backward(ctx, d_out):
        cfg = ctx.cfg
        saved = ctx.saved_tensors
        qs, ks, vs, pos, out, lse = saved[:6]
        count = len(cfg.feature_keys) + len(cfg.param_keys)
        rest = saved[6:6 + count]
        carries = dict(zip(ctx.chunks, saved[6 + count:], strict=True))
        grads = _backward(cfg, qs, ks, vs, pos, out, lse, rest, carries, d_out, ctx.needs_input_grad[5:], ctx.kept)
        return (None, *grads[:3], None, *grads[3:])


def _leaf(t: torch.Tensor, wanted: bool) -> torch.Tensor:
    return t.detach().requires_grad_(wanted)


def _backward(cfg: ShardConfig, qs, ks, vs, pos, out, lse, rest, carries, d_out, rest_wanted, kept=None):
    """Gradients of qs, ks, vs, then of each feature and parameter (None where not wanted)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    qs, ks, vs, out = qs.detach(), ks.detach(), vs.detach(), out.detach()
    rest = [t.detach() for t in rest]
    features, params = unpack_rest(cfg, rest)
    nf = len(cfg.feature_keys)
    feature_wanted = dict(zip(cfg.feature_keys, rest_wanted[:nf], strict=True))
    param_wanted = list(rest_wanted[nf:])
    d_out = d_out.contiguous()
    delta = (d_out * out).sum(-1)  # (B, H, n)
    walk = PairWalk(cfg, pos)
    wide = accumulator_dtype(qs.dtype)

    d_q = torch.zeros_like(qs)
    d_feat_q = {name: torch.zeros_like(t) for name, t in features.items()}
    d_params = [torch.zeros_like(t) for t in rest[nf:]]

    def pair_grads(o, l, qb):
        w = partial_weight(l.detach(), lse[:, :, qb])
        g_o = w.unsqueeze(-1).to(o.dtype) * d_out[:, :, qb]
        g_l = w * ((d_out[:, :, qb] * o.detach()).sum(-1) - delta[:, :, qb])
        return g_o, g_l

    # the sink: one more partial result, of log-sum-exp sink[h] and output 0
    sink_leaves = [_leaf(t, wanted) for t, wanted in zip(rest[nf:], param_wanted, strict=True)]
    if plan.one(Slot.NORMALISER) is not None and any(param_wanted):
        with torch.enable_grad():
            _, sink_params = unpack_rest(cfg, [*rest[:nf], *sink_leaves])
            sink = plan.composition.sink(torch.arange(h, device=qs.device).view(1, -1, 1, 1), sink_params, qs)
            w = torch.exp(sink[..., 0].expand_as(lse) - lse)
            g = (-w * delta).sum(dim=(0, 2)).view_as(sink)
            wrt = [t for t, wanted in zip(sink_leaves, param_wanted, strict=True) if wanted]
            got = torch.autograd.grad(sink, wrt, g, allow_unused=True)
        it = iter(got)
        for i, wanted in enumerate(param_wanted):
            if wanted:
                g_i = next(it)
                if g_i is not None:
                    d_params[i] += g_i

    if cfg.triton is not None:  # no feature
        d_q, d_k, d_v, more = triton_backward(cfg, cfg.triton, qs, ks, vs, pos, out, lse, carries, d_out,
                                              rest[nf:], param_wanted)
        for i, g in enumerate(more):
            if g is not None:
                d_params[i] += g
        return [d_q, d_k, d_v, *(g if wanted else None for g, wanted in zip(d_params, param_wanted, strict=True))]

    if cfg.fused:  # no feature, and the only pair-slot parameters are the sink's
        if kept is None:
            raise RuntimeError("context-parallel backward: the forward ran without gradients (it kept nothing)")
        d_q, d_k, d_v = fused_backward(cfg, qs, ks, vs, pos, out, lse, carries, kept, d_out, cfg.bos)
        return [d_q, d_k, d_v, *(g if wanted else None for g, wanted in zip(d_params, param_wanted, strict=True))]

    # the reverse carry: the gradient reaching each chunk's carries (Pass A), scanned back over the chunks
    later: dict[int, torch.Tensor] = {}
    if acc is not None:
        reach = {c: torch.zeros_like(t) for c, t in carries.items()}
        for src, blk in KeyBlocks(cfg, "kv")(key_block(ks, vs, pos, features)):
            for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
                width = blk["pos"][:, chunk].shape[-1]
                carry = carries[c][:, gstart:gstart + width].clone()
                for qb, keys in blocks:
                    leaf = _leaf(carry[:, keys], True)
                    with torch.enable_grad():
                        o, l, colsum = eager_pair(plan, params, qs[:, :, qb], blk["k"][:, :, chunk][:, :, keys],
                                                  blk["v"][:, :, chunk][:, :, keys], pos[:, qb],
                                                  blk["pos"][:, chunk][:, keys],
                                                  {k: t[..., qb] for k, t in features.items()},
                                                  block_key_features(blk, keys, chunk), leaf, cfg.scale)
                        g_o, g_l = pair_grads(o, l, qb)
                        (g_carry,) = torch.autograd.grad((o, l), (leaf,), (g_o, g_l), allow_unused=True)
                    if g_carry is not None:
                        reach[c][:, gstart + keys.start:gstart + keys.stop] += g_carry
                    carry[:, keys] += colsum.detach()
        later = scan_chunks(cfg, reach, reverse=True)

    # Pass C: every pair's gradients; key-side gradients travel with their block
    kv_names = ["k", "v"] + [f"f:{name}" for name in cfg.feature_keys]
    blocks_of = KeyBlocks(cfg, "kv")
    for src, blk, g_blk in blocks_of.with_grads(key_block(ks, vs, pos, features), kv_names):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            kchunk, vchunk, pchunk = blk["k"][:, :, chunk], blk["v"][:, :, chunk], blk["pos"][:, chunk]
            if cfg.flash:  # the pair's share of the gradients from the final output and log-sum-exp
                rows = pair_queries(blocks)
                g_q, g_k, g_v = flash_pair_grads(d_out[:, :, rows], qs[:, :, rows], kchunk, vchunk, out[:, :, rows],
                                                 lse[:, :, rows], cb == c, cfg.scale)
                _add(d_q[:, :, rows], g_q)
                _add(g_blk["k"][:, :, chunk], g_k)
                _add(g_blk["v"][:, :, chunk], g_v)
                continue
            width = pchunk.shape[-1]
            carry_in = []
            if acc is not None:  # the carry into each query block, from a selector-only sweep
                carry = carries[c][:, gstart:gstart + width].clone()
                dims = Dims(h, d, ks.shape[1])
                index = selector_kv_heads(plan, acc, dims, ks.device)
                for qb, keys in blocks:
                    carry_in.append(carry[:, keys].clone())
                    s = pair_selection(plan, acc, qs[:, :, qb], kchunk[:, :, keys].index_select(1, index), pos[:, qb],
                                       pchunk[:, keys], dims, {k: t[..., qb] for k, t in features.items()},
                                       block_key_features(blk, keys, chunk), params, cfg.scale)
                    carry[:, keys] += s.to(wide).sum(dim=2)[:, 0]
                g_colsum = later[c][:, gstart:gstart + width].clone()
            for i in reversed(range(len(blocks))):
                qb, keys = blocks[i]
                q_l = _leaf(qs[:, :, qb], True)
                k_l, v_l = _leaf(kchunk[:, :, keys], True), _leaf(vchunk[:, :, keys], True)
                qf_l = {name: _leaf(t[..., qb], feature_wanted[name]) for name, t in features.items()}
                kf_l = {name: _leaf(t, feature_wanted[name])
                        for name, t in block_key_features(blk, keys, chunk).items()}
                p_l = [_leaf(t, wanted) for t, wanted in zip(rest[nf:], param_wanted, strict=True)]
                c_l = _leaf(carry_in[i], True) if acc is not None else None
                _, pair_params = unpack_rest(cfg, [*rest[:nf], *p_l])
                with torch.enable_grad():
                    o, l, colsum = eager_pair(plan, pair_params, q_l, k_l, v_l, pos[:, qb], pchunk[:, keys], qf_l,
                                              kf_l, c_l, cfg.scale)
                    g_o, g_l = pair_grads(o, l, qb)
                    outs, cots = [o, l], [g_o, g_l]
                    if colsum is not None:
                        outs.append(colsum)
                        cots.append(g_colsum[:, keys])
                    wrt = [q_l, k_l, v_l]
                    wrt += [qf_l[name] for name in cfg.feature_keys if feature_wanted[name]]
                    wrt += [kf_l[name] for name in cfg.feature_keys if feature_wanted[name]]
                    wrt += [p for p, wanted in zip(p_l, param_wanted, strict=True) if wanted]
                    if c_l is not None:
                        wrt.append(c_l)
                    got = list(torch.autograd.grad(outs, wrt, cots, allow_unused=True))
                g_q, g_k, g_v = got[:3]
                _add(d_q[:, :, qb], g_q)
                _add(g_blk["k"][:, :, chunk][:, :, keys], g_k)
                _add(g_blk["v"][:, :, chunk][:, :, keys], g_v)
                at = 3
                wanted_names = [name for name in cfg.feature_keys if feature_wanted[name]]
                for name in wanted_names:
                    _add(d_feat_q[name][..., qb], got[at])
                    at += 1
                for name in wanted_names:
                    _add(g_blk[f"f:{name}"][..., chunk][..., keys], got[at])
                    at += 1
                for j, wanted in enumerate(param_wanted):
                    if wanted:
                        _add(d_params[j], got[at])
                        at += 1
                if c_l is not None and got[at] is not None:
                    g_colsum[:, keys] += got[at]  # this block's carry came from the column sums before it
    returned = blocks_of.returned
    d_feats = [d_feat_q[name] + returned[f"f:{name}"] if feature_wanted[name] else None
               for name in cfg.feature_keys]
    d_params_out = [g if wanted else None for g, wanted in zip(d_params, param_wanted, strict=True)]
    return [d_q, returned["k"], returned["v"], *d_feats, *d_params_out]


def _add(target: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None:
        target.add_(grad.to(target.dtype))

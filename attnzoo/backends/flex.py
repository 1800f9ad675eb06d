"""The flex backend: lowers what fits to ``torch.nn.attention.flex_attention`` under ``torch.compile``.

Query/key/value temperatures become a pre-scale of q, k and v (a per-row scalar commutes with the dot product),
logits transforms become the ``score_mod`` (the transforms' own pointwise maths, traced with scalar positions),
masks become a block mask (``mask_mod``), the output scale is applied after. A probability map that is the softmax
itself (``softmax_map``: ``diff``) runs over its ``values(v)`` (FlexAttention takes values wider than the keys) and is
combined after; every other map is declined (the softmax is fixed). The accumulator is declined: F is not
a pointwise function of (b, h, q, kv) and FlexAttention could only take it as a captured N×N tensor. On CPU,
FlexAttention has no backward, so cases that need gradients are declined there.

The compiled kernel is cached per process and reused across calls; torch.compile recompiles per shape family
(and per distinct score_mod), which is the first-call latency ``attnzoo bench`` reports.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..core.numerics import all_finite
from ..transforms.base import Context, Dims, Slot
from .base import Backend, Mode
from .softmax_maps import other_map, softmax_map_combine, softmax_map_rows

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAD = 128  # FlexAttention's default block size
RECOMPILE_LIMIT = 256


@functools.lru_cache(maxsize=1)
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention, dynamic=False), create_block_mask


class FlexBackend(Backend):
    name = "flex"
    priority = 5  # measured on CPU (2 threads, N=4096): ~4x SDPA forward, slower than blocked on shipped specs
    summary = "torch FlexAttention (score_mod + block mask) under torch.compile; forward only on CPU"

    def supports(self, plan, device, dtype, mode):
        reasons = []
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:
            return ["this torch has no torch.nn.attention.flex_attention"]
        if plan.one(Slot.ACCUMULATOR) is not None:
            reasons.append(f"'{plan.one(Slot.ACCUMULATOR).kind}' accumulates over queries: not a pointwise "
                           "score_mod (FlexAttention would need F as a captured N×N tensor)")
        if plan.one(Slot.NORMALISER) is not None:
            reasons.append(f"'{plan.one(Slot.NORMALISER).kind}' adds a term to the softmax denominator: neither a "
                           "score_mod nor a mask_mod")
        if other_map(plan) is not None:
            reasons.append(f"'{plan.one(Slot.PROBABILITY).kind}' replaces the softmax: FlexAttention's score_mod acts "
                           "before a fixed softmax")
        if mode == Mode.BACKWARD and torch.device(device).type == "cpu":
            reasons.append("FlexAttention has no backward on CPU")
        if dtype not in SUPPORTED_DTYPES:
            reasons.append(f"FlexAttention does not compile {str(dtype).removeprefix('torch.')} here")
        return reasons

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        flex_attention, create_block_mask = _flex()
        b, h, n, d = q.shape
        hkv = k.shape[1]
        pos = positions.unsqueeze(1)
        qs = plan.composition.row_scale(Slot.QUERY, q, pos, params)
        ks = plan.composition.row_scale(Slot.KEY, k, pos, params)
        vs = plan.composition.row_scale(Slot.VALUE, v, pos, params)
        raw_ks, raw_vs = ks, vs  # the per-token features read them as the value slot leaves them
        ks, vs, _ = softmax_map_rows(plan, ks, vs, None, h, params)  # a softmax map (diff): its rows, H heads
        hkv = ks.shape[1]
        # Pad N to a multiple of FlexAttention's block: torch's compiled CPU kernel was seen returning garbage or
        # NaN for lengths that are not (caught by the conformance suite); padded keys are masked, padded query
        # rows dropped. It also means one compiled kernel per 128 tokens of length, not per length.
        m = -(-n // PAD) * PAD
        qs, ks, vs = (F.pad(t, (0, 0, 0, m - n)) for t in (qs, ks, vs))
        padded_pos = F.pad(positions, (0, m - n), value=1)
        valid = F.pad(torch.ones_like(positions, dtype=torch.bool) if key_mask is None else key_mask, (0, m - n))
        dims = Dims(h, d, hkv)
        logits_transforms = plan.many(Slot.LOGITS)
        masks = plan.many(Slot.MASK)
        # per-token features are captured (B, H, M) tensors the score_mod indexes, as FlexAttention allows
        features = {name: F.pad(f, (0, m - n)) for name, f in
                    plan.composition.token_features(qs[:, :, :n], raw_ks, raw_vs, positions, key_mask,
                                                    params).items()}

        def context(batch, head, q_idx, kv_idx):
            return Context(qpos=padded_pos[batch, q_idx], kpos=padded_pos[batch, kv_idx], heads=head, dims=dims,
                           key_mask=valid[batch, kv_idx],
                           query_features={name: f[batch, head, q_idx] for name, f in features.items()},
                           key_features={name: f[batch, head, kv_idx] for name, f in features.items()})

        def score_mod(score, batch, head, q_idx, kv_idx):
            ctx = context(batch, head, q_idx, kv_idx)
            for t in logits_transforms:
                score = t.apply(score, ctx, params[t.kind])
            return score

        def mask_mod(batch, head, q_idx, kv_idx):
            ctx = context(batch, head, q_idx, kv_idx)
            allowed = valid[batch, kv_idx]
            if plan.causal:
                allowed = allowed & (ctx.kpos <= ctx.qpos)
            for t in masks:
                allowed = allowed & t.allowed(ctx)
            return allowed

        block_mask = create_block_mask(mask_mod, b, h, m, m, device=q.device)
        # FlexAttention weighs every value of a block, a masked pair's by 0 (0 × NaN is NaN): non-finite values are
        # attended as 0 here, and passes over the same mask below mark the outputs an allowed pair brings them to
        finite_values = all_finite(vs)
        if not finite_values:
            bad_values = vs
            vs = torch.where(torch.isfinite(vs), vs, torch.zeros((), dtype=vs.dtype, device=vs.device))
        # Past torch.compile's recompile limit dynamo would silently run flex_attention eagerly (unfused, N×N):
        # raise the limit for this call and make hitting it an error instead.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            out = flex_attention(qs, ks, vs, score_mod=score_mod if logits_transforms else None,
                                 block_mask=block_mask, scale=plan.logit_scale(d), enable_gqa=h != hkv)[:, :, :n]
            if q.device.type == "cpu" and not (all_finite(qs) and all_finite(ks)):
                # FlexAttention's CPU kernel drops a NaN logit (a row that sees one comes out finite, where the
                # reference's is NaN): a second pass, over the same mask, gives 1 to the rows that have one
                def nan_mod(score, batch, head, q_idx, kv_idx):
                    score = score_mod(score, batch, head, q_idx, kv_idx) if logits_transforms else score
                    return torch.where(torch.isnan(score), 0.0, float("-inf"))

                mark = flex_attention(qs, ks, torch.ones_like(vs), score_mod=nan_mod, block_mask=block_mask,
                                      scale=plan.logit_scale(d), enable_gqa=h != hkv)[:, :, :n, :1]
                out = out.masked_fill(mark > 0, float("nan"))
            if not finite_values:
                def uniform(score, batch, head, q_idx, kv_idx):  # every allowed pair alike: a mean over them
                    return torch.zeros_like(score)

                def reached(elements):  # (B, H, N, D) bool: an allowed pair meets one of ``elements``
                    mean = flex_attention(qs, ks, elements.to(qs.dtype), score_mod=uniform, block_mask=block_mask,
                                          scale=plan.logit_scale(d), enable_gqa=h != hkv)[:, :, :n]
                    return mean > 0

                plus, minus = reached(bad_values == float("inf")), reached(bad_values == float("-inf"))
                nan = reached(torch.isnan(bad_values)) | (plus & minus)
                inf = torch.full((), float("inf"), dtype=out.dtype, device=out.device)
                out = torch.where(nan, float("nan"), torch.where(plus, inf, torch.where(minus, -inf, out)))
        out = softmax_map_combine(plan, out, q.shape, params)
        out = plan.composition.row_scale(Slot.OUTPUT, out, pos, params)
        return (out, None) if return_accumulated else out

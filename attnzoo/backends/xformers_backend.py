"""The xformers backend: ``xformers.ops.memory_efficient_attention`` on CUDA, with the spec as an attention bias.

The bias is xformers' own structured one where the spec allows it (``LowerTriangularMask`` for causal attention at
consecutive positions, ``LowerTriangularFromBottomRightLocalAttentionMask`` for a causal sliding window), else a
tensor bias materialised per call: ``-inf`` where a pair may not attend (causality at the real positions, every mask
transform, the key mask) plus every additive logits transform (``LogitsTransform.bias``: ALiBi, the forgetting
gate's ``D_i - D_j``). Row maps (SSA temperatures, QK-norm) run around the kernel with the transforms' torch maths.

It declines, with a reason: the accumulator (selective attention's F depends on the attention of earlier queries,
which the kernel cannot take; materialising it as a tensor bias is the reference's N² cost), logits transforms that
are not additive (softcap), the normaliser (an attention sink is not a bias), decoding, float64, and CPU
(xformers has no CPU kernels; its bias classes do work on CPU, and :func:`attention_bias` is tested there by
materialising it). Ranked below triton until measured on a GPU (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import logging

import torch

from ..transforms.base import Dims, Slot
from ..transforms.masks import SlidingWindow
from .base import Backend, Mode
from .blocked import consecutive_positions


def xformers_available() -> str | None:
    """Why xformers cannot be used (not installed), or None. Its import logs a multi-line warning when its
    C++/CUDA extensions do not load (always on CPU): the kernels are then unavailable, which :meth:`supports`
    says in one line, so that warning is kept quiet here."""
    logger = logging.getLogger("xformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from xformers.ops.fmha import attn_bias  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported as one line
        return f"xformers is not installed or does not import ({type(exc).__name__}): pip install xformers"
    finally:
        logger.setLevel(level)
    return None


def attention_bias(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, key_mask,
                   params):
    """The xformers attention bias of the batch form and the queries that have a key: q (B, H, N, D), k and v
    (B, H, N, D) after the row maps (k, v repeated to H heads), positions (B, N), key_mask (B, N) or None.
    Returns (bias, has_key): a structured xformers bias (or None) where the spec allows it, with has_key None;
    else a tensor bias (B, H, N, N) in q's dtype, causality and masks folded in as -inf, and has_key (B, H, N, 1)
    bool (a row with no key gets a finite bias row, and its output must be zeroed)."""
    from xformers.ops.fmha import attn_bias

    b, h, n, d = q.shape
    masks = plan.many(Slot.MASK)
    logits = plan.many(Slot.LOGITS)
    plain = key_mask is None and not logits and consecutive_positions(positions)
    if plain and plan.causal and not masks:
        return attn_bias.LowerTriangularMask(), None
    if plain and plan.causal and len(masks) == 1 and type(masks[0]) is SlidingWindow:
        return attn_bias.LowerTriangularFromBottomRightLocalAttentionMask(masks[0].options.window), None
    if plain and not plan.causal and not masks:
        return None, None
    features = plan.composition.token_features(q, k, v, positions, key_mask, params)
    ctx = plan.composition.context(positions, positions.unsqueeze(1), Dims(h, d, k.shape[1]), key_mask, features,
                                   features)
    allowed = plan.composition.allowed(ctx, key_mask).expand(b, h, n, n)
    total = torch.zeros((b, h, n, n), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for t in logits:
        total = total + t.bias(ctx, params[t.kind], total.dtype)
    bias = torch.where(allowed, total, float("-inf"))
    has_key = allowed.any(-1, keepdim=True)
    # a row with no key (a padding query): any finite row, its output is zeroed by the backend
    return torch.where(has_key, bias, 0.0).to(q.dtype), has_key


class XformersBackend(Backend):
    name = "xformers"
    priority = 7  # not yet measured on a GPU: below triton (8) and blocked (10)
    summary = "xformers memory_efficient_attention (CUDA) with structured or tensor attention biases"
    modes = frozenset({Mode.FORWARD, Mode.BACKWARD})

    def supports(self, plan, device, dtype, mode):
        reasons = []
        missing = xformers_available()
        if missing:
            reasons.append(missing)
        if device.type != "cuda":
            reasons.append("xformers' memory_efficient_attention has no CPU kernels (its attention-bias classes do "
                           "work on CPU: packed input takes them)")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')}: xformers' kernels take float16, bfloat16 or "
                           "float32")
        if plan.one(Slot.ACCUMULATOR) is not None:
            reasons.append("the accumulator (selective attention) needs F, which depends on earlier queries' "
                           "attention: memory_efficient_attention cannot take it unless it is materialised")
        for t in plan.many(Slot.LOGITS):
            if not _additive(t):
                reasons.append(f"logits transform '{t.kind}' is not an additive bias (xformers adds biases only)")
        if plan.one(Slot.NORMALISER) is not None:
            reasons.append(f"normaliser '{plan.one(Slot.NORMALISER).kind}': an attention sink is not an attention "
                           "bias")
        if plan.one(Slot.PROBABILITY) is not None:
            reasons.append(f"probability map '{plan.one(Slot.PROBABILITY).kind}' replaces the softmax: "
                           "memory_efficient_attention computes a softmax")
        return reasons

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        from xformers.ops import memory_efficient_attention

        pos = positions.unsqueeze(1)
        qs = plan.composition.row_scale(Slot.QUERY, q, pos, params)
        ks = plan.composition.row_scale(Slot.KEY, k, pos, params)
        vs = plan.composition.row_scale(Slot.VALUE, v, pos, params)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        bias, has_key = attention_bias(plan, qs, ks, vs, positions, key_mask, params)
        out = memory_efficient_attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                         attn_bias=bias, scale=plan.logit_scale(q.shape[-1])).transpose(1, 2)
        if has_key is not None:  # rows with no key attend to nothing
            out = torch.where(has_key, out, 0.0)
        out = plan.composition.row_scale(Slot.OUTPUT, out, pos, params)
        return (out, None) if return_accumulated else out


def _additive(t) -> bool:
    from ..transforms.base import LogitsTransform

    return type(t).bias is not LogitsTransform.bias


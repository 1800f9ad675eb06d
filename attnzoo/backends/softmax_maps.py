"""Probability maps that are the softmax itself (``ProbabilityTransform.softmax_map``: differential attention's pair
of softmaxes): a backend with softmax kernels computes them as softmax attention over the rows ``values(v)``
gives, then ``combine`` (docs/backends.md). Shared by the blocked, flex and triton backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.composition import checked_rows
from ..transforms.base import Slot


def other_map(plan):
    """The spec's probability transform unless it is the softmax itself (``ProbabilityTransform.softmax_map``:
    those run a backend's softmax paths over ``values(v)`` and ``combine`` the result), else None."""
    mapped = plan.one(Slot.PROBABILITY)
    return None if mapped is None or mapped.softmax_map else mapped


def softmax_map_rows(plan, ks, vs, kpos, num_heads, params):
    """For a softmax map (``ProbabilityTransform.softmax_map``): the keys repeated to the query heads and the rows
    its softmaxes weigh, ``values(v repeated)`` (B, H, Nk, D'), with the key positions to match; the inputs
    unchanged for any other spec."""
    mapped = plan.one(Slot.PROBABILITY)
    if mapped is None or not mapped.softmax_map:
        return ks, vs, kpos
    group = num_heads // ks.shape[1]
    if group > 1:
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        if kpos is not None and kpos.shape[1] > 1:
            kpos = kpos.repeat_interleave(group, dim=1)
    return ks, mapped.values(vs, params[mapped.kind]), kpos


def softmax_map_combine(plan, out, q_shape, params):
    """``combine`` of a softmax map's outputs (B, H, Nq, D') → (B, H, Nq, D); the outputs unchanged otherwise."""
    mapped = plan.one(Slot.PROBABILITY)
    if mapped is None or not mapped.softmax_map:
        return out
    return checked_rows(mapped, "outputs", mapped.combine(out, params[mapped.kind]), q_shape).to(out.dtype)


def value_slices(rows: torch.Tensor, width: int) -> list[torch.Tensor]:
    """Rows wider than the queries (a softmax map's ``values(v)``, (..., D')) in contiguous slices ``width`` wide,
    the last zero-padded (zero value rows add exactly 0), for kernels that take one head dim for q, k and v (CPU
    SDPA's fused kernel, the generated Triton kernels). Join their outputs with :func:`joined`."""
    if rows.shape[-1] % width:
        rows = F.pad(rows, (0, width - rows.shape[-1] % width))
    return [piece.contiguous() for piece in rows.split(width, dim=-1)]


def joined(outs: list[torch.Tensor], width: int) -> torch.Tensor:
    """The outputs of :func:`value_slices`' slices side by side, cut back to the rows' ``width`` (the padding
    dropped)."""
    return (torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0])[..., :width]

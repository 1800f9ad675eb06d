"""Probability maps that are the softmax itself (``ProbabilityTransform.softmax_map``: differential attention's pair
of softmaxes): a backend with softmax kernels computes them as softmax attention over the rows ``values(v)``
gives, then ``combine`` (docs/backends.md). Shared by the blocked and flex backends."""

from __future__ import annotations

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

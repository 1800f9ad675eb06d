"""Two probability maps a plugin package would ship (docs/plugins.md), each with its blocked form, used by
``benchmarks/plugin_map.py`` and the tests of plugin maps:

- ``SSMax`` (Nakanishi 2025): softmax(s_h ln(n_i) l_ij) over the keys query i sees, n_i their number, a learnable
  s per head. The reference form counts the keys; the blocked form is one pass (an online softmax) that reads the
  count from the step (``update(..., step)``: ``step.visible``, ``attnzoo.MapStep``).
- ``ReluMean`` (ReLU attention, Wortsman et al. 2023): w_ij = relu(l_ij) / n_i; the blocked form sums the weighted
  values and counts the keys itself (no step), and divides at the end.

Register them from a plugin module (``register_transforms``) or ``attnzoo.new_registry(extra_plugins=...)``.
"""

from __future__ import annotations

import torch

import attnzoo

NEG = float("-inf")


class SSMax(attnzoo.ProbabilityTransform):
    """softmax(s_h ln(n_i) l_ij) over the keys query i sees, n_i their number: the reference form counts them, the
    blocked form reads the count from the step (one pass, an online softmax)."""

    kind = "ssmax"
    slot = attnzoo.Slot.PROBABILITY
    normalised = True

    def parameters(self):
        return [attnzoo.ParamSpec("s", ("H",), 0.43)]

    def weights(self, logits, allowed, ctx, params):
        allowed = allowed.expand_as(logits)
        n = allowed.sum(-1, keepdim=True).clamp_min(1).to(logits.dtype)
        x = torch.where(allowed, params["s"][ctx.heads] * torch.log(n) * torch.where(allowed, logits, 0.0), NEG)
        w = torch.softmax(torch.where(allowed.any(-1, keepdim=True), x, 0.0), dim=-1)
        return torch.where(allowed, w, 0.0)

    def start(self, out_shape, like):
        dtype, rows = torch.promote_types(like.dtype, torch.float32), (*out_shape[:-1], 1)
        return {"m": like.new_full(rows, NEG, dtype=dtype), "l": like.new_zeros(rows, dtype=dtype),
                "acc": like.new_zeros(out_shape, dtype=dtype)}

    def update(self, state, logits, allowed, values, ctx, params, step):
        m = state["m"]
        scale = params["s"][ctx.heads].to(m.dtype) * torch.log(step.visible.clamp_min(1))
        x = torch.where(allowed, scale * torch.where(allowed, logits.to(m.dtype), 0.0), NEG)
        new = torch.maximum(m, x.amax(-1, keepdim=True)).detach()
        shift = torch.where(torch.isinf(new), 0.0, new)  # no key yet
        rescale, p = torch.exp(m - shift), torch.exp(x - shift)
        return {"m": new, "l": state["l"] * rescale + p.sum(-1, keepdim=True),
                "acc": state["acc"] * rescale + p @ values.to(m.dtype)}

    def finish(self, state, params):
        total = state["l"]
        return torch.where(total > 0, state["acc"] / total.clamp_min(1e-30), 0.0)


class ReluMean(attnzoo.ProbabilityTransform):
    """ReLU attention: w_ij = relu(l_ij) / n_i, n_i the number of keys query i may see; the blocked form sums the
    weighted values and counts the keys, and divides at the end."""

    kind = "relu_mean"
    slot = attnzoo.Slot.PROBABILITY

    def weights(self, logits, allowed, ctx, params):
        allowed = allowed.expand_as(logits)
        return torch.where(allowed, torch.relu(logits), 0.0) / allowed.sum(-1, keepdim=True).clamp_min(1)

    def start(self, out_shape, like):
        return {"sum": like.new_zeros(out_shape), "count": like.new_zeros((*out_shape[:-1], 1))}

    def update(self, state, logits, allowed, values, ctx, params):
        allowed = allowed.expand_as(logits)
        return {"sum": state["sum"] + torch.where(allowed, torch.relu(logits), 0.0) @ values,
                "count": state["count"] + allowed.sum(-1, keepdim=True)}

    def finish(self, state, params):
        return state["sum"] / state["count"].clamp_min(1)

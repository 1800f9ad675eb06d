"""Attention sinks: a learnable logit per head that joins every row's softmax denominator (docs/specs.md).

``p[h, i, j] = exp(l[h, i, j]) / (exp(s_h) + sum_j' exp(l[h, i, j']))``: as gpt-oss ships it (one learnable
``s_h`` per head, attending to nothing), and with ``learnable: false`` and ``value: 0`` the "off-by-one" softmax
(Miller, 2023) whose denominator is ``1 + sum exp(l)``. A row may then put less than all of its weight on the
keys, and a row with no key outputs 0.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import NormaliserTransform, ParamSpec, Slot, TransformOptions


class AttentionSinkOptions(TransformOptions):
    value: float = Field(0.0, description="initial sink logit of every head (the fixed value when not learnable)")
    learnable: bool = Field(True, description="one learnable sink logit per head (gpt-oss); false: a constant")


class AttentionSink(NormaliserTransform):
    """A sink logit ``s_h`` per query head in every row's softmax denominator."""

    kind = "attention_sink"
    slot = Slot.NORMALISER
    Options = AttentionSinkOptions
    summary = "softmax denominator + exp(s_h): a learnable per-head sink logit (gpt-oss; off-by-one softmax)"

    def parameters(self):
        return [ParamSpec("sink", ("H",), self.options.value)] if self.options.learnable else []

    def sink(self, heads, params):
        if self.options.learnable:
            return params["sink"][heads]
        return torch.full(heads.shape, self.options.value, dtype=torch.float32, device=heads.device)

"""An example third-party attnzoo plugin: a per-token, per-head sigmoid gate on the attention output.

``out[b, h, i] *= 2 * sigmoid(w_h · out[b, h, i] + bias_h)``: at the initial parameters (w = 0, bias = 0) the gate
is exactly 1, so a gated variant starts as its ungated base. It is installed through the ``attnzoo`` entry-point
group, like any plugin a user writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

import attnzoo

__version__ = "0.1.0"


class SigmoidGateOptions(attnzoo.TransformOptions):
    weight: Literal["per_head", "shared"] = Field("per_head", description="one gate vector per head, or one for all")


class SigmoidOutputGate(attnzoo.RowScaleTransform):
    kind = "sigmoid_output_gate"
    slot = attnzoo.Slot.OUTPUT
    Options = SigmoidGateOptions
    summary = "out_i *= 2 sigmoid(w_h · out_i + b_h)"

    def parameters(self):
        shape = ("H", "D") if self.options.weight == "per_head" else ("D",)
        return [attnzoo.ParamSpec("weight", shape, 0.0), attnzoo.ParamSpec("bias", ("H",), 0.0)]

    def scale(self, rows, positions, params):
        w = params["weight"]
        dot = rows @ w if w.dim() == 1 else torch.einsum("bhnd,hd->bhn", rows, w)
        return 2.0 * torch.sigmoid(dot + params["bias"].view(1, -1, 1))


@attnzoo.hookimpl
def register_transforms(register):
    register(SigmoidOutputGate)


@attnzoo.hookimpl
def register_specs(register):
    register(Path(__file__).parent / "gated.yaml")

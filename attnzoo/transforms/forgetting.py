"""The Forgetting Transformer's data-dependent decay (Lin et al., ICLR 2025), through per-token features.

Each head h has a forget gate per token, ``f_t = sigmoid(w_h · x_t + b_h)``, and the logits gain the log of the
product of the gates between key and query: ``l'[i, j] = l[i, j] + D_i - D_j`` with ``D_t = sum_{s <= t} log f_s``
(so ``D_i - D_j = sum_{j < s <= i} log f_s <= 0``). ``D`` is a cumulative per-token feature: the transform returns
``log f_t``, the backend sums it along each row (padding adds nothing).

The paper computes the gate from the layer input x: with ``source: input`` the caller passes the gate's logit
``w_h · x_t + b_h`` per head and token as the per-token input ``forgetting_gate.gate`` (B, H, N), and owns the
projection (``attnzoo.nn.Attention(..., input_dim=E)`` makes it, weight 0 and bias ``bias_init``, and computes it
from ``x``). The default ``source: keys`` reads the token's key row instead (``x_t = k'_t`` of the head's key/value
head, after the key slot's row maps; an attnzoo choice), so that the transform needs nothing but what attention
is given; its parameters ``weight`` (H, D) start at 0 and ``bias`` (H,) at ``bias_init``, i.e. every gate starts at
``sigmoid(bias_init)`` (attnzoo's initial values; the paper's are not restated here).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from .base import LogitsTransform, ParamSpec, Slot, TokenInput, TransformOptions


class ForgettingGateOptions(TransformOptions):
    source: Literal["keys", "input"] = Field(
        "keys", description="the gate's input x_t: the token's key row (keys), or the layer input, projected by the "
                            "caller and passed as the per-token input forgetting_gate.gate (input)")
    bias_init: float = Field(5.0, description="initial gate bias b_h: every gate starts at sigmoid(bias_init)")


class ForgettingGate(LogitsTransform):
    """``l' = l + D_i - D_j``, ``D_t = sum_{s <= t} log sigmoid(w_h · k'_s + b_h)`` (a data-dependent decay)."""

    kind = "forgetting_gate"
    slot = Slot.LOGITS
    Options = ForgettingGateOptions
    summary = "Forgetting Transformer: l += D_i - D_j, D_t = sum_{s<=t} log sigmoid(w_h k_s + b_h)"
    cumulative = frozenset({"D"})

    def parameters(self):
        if self.options.source == "input":
            return []  # the projection of x belongs to the caller
        return [ParamSpec("weight", ("H", "D"), 0.0), ParamSpec("bias", ("H",), self.options.bias_init)]

    def token_inputs(self):
        if self.options.source != "input":
            return []
        return [TokenInput("gate", self.options.bias_init, "the gate's logit w_h · x_t + b_h, (B, H, N)")]

    def features(self, rows, params):
        if self.options.source == "input":
            gate = params["gate"]
            return {"D": F.logsigmoid(gate.to(torch.promote_types(gate.dtype, torch.float32)))}
        group = rows.dims.num_heads // rows.dims.num_kv_heads
        wide = torch.promote_types(rows.k.dtype, torch.float32)
        keys = rows.k.to(wide).repeat_interleave(group, dim=1)  # (B, H, N, D)
        # (B, H, N, D) @ (H, D, 1): one batched matmul per head (einsum's own dispatch is most of a decode step's)
        gate = (keys @ params["weight"].to(wide).unsqueeze(-1)).squeeze(-1) + params["bias"].to(wide)[:, None]
        return {"D": F.logsigmoid(gate)}

    def apply(self, logits, ctx, params):
        return logits + self.bias(ctx, params, logits.dtype)

    def bias(self, ctx, params, dtype):
        query_d, key_d = ctx.features(self.kind, "D")
        return (query_d - key_d).to(dtype)

    def separable(self, ctx, params, dtype):
        query_d, key_d = ctx.features(self.kind, "D")
        return query_d.to(dtype), (-key_d).to(dtype)

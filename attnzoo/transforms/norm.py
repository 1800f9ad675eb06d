"""QK-norm: RMS normalisation of each query and key row with a learnable per-dimension gain (docs/specs.md).

``y = x / sqrt(mean(x²) + eps) * g``, the mean over a head's D dimensions (Qwen3, Gemma-3: one gain of D values
shared by the heads) or over all heads of the token (OLMo-2: one gain per head and dimension, ``over: all_heads``).
The models above normalise before their RoPE; a row map sees the rows given to attention, so in a model that applies
RoPE before calling attention this is QK-norm after RoPE (the norm commutes with RoPE, a non-uniform gain does not).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import ParamSpec, RowMapTransform, Slot, TransformOptions


class RmsNormOptions(TransformOptions):
    gain: Literal["shared", "per_head"] = Field("shared", description="one gain of D values for every head "
                                                "(Qwen3, Gemma-3), or one per head (H x D)")
    over: Literal["head", "all_heads"] = Field("head", description="the RMS over a head's D dimensions, or over "
                                               "all heads of the token (OLMo-2; needs gain: per_head)")
    eps: float = Field(1e-6, gt=0, description="added to the mean square")


class _RmsNorm(RowMapTransform):
    Options = RmsNormOptions
    heads_symbol = "H"

    def check_spec(self, spec):
        if self.options.over == "all_heads" and self.options.gain != "per_head":
            return f"{self.kind}: over: all_heads normalises the whole token, its gain is per head (gain: per_head)"
        return None

    def parameters(self):
        shape = ("D",) if self.options.gain == "shared" else (self.heads_symbol, "D")
        return [ParamSpec("gain", shape, 1.0)]

    def map(self, rows, positions, params):
        """rows (B, Hx, N, D) → normalised rows, computed in at least float32 (the numerics contract)."""
        wide = torch.promote_types(rows.dtype, torch.float32)
        x = rows.to(wide)
        gain = params["gain"].to(wide)
        if self.options.over == "head" and gain.dim() == 1:  # torch's fused RMS norm: the same formula
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight=gain, eps=self.options.eps)
        if self.options.over == "head":
            mean_square = x.square().mean(-1, keepdim=True)
        else:
            mean_square = x.square().mean(dim=(1, 3), keepdim=True)
        if gain.dim() == 2:
            gain = gain[:, None, :]  # (Hx, 1, D) against (B, Hx, N, D)
        return x * torch.rsqrt(mean_square + self.options.eps) * gain


class QueryNorm(_RmsNorm):
    """QK-norm on the queries: ``q <- q / rms(q) * g``."""

    kind = "query_norm"
    slot = Slot.QUERY
    summary = "QK-norm: q <- q / sqrt(mean(q²) + eps) * g (per-dimension gain)"


class KeyNorm(_RmsNorm):
    """QK-norm on the keys: ``k <- k / rms(k) * g``; a per-head gain is per key/value head."""

    kind = "key_norm"
    slot = Slot.KEY
    heads_symbol = "H_kv"
    summary = "QK-norm: k <- k / sqrt(mean(k²) + eps) * g (per-dimension gain)"

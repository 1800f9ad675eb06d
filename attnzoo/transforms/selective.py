"""Selective attention (Leviathan, Kalman, Matias; ICLR 2025), docs/papers.md §2.

``S[k, j] = ReLU(l[selector, k, j])`` on the masked logits of the selector head, with ``S[k, BOS] = 0`` and
``S[k, k] = 0``, declared once (:meth:`SelectiveMask.pointwise`); ``F[i, j] = sum_{k < i} S[k, j]`` (over strictly
earlier *queries*) is subtracted from every head's logits. Gradients flow through F into the selector head's query
and key.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import AccumulatorTransform, Dims, PointwiseSelection, Slot, TransformOptions


class SelectiveMaskOptions(TransformOptions):
    selector_head: int = Field(0, ge=0, description="query head whose logits select (default 0)")
    protect_bos: bool = Field(True, description="never mask position 1 (requires that it really is BOS)")
    self_mask: bool = Field(False, description="let a token mask itself (an ablation that hurt)")


class SelectiveMask(AccumulatorTransform):
    kind = "selective_mask"
    slot = Slot.ACCUMULATOR
    Options = SelectiveMaskOptions
    summary = "Leviathan et al.: l -= F, F[i,j] = sum_{k<i} ReLU(l_sel[k,j])"

    def check_spec(self, spec):
        if not spec.attention.causal:
            return "selective_mask needs attention.causal: true"
        return None

    def check_dims(self, dims: Dims) -> None:
        if self.options.selector_head >= dims.num_heads:
            raise ValueError(
                f"selective_mask.selector_head={self.options.selector_head} but the call has {dims.num_heads} heads"
            )

    def heads(self) -> list[int]:
        return [self.options.selector_head]

    def pointwise(self):
        """The one declaration of the selection (``S = ReLU(l)``, the named rule ``relu``): ``selection()``
        (the base class's default), the Triton lowering, the blocked kernels and the fused C decoding step all
        compute it from here."""
        return PointwiseSelection(rule="relu", exclude_first=self.options.protect_bos,
                                  exclude_self=not self.options.self_mask)


def memory_counts(selection_mask: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """``M_i = i - sum_j min(F[i, j], tau) / tau``: the soft count of tokens still in memory at query i.

    selection_mask: F of one layer, (B, N, N) or (N, N), query rows; returns (B, N) or (N,).
    """
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    n = selection_mask.shape[-1]
    i = torch.arange(1, n + 1, dtype=selection_mask.dtype, device=selection_mask.device)
    return i - torch.clamp(selection_mask, max=tau).sum(-1) / tau


def memory_loss(accumulated: list[torch.Tensor] | tuple[torch.Tensor, ...], tau: float = 1.0,
                eps: float = 0.1) -> torch.Tensor:
    """The auxiliary memory loss of selective attention (docs/papers.md §2; tau and eps are [open] constants):

    ``eps * (sum over layers of max_i M_i) / (num_layers * N)``, averaged over the batch.
    ``accumulated`` holds one F per layer, each (B, N, N) (or (N, N)); add the result to the LM loss.
    """
    if not accumulated:
        raise ValueError("memory_loss needs the F of at least one layer")
    n = accumulated[0].shape[-1]
    per_layer = [memory_counts(f, tau).max(dim=-1).values for f in accumulated]
    return eps * torch.stack(per_layer).sum(0).mean() / (len(accumulated) * n)

"""The backend contract: say what you cannot run (with reasons), then run it."""

from __future__ import annotations

from typing import ClassVar

import torch


class Backend:
    """A way to execute a :class:`attnzoo.plan.Plan`.

    ``priority``: higher is preferred by ``backend="auto"`` among backends that support a case (set from
    measurements). ``supports`` returns the reasons it cannot run a case; an empty list means it can.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = ""

    def supports(self, plan, device: torch.device, dtype: torch.dtype, requires_grad: bool) -> list[str]:
        raise NotImplementedError

    def forward(self, plan, q, k, v, params, positions, key_mask, return_selection: bool = False):
        """Batch form. q (B, H, N, D), k/v (B, H_kv, N, D), params grouped per transform kind, positions (B, N)
        int64, key_mask (B, N) bool or None. Returns out (B, H, N, D), or (out, F (B, N, N)) when
        ``return_selection`` (F is None for a spec without an accumulator)."""
        raise NotImplementedError

    def extend(self, plan, q, k, v, cache, params, *, evict_first: bool):
        """Append T tokens to ``cache`` and attend their queries (B, H, T, D) over it; returns (B, H, T, D)."""
        raise NotImplementedError(f"backend '{self.name}' does not implement decoding")

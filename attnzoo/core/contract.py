"""The backend contract: say what you cannot run (with reasons), then run it.

Its public path is :mod:`attnzoo.backends.base` (docs/plugins.md); it lives here, in the core, because the
registry validates plugins against it and the decode step names its modes, both below the backends.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..decode.state import FastStep
    from ..decode.storage import KVCache
    from ..plan import Plan

#: parameters as a backend receives them: grouped per transform kind, ``{kind: {short_name: tensor}}``
Grouped = dict[str, dict[str, torch.Tensor]]


class Mode(str, Enum):
    """What a call asks of a backend: the batch form without gradients, the batch form with gradients, or
    extending a decode-time cache (:meth:`Backend.extend`: ``decode`` and ``prefill``)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


#: the dtypes torch computes eager attention in (matmul, softmax) on every device
EAGER_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def eager_dtype_reasons(dtype: torch.dtype) -> list[str]:
    """Why eager torch attention (the reference and blocked backends) cannot compute in ``dtype``: [] for
    :data:`EAGER_DTYPES`, else one reason (integers, bool, complex, quantized; float8 and float4, in which torch
    has no matmul or softmax, only scaled float8 matmuls)."""
    if dtype in EAGER_DTYPES:
        return []
    name = str(dtype).removeprefix("torch.")
    why = ("torch has no matmul or softmax in it (its float8 kernels are scaled matmuls)" if dtype.is_floating_point
           else "not a floating-point dtype")
    return [f"dtype {name}: {why}; eager torch attention takes float64, float32, float16 or bfloat16"]


def batch_mode(requires_grad: bool) -> Mode:
    """The mode of a batch-form call: BACKWARD when a gradient is wanted, else FORWARD."""
    return Mode.BACKWARD if requires_grad else Mode.FORWARD


class Backend:
    """A way to execute a :class:`attnzoo.plan.Plan`.

    ``priority``: higher is preferred by ``backend="auto"`` among backends that support a case (set from
    measurements). ``modes``: the modes the backend implements at all (a backend that implements :meth:`extend`
    lists :attr:`Mode.DECODE`); dispatch never asks ``supports`` about another mode. ``supports`` returns the
    reasons it cannot run a case in one of its modes; an empty list means it can.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = ""
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.FORWARD, Mode.BACKWARD})

    def supports(self, plan: Plan, device: torch.device, dtype: torch.dtype, mode: Mode) -> list[str]:
        """Reasons this backend cannot run ``plan`` on ``device`` in ``dtype`` and ``mode`` (empty: it can)."""
        raise NotImplementedError

    def verdict(self, plan: Plan, device: torch.device, dtype: torch.dtype, mode: Mode) -> list[str]:
        """:meth:`supports`, preceded by the check that the backend implements ``mode`` at all."""
        mode = Mode(mode)
        if mode not in self.modes:
            what = "decoding (no extend)" if mode is Mode.DECODE else f"the {mode} mode"
            return [f"backend '{self.name}' does not implement {what}"]
        return list(self.supports(plan, device, dtype, mode))

    def forward(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Grouped,
                positions: torch.Tensor, key_mask: torch.Tensor | None, return_accumulated: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Batch form. q (B, H, N, D), k/v (B, H_kv, N, D), params grouped per transform kind, positions (B, N)
        int64 strictly increasing along N, key_mask (B, N) bool or None. Returns out (B, H, N, D), or
        (out, F (B, N, N)) when ``return_accumulated`` (F is None for a spec without an accumulator)."""
        raise NotImplementedError

    def extend(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
               params: Grouped, *, evict_first: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append T tokens to ``cache`` and attend their queries (B, H, T, D) over it; returns (B, H, T, D).
        ``key_mask`` (B, T) bool marks the new tokens' padding (False) or is None. q, k, v are raw: hand them to
        :meth:`attnzoo.plan.Plan.admit` (row maps once per token, features, the append: the cache stores
        transformed rows), attend the queries it returns over ``cache.keys``/``cache.values`` with
        ``cache.key_mask()`` and ``cache.key_features()``, then :meth:`attnzoo.KVCache.settle`.
        Only called for backends whose ``modes`` include :attr:`Mode.DECODE`."""
        raise NotImplementedError(f"backend '{self.name}' does not implement decoding")

    def attend_rows(self, plan: Plan, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, qpos: torch.Tensor,
                    kpos: torch.Tensor, params: Grouped, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of rows already through the query, key and value slots' row maps (the output slot is the
        caller's): qs (B, H, Nq, D) at positions qpos (B, Nq) over ks, vs (B, H_kv, Nk, D) at kpos (B, 1 or H_kv,
        Nk) ascending, with ``key_mask`` (B, Nk) or None; the accumulator's F starts at zero. Returns (B, H, Nq, D).
        For hosts that keep their own key/value storage (the vLLM integration reads its paged cache and calls this
        on the blocked backend); optional: the default raises NotImplementedError."""
        raise NotImplementedError(f"backend '{self.name}' does not attend prepared rows")

    def decode_step(self, plan: Plan, cache: KVCache, params: Grouped) -> FastStep | None:
        """A fast step for the later single-token decodes of ``cache``, or None (the default: every step takes
        :meth:`extend`). Asked after a step of one token that went through every check and :meth:`extend`, with
        its grouped ``params``; the step returned (an :class:`attnzoo.decode.state.FastStep`) is taken while the
        call's shapes, dtypes, devices and parameter tensors stay those checked, no key mask or gradient is given,
        and its own ``ready(cache)`` holds (docs/decoding.md, "A step validated once"). It must compute what
        :meth:`extend` computes, evictions included (the blocked backend's: :mod:`attnzoo.decode.fast`)."""
        return None

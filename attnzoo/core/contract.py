"""The backend contract: say what you cannot run (with reasons), then run it.

Its public path is :mod:`attnzoo.backends.base` (docs/plugins.md); it lives here, in the core, because the
registry validates plugins against it and the decode step names its modes, both below the backends.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

if TYPE_CHECKING:
    from ..decode.state import FastStep
    from ..decode.step import DecodeStep, QueryRows
    from ..decode.storage import KVCache
    from ..plan import Plan

#: parameters as a backend receives them: grouped per transform kind, ``{kind: {short_name: tensor}}``
Grouped = dict[str, dict[str, torch.Tensor]]


class Mode(str, Enum):
    """What a call asks of a backend: the batch form without gradients, the batch form with gradients, or
    decoding into a cache (``decode`` and ``prefill``: the decode step calls :meth:`Backend.attend_held`)."""

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


class HeldAttention(NamedTuple):
    """What :meth:`Backend.attend_held` returns to the decode step (:mod:`attnzoo.decode.step`).

    ``out`` (B, H, T, D): the new queries' attention over the cache, before the output slot (the step applies
    it); ``accumulated``: the new running F of every held token (B, M) (the carry plus the new queries' selections,
    any float dtype: the step stores it in at least float32), or None for a spec without an accumulator;
    ``probs``: the new queries' attention probabilities (B, H, T, M) when the step asked for them
    (``want_probs``), or the evictor's rows packed (``want_probs.pack(...)``, an
    :class:`attnzoo.decode.step.EvictorRows`), else None."""

    out: torch.Tensor
    accumulated: torch.Tensor | None
    probs: Any = None


def old_decoding_contract(backend_cls: type) -> bool:
    """Whether ``backend_cls`` decodes by the contract before issue 54: it (or a class it inherits from, below
    the one that gives it :meth:`Backend.attend_held`) defines ``extend``, which nothing calls any more. Such a
    backend is refused for decoding with one line (:meth:`Backend.verdict`), never run through an ``attend_held``
    it inherits beside its own ``extend``."""
    mro = backend_cls.__mro__
    defines = {name: next((i for i, c in enumerate(mro) if name in c.__dict__), len(mro))
               for name in ("extend", "attend_held")}
    return defines["extend"] < defines["attend_held"]


def batch_mode(requires_grad: bool) -> Mode:
    """The mode of a batch-form call: BACKWARD when a gradient is wanted, else FORWARD."""
    return Mode.BACKWARD if requires_grad else Mode.FORWARD


class Backend:
    """A way to execute a :class:`attnzoo.plan.Plan`.

    ``priority``: higher is preferred by ``backend="auto"`` among backends that support a case (set from
    measurements). ``modes``: the modes the backend implements at all (a backend that implements
    :meth:`attend_held` lists :attr:`Mode.DECODE`); dispatch never asks ``supports`` about another mode.
    ``supports`` returns the reasons it cannot run a case in one of its modes; an empty list means it can.

    Decoding (docs/decoding.md, "Who owns what"): the decode step (:mod:`attnzoo.decode.step`) runs every step
    one way: it admits the new tokens (positions, the query, key and value slots, per-token features, the append,
    eviction before attention), calls :meth:`attend_held` once, then settles (the running F stored, the evictor's
    scores, eviction to the budget), applies the output slot and drops what no later query sees. The backend reads
    the cache and writes nothing to it. Two class attributes tell the step how: ``admit_widen`` (the row maps
    get float32 rows for half-precision inputs, :meth:`attnzoo.core.composition.Composition.row_scale`'s
    ``widen``, also for the output slot) and ``decodes_with_gradients`` (False: a step whose q, k or v requires
    grad is refused before the cache changes).
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    summary: ClassVar[str] = ""
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.FORWARD, Mode.BACKWARD})
    admit_widen: ClassVar[bool] = False
    decodes_with_gradients: ClassVar[bool] = True

    def supports(self, plan: Plan, device: torch.device, dtype: torch.dtype, mode: Mode) -> list[str]:
        """Reasons this backend cannot run ``plan`` on ``device`` in ``dtype`` and ``mode`` (empty: it can)."""
        raise NotImplementedError

    def verdict(self, plan: Plan, device: torch.device, dtype: torch.dtype, mode: Mode) -> list[str]:
        """:meth:`supports`, preceded by the check that the backend implements ``mode`` at all."""
        mode = Mode(mode)
        if mode not in self.modes:
            what = "decoding (no attend_held)" if mode is Mode.DECODE else f"the {mode} mode"
            return [f"backend '{self.name}' does not implement {what}"]
        if mode is Mode.DECODE and old_decoding_contract(type(self)):
            return [f"backend '{self.name}' defines extend(), which attnzoo no longer calls: implement "
                    f"attend_held(plan, step, cache, params, *, want_probs) instead (docs/plugins.md, "
                    f"\"Writing a decoding backend\")"]
        return list(self.supports(plan, device, dtype, mode))

    def forward(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Grouped,
                positions: torch.Tensor, key_mask: torch.Tensor | None, return_accumulated: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Batch form. q (B, H, N, D), k/v (B, H_kv, N, D), params grouped per transform kind, positions (B, N)
        int64 strictly increasing along N, key_mask (B, N) bool or None. Returns out (B, H, N, D), or
        (out, F (B, N, N)) when ``return_accumulated`` (F is None for a spec without an accumulator)."""
        raise NotImplementedError

    def attend_held(self, plan: Plan, step: DecodeStep, cache: KVCache, params: Grouped, *,
                    want_probs: bool | QueryRows = False) -> HeldAttention:
        """Attend the step's new queries over every token ``cache`` holds (they are appended already); called once
        per decoding step by :mod:`attnzoo.decode.step`, only for backends whose ``modes`` include
        :attr:`Mode.DECODE`. Reads the cache, writes nothing to it.

        ``step`` (:class:`attnzoo.decode.step.DecodeStep`): ``queries`` (B, H, T, D) already through the query
        slot, their ``positions`` (B, T) and per-token ``features``; the keys and values are held through their
        slots: ``cache.keys``/``cache.values`` (B, H_kv, M, D) at ``cache.positions``, with ``cache.key_mask()``
        (padding), ``cache.key_features()``, ``cache.query_mask()`` (the new queries' padding: a padding query
        selects nothing) and the running F ``cache.accumulated()`` as the carry. ``want_probs``: False (no
        probabilities wanted), True (the new queries' softmax probabilities (B, H, T, M)), or a
        :class:`attnzoo.decode.step.QueryRows` (the evictor reads only some rows: return either every row's
        probabilities or ``want_probs.pack(probabilities of want_probs.queries(...))``).

        Returns :class:`HeldAttention`: the output before the output slot, the new running F (carry plus the new
        queries' selections) or None, and the probabilities asked for."""
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
        the full path). Asked after a step of one token that went through every check and the full path, with
        its grouped ``params``; the step returned (an :class:`attnzoo.decode.state.FastStep`) is taken while the
        call's shapes, dtypes, devices and parameter tensors stay those checked, no key mask or gradient is given,
        and its own ``ready(cache)`` holds (docs/decoding.md, "A step validated once"). It must compute what
        the full path computes, evictions included (the blocked backend's: :mod:`attnzoo.decode.fast`)."""
        return None

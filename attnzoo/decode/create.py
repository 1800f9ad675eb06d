"""A decode-time cache made for a plan (``Variant.new_cache``): the spec's evictor, budget, state names and window
horizon. Apart from :mod:`.step` so that the step does not import the storage, which calls the step."""

from __future__ import annotations

from typing import Any

from ..core.numerics import ACCUMULATED_STATE
from ..evictors.base import budget_problem, resolve_budget, smallest_budget
from ..transforms.base import Slot
from .storage import KVCache

#: ``budget`` not given to :func:`new_cache`: the spec's own
UNSET: Any = object()


def new_cache(plan, batch: int, budget: int | None = UNSET) -> KVCache:
    """A decode-time KV cache of ``plan``'s spec with its evictor (``Variant.new_cache``). ``budget`` defaults to
    the spec's ``cache.budget``; None never evicts."""
    spec = plan.spec
    if not plan.causal:
        raise ValueError(f"spec '{spec.name}' is not causal: token-by-token decoding needs causal attention")
    options = spec.cache
    if budget is UNSET:
        budget = options.budget if options is not None else None
    if isinstance(budget, float) and budget_problem(budget) is None:
        raise ValueError(f"budget {budget} is a fraction of the prompt: a cache needs a token count, known at the "
                         f"prompt's prefill (attnzoo.decode.create.prompt_budget(plan, {budget}, prompt_tokens))")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be an int >= 1 or None, got {budget!r}")
    evictor = plan.evictor_cls(options) if options is not None else None
    if budget is not None and evictor is None:
        raise ValueError(f"spec '{spec.name}' has no cache evictor, so a budget cannot be kept")
    if evictor is not None:
        problem = evictor.check_budget(budget)
        if problem:
            raise ValueError(problem)
    names = list(evictor.state_names) if evictor is not None else []
    if plan.one(Slot.ACCUMULATOR) is not None:
        names.insert(0, ACCUMULATED_STATE)
    # a mask that bounds how far back any query sees (a sliding window) lets the cache drop what none will see;
    # the spec is remembered so that another spec's steps are refused
    horizon = plan.composition.earliest_key if plan.composition.earliest_key(1) is not None else None
    return KVCache(batch, budget, evictor, tuple(names), horizon=horizon, spec=(spec.hash, spec.name))


def plan_evictor(plan):
    """The evictor of ``plan``'s spec, or None."""
    return plan.evictor_cls(plan.spec.cache) if plan.spec.cache is not None else None


def prompt_budget(plan, budget, prompt_tokens: int) -> int | None:
    """The token budget of a cache of ``plan`` whose prefill brings ``prompt_tokens`` real tokens: ``budget`` (the
    spec's ``cache.budget`` when UNSET) as given when it is an int or None; a fraction f of the prompt resolved to
    ``max(smallest budget the evictor accepts, round(f * prompt_tokens))`` and checked by the evictor
    (:func:`attnzoo.evictors.base.resolve_budget`). Raises ValueError, one line."""
    if budget is UNSET:
        budget = plan.spec.cache.budget if plan.spec.cache is not None else None
    return resolve_budget(budget, prompt_tokens, plan_evictor(plan))


def check_fraction(plan, budget) -> None:
    """Refuse, before any prompt, a fraction of the prompt ``plan``'s spec cannot keep: no evictor, or an evictor
    that accepts no budget (ValueError, one line)."""
    evictor = plan_evictor(plan)
    if evictor is None:
        raise ValueError(f"spec '{plan.spec.name}' has no cache evictor, so a budget ({budget}) cannot be kept")
    if smallest_budget(evictor) is None:
        raise ValueError(f"budget {budget}: evictor '{evictor.kind}' accepts no token budget")

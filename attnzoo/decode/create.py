"""A decode-time cache made for a plan (``Variant.new_cache``): the spec's evictor, budget, state names and window
horizon. Apart from :mod:`.step` so that the step does not import the storage, which calls the step."""

from __future__ import annotations

from typing import Any

from ..core.numerics import ACCUMULATED_STATE
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

"""The decode step (docs/decoding.md, "Who owns what"): everything ``Variant.decode`` and ``Variant.prefill`` do to
a cache, in one place, calling one way (down, never back)::

    extend ── the fast step (Backend.decode_step's offer, attnzoo.decode.fast) while it holds
       └── full_step: every check, then held_step:
             admit ──> backend.attend_held ──> settle ──> output slot ──> drop_expired

:func:`extend` is the step: the fast step a backend offered for this cache (:mod:`attnzoo.decode.fast`) while the
checks the full path made still hold (:class:`~attnzoo.decode.state.StepState`), else :func:`full_step`: every
check, then :func:`held_step`: :func:`admit` (the new tokens' positions, their rows through the row maps, their
features, the append, eviction first for an evictor that works before attention), the backend's one decoding
method ``Backend.attend_held`` (attention over the held cache: the output, the new running F and, when asked, the
probabilities, as a ``HeldAttention``), :func:`settle` (the running F stored, the evictor's scores updated,
eviction to the budget), the output slot, then :func:`drop_expired` (window expiry); then the backend is asked for
a fast step (``Backend.decode_step``). A backend reads the cache and returns; it calls nothing here.

Eviction calls the evictor's Python rule (``Evictor.victim``, or for many victims at once its ``score``,
``protected`` and ``largest`` through :func:`attnzoo.evictors.base.eviction_order`); the cache's storage
(:mod:`attnzoo.decode.storage`) only removes the slots it is told to.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.contract import Mode
from ..core.numerics import accumulator_dtype
from ..evictors.base import Evictor, eviction_order, rule_score
from ..inputs import check_key_mask, check_qkv
from ..transforms.base import Dims, Slot, TokenRows
from .state import StepState


class DecodeStep(NamedTuple):
    """What :func:`admit` hands a decoding backend (``Backend.attend_held``): the new queries after the query slot
    (B, H, T, D), their positions (B, T) and their per-token features ``{"<kind>.<name>": (B, H, T)}`` (the keys'
    are in ``cache.key_features()``)."""

    queries: torch.Tensor
    positions: torch.Tensor
    features: dict[str, torch.Tensor]


# -- the step -------------------------------------------------------------------------------------------------------
def extend(variant, q, k, v, cache, params, key_mask, evict_first: bool, inputs=None):
    """One ``decode`` (T = 1) or ``prefill`` of ``variant`` into ``cache``: the fast step when it was validated
    for this variant and call signature and is ready, else :func:`full_step` and a new offer of a fast step."""
    try:
        state = cache.step_state
        fast = state.fast
    except AttributeError:  # not a KVCache: full_step says so
        fast = None
    # a call the fast step may take: no key mask, no inputs, no gradient wanted (spelled out: this runs per token)
    plain_call = key_mask is None and inputs is None and not (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    if (fast is not None and plain_call and state.variant is variant and state.signature == _signature(q, k, v)
            and fast.ready(cache) and _fingerprint(params) == state.params_key):
        return fast(q, k, v, cache)  # what the full path checked for this signature still holds
    out, grouped = full_step(variant, q, k, v, cache, params, key_mask, evict_first, inputs)
    cache.step_state.forget()
    chosen = None
    if plain_call and q.shape[2] == 1:
        offer = getattr(variant.backend_for(q.device, q.dtype, Mode.DECODE), "decode_step", None)
        chosen = offer(variant.plan, cache, grouped) if offer is not None else None
    cache.step_state.choose(chosen, variant, _signature(q, k, v) if chosen is not None else None)
    return out


def full_step(variant, q, k, v, cache, params, key_mask, evict_first: bool, inputs=None):
    """Every check of a step (the cache's spec, geometry, batch and parameters, the inputs), then
    :func:`held_step` on the chosen backend. Returns (out, the parameters and inputs grouped per transform)."""
    if not isinstance(getattr(cache, "step_state", None), StepState):  # a KVCache (storage imports this module)
        raise ValueError(f"cache must come from variant.new_cache(), got {type(cache).__name__}")
    state = cache.step_state
    state.check_spec(variant.spec)
    if isinstance(q, torch.Tensor):  # a dtype no backend takes: UnsupportedError with each one's reason, first
        variant.backend_for(q.device, q.dtype, Mode.DECODE)
    dims = check_qkv(q, k, v)
    state.check_geometry(dims)
    if q.shape[0] != cache.batch:
        raise ValueError(f"cache was made for batch {cache.batch}, got q of batch {q.shape[0]}")
    mask = check_key_mask(key_mask, q.shape[0], q.shape[2], q.device)
    state.check_params(_fingerprint(params))
    plan = variant.plan
    plan.check_dims(dims)
    if params is None:  # the initial values, made once per shape rather than at every decoding step
        params = variant.initial_params_for(dims, q)
    grouped = plan.add_inputs(plan.split_params(params, dims, q), inputs, q.shape[0], q.shape[1], q.shape[2], q)
    backend = variant.backend_for(q.device, q.dtype, Mode.DECODE)
    return held_step(plan, backend, q, k, v, cache, grouped, evict_first=evict_first, key_mask=mask), grouped


def held_step(plan, backend, q, k, v, cache, params, *, evict_first: bool, key_mask=None) -> torch.Tensor:
    """One step after its checks, in one direction: :func:`admit` the new tokens, ``backend.attend_held`` over
    the cache (once), :func:`settle`, the output slot, :func:`drop_expired`. ``params`` grouped per transform
    (inputs included); q (B, H, T, D), k, v (B, H_kv, T, D) raw. Returns the output (B, H, T, D).

    The backend's class attributes say how: ``decodes_with_gradients`` False refuses a step whose q, k or v
    requires grad before anything changes in the cache; ``admit_widen`` hands the row maps float32 rows for
    half-precision inputs (the query, key, value and output slots alike)."""
    if (not backend.decodes_with_gradients and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        raise ValueError(f"the {backend.name} backend decodes without gradients: run decoding under "
                         "torch.no_grad()")
    widen = backend.admit_widen
    step = admit(plan, cache, q, k, v, params, evict_first=evict_first, key_mask=key_mask, widen=widen)
    held = backend.attend_held(plan, step, cache, params, want_probs=wanted_probabilities(plan, cache, q.shape[2]))
    settle(cache, held.accumulated, held.probs)
    out = plan.composition.row_scale(Slot.OUTPUT, held.out, step.positions.unsqueeze(1), params, widen=widen)
    drop_expired(cache)
    return out


def wanted_probabilities(plan, cache, count: int) -> bool | QueryRows:
    """What ``attend_held``'s ``want_probs`` asks of a step of ``count`` queries: False (the cache's evictor reads
    no probabilities, or there is none), the rows it reads (:func:`evictor_query_rows`: it declares
    ``probability_rows``, fewer than ``count``; with no accumulator and no probability map, whose rows depend on
    the step's other queries), else True (every row's)."""
    evictor = cache.evictor
    if evictor is None or not evictor.needs_probabilities:
        return False
    if plan.one(Slot.ACCUMULATOR) is None and plan.one(Slot.PROBABILITY) is None:
        rows = evictor_query_rows(cache, count)
        if rows is not None:
            return rows
    return True


def _signature(q, k, v) -> tuple:
    """What a fast step was validated for: the shapes, dtypes and devices of q, k and v."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)


def _fingerprint(params) -> tuple:
    """Which parameter tensors, at which in-place version, a cache's rows were transformed with."""
    if params is None:
        return ("initial",)
    return tuple(sorted((key, id(t), t._version) for key, t in params.items() if isinstance(t, torch.Tensor)))


# -- the parts of a step ----------------------------------------------------------------------------------------------
def admit(plan, cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params, *, evict_first: bool,
          key_mask: torch.Tensor | None = None, widen: bool = False) -> DecodeStep:
    """What a step does before attending, for every backend: the new tokens' positions, their rows through
    the query, key and value slots (once per token), their per-token features (cumulative ones continuing the
    cache's running sums), the append to ``cache``, then eviction for an evictor that works before attention.
    ``q`` (B, H, T, D) and ``k``, ``v`` (B, H_kv, T, D) are raw; ``widen``: see ``Composition.row_scale``."""
    count = k.shape[2]
    features: dict[str, torch.Tensor] = {}
    totals = None
    featured = bool(plan.composition.feature_transforms())
    if plan.many(Slot.KEY) or plan.many(Slot.VALUE) or featured:
        positions = cache.upcoming_positions(count, key_mask, k.device)
        k = plan.composition.row_scale(Slot.KEY, k, positions.unsqueeze(1), params, widen=widen)
        v = plan.composition.row_scale(Slot.VALUE, v, positions.unsqueeze(1), params, widen=widen)
    if featured:
        qs = plan.composition.row_scale(Slot.QUERY, q, positions.unsqueeze(1), params, widen=widen)
        totals = dict(cache.feature_totals)  # the running sums go on from here; the cache takes them with the rows
        rows = TokenRows(qs, k, v, positions, key_mask, Dims(q.shape[1], q.shape[3], k.shape[1]))
        features = plan.composition.features_of(rows, params, totals)
    positions = cache.append(k, v, key_mask, features, totals)
    evictor = cache.evictor
    if evict_first and evictor is not None and not evictor.evict_after_attention:
        evict_to_budget(cache)
    if not featured:
        qs = plan.composition.row_scale(Slot.QUERY, q, positions.unsqueeze(1), params, widen=widen)
    return DecodeStep(qs, positions, features)


class EvictorRows(NamedTuple):
    """Probabilities a backend returns (``HeldAttention.probs``) in place of a (B, H, T, M) tensor when the
    evictor declares ``probability_rows`` (:func:`evictor_query_rows`): ``probs`` (B, H, R, M), already what the
    evictor reads (the last R rows of :func:`real_query_rows`' packing of the step's T rows), so :func:`settle`
    packs nothing."""

    probs: torch.Tensor


class QueryRows(NamedTuple):
    """The step's query rows whose probabilities an evictor that declares ``probability_rows`` reads
    (:func:`evictor_query_rows`; ``attend_held``'s ``want_probs``): ``index`` (B, R), each row's query indices
    (into the step's T queries), and
    ``real`` (B, R) bool or None (every one real); the evictor's row j of batch row b is the probabilities of query
    ``index[b, j]`` where ``real[b, j]``, else a zero row. :meth:`pack` makes them from the probabilities of those
    queries."""

    index: torch.Tensor
    real: torch.Tensor | None

    def queries(self, rows: torch.Tensor) -> torch.Tensor:
        """The selected queries of ``rows`` (B, X, T, ...) along dim 2: (B, X, R, ...)."""
        index = self.index.to(rows.device).view(*self.index.shape[:1], 1, self.index.shape[1],
                                                *([1] * (rows.dim() - 3)))
        return rows.gather(2, index.expand(rows.shape[0], rows.shape[1], -1, *rows.shape[3:]))

    def pack(self, probs: torch.Tensor) -> EvictorRows:
        """The selected queries' probabilities (B, H, R, M) as :func:`settle` takes them: zero rows where a query
        is padding."""
        if self.real is not None:
            zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
            probs = torch.where(self.real.to(probs.device)[:, None, :, None], probs, zero)
        return EvictorRows(probs)


def evictor_query_rows(cache, count: int) -> QueryRows | None:
    """Which of a step's ``count`` query rows the cache's evictor reads, when it declares ``probability_rows``
    (``Evictor.probability_rows``: the last R of the rows it gets) and R < ``count``, else None (no evictor that
    reads probabilities, or every row: a backend computes the (B, H, T, M) probabilities and :func:`settle` packs
    them). Call after the step's tokens are appended (``admit``): padding queries (``cache.query_mask()``) are
    packed first, so the rows are each batch row's last R real queries, with padding queries (zero rows) in front
    where it has fewer than R; they may lie anywhere among the T, padding inside them included.

    The step hands them to ``attend_held`` (``want_probs``, :func:`wanted_probabilities`); a backend may then
    compute only those queries' probabilities (the same mask and logits transforms as the whole step's) and return
    ``rows.pack(probs)``: the evictor gets exactly what the whole step's
    probabilities give it, and no T x M tensor is made. The queries' probabilities must not depend on the other
    queries of the step (an accumulator's F does: a backend keeps the whole step's probabilities there)."""
    evictor = cache.evictor
    rows = getattr(evictor, "probability_rows", None) if evictor is not None and evictor.needs_probabilities else None
    if rows is None or rows >= count:
        return None
    real = cache.query_mask()
    if real is None:
        index = torch.arange(count - rows, count, device=cache.positions.device)
        return QueryRows(index.expand(cache.batch, rows), None)
    order = torch.argsort(real.to(torch.int8), dim=-1, stable=True)[:, count - rows:]  # padding first, then real
    return QueryRows(order, real.gather(-1, order))


def settle(cache, accumulated: torch.Tensor | None, probs: torch.Tensor | EvictorRows | None) -> None:
    """After attending (``HeldAttention``): store the new running F (B, M), update the evictor's scores from the new
    queries' attention ``probs`` (B, H, T, M), evict down to the budget, and detach everything held.

    F is stored, and ``probs`` handed to the evictor, detached and in :func:`accumulator_dtype` of the keys (at
    least float32): a backend that computed either in half precision cannot round the running state.

    Padding queries (``cache.query_mask()``: a left-padded prompt, a padding token decoded) are not the row's: the
    evictor gets only real queries' rows (:func:`real_query_rows`), and a row whose new tokens are all padding keeps
    its F and its evictor's scores as they were (the row alone had no such step).

    ``probs`` may instead be :class:`EvictorRows`: the rows the evictor reads (``probability_rows``), already packed
    (:func:`evictor_query_rows`)."""
    cache.end_step()
    evictor = cache.evictor
    if evictor is not None and evictor.needs_probabilities and probs is None:
        raise ValueError(f"evictor '{evictor.kind}' needs the attention probabilities, and the backend returned "
                         "none from attend_held()")
    real = cache.query_mask() if accumulated is not None or evictor is not None else None
    idle = None
    if real is not None:
        idle = ~real.any(-1)
        idle = idle if bool(idle.any()) else None
    if accumulated is not None:
        if idle is not None:  # no real query: F as it was (the new padding tokens' slots hold 0)
            accumulated = torch.where(idle[:, None], cache.accumulated().to(accumulated.device), accumulated)
        cache.store_accumulated(accumulated)
    if evictor is not None:
        if not evictor.needs_probabilities:
            probs = None
        elif isinstance(probs, EvictorRows):  # the evictor's rows, packed by the backend
            probs = probs.probs.detach().to(accumulator_dtype(cache.keys.dtype))
        else:
            probs = probs.detach().to(accumulator_dtype(cache.keys.dtype))
            if real is not None:
                probs = real_query_rows(probs, real)
        held = {name: cache.state[name].clone() for name in evictor.state_names} if idle is not None else None
        evictor.update(cache, probs)
        if held is not None:
            rows = idle.to(cache.positions.device)[:, None, None]
            for name, before in held.items():
                cache.state[name] = torch.where(rows, before, cache.state[name])
    if evictor is not None or cache.valid is not None:
        evict_to_budget(cache)


def real_query_rows(probs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The new queries' attention ``probs`` (B, H, T, M) as an evictor gets it (``Evictor.update``) when some
    queries are padding (``real`` (B, T), False for padding): each row's real queries last, in their order, after
    zero rows in place of its padding queries. An evictor that sums over the queries (H2O) adds nothing for them, one
    that reads the last query (TOVA) reads the row's last real one: each row gets what it gets alone."""
    order = torch.argsort(real.to(torch.int8), dim=-1, stable=True).to(probs.device)  # padding first, then real
    kept = real.to(probs.device).gather(-1, order)
    packed = probs.gather(2, order[:, None, :, None].expand_as(probs))
    return torch.where(kept[:, None, :, None], packed, torch.zeros((), dtype=probs.dtype, device=probs.device))


# -- eviction and expiry --------------------------------------------------------------------------------------------
def evict_one(cache) -> None:
    """Drop one token per row (and head): a padding token first (the oldest), else the evictor's victim."""
    victim = cache.evictor.victim(cache) if cache.evictor is not None else None
    valid = cache.valid
    if valid is not None:
        padding = ~valid
        first_pad = padding.to(torch.int8).argmax(-1)
        victim = first_pad if victim is None else torch.where(padding.any(-1), first_pad, victim)
    cache.remove(victim)


def evict_to_budget(cache) -> None:
    """Evict until the budget holds: padding first, then by the evictor's rule. An evictor that declares
    ``independent_scores`` (removing a token changes no other token's score or protection) and keeps the default
    :meth:`~attnzoo.Evictor.victim` has all its victims chosen at once, by the same rule
    (:func:`~attnzoo.evictors.base.eviction_order`: the same tokens, in one gather instead of one per token); any
    other evicts one token at a time."""
    excess = cache.num_tokens - cache.budget if cache.budget is not None else 0
    if excess <= 0:
        return
    evictor = cache.evictor
    rule_only = getattr(getattr(evictor, "victim", None), "__func__", None) is Evictor.victim
    if excess == 1 or not rule_only or not evictor.independent_scores:
        while cache.over_budget():
            evict_one(cache)
    else:
        valid = cache.valid
        order = eviction_order(rule_score(evictor, cache), ~evictor.protected(cache), cache.positions, evictor.largest,
                               padding=None if valid is None else ~valid)
        doomed = torch.zeros(order.shape, dtype=torch.bool, device=order.device).scatter_(-1, order[..., :excess],
                                                                                          True)
        kept = cache.num_tokens - excess
        cache.keep(torch.argsort(doomed.to(torch.int8), dim=-1, stable=True)[..., :kept])
    cache.compact()


def drop_expired(cache) -> None:
    """Drop the tokens that no later query can see: under a window mask (``cache.horizon``), a token before the
    earliest key visible from a row's next position, and padding. Every row and head drops the same number (the
    fewest any of them can spare, oldest first), so the cache stays dense; what one row keeps beyond its window is
    masked as before. Between steps a window layer then holds at most ``window - 1`` tokens per row (once every
    row has seen that many, exactly that), as transformers' sliding-window cache does; a ``chunked`` layer holds
    each row's tokens of its current chunk, at most ``chunk - 1``. Counted in ``cache.expired``."""
    m = cache.num_tokens
    if cache.horizon is None or m == 0:
        return
    firsts = [cache.horizon(int(p)) for p in cache.next_position.tolist()]
    positions = cache.positions
    earliest = torch.tensor(firsts, dtype=torch.int64, device=positions.device).view(-1, 1, 1)
    expired = positions < earliest
    if cache.valid is not None:
        expired |= ~cache.valid
    spare = int(expired.sum(-1).min())
    if spare == 0:
        return
    if bool(expired[..., :spare].all()):  # the oldest slots of every row and head: a shift, no gather
        keep = torch.arange(spare, m, device=positions.device).expand(*expired.shape[:2], -1)
    else:  # drop each row's first `spare` expired slots, keep the rest in order
        doomed = expired & (expired.cumsum(-1) <= spare)
        keep = torch.argsort(doomed.to(torch.int8), dim=-1, stable=True)[..., :m - spare]
    cache.keep(keep.contiguous(), expired=True)

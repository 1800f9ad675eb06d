"""A cache copied, and a cache taken back to an earlier step (docs/transformers.md, "Compress once, ask several
questions").

:func:`copy_cache` is :meth:`KVCache.copy`: a deep copy of every tensor the cache holds (one storage copy each,
views kept views of their copy), sharing only what no step writes (the evictor, the window's horizon); the copy
starts without the fast step its original chose (it validates again at its first step).

:func:`mark` records what a later step may change of the tokens a cache holds (their per-token scores, the next
position, the feature totals) and :func:`rewind` puts them back: the tokens appended since are dropped, the held
ones get their scores as they were. Honest only while nothing was evicted or expired since the mark (a dropped token
cannot be brought back): :func:`rewind` refuses otherwise, and the caller drops a mark when it reorders the rows
(``AttnzooCache`` does)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from . import quant
from .state import StepState


def _copied(value, memo: dict):
    if isinstance(value, torch.Tensor):
        if value.requires_grad and not value.is_leaf:  # only a step's own rows (dropped between steps)
            return value.detach().clone()
        return copy.deepcopy(value, memo)  # one copy per storage: views stay views of the copy
    if isinstance(value, dict):
        return {k: _copied(v, memo) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        out = [_copied(v, memo) for v in value]
        if isinstance(value, list):
            return out
        return type(value)._make(out) if hasattr(value, "_fields") else tuple(out)  # a NamedTuple of tensors
    return value


def copy_cache(cache):
    """A deep copy of ``cache`` (:meth:`KVCache.copy`): its tokens, positions, scores, features and counters, each
    tensor copied once; the evictor and horizon shared (no step writes them); a new step state with what the full
    path validated (spec, geometry, parameters), and no fast step."""
    new = object.__new__(type(cache))
    memo: dict = {}
    for name, value in vars(cache).items():
        if name == "step_state":
            state = StepState(value.spec_hash, value.spec_name)
            state.geometry, state.params_key = value.geometry, value.params_key
            value = state
        elif name == "_bias":  # the plain lean step's padding bias, keyed by the identity of ``valid``
            value = None
        elif name == "_dense_seen":  # the score tensors last found fit for the fast steps, by identity
            value = {}
        elif name in ("evictor", "horizon"):
            pass
        else:
            value = _copied(value, memo)
        new.__dict__[name] = value
    return new


@dataclass(frozen=True)
class Mark:
    """What :func:`rewind` restores: ``held`` tokens per row and head, the ``batch``, the ``evicted`` and
    ``expired`` counters, the next position, the positions appended last, the per-token ``scores`` and the feature
    ``totals`` (copies), and whether the slots were ``ordered``."""

    held: int
    batch: int
    evicted: int
    expired: int
    next_position: torch.Tensor | int
    last: torch.Tensor | None
    scores: dict
    totals: dict
    ordered: bool


def mark(cache) -> Mark:
    """The state of ``cache`` between two steps that :func:`rewind` can return to (copies of its per-token scores,
    not of its keys and values)."""
    scores = {name: t.clone() for name, t in cache.state.items()}  # reading state settles the slots' order
    nxt = cache._next
    return Mark(cache._m, cache.batch, cache.evicted, cache.expired,
                nxt.clone() if isinstance(nxt, torch.Tensor) else nxt,
                None if cache._last is None else cache._last.clone(), scores,
                {name: t.clone() for name, t in cache._totals.items()}, cache.ordered)


def rewind_refusal(cache, at: Mark) -> str | None:
    """Why ``cache`` cannot go back to ``at``, or None."""
    if cache.batch != at.batch:
        return f"the cache holds {cache.batch} rows, {at.batch} at the mark"
    dropped = (cache.evicted - at.evicted) + (cache.expired - at.expired)
    if dropped or cache._m < at.held:
        return (f"{dropped} tokens were evicted or expired since (the evictor may have dropped tokens of the "
                f"context; a dropped token cannot be brought back)")
    return None


def rewind(cache, at: Mark) -> None:
    """Put ``cache`` back in the state of :func:`mark`: the tokens appended since dropped (the first ``held`` slots
    in position order are the mark's tokens: nothing was evicted since), the held tokens' scores, the next position
    and the feature totals as they were. Raises ValueError (one line) where :func:`rewind_refusal` says why not."""
    problem = rewind_refusal(cache, at)
    if problem:
        raise ValueError(f"cannot rewind the cache: {problem}")
    _ = cache._k  # keys and values held in 8, 4, 3 or 2 bits between steps are unpacked (attnzoo.decode.quant)
    quant.forget_from(cache, at.next_position)  # the positions after the mark are given out again
    _ = cache.state  # settles the slots' order
    valid = cache.valid  # caught up with the plain lean step's appends
    m = at.held
    cache.step_state.forget()
    cache._live = cache._feat_live = None
    cache._m = m
    cache.state = {name: t.clone() for name, t in at.scores.items()}  # adopted into dense buffers at the next append
    cache._feat = {name: t[:, :, :m].clone() for name, t in cache._feat.items()}
    cache._totals = {name: t.clone() for name, t in at.totals.items()}
    if valid is not None:
        kept = valid[:, :, :m].clone()
        cache.valid = None if bool(kept.all()) else kept
    cache._next = at.next_position.clone() if isinstance(at.next_position, torch.Tensor) else at.next_position
    cache._last = None if at.last is None else at.last.clone()
    cache.evicted, cache.expired, cache.ordered = at.evicted, at.expired, at.ordered

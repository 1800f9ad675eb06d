"""Evictor checks on crafted caches: every evictor (built-in or plugin) evicts exactly the token its declared rule
names (:meth:`Evictor.score`, ``largest``, :meth:`Evictor.protected`, ties to the oldest position) and never a
protected one.

The rule is read here independently of :func:`attnzoo.evictors.base.pick`, so an evictor that overrides
``victim`` (or a broken ``pick``) is held to its own declaration.
"""

from __future__ import annotations

import torch

from ..cache import ACCUMULATED_STATE, KVCache


def rule_victim(score: torch.Tensor, protected: torch.Tensor, positions: torch.Tensor, largest: bool
                ) -> torch.Tensor:
    """The slot the declared rule names per (batch row, key/value head): (B, H_kv) int64, or -1 where every
    token is protected. Plain loops: the suite's own reading of the rule, small caches only."""
    b, h, m = positions.shape
    out = torch.full((b, h), -1, dtype=torch.int64)
    for i in range(b):
        for j in range(h):
            best = None
            for s in range(m):
                if bool(protected[i, j, s]):
                    continue
                value = float(score[i, j, s])
                key = (-value if largest else value, int(positions[i, j, s]))
                if best is None or key < best[0]:
                    best = (key, s)
            if best is not None:
                out[i, j] = best[1]
    return out


def crafted_cache(evictor, budget: int, state_names: tuple[str, ...], gen: torch.Generator, first: tuple[int, ...],
                  head_dim: int = 4, kv_heads: int = 2, gapped: bool = True) -> KVCache:
    """A cache one token over ``budget`` with positions that start at ``first[row]`` and grow with gaps (of 1 to
    3; not ``gapped``: by 1, as in real decoding), and integer-valued scores (so ties occur), the same in every
    head unless the evictor keeps a set per head."""
    batch, m = len(first), budget + 1
    cache = KVCache(batch, budget, evictor, state_names)
    cache.keys = torch.randn(batch, kv_heads, m, head_dim, generator=gen)
    cache.values = torch.randn(batch, kv_heads, m, head_dim, generator=gen)
    gaps = torch.randint(1, 4, (batch, m), generator=gen) if gapped else torch.ones(batch, m, dtype=torch.int64)
    gaps[:, 0] = 0
    positions = torch.tensor(first).view(batch, 1) + gaps.cumsum(-1)
    cache.positions = positions.view(batch, 1, m).expand(batch, kv_heads, m).clone()
    heads = kv_heads if evictor.per_head else 1
    for name in state_names:
        values = torch.randint(0, 4, (batch, heads, m), generator=gen).to(torch.float32)
        cache.state[name] = values.expand(batch, kv_heads, m).clone()
    cache.next_position = int(positions.max()) + 1
    return cache


#: the largest budget the suite looks for an accepted one under
MAX_BUDGET = 64


def state_names_of(evictor, has_accumulator: bool) -> tuple[str, ...]:
    return ((ACCUMULATED_STATE,) if has_accumulator else ()) + tuple(evictor.state_names)


def protected_count(evictor_factory, budget: int, names: tuple[str, ...]) -> int:
    """The most tokens the evictor protects in one row and head of a cache one over ``budget`` whose positions
    run 1, 2, 3, ... (as in real decoding from BOS)."""
    evictor = evictor_factory()
    cache = crafted_cache(evictor, budget, names, torch.Generator().manual_seed(0), (1,), gapped=False)
    return int(evictor.protected(cache).sum(-1).max())


def budgets_for(evictor_factory, has_accumulator: bool) -> list[int]:
    """The budgets the suite checks an evictor at, derived from the evictor itself: its smallest accepted budget,
    the smallest budget just above the number of tokens it protects, and one in between (about six above the
    smallest). Raises AssertionError ("not run, because ...") when it accepts no budget up to :data:`MAX_BUDGET`:
    an evictor check that cannot run is never a pass."""
    sample = evictor_factory()
    accepted = [b for b in range(1, MAX_BUDGET + 1) if not sample.check_budget(b)]
    if not accepted:
        raise AssertionError(f"evictor '{sample.kind}': not run, because check_budget refuses every budget from 1 "
                             f"to {MAX_BUDGET} ({sample.check_budget(MAX_BUDGET)})")
    names = state_names_of(sample, has_accumulator)
    above = next((b for b in accepted if b > protected_count(evictor_factory, b, names)), accepted[0])
    middle = min(accepted, key=lambda b: abs(b - (accepted[0] + 6)))
    return sorted({accepted[0], above, middle})


def must_keep(spec) -> tuple[int, str]:
    """(k, why): the spec itself says positions 1..k are never evicted, whatever its evictor's rule declares: a
    transform option ``protect_bos: true`` (selective_mask: BOS is never masked, so its evictor must keep it) gives
    k = 1, a cache option ``sink: s`` gives k = s. (0, "") when the spec says nothing."""
    keep, why = 0, ""
    for i, t in enumerate(spec.transforms):
        if getattr(t, "protect_bos", False) is True:
            keep, why = 1, f"transforms[{i}] ({t.kind}) sets protect_bos"
    sink = getattr(spec.cache, "sink", None)
    if isinstance(sink, int) and not isinstance(sink, bool) and sink > keep:
        keep, why = sink, f"cache.sink is {sink}"
    return keep, why


def check_rule_on_crafted_caches(evictor_factory, budgets: list[int], has_accumulator: bool,
                                 gen: torch.Generator) -> None:
    """Raise AssertionError (one line) unless the evictor follows its declared rule on crafted caches at each of
    ``budgets`` (:func:`budgets_for`: every one is accepted, so none is skipped).

    ``evictor_factory()`` returns a fresh evictor instance with the spec's options."""
    sample = evictor_factory()
    kind = sample.kind
    names = state_names_of(sample, has_accumulator)
    for budget in budgets:
        for first, gapped in (((1, 37), True), ((5, 1), True), ((1, 3), False)):
            evictor = evictor_factory()
            cache = crafted_cache(evictor, budget, names, gen, first, gapped=gapped)
            try:
                score, protected = evictor.score(cache), evictor.protected(cache)
            except NotImplementedError as exc:
                raise AssertionError(str(exc)) from None
            if tuple(score.shape) != tuple(cache.positions.shape) or tuple(protected.shape) != tuple(score.shape):
                raise AssertionError(f"evictor '{kind}': score {tuple(score.shape)} and protected "
                                     f"{tuple(protected.shape)} must both have the cache's shape "
                                     f"{tuple(cache.positions.shape)}")
            if protected.dtype != torch.bool:
                raise AssertionError(f"evictor '{kind}': protected() must return a bool tensor, got {protected.dtype}")
            got = evictor.victim(cache)
            want = rule_victim(score, protected, cache.positions, evictor.largest)
            for i, j in ((i, j) for i in range(got.shape[0]) for j in range(got.shape[1])):
                slot, named = int(got[i, j]), int(want[i, j])
                pos = cache.positions[i, j]
                if named < 0:
                    raise AssertionError(f"evictor '{kind}': budget {budget}: every one of {budget + 1} tokens is "
                                         f"protected, so the budget cannot be kept")
                if bool(protected[i, j, slot]):
                    raise AssertionError(f"evictor '{kind}': budget {budget}: evicted protected position "
                                         f"{int(pos[slot])} (row {i}, head {j})")
                if slot != named:
                    rule = "largest" if evictor.largest else "smallest"
                    raise AssertionError(
                        f"evictor '{kind}': budget {budget}: evicted position {int(pos[slot])} (score "
                        f"{float(score[i, j, slot]):g}) but its declared rule ({rule} score among unprotected, "
                        f"ties to the oldest) names position {int(pos[named])} (score {float(score[i, j, named]):g})")
            if not evictor.per_head and not bool((got == got[:, :1]).all()):
                raise AssertionError(f"evictor '{kind}' keeps one set per layer but evicted different tokens in "
                                     f"different key/value heads")
            if evictor.independent_scores:
                check_bulk_eviction(evictor_factory, cache, budget)


def _copy(cache: KVCache, evictor) -> KVCache:
    twin = KVCache(cache.batch, cache.budget, evictor, cache.state_names)
    twin.keys, twin.values = cache.keys.clone(), cache.values.clone()
    twin.positions = cache.positions.clone()
    twin.state = {name: t.clone() for name, t in cache.state.items()}
    twin.next_position = cache.next_position.clone()
    return twin


def check_bulk_eviction(evictor_factory, cache: KVCache, budget: int) -> None:
    """An evictor declaring ``independent_scores`` lets the cache choose several victims at once: that must keep
    the same tokens as evicting one at a time (three tokens over a smaller budget)."""
    smaller = budget - 2
    if smaller < 1 or evictor_factory().check_budget(smaller):
        return
    kept = []
    for bulk in (True, False):
        evictor = evictor_factory()
        evictor.independent_scores = bulk
        twin = _copy(cache, evictor)
        twin.budget = smaller
        twin.evict_to_budget()
        kept.append(twin.positions)
    if not torch.equal(kept[0], kept[1]):
        raise AssertionError(f"evictor '{evictor.kind}' declares independent_scores, but choosing 3 victims at once "
                             f"kept positions {kept[0][0, 0].tolist()} where one at a time keeps "
                             f"{kept[1][0, 0].tolist()}: removing a token changes other tokens' scores (set "
                             f"independent_scores = False)")


def kept_positions(cache: KVCache) -> torch.Tensor:
    """The positions the cache holds, (B, H_kv, M) on CPU, sorted along M. Read from the slots as they are: the
    public ``positions`` view would put slots that fast decoding steps left out of position order back in order,
    and so change what the next step starts from (a bug that only shows in scrambled slots would never show). A
    cache without those slots (another storage) is read through ``positions``."""
    raw, held = getattr(cache, "_pos", None), getattr(cache, "_m", None)
    if isinstance(raw, torch.Tensor) and raw.dim() == 3 and isinstance(held, int):
        positions = raw[:, :, :held]
    else:
        positions = cache.positions
    if positions is None:
        return torch.empty(cache.batch, 0, 0, dtype=torch.int64)
    return positions.sort(dim=-1).values.cpu()


class WatchedVictims:
    """Wraps an evictor instance's ``victim`` during a real decode: every victim must be unprotected when chosen."""

    def __init__(self, evictor) -> None:
        self.evictor = evictor
        self.original = evictor.victim
        self.problems: list[str] = []
        evictor.victim = self

    def __call__(self, cache):
        got = self.original(cache)
        protected = self.evictor.protected(cache)
        hit = protected.gather(-1, got.unsqueeze(-1)).squeeze(-1)
        if bool(hit.any()) and not self.problems:
            i, j = (int(x) for x in hit.nonzero()[0].tolist())
            self.problems.append(f"evictor '{self.evictor.kind}' evicted protected position "
                                 f"{int(cache.positions[i, j, got[i, j]])} while decoding")
        return got

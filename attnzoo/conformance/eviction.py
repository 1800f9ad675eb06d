"""Evictor checks on crafted caches: every evictor (built-in or plugin) evicts exactly the token its declared rule
names (:meth:`Evictor.score`, ``largest``, :meth:`Evictor.protected`, ties to the oldest position) and never a
protected one.

The rule is read here independently of :func:`attnzoo.evictors.base.pick`, so an evictor that overrides
``victim`` (or a broken ``pick``) is held to its own declaration.
"""

from __future__ import annotations

import torch

from ..cache import ACCUMULATED_STATE, KVCache
from ..decode.step import evict_to_budget


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


#: How the keys of a crafted cache are drawn: ``random`` (normal; no two norms or directions tie), ``equal-norms``
#: (signed permutations of one integer vector: every key has exactly the same norm, in any precision, and the
#: directions differ), ``equal-directions`` (one integer vector times 1, 2 or 4: every unit vector is bitwise the
#: same, norms tie in groups), ``identical`` (every key the same vector). A rule that reads the keys (a key norm, a
#: cosine to the mean direction) ties there, and must still follow its declared tie-break and protection.
KEY_MODES = ("random", "equal-norms", "equal-directions", "identical")


def crafted_keys(mode: str, batch: int, kv_heads: int, m: int, head_dim: int, gen: torch.Generator,
                 dtype=torch.float32) -> torch.Tensor:
    """(B, H_kv, M, D) keys of ``mode`` (:data:`KEY_MODES`). Tied keys are integer-valued, so their norms and unit
    vectors are computed exactly alike in any floating-point dtype."""
    if mode == "random":
        return torch.randn(batch, kv_heads, m, head_dim, generator=gen).to(dtype)
    base = torch.arange(1, head_dim + 1, dtype=torch.float64)
    shape = (batch, kv_heads, m, head_dim)
    if mode == "equal-norms":
        order = torch.rand(shape, generator=gen).argsort(-1)
        signs = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        return (base[order] * signs).to(dtype)
    direction = base[torch.rand(head_dim, generator=gen).argsort()] * (torch.randint(0, 2, (head_dim,),
                                                                                      generator=gen) * 2 - 1)
    if mode == "identical":
        return direction.expand(shape).to(dtype).clone()
    if mode == "equal-directions":
        scale = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)[torch.randint(0, 3, shape[:3], generator=gen)]
        return (scale[..., None] * direction).to(dtype)
    raise ValueError(f"unknown key mode '{mode}' (modes: {', '.join(KEY_MODES)})")


def crafted_cache(evictor, budget: int, state_names: tuple[str, ...], gen: torch.Generator, first: tuple[int, ...],
                  head_dim: int = 4, kv_heads: int = 2, gapped: bool = True, keys: str = "random") -> KVCache:
    """A cache one token over ``budget`` with positions that start at ``first[row]`` and grow with gaps (of 1 to
    3; not ``gapped``: by 1, as in real decoding), integer-valued scores (so ties occur), the same in every head
    unless the evictor keeps a set per head, and keys drawn as ``keys`` says (:data:`KEY_MODES`: tied norms or
    directions where not ``random``)."""
    batch, m = len(first), budget + 1
    cache = KVCache(batch, budget, evictor, state_names)
    cache.keys = crafted_keys(keys, batch, kv_heads, m, head_dim, gen)
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


#: the budgets every evictor's crafted caches are built at (where its check_budget accepts them), beside the ones
#: derived from the evictor (:func:`budgets_for`)
CRAFTED_BUDGETS = (2, 5, 8)


def crafted_budgets(evictor_factory, derived: list[int]) -> list[int]:
    """The budgets of the crafted caches: :data:`CRAFTED_BUDGETS` that the evictor accepts, and ``derived``."""
    sample = evictor_factory()
    return sorted({b for b in CRAFTED_BUDGETS if not sample.check_budget(b)} | set(derived))


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


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int] | None:
    """The first (batch row, key/value head) whose kept positions differ (sorted; a different count counts), or
    None."""
    for i in range(want.shape[0]):
        for j in range(want.shape[1]):
            a, b = got[i, j].sort().values, want[i, j].sort().values
            if a.shape != b.shape or not torch.equal(a, b):
                return i, j
    return None


def _score_update(evictor, cache: KVCache) -> None:
    """What a decoding step does before the rule is asked: ``update`` with the step's attention (uniform over the
    held tokens, so that scores built from it tie too) when the evictor reads it, else None. Used on the crafted
    caches with tied keys, so that a rule computed in ``update`` from the keys (KeyDiff's cosine) ties as well."""
    probs = None
    if evictor.needs_probabilities:
        b, h, m = cache.positions.shape
        probs = torch.full((b, h, 1, m), 1.0 / m, dtype=torch.float32)
    evictor.update(cache, probs)


def check_rule_on_crafted_caches(evictor_factory, budgets: list[int], has_accumulator: bool,
                                 gen: torch.Generator, keep: tuple[int, str] = (0, "")) -> None:
    """Raise AssertionError (one line) unless the evictor follows its declared rule on crafted caches at each of
    ``budgets`` (:func:`crafted_budgets`: every one is accepted, so none is skipped): for every layout of positions
    (gapped, from 1 and later; contiguous) and every way of drawing the keys (:data:`KEY_MODES`: random, and keys
    whose norms or directions tie), the victim is the token the declared rule names (ties to the oldest), never a
    protected one, never one of positions 1..k of ``keep = (k, why)`` (:func:`must_keep`: what the spec itself
    promises), the same in every head for an evictor that keeps one set per layer; an evictor declaring
    ``independent_scores`` keeps the same tokens choosing three victims at once as one at a time. With tied keys the
    evictor's ``update`` runs first (as in a decoding step), so that a score it computes from the keys ties too.

    ``evictor_factory()`` returns a fresh evictor instance with the spec's options."""
    sample = evictor_factory()
    kind = sample.kind
    names = state_names_of(sample, has_accumulator)
    for budget in budgets:
        for keys in KEY_MODES:
            for first, gapped in (((1, 37), True), ((5, 1), True), ((1, 3), False)):
                evictor = evictor_factory()
                cache = crafted_cache(evictor, budget, names, gen, first, gapped=gapped, keys=keys)
                where = f"budget {budget}" + ("" if keys == "random" else f", {keys} keys")
                try:
                    if keys != "random":
                        _score_update(evictor, cache)
                    score, protected = evictor.score(cache), evictor.protected(cache)
                except NotImplementedError as exc:
                    raise AssertionError(str(exc)) from None
                want_shape = tuple(cache.positions.shape)
                if not isinstance(score, torch.Tensor) or tuple(score.shape) != want_shape:
                    got_shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
                    raise AssertionError(f"evictor '{kind}': score() returned shape {got_shape}, expected the "
                                         f"cache's (B, H_kv, M) = {want_shape}")
                if not isinstance(protected, torch.Tensor) or tuple(protected.shape) != want_shape:
                    got_shape = (tuple(protected.shape) if isinstance(protected, torch.Tensor)
                                 else type(protected).__name__)
                    raise AssertionError(f"evictor '{kind}': protected() returned shape {got_shape}, expected the "
                                         f"cache's (B, H_kv, M) = {want_shape}")
                if protected.dtype != torch.bool:
                    raise AssertionError(f"evictor '{kind}': protected() must return a bool tensor, got "
                                         f"{protected.dtype}")
                got = evictor.victim(cache)
                want = rule_victim(score, protected, cache.positions, evictor.largest)
                for i, j in ((i, j) for i in range(got.shape[0]) for j in range(got.shape[1])):
                    slot, named = int(got[i, j]), int(want[i, j])
                    pos = cache.positions[i, j]
                    at = f"batch row {i}, key/value head {j}"
                    if named < 0:
                        raise AssertionError(f"evictor '{kind}': {where}: every one of {budget + 1} tokens is "
                                             f"protected ({at}), so the budget cannot be kept")
                    if bool(protected[i, j, slot]):
                        raise AssertionError(f"evictor '{kind}': {where}: evicted protected position "
                                             f"{int(pos[slot])} ({at})")
                    if int(pos[slot]) <= keep[0]:
                        raise AssertionError(f"evictor '{kind}': {where}: evicted position {int(pos[slot])} ({at}), "
                                             f"but {keep[1]}: the spec says positions 1..{keep[0]} are never "
                                             f"evicted (score {float(score[i, j, slot]):g}; declare them in "
                                             f"protected())")
                    if slot != named:
                        rule = "largest" if evictor.largest else "smallest"
                        raise AssertionError(
                            f"evictor '{kind}': {where}: evicted position {int(pos[slot])} (score "
                            f"{float(score[i, j, slot]):g}) in {at}, but its declared rule ({rule} score among "
                            f"unprotected, ties to the oldest) names position {int(pos[named])} (score "
                            f"{float(score[i, j, named]):g})")
                if not evictor.per_head and not bool((got == got[:, :1]).all()):
                    i, j = (int(x) for x in (got != got[:, :1]).nonzero()[0].tolist())
                    raise AssertionError(f"evictor '{kind}' keeps one set per layer but evicted different tokens "
                                         f"in different key/value heads ({where}: batch row {i}, head {j} evicted "
                                         f"position {int(cache.positions[i, j, got[i, j]])}, head 0 position "
                                         f"{int(cache.positions[i, 0, got[i, 0]])})")
                if evictor.independent_scores:
                    check_bulk_eviction(evictor_factory, cache, budget, where)


def _copy(cache: KVCache, evictor) -> KVCache:
    twin = KVCache(cache.batch, cache.budget, evictor, cache.state_names)
    twin.keys, twin.values = cache.keys.clone(), cache.values.clone()
    twin.positions = cache.positions.clone()
    twin.state = {name: t.clone() for name, t in cache.state.items()}
    twin.next_position = cache.next_position.clone()
    return twin


def check_bulk_eviction(evictor_factory, cache: KVCache, budget: int, where: str = "") -> None:
    """An evictor declaring ``independent_scores`` lets the cache choose several victims at once: that must keep
    the same tokens as evicting one at a time (three tokens over a smaller budget). The failure names the first
    batch row and key/value head whose kept tokens differ."""
    smaller = budget - 2
    if smaller < 1 or evictor_factory().check_budget(smaller):
        return
    kept = []
    for bulk in (True, False):
        evictor = evictor_factory()
        evictor.independent_scores = bulk
        twin = _copy(cache, evictor)
        twin.budget = smaller
        evict_to_budget(twin)
        kept.append(twin.positions)
    differ = _first_difference(kept[0], kept[1])
    if differ is not None:
        i, j = differ
        raise AssertionError(f"evictor '{evictor.kind}' declares independent_scores, but choosing 3 victims at once "
                             f"({where or f'budget {budget}'}, down to {smaller}) kept positions "
                             f"{kept[0][i, j].tolist()} in batch row {i}, key/value head {j}, where one at a time "
                             f"keeps {kept[1][i, j].tolist()}: removing a token changes other tokens' scores (set "
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
                                 f"{int(cache.positions[i, j, got[i, j]])} (batch row {i}, key/value head {j}) "
                                 f"while decoding")
        return got

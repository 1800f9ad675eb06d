"""The evictor contract: which cached token to drop when a decode-time cache is over its budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field, create_model

from ..transforms.base import StrictModel

if TYPE_CHECKING:
    from ..cache import KVCache


class EvictorOptions(StrictModel):
    """The ``cache:`` mapping of a spec: ``evictor`` (the kind), ``budget`` (tokens per layer; None never evicts)
    and the evictor's own options."""

    evictor: str
    budget: int | None = Field(None, ge=1)


class Evictor:
    """Base class of evictors. Subclasses set ``kind``, ``Options`` and declare their rule: :meth:`score` (the
    per-token score it ranks by), ``largest`` (evict the largest score, else the smallest) and :meth:`protected`
    (tokens never evicted, e.g. the first ``sink`` tokens). :meth:`victim` applies the rule (ties go to the oldest
    position); the conformance suite checks on crafted caches that the evictor evicts exactly the token its rule
    names and never a protected one.

    ``per_head``: the kept set may differ between key/value heads (otherwise one set per layer).
    ``evict_after_attention``: evict after the new query attended over ``budget + 1`` tokens (H2O, TOVA score
    with the current query's attention) rather than before (selective, sink + window).
    ``state_names``: per-token scores the cache keeps for this evictor, (B, H_kv, M) each, starting at 0. A class
    attribute, or set per instance in ``__init__`` when the names depend on the options (one score per query of a
    window of W: ``self.state_names = tuple(f"q{i}" for i in range(options.window))``). :meth:`update` may write
    ``cache.state[name]`` in place or assign it a new (B, H_kv, M) tensor; the cache adopts it.
    ``needs_probabilities``: :meth:`update` reads the new queries' attention probabilities (backends compute
    them, O(H·T·M) per step, only for evictors that declare it; the others get None).
    ``independent_scores``: removing a token changes no other token's score or protection, so the cache may pick
    several victims at once (after a long prefill) with the same result as one at a time; the conformance suite
    checks the claim on crafted caches.
    """

    kind: ClassVar[str]
    Options: ClassVar[type[EvictorOptions]] = EvictorOptions
    summary: ClassVar[str] = ""
    largest: ClassVar[bool] = True
    per_head: ClassVar[bool] = False
    evict_after_attention: ClassVar[bool] = False
    state_names: tuple[str, ...] = ()  # per class, or per instance from the options
    needs_probabilities: ClassVar[bool] = False
    independent_scores: ClassVar[bool] = False
    _options_model: ClassVar[type[EvictorOptions] | None] = None

    def __init__(self, options: EvictorOptions) -> None:
        self.options = options

    def check_spec(self, spec: Any) -> str | None:
        """A reason this evictor cannot serve ``spec``, or None."""
        if self.per_head and "accumulator" in spec.slots():
            return (f"evictor '{self.kind}' keeps a set per head; an accumulator needs one kept set per layer "
                    "(its F is per token)")
        return None

    def check_budget(self, budget: int | None) -> str | None:
        """A reason this evictor cannot work with ``budget`` tokens, or None."""
        return None

    def update(self, cache: KVCache, probs: torch.Tensor | None) -> None:
        """Update scores after a step; ``probs`` (B, H, T, M) is the new queries' attention over the cache
        (T = 1 when decoding, the chunk length in a prefill) when the evictor declares ``needs_probabilities``,
        else None."""

    def score(self, cache: KVCache) -> torch.Tensor:
        """The score the rule ranks cached tokens by: (B, H_kv, M), float32 or wider."""
        raise NotImplementedError(f"evictor '{self.kind}' declares no score: implement score() (docs/plugins.md)")

    def protected(self, cache: KVCache) -> torch.Tensor:
        """Tokens the rule never evicts: (B, H_kv, M) bool. Default: none."""
        return torch.zeros_like(cache.positions, dtype=torch.bool)

    def victim(self, cache: KVCache) -> torch.Tensor:
        """Slot index to drop per (batch row, key/value head): (B, H_kv) int64. Default: the declared rule."""
        if getattr(cache, "ordered", False):  # the oldest of tied slots is the first: argmax/argmin decide
            fill = float("-inf") if self.largest else float("inf")
            masked = self.score(cache).masked_fill(self.protected(cache), fill)
            return masked.argmax(-1) if self.largest else masked.argmin(-1)
        return pick(self.score(cache), ~self.protected(cache), cache.positions, largest=self.largest)

    @classmethod
    def options_model(cls) -> type[EvictorOptions]:
        if cls.__dict__.get("_options_model") is None:
            cls._options_model = create_model(
                f"{cls.__name__}Options", __base__=cls.Options, evictor=(Literal[cls.kind], ...)
            )
        return cls._options_model

    @classmethod
    def contract_problem(cls) -> str | None:
        if not (isinstance(cls.Options, type) and issubclass(cls.Options, EvictorOptions)):
            return "Options must subclass attnzoo.EvictorOptions"
        return None


def pick(score: torch.Tensor, eligible: torch.Tensor, positions: torch.Tensor, largest: bool,
         ordered: bool = False) -> torch.Tensor:
    """Among eligible slots, the one with the largest (or smallest) score; ties go to the oldest position.

    score, eligible, positions: (B, H_kv, M) → (B, H_kv) slot indices. Every row must have an eligible slot.
    ``ordered``: positions increase along the slots (a cache's invariant), so the oldest of tied slots is the
    first one, which is what ``argmax``/``argmin`` return.
    """
    if ordered:
        masked = score.masked_fill(~eligible, float("-inf") if largest else float("inf"))
        return masked.argmax(-1) if largest else masked.argmin(-1)
    fill = float("-inf") if largest else float("inf")
    masked = torch.where(eligible, score, torch.full_like(score, fill))
    best = masked.amax(-1, keepdim=True) if largest else masked.amin(-1, keepdim=True)
    tied = eligible & (masked == best)
    oldest = torch.where(tied, positions, torch.full_like(positions, torch.iinfo(torch.int64).max))
    return oldest.argmin(-1)

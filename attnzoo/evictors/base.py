"""The evictor contract: which cached token to drop when a decode-time cache is over its budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple

import torch
from pydantic import Field, create_model, field_validator

from ..transforms.base import StrictModel

if TYPE_CHECKING:
    from ..decode.storage import KVCache


def budget_problem(value: Any) -> str | None:
    """Why ``value`` is no budget, or None: a budget is an int >= 1 (tokens), a float in (0, 1] (a fraction of
    the prompt, resolved at each request's prefill: :func:`resolve_budget`) or None (never evict)."""
    if value is None or (type(value) is int and value >= 1):
        return None
    if type(value) is float and 0.0 < value <= 1.0:  # NaN fails both comparisons
        return None
    return (f"a budget is an int >= 1 (tokens), a float in (0, 1] (a fraction of the prompt) or null, "
            f"got {value!r}")


def is_fraction(budget: Any) -> bool:
    """Whether ``budget`` is a fraction of the prompt (a float), not a token count."""
    return type(budget) is float


def smallest_budget(evictor: Evictor | None, limit: int = 1 << 16) -> int | None:
    """The smallest token budget ``evictor`` accepts (:meth:`Evictor.check_budget`), up to ``limit``; 1 without an
    evictor; None when it accepts none."""
    if evictor is None:
        return 1
    return next((b for b in range(1, limit + 1) if not evictor.check_budget(b)), None)


def resolve_budget(budget: Any, prompt_tokens: int, evictor: Evictor | None = None) -> int | None:
    """The token budget of a cache whose first step (its prefill) brings ``prompt_tokens`` real tokens: an int
    or None as given; a fraction f gives ``max(minimum, round(f * prompt_tokens))``, ``minimum`` the smallest budget
    ``evictor`` accepts (:func:`smallest_budget`), checked by the evictor. Raises ValueError (one line naming the
    budget)."""
    problem = budget_problem(budget)
    if problem:
        raise ValueError(f"budget: {problem}")
    if not is_fraction(budget):
        return budget
    minimum = smallest_budget(evictor)
    if minimum is None:
        raise ValueError(f"budget {budget} (a fraction of the prompt): evictor '{evictor.kind}' accepts no budget "
                         f"({evictor.check_budget(1 << 16)})")
    resolved = max(minimum, round(budget * prompt_tokens))
    problem = evictor.check_budget(resolved) if evictor is not None else None
    if problem:
        raise ValueError(f"budget {resolved} (fraction {budget} of a {prompt_tokens}-token prompt): {problem}")
    return resolved


class EvictorOptions(StrictModel):
    """The ``cache:`` mapping of a spec: ``evictor`` (the kind), ``budget`` (tokens per layer, an int >= 1; a
    float in (0, 1]: that fraction of each request's prompt, :func:`resolve_budget`; None never evicts) and the
    evictor's own options."""

    evictor: str
    budget: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="tokens kept per layer; a float in (0, 1]: that fraction of each request's prompt; null: "
        "never evict")

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        problem = budget_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class KernelRule(NamedTuple):
    """An evictor's rule as the fused C decoding steps take it (``attnzoo/decode/fused_decode_body.h``), made by the
    evictor itself (:meth:`Evictor.kernel_rule`) beside the Python rule it implements a second time.

    ``kernel``: the C step ("selective", "sink_window" or "scoring"); ``options``: its leading options, from the
    rule (the step's other options, if any, come from the spec's transforms: the selector head, ...); ``state``:
    the per-token score the step updates, or None; ``spare``: 1 when the step puts the new token in the slot after
    the held ones and evicts after attention."""

    kernel: str
    options: tuple[int, ...]
    state: str | None = None
    spare: int = 0


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
    them, O(H·T·M) per step, only for evictors that declare it; the others get None), real queries' rows only.
    ``probability_rows``: the most query rows :meth:`update` reads, the last ones of the step (TOVA: 1, SnapKV: its
    window), or None: every row (H2O). A backend may then compute only those rows' probabilities and hand
    :meth:`update` a (B, H, min(T, rows), M) tensor of the step's last rows (a long prefill need not materialise
    T x M probabilities to score a prompt); an evictor that declares it must read nothing but those rows.
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
    probability_rows: int | None = None  # per class, or per instance from the options
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
        else None.

        Only real queries' rows (``attnzoo.decode.step.settle``): where some of a row's new tokens are padding (a
        left-padded prompt, a padding token decoded), its real queries' rows come last, in order, after zero rows
        in place of its padding queries, so a sum over the queries adds nothing for them and ``probs[:, :, -1]``
        is the row's last real query; a row with no real query in the step keeps every score as it was, whatever
        ``update`` writes there (alone, the row had no such step)."""

    def score(self, cache: KVCache) -> torch.Tensor:
        """The score the rule ranks cached tokens by: (B, H_kv, M), float32 or wider."""
        raise NotImplementedError(f"evictor '{self.kind}' declares no score: implement score() (docs/plugins.md)")

    def protected(self, cache: KVCache) -> torch.Tensor:
        """Tokens the rule never evicts: (B, H_kv, M) bool. Default: none."""
        return torch.zeros_like(cache.positions, dtype=torch.bool)

    def kernel_rule(self, budget: int) -> KernelRule | None:
        """This rule's second implementation, the fused C decoding step, as its options (:class:`KernelRule`), or
        None: no fast step (the default). Only the built-in evictors have one; it is honoured only for a class that
        defines it itself (a subclass that changes the rule and not this gets no fast step), and
        ``attnzoo.decode.check.check_fast_step`` holds the C step to :meth:`update` and :meth:`victim`."""
        return None

    def victim(self, cache: KVCache) -> torch.Tensor:
        """Slot index to drop per (batch row, key/value head): (B, H_kv) int64. Default: the declared rule."""
        fill = float("-inf") if self.largest else float("inf")
        masked = rule_score(self, cache).masked_fill(self.protected(cache), fill)
        if getattr(cache, "ordered", False):  # the oldest of tied slots is the first: argmax/argmin decide
            return masked.argmax(-1) if self.largest else masked.argmin(-1)
        return _oldest_best(masked, cache.positions, self.largest)  # slots in any order (a fast step's)

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


def rule_score(evictor: Evictor, cache: Any) -> torch.Tensor:
    """``evictor.score(cache)``, refused (ValueError, one line naming the evictor) unless it has the cache's shape
    (B, H_kv, M): a score without the head axis (B, M) would broadcast against (B, H_kv, M) where B equals H_kv or
    is 1, and one batch row's scores would silently rank a head's tokens."""
    score = evictor.score(cache)
    want = cache.positions.shape
    if not isinstance(score, torch.Tensor) or score.shape != want:
        got = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
        raise ValueError(f"evictor '{evictor.kind}': score() returned shape {got}, expected the cache's (B, H_kv, M) "
                         f"= {tuple(want)}: one score per batch row, key/value head and cached token")
    return score


def pick(score: torch.Tensor, eligible: torch.Tensor, positions: torch.Tensor, largest: bool,
         ordered: bool = False) -> torch.Tensor:
    """Among eligible slots, the one with the largest (or smallest) score; ties go to the oldest position. A NaN
    score outranks every number (as torch's ``argmax``/``argmin`` rank it), the oldest NaN first.

    score, eligible, positions: (B, H_kv, M) → (B, H_kv) slot indices. Every row must have an eligible slot.
    ``ordered``: positions increase along the slots (a cache's invariant), so the oldest of tied slots is the
    first one, which is what ``argmax``/``argmin`` return. Slots in any order (a fast step's) take the tie-break.
    """
    fill = float("-inf") if largest else float("inf")
    masked = score.masked_fill(~eligible, fill)
    if ordered:
        return masked.argmax(-1) if largest else masked.argmin(-1)
    return _oldest_best(masked, positions, largest)


def _oldest_best(masked: torch.Tensor, positions: torch.Tensor, largest: bool) -> torch.Tensor:
    """The slot of the largest (smallest) of ``masked`` (protected slots already filled with -inf/+inf), NaN first,
    ties to the oldest position, for slots in any order."""
    best = masked.amax(-1, keepdim=True) if largest else masked.amin(-1, keepdim=True)
    tied = (masked == best) | masked.isnan()  # a NaN best (amax/amin propagate it): the NaN-scored slots tie
    return torch.where(tied, positions, _NEWEST).argmin(-1)


#: a position past any held: the tie-break to the oldest position
_NEWEST = torch.iinfo(torch.int64).max


def eviction_order(score: torch.Tensor, eligible: torch.Tensor, positions: torch.Tensor, largest: bool,
                   padding: torch.Tensor | None = None) -> torch.Tensor:
    """Every slot, in the order the rule of :func:`pick` evicts them when removing one changes no other's score
    (``Evictor.independent_scores``): padding first (by slot, the oldest first), then eligible slots by score
    (largest first when ``largest``; NaN first), ties to the oldest position, then the protected ones. (B, H_kv, M)
    slot indices; the first k of each row are the k victims."""
    if not largest:
        score = -score
    order = positions.argsort(dim=-1, stable=True)
    order = order.gather(-1, score.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    order = order.gather(-1, eligible.gather(-1, order).to(torch.int8).argsort(dim=-1, descending=True, stable=True))
    if padding is not None:  # padding first, by slot (the oldest first), whatever its score: the same slots in
        # every head (padding is per batch row, and the backends mask held keys by the row's validity), as evict_one
        # takes them one at a time
        pad = padding.gather(-1, order)
        order = order.gather(-1, torch.where(pad, order, _NEWEST).argsort(dim=-1, stable=True))
    return order

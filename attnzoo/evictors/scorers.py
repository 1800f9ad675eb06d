"""Prompt scorers as evictors: SnapKV (the last queries' attention, pooled over neighbouring keys), KNorm (the key's
L2 norm) and KeyDiff (the key's cosine to the mean key direction) (docs/specs.md, "Evictors"; issue 52).

Each scores the tokens once per step, after attention (``evict_after_attention``): a prefill scores the whole prompt
at once, as kvpress's presses do when they compress a prompt, then evicts down to the budget by those scores; each
decoding step scores the held tokens and the new one again (SnapKV: adds the new query's attention) and
evicts one. Every score that depends on more than its
own token (SnapKV's pooling, KeyDiff's anchor) is computed in :meth:`update` and stored as a
per-token score (``cache.state``), so removing a token changes no other token's score within the step
(``independent_scores``: the many victims of a long prefill are chosen at once, by the scores of the whole prompt).
SnapKV's rule for generated tokens (``decode: accumulate``, the default) is H2O's, so its decoding steps take H2O's
fused step (``kernel_rule``); KNorm and KeyDiff have none: the full decode path runs their rules.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from ..core.numerics import accumulator_dtype
from .base import Evictor, EvictorOptions, KernelRule

#: norms below this count as zero (as ``torch.nn.functional.normalize``)
_EPS = 1e-12


def newest_real(cache) -> torch.Tensor:
    """(B, H_kv, 1): the newest position of each row's real tokens (padding, which takes the position of its row's
    next real token, left out; 0 for a row of padding only)."""
    positions = cache.positions
    valid = cache.valid
    held = positions if valid is None else positions.masked_fill(~valid, 0)
    return held.amax(-1, keepdim=True)


def pool_by_position(raw: torch.Tensor, positions: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """Pool ``raw`` (B, H_kv, M) over the tokens within ``kernel // 2`` positions of each token (by position, not by
    slot: an evicted or absent position counts 0, a padding slot, which shares its position with the next real
    token and holds 0, adds nothing). ``avg``: the sum over the ``kernel`` positions divided by ``kernel`` (zeros
    included, as ``avg_pool1d`` with ``count_include_pad``); ``max``: the largest (scores are >= 0). The terms are
    added in increasing position order whatever the centre, so two tokens whose neighbourhoods hold the same
    tokens get bitwise equal sums (a tie, which goes to the oldest)."""
    positions = positions.contiguous()
    radius = kernel // 2
    out = torch.zeros_like(raw)
    m = positions.shape[-1]
    if m == 0:
        return out
    low = int(positions.min())
    span = int(positions.max()) - low + 1
    if span <= 8 * m + 64:  # the usual case: the held positions spread over a few times their number
        # one row per position (padding, at a real token's position, adds its 0), read back at each offset
        at = positions - low + radius
        dense = raw.new_zeros(*raw.shape[:-1], span + 2 * radius).scatter_add_(-1, at, raw)
        for offset in range(-radius, radius + 1):
            value = dense.gather(-1, at + offset)
            out = out + value if pool == "avg" else torch.maximum(out, value)
        return out / kernel if pool == "avg" else out
    for offset in range(-radius, radius + 1):  # positions far apart: find each neighbour by search
        target = positions + offset
        slot = torch.searchsorted(positions, target, right=True) - 1  # the last slot at or before: the real one
        at = slot.clamp(min=0)
        hit = (slot >= 0) & (positions.gather(-1, at) == target)
        value = raw.gather(-1, at).masked_fill(~hit, 0)
        out = out + value if pool == "avg" else torch.maximum(out, value)
    return out / kernel if pool == "avg" else out


class SnapKVOptions(EvictorOptions):
    window: int = Field(32, ge=1, description="the last queries whose attention scores the keys; the newest "
                                              "`window` positions are always kept (under a budget <= window: "
                                              "budget - 1 of each)")
    kernel: int = Field(7, ge=1, description="pooling width over neighbouring positions (odd)")
    pool: Literal["avg", "max"] = Field("avg", description="avg (SnapKV's and kvpress's default) or max pooling")
    decode: Literal["accumulate", "pooled"] = Field(
        "accumulate", description="a step of one query (a generated token): accumulate adds its attention to every "
        "held token's score unpooled (H2O's rule, the fused decoding step); pooled adds it with the window left out "
        "and pooled as a prompt's (no fused step)")

    @field_validator("kernel")
    @classmethod
    def _odd(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"snapkv.kernel must be odd (centred on the token), got {value}")
        return value


class SnapKV(Evictor):
    """SnapKV (Li et al. 2024): a token's score is the attention the last ``window`` queries paid it (softmax
    probabilities, summed over those queries and over its key/value head's query group), the newest ``window``
    positions left out (they are kept), then pooled over the ``kernel`` neighbouring positions; the smallest score
    goes, per key/value head, ties to the oldest. At a prefill longer than the budget this is SnapKV's selection of
    the prompt (the window: the prompt's last queries), the same kept set as kvpress's SnapKVPress.

    Generated tokens (kvpress lets the cache grow; a fixed page cannot): ``decode: accumulate`` (the default) adds a
    step of one query's attention, summed over its key/value head's query group, to every held token's score,
    unpooled and the window included (H2O's accumulation), so the decoding step is H2O's fused C step with the newest
    ``window`` positions as its recent window; ``decode: pooled`` adds it as a prompt's is added, the newest
    ``window`` positions left out and pooled over the tokens held at that step (no fused step). Either way the newest
    ``window`` positions stay protected and a token keeps what the prompt's window paid it plus what later queries
    pay it. A step of T > 1 tokens adds its last ``min(T, window)`` real queries, pooled (a prefill in chunks
    therefore scores with each chunk's last queries: one prefill is SnapKV's rule). One float per held token
    (``score``), as H2O keeps. A budget of at most ``window`` tokens shrinks the window to ``budget - 1`` (the
    newest rows, the newest positions), so that one held token can be evicted."""

    independent_scores = True  # the pooled score is stored by update(); the protected window is the newest positions
    kind = "snapkv"
    Options = SnapKVOptions
    summary = "keep the newest `window` + the keys the last `window` queries attend to most (pooled), per head"
    per_head = True
    evict_after_attention = True
    needs_probabilities = True
    largest = False
    state_names = ("score",)

    def __init__(self, options: SnapKVOptions) -> None:
        super().__init__(options)
        self.probability_rows = options.window  # update reads the step's last `window` rows at most

    def check_budget(self, budget):
        if budget is not None and budget < 2:
            return f"snapkv needs budget >= 2 (the newest token is always kept), got {budget}"
        return None

    def window(self, budget: int | None) -> int:
        """The queries that score, and the newest positions kept: ``window``, or ``budget - 1`` under a smaller
        budget."""
        return self.options.window if budget is None else min(self.options.window, budget - 1)

    def update(self, cache, probs):
        b, h, t, m = probs.shape
        hkv = cache.positions.shape[1]
        take = min(t, self.window(cache.budget))
        # the step's last `take` query rows (each row's real queries are last, zero rows before them for its
        # padding queries: they add nothing), summed over the queries, then over each key/value head's group
        rows = probs[:, :, t - take:].detach().sum(dim=2)
        score = cache.state["score"]
        raw = rows.reshape(b, hkv, h // hkv, m).sum(dim=2).to(score.dtype)
        if t == 1 and self.options.decode == "accumulate":  # a generated token: H2O's accumulation (its C step)
            if cache.valid is not None:
                raw = raw.masked_fill(~cache.valid, 0)
            cache.state["score"] = score + raw
            return
        raw = raw.masked_fill(self.protected(cache), 0)  # the window's own keys are kept, not scored (kvpress)
        if cache.valid is not None:
            raw = raw.masked_fill(~cache.valid, 0)
        cache.state["score"] = score + pool_by_position(raw, cache.positions, self.options.kernel, self.options.pool)

    def score(self, cache):
        return cache.state["score"]

    def protected(self, cache):
        return cache.positions > newest_real(cache) - self.window(cache.budget)

    def kernel_rule(self, budget):
        if self.options.decode != "accumulate":
            return None
        return KernelRule("scoring", (0, self.window(budget)), "score", spare=1)  # H2O's step, the window recent


class SinkOptions(EvictorOptions):
    sink: int = Field(0, ge=0, description="first positions always kept (attention sinks, BOS); 0: none, as kvpress")
    recent: int = Field(0, ge=0, description="newest positions always kept (the question, generated tokens); 0: "
                                             "none, as kvpress")


class _SinkProtected(Evictor):
    Options = SinkOptions

    def check_budget(self, budget):
        kept = self.options.sink + self.options.recent
        if budget is not None and budget <= kept:
            return (f"{self.kind}.sink + {self.kind}.recent ({kept}) must be smaller than the budget ({budget})")
        return None

    def protected(self, cache):
        guarded = cache.positions <= self.options.sink
        if self.options.recent:
            guarded = guarded | (cache.positions > newest_real(cache) - self.options.recent)
        return guarded


class KNorm(_SinkProtected):
    """KNorm (Devoto et al. 2024; kvpress's KnormPress): keep the keys with the lowest L2 norm, i.e. evict the
    largest norm, per key/value head, ties to the oldest. Key-only (no probabilities); the first ``sink`` and the
    newest ``recent`` positions optionally kept. Keys as the cache holds them (after the key slot's transforms, RoPE
    included: a rotation keeps the norm)."""

    independent_scores = True  # a token's score is its own key's norm
    kind = "knorm"
    summary = "drop the key with the largest L2 norm, per head"
    per_head = True
    evict_after_attention = True
    largest = True

    def score(self, cache):
        keys = cache.keys.detach()
        return torch.linalg.vector_norm(keys.to(accumulator_dtype(keys.dtype)), dim=-1)


class KeyDiff(_SinkProtected):
    """KeyDiff (Park et al. 2025; kvpress's KeyDiffPress): evict the key most similar (cosine) to the anchor, the
    mean of the held keys' unit vectors, per key/value head, ties to the oldest: the most distinctive keys stay.
    The anchor is taken over the keys held when the step attended (the whole prompt at a prefill, as kvpress
    compresses it; the held tokens and the new one at a decoding step) and the similarities are stored
    (``similarity``), so the victims of one step are chosen by one anchor. Key-only (no probabilities);
    ``sink`` and ``recent`` as for :class:`KNorm`."""

    independent_scores = True  # the similarities are stored by update(), against the step's one anchor
    kind = "keydiff"
    summary = "drop the key most similar to the mean key direction (cosine), per head"
    per_head = True
    evict_after_attention = True
    state_names = ("similarity",)
    largest = True

    def update(self, cache, probs):
        keys = cache.keys
        keys = keys.detach().to(accumulator_dtype(keys.dtype))
        unit = keys / torch.linalg.vector_norm(keys, dim=-1, keepdim=True).clamp_min(_EPS)
        if cache.valid is not None:
            unit = unit.masked_fill(~cache.valid[..., None], 0)  # padding is no part of the anchor
        anchor = unit.sum(dim=2, keepdim=True)
        anchor = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(_EPS)
        cache.state["similarity"] = (unit * anchor).sum(dim=-1)

    def score(self, cache):
        return cache.state["similarity"]


SCORER_EVICTORS = (SnapKV, KNorm, KeyDiff)

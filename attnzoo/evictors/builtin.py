"""Built-in evictors: selective (max F), H2O, TOVA, sink + window (docs/papers.md §2-3); the prompt scorers SnapKV,
KNorm and KeyDiff (:mod:`attnzoo.evictors.scorers`; SnapKV decodes with H2O's fused step) are registered here too.

Each rule is written once, here, in Python (``score``, ``protected``, ``largest``, ``update``): the full decode
path and the torch fast steps (attnzoo/decode/fast.py) call it. ``kernel_rule`` hands the same rule's options to
its second, faster implementation, the fused C step (attnzoo/decode/fused_decode_body.h), which
``attnzoo.decode.check.check_fast_step`` holds to it. Changing a rule: edit it here (and its ``kernel_rule``) and in
the C body.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..core.numerics import ACCUMULATED_STATE
from ..hookspecs import hookimpl
from .base import Evictor, EvictorOptions, KernelRule
from .scorers import SCORER_EVICTORS


class Selective(Evictor):
    """Evict the non-BOS token with the largest accumulated F; ties go to the oldest. Needs ``selective_mask``
    (or another accumulator) in the spec: F is the same quantity the model subtracted from its logits."""

    independent_scores = True
    kind = "selective"
    summary = "drop the largest F (never BOS, ties -> oldest)"

    def check_spec(self, spec):
        if "accumulator" not in spec.slots():
            return "evictor 'selective' needs an accumulator transform (e.g. selective_mask) in the spec"
        return None

    def check_budget(self, budget):
        if budget is not None and budget < 2:
            return "evictor 'selective' needs budget >= 2 (BOS is never evicted)"
        return None

    def score(self, cache):
        return cache.state[ACCUMULATED_STATE]

    def protected(self, cache):
        return cache.positions == 1

    def kernel_rule(self, budget):
        return KernelRule("selective", (1,), ACCUMULATED_STATE)  # OPT0 1: position 1 is never the victim


class H2OOptions(EvictorOptions):
    recent: int | None = Field(None, ge=0, description="most recent tokens always kept; default budget // 2")


class H2O(Evictor):
    """Heavy-Hitter Oracle: keep a window of recent tokens plus the tokens with the most attention accumulated
    over all queries so far, per key/value head (summed over its query heads; kept per batch row)."""

    independent_scores = True
    kind = "h2o"
    Options = H2OOptions
    summary = "keep recent window + highest accumulated attention, per head"
    per_head = True
    evict_after_attention = True
    state_names = ("attention",)
    needs_probabilities = True

    def recent(self, budget: int) -> int:
        return self.options.recent if self.options.recent is not None else budget // 2

    def check_budget(self, budget):
        if budget is not None and self.recent(budget) >= budget:
            return f"h2o.recent ({self.recent(budget)}) must be smaller than the budget ({budget})"
        return None

    def update(self, cache, probs):
        b, h, _, m = probs.shape
        hkv = cache.keys.shape[1]
        per_query_head = probs.detach().sum(dim=2)
        cache.state["attention"] += per_query_head.reshape(b, hkv, h // hkv, m).sum(dim=2)

    largest = False

    def score(self, cache):
        return cache.state["attention"]

    def protected(self, cache):
        newest = cache.positions.amax(-1, keepdim=True)
        return cache.positions > newest - self.recent(cache.budget)

    def kernel_rule(self, budget):
        return KernelRule("scoring", (0, self.recent(budget)), "attention", spare=1)  # OPT1: the recent window


class TOVA(Evictor):
    """Token Omission Via Attention: drop the token the current query attends to least, averaged over heads;
    one kept set per layer; no accumulation."""

    independent_scores = True
    kind = "tova"
    summary = "drop the lowest current-query attention (mean over heads)"
    evict_after_attention = True
    state_names = ("last_attention",)
    needs_probabilities = True
    probability_rows = 1  # the step's last query

    def update(self, cache, probs):
        mean = probs[:, :, -1].detach().mean(dim=1)
        cache.state["last_attention"] = mean.unsqueeze(1).expand_as(cache.positions).clone()

    largest = False

    def score(self, cache):
        return cache.state["last_attention"]

    def kernel_rule(self, budget):
        return KernelRule("scoring", (1,), "last_attention", spare=1)  # OPT0 1: TOVA's update, nothing protected


class SinkWindowOptions(EvictorOptions):
    sink: int = Field(4, ge=0, description="first tokens always kept (attention sinks)")


class SinkWindow(Evictor):
    """StreamingLLM: keep the first ``sink`` tokens and the most recent ``budget - sink``."""

    independent_scores = True
    kind = "sink_window"
    Options = SinkWindowOptions
    summary = "keep the first `sink` tokens + a recent window"

    def check_budget(self, budget):
        if budget is not None and budget <= self.options.sink:
            return f"sink_window.sink ({self.options.sink}) must be smaller than the budget ({budget})"
        return None

    largest = False

    def score(self, cache):
        return cache.positions.to(torch.float64)

    def protected(self, cache):
        return cache.positions <= self.options.sink

    def kernel_rule(self, budget):
        return KernelRule("sink_window", (self.options.sink,))


BUILTIN_EVICTORS = (Selective, H2O, TOVA, SinkWindow, *SCORER_EVICTORS)


@hookimpl
def register_evictors(register):
    for cls in BUILTIN_EVICTORS:
        register(cls)

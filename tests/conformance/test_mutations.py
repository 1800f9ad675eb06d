"""The mutation catalogue: bugs planted one at a time, each of which the conformance suite must catch, in float32
as well as float64 (docs/conformance.md). A mutation is a backend, transform or evictor that differs from the
correct one in exactly one way a real implementation could get wrong."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from broken import registry_replacing, registry_with_broken_backends

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.backends.reference import ReferenceBackend
from attnzoo.conformance import runner
from attnzoo.evictors.base import pick
from attnzoo.evictors.builtin import H2O, Selective, SinkWindow
from attnzoo.registry import new_registry
from attnzoo.transforms.logits import Softcap
from attnzoo.transforms.lowering import TritonLogits, tanh
from attnzoo.transforms.masks import SlidingWindow

DTYPES = (torch.float64, torch.float32)


class _PlanWith:
    """The plan with some methods replaced (a backend that computes one piece differently)."""

    def __init__(self, plan, **overrides):
        self._plan = plan
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._plan, name)


# -- backends ---------------------------------------------------------------------------------------------------
class CausalityLeak(ReferenceBackend):
    """Each query also sees the next key."""

    name = "mut_causality_leak"

    def attend(self, plan, q, k, v, qpos, kpos, params, key_mask=None, carry=None):
        def allowed(ctx, mask):
            return plan.composition.allowed(dataclasses.replace(ctx, qpos=ctx.qpos + 1), mask)

        return super().attend(_PlanWith(plan, allowed=allowed), q, k, v, qpos, kpos, params, key_mask, carry)


class BatchPooling(ReferenceBackend):
    """Keys are averaged over the batch (rows leak into each other)."""

    name = "mut_batch_pooling"

    def attend(self, plan, q, k, v, qpos, kpos, params, key_mask=None, carry=None):
        return super().attend(plan, q, k.mean(0, keepdim=True).expand_as(k), v, qpos, kpos, params, key_mask, carry)


class NanAtOneToken(ReferenceBackend):
    """A kernel whose row normalisation divides by N - 1: NaN for a single token."""

    name = "mut_nan_n1"

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        result = super().forward(plan, q, k, v, params, positions, key_mask, return_accumulated)
        if q.shape[2] == 1:
            out = (result[0] if return_accumulated else result) * float("nan")
            return (out, result[1]) if return_accumulated else out
        return result


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.1


class GradientTenPercentOff(BlockedBackend):
    """The blocked backend with the gradient of q 10% too large."""

    def __init__(self):
        super().__init__(name="mut_grad_off")

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        return super().forward(plan, _ScaleGrad.apply(q), k, v, params, positions, key_mask, return_accumulated)


class WrongSelection(ReferenceBackend):
    """``return_accumulated`` returns F including each query's own row (the outputs are right)."""

    name = "mut_wrong_selection"

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        if not return_accumulated:
            return super().forward(plan, q, k, v, params, positions, key_mask)
        out, f = super().forward(plan, q, k, v, params, positions, key_mask, True)
        return out, (torch.nn.functional.pad(f[:, 1:], (0, 0, 0, 1)) if f is not None else None)


class HalfPrecisionF(ReferenceBackend):
    """Accumulates F in float16."""

    name = "mut_half_f"

    def accumulate(self, selection):
        return super().accumulate(selection.to(torch.float16)).to(selection.dtype)


MUTANT_BACKENDS = (CausalityLeak, BatchPooling, NanAtOneToken, GradientTenPercentOff, WrongSelection, HalfPrecisionF)


def registry_with_mutants():
    module = types.ModuleType("mutants")
    module.register_backends = attnzoo.hookimpl(lambda register: [register(cls()) for cls in MUTANT_BACKENDS])
    return new_registry(entry_points=False, extra_plugins=[("mutants", module)])


# -- transforms ---------------------------------------------------------------------------------------------------
class WindowDecodeOffByOne(SlidingWindow):
    """Decoding (one query past position 1) reads the query position one too far: the window loses its oldest
    key. (The same slip in ALiBi would be invisible: under a causal mask it shifts a whole row of logits.)"""

    def allowed(self, ctx):
        if ctx.qpos.shape[2] == 1 and bool((ctx.qpos > 1).all()):
            ctx = dataclasses.replace(ctx, qpos=ctx.qpos + 1)
        return super().allowed(ctx)


class SoftcapNanAtOneKey(Softcap):
    """Rescales by (Nk - 1) / (Nk - 1): 0/0 when a row has one key."""

    def apply(self, logits, ctx, params):
        keys = logits.shape[-1] - 1
        return super().apply(logits, ctx, params) * keys / keys


class SoftcapTritonGradientOff(Softcap):
    """The torch maths is right; the Triton lowering's derivative is 10% too large."""

    def triton(self):
        cap = float(self.options.cap)
        return TritonLogits(forward=f"{cap!r} * {tanh(f'{{x}} / {cap!r}')}",
                            derivative=f"1.1 * (1.0 - ({{y}} / {cap!r}) * ({{y}} / {cap!r}))")


# -- evictors -------------------------------------------------------------------------------------------------------
class EvictsSmallestF(Selective):
    """Evicts the smallest F instead of the largest (protection kept)."""

    def victim(self, cache):
        return pick(self.score(cache), ~self.protected(cache), cache.positions, largest=False)


class EvictsProtected(Selective):
    """Ranks by the largest F but ignores protection (BOS may go)."""

    def victim(self, cache):
        return pick(self.score(cache), torch.ones_like(self.protected(cache)), cache.positions, largest=True)


class ScoresFromOthers(Selective):
    """Ranks tokens by their distance from the mean position (a score that moves when a token goes) but still
    declares independent scores, so the cache's all-at-once eviction would keep other tokens."""

    independent_scores = True

    def score(self, cache):
        positions = cache.positions.to(torch.float64)
        return (positions - positions.mean(-1, keepdim=True)).abs()


class NeedsBudgetOverEight(H2O):
    """A SnapKV-like evictor: a window of the 8 most recent tokens is always kept, so it refuses budgets up to 8
    (every budget the suite used to craft caches at). Correct in itself: the suite must still check it."""

    def check_budget(self, budget):
        return None if budget is None or budget > 8 else f"needs budget > 8 (got {budget})"

    def protected(self, cache):
        return cache.positions > cache.positions.amax(-1, keepdim=True) - 8


class WrongVictimOverEight(NeedsBudgetOverEight):
    """Its victim() evicts the largest accumulated attention where its declared rule (``largest = False``) names
    the smallest."""

    def victim(self, cache):
        return pick(self.score(cache), ~self.protected(cache), cache.positions, largest=True)


class ProtectsOneTooMany(NeedsBudgetOverEight):
    """Keeps BOS and nine recent tokens where check_budget allows a budget of nine: at its smallest budget every
    token of a full cache is protected, and the budget cannot be kept."""

    def protected(self, cache):
        return (cache.positions > cache.positions.amax(-1, keepdim=True) - 9) | (cache.positions == 1)


class SinkForgetsBOS(SinkWindow):
    """Protects positions 2..sink and lets BOS go: consistent with its own protected(), so only the spec's
    ``sink`` (positions 1..sink are never evicted) shows the bug."""

    def protected(self, cache):
        return (cache.positions <= self.options.sink) & (cache.positions > 1)


class SelectiveForgetsBOS(Selective):
    """Ranks BOS first (as an evictor that scores by key norm or age might) and protects nothing: its rule is
    followed, but the spec's selective_mask sets protect_bos, so BOS must stay."""

    def score(self, cache):
        return super().score(cache) + (cache.positions == 1).to(torch.float32) * 1e6

    def protected(self, cache):
        return torch.zeros_like(cache.positions, dtype=torch.bool)


def caught(registry, spec: str, backend: str, dtype: torch.dtype) -> list[runner.Result]:
    """Run the suite's cases for one spec, backend and dtype until the first failure; return the failures."""
    for case in runner.build_cases(registry, [spec], [backend], (dtype,)):
        result = runner.run_case(case)
        if result.status == "fail":
            return [result]
    return []


BACKEND_MUTANTS = [
    ("mut_causality_leak", "vanilla"),
    ("mut_batch_pooling", "alibi"),
    ("mut_nan_n1", "ssa"),
    ("mut_grad_off", "selective"),
    ("mut_wrong_selection", "selective-ssa"),
    ("mut_half_f", "selective"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend, spec", BACKEND_MUTANTS, ids=[m[0] for m in BACKEND_MUTANTS])
def test_planted_backend_bug_is_caught(backend, spec, dtype):
    assert caught(registry_with_mutants(), spec, backend, dtype), f"{backend} passed the suite in {dtype}"


TRANSFORM_MUTANTS = [
    ("sliding_window", WindowDecodeOffByOne, "local", "transforms", "decode", "prefill + decode"),
    ("softcap", SoftcapNanAtOneKey, "softcap", "transforms", "outputs/n1", "transform 'softcap'"),
    ("selective", EvictsSmallestF, "selective-pruned", "evictors", "evictor", "declared rule"),
    ("selective", EvictsProtected, "selective-pruned", "evictors", "evictor", "protected"),
    ("selective", ScoresFromOthers, "selective-pruned", "evictors", "evictor", "independent_scores"),
    ("h2o", WrongVictimOverEight, "h2o", "evictors", "evictor", "budget 9: evicted position"),
    ("h2o", ProtectsOneTooMany, "h2o", "evictors", "evictor", "budget 9: every one of 10 tokens is protected"),
    ("sink_window", SinkForgetsBOS, "streaming", "evictors", "evictor", "but cache.sink is 4"),
    ("selective", SelectiveForgetsBOS, "selective-pruned", "evictors", "evictor", "sets protect_bos"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, mutant, spec, category, check, message", TRANSFORM_MUTANTS,
                         ids=[m[1].__name__ for m in TRANSFORM_MUTANTS])
def test_planted_transform_or_evictor_bug_is_caught(name, mutant, spec, category, check, message, dtype):
    """A plugin's own transform or evictor, run on the reference backend (its bug is shared by every backend).
    The check that is meant for it catches it and says what it is (plugin specs have no stored vectors)."""
    reg = registry_replacing(name, mutant, category)
    assert caught(reg, spec, "reference", dtype), f"{mutant.__name__} passed the suite in {dtype}"
    case = next(c for c in runner.build_cases(reg, [spec], ["reference"], (dtype,)) if c.check == check)
    result = runner.run_case(case)
    assert result.status == "fail" and message in result.message, result


PADDING_MUTANTS = [
    ("h2o", "after the prompt's first chunk: batch row 0 (behind 1 padding tokens): score 'attention'"),
    ("tova", "batch row 0 (behind 1 padding tokens): score 'last_attention'"),
    ("selective-pruned", "batch row 0 (behind 1 padding tokens): score 'accumulated'"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec, message", PADDING_MUTANTS, ids=[m[0] for m in PADDING_MUTANTS])
def test_padding_queries_handed_to_the_evictor_are_caught(spec, message, dtype):
    """Issue 51: a backend whose padding queries' attention reaches the evictor (H2O: each padding query's row goes
    to the first real token's score; TOVA: a padding token decoded sets the scores) or whose padding queries'
    selections reach F fails ``padded-decode``, naming the row, the step and the score; the same spec passes it on
    the reference."""
    reg = registry_with_broken_backends()
    case = next(c for c in runner.build_cases(reg, [spec], ["broken_padding_queries_scored"], (dtype,))
                if c.check == "padded-decode")
    result = runner.run_case(case)
    assert result.status == "fail" and message in result.message, result
    fixed = next(c for c in runner.build_cases(reg, [spec], ["reference"], (dtype,)) if c.check == "padded-decode")
    assert runner.run_case(fixed).status == "pass"


def test_planted_triton_gradient_bug_is_caught():
    """The Triton lowering's derivative 10% off: caught by the gradients check in the interpreter (float32 only:
    the Triton backend declines float64)."""
    reg = registry_replacing("softcap", SoftcapTritonGradientOff)
    cases = [c for c in runner.build_cases(reg, ["softcap"], ["triton"], (torch.float32,))
             if c.check == "gradients/gqa-n63"]
    result = runner.run_case(cases[0])
    assert result.status == "fail" and "gradients gqa-n63: grad." in result.message, result


def test_an_evictor_that_refuses_small_budgets_is_still_checked():
    """Its crafted caches are built at the budgets it accepts (9, and about six above), and it passes."""
    reg = registry_replacing("h2o", NeedsBudgetOverEight, "evictors")
    from attnzoo.conformance import eviction
    from attnzoo.plan import Plan

    spec = reg.specs["h2o"]
    assert eviction.budgets_for(lambda: Plan.from_spec(spec, reg).evictor_cls(spec.cache), False) == [9, 15]
    case = next(c for c in runner.build_cases(reg, ["h2o"], ["reference"], (torch.float64,)) if c.check == "evictor")
    assert runner.run_case(case).status == "pass"


class RefusesEveryBudget(Selective):
    def check_budget(self, budget):
        return None if budget is None or budget > 100 else "needs budget > 100"


def test_an_evictor_check_that_cannot_run_is_never_a_pass():
    """No budget to check at: the evictor check fails with "not run, because ..." (an AssertionError, which the
    runner reports as a fail), never a pass."""
    from attnzoo.conformance import eviction
    from attnzoo.evictors.base import EvictorOptions

    with pytest.raises(AssertionError, match="not run, because check_budget refuses every budget from 1 to 64"):
        eviction.budgets_for(lambda: RefusesEveryBudget(EvictorOptions(evictor="selective")), True)

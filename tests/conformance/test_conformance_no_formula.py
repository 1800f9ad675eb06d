"""Plugin bugs the conformance suite catches although it knows no formula (issue 54, item 3): each planted in an
outside plugin's transform or evictor, each caught by the check meant for it with one line that names the
transform (or evictor), the parameter, and the batch row and head where they matter; the same plugin without the
bug passes that check."""

from __future__ import annotations

import re
import types

import pytest
import torch
from map_plugins import ReluMean  # examples/map_plugins.py: ReLU attention over the keys a query sees
from pydantic import Field

import attnzoo
from attnzoo.conformance import eviction, runner
from attnzoo.registry import new_registry

DTYPES = (torch.float64, torch.float32)


def registry_with(tmp_path, spec: str, transforms=(), evictors=()):
    """A registry with an outside plugin 'outside': its transforms and evictors, and the spec 'mine' (YAML)."""
    path = tmp_path / "mine.yaml"
    path.write_text(spec)
    module = types.ModuleType("outside")
    module.register_specs = attnzoo.hookimpl(lambda register: register(path))
    if transforms:
        module.register_transforms = attnzoo.hookimpl(lambda register: [register(t) for t in transforms])
    if evictors:
        module.register_evictors = attnzoo.hookimpl(lambda register: [register(e) for e in evictors])
    reg = new_registry(entry_points=False, extra_plugins=[("outside", module)])
    reg.check_pending()
    return reg


def run(reg, check: str, dtypes=DTYPES, backend: str = "reference") -> list[runner.Result]:
    return runner.run_suite(runner.build_cases(reg, ["mine"], [backend], dtypes, shapes=[check]))


# -- a learnable parameter no gradient reaches -------------------------------------------------------------------
class SSMax(attnzoo.RowScaleTransform):
    """Scalable softmax (Nakanishi 2025): q_i *= s_h ln(i), s learnable per head."""

    kind = "ssmax"
    slot = attnzoo.Slot.QUERY

    def parameters(self):
        return [attnzoo.ParamSpec("s", ("H",), 1.0)]

    def scale(self, rows, positions, params):
        return params["s"].view(1, -1, 1) * torch.log(positions.to(rows.dtype) + 1)


class SSMaxDetached(SSMax):
    """The planted bug: s is detached, so no gradient reaches it (the outputs are right, every backend agrees)."""

    kind = "ssmax_detached"

    def scale(self, rows, positions, params):
        return params["s"].detach().view(1, -1, 1) * torch.log(positions.to(rows.dtype) + 1)


class GateDetachedBias(attnzoo.RowScaleTransform):
    """An output gate 2 sigmoid(w . out + b_h) whose per-head bias is taken as a number (outside autograd) for one
    head only: its gradient is missing for head 1 alone."""

    kind = "gate_detached_bias"
    slot = attnzoo.Slot.OUTPUT

    def parameters(self):
        return [attnzoo.ParamSpec("w", ("D",), 0.0), attnzoo.ParamSpec("b", ("H",), 0.0)]

    def scale(self, rows, positions, params):
        b = params["b"]
        bias = torch.stack([b[h] if h != 1 else b[h].detach() for h in range(b.shape[0])])
        return 2 * torch.sigmoid(rows @ params["w"] + bias.view(1, -1, 1))


@pytest.mark.parametrize("kind, message", [
    ("ssmax", None),
    ("ssmax_detached", "finite differences (float64, the reference): transform 'ssmax_detached' parameter 's', "
                       "element (0,): autograd gives 0 where central differences of the outputs give "),
    ("gate_detached_bias", "transform 'gate_detached_bias' parameter 'b', element (1,): autograd gives"),
])
def test_a_parameter_no_gradient_reaches_is_caught_by_finite_differences(tmp_path, kind, message):
    reg = registry_with(tmp_path, f"name: mine\ntransforms: [{{kind: {kind}}}]\n",
                        transforms=[SSMax, SSMaxDetached, GateDetachedBias])
    results = run(reg, "finite-differences", (torch.float64,))
    if message is None:
        assert [r.status for r in results] == ["pass"], runner.failure_lines(results)
        return
    assert [r.status for r in results] == ["fail"]
    assert message in results[0].message and "\n" not in results[0].message, results[0].message
    # every backend agrees with the reference's (wrong) gradients: only finite differences see it
    grads = run(reg, "gradients/n1", (torch.float64,), backend="blocked")
    assert [r.status for r in grads] == ["pass"], runner.failure_lines(grads)


def test_finite_differences_name_the_batch_row_and_head_of_a_token_input(tmp_path):
    """A value-slot scale whose gradient is lost for batch row 1, key/value head 0 of v only."""

    class ValueGainLostInRowOne(attnzoo.RowScaleTransform):
        kind = "value_gain_lost"
        slot = attnzoo.Slot.VALUE

        def scale(self, rows, positions, params):
            t = 1 + rows.sum(-1).tanh() * 0.5
            lost = torch.zeros_like(t, dtype=torch.bool)
            lost[1, 0] = True
            return torch.where(lost, t.detach(), t)

    reg = registry_with(tmp_path, "name: mine\ntransforms: [{kind: value_gain_lost}]\n",
                        transforms=[ValueGainLostInRowOne])
    (result,) = run(reg, "finite-differences", (torch.float64,))
    assert result.status == "fail" and "v, batch row 1, key/value head 0: autograd gives" in result.message, result


# -- a probability map's weights --------------------------------------------------------------------------------
class SigmoidMap(attnzoo.ProbabilityTransform):
    """w = sigmoid(l) on the allowed pairs, 0 elsewhere."""

    kind = "sigmoid_map"
    slot = attnzoo.Slot.PROBABILITY

    def weights(self, logits, allowed, ctx, params):
        allowed = allowed.expand_as(logits)
        return torch.where(allowed, torch.sigmoid(torch.where(allowed, logits, 0.0)), 0.0)


class WideWeights(SigmoidMap):
    """The planted bug: weights computed and returned in float64 whatever the logits' dtype."""

    kind = "wide_weights"

    def weights(self, logits, allowed, ctx, params):
        return super().weights(logits.double(), allowed, ctx, params)


class AlmostZero(SigmoidMap):
    """The planted bug: 1e-9 instead of 0 at the pairs that are not allowed (the outputs move by about 1e-9)."""

    kind = "almost_zero"

    def weights(self, logits, allowed, ctx, params):
        return torch.where(allowed.expand_as(logits), super().weights(logits, allowed, ctx, params), 1e-9)


class NormalisedMap(SigmoidMap):
    """A map that declares its rows normalised: sigmoid weights divided by their row's sum."""

    kind = "normalised_map"
    normalised = True

    def weights(self, logits, allowed, ctx, params):
        w = super().weights(logits, allowed, ctx, params)
        return w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)


class NotQuiteNormalised(NormalisedMap):
    """The planted bug: declares normalised rows, but each row sums to 1 - 1e-3."""

    kind = "not_quite_normalised"

    def weights(self, logits, allowed, ctx, params):
        return super().weights(logits, allowed, ctx, params) * (1 - 1e-3)


MAPS = [SigmoidMap, WideWeights, AlmostZero, NormalisedMap, NotQuiteNormalised]


@pytest.mark.parametrize("kind, pattern, dtypes", [
    ("sigmoid_map", None, DTYPES),
    ("normalised_map", None, DTYPES),
    ("wide_weights", r"^transform 'wide_weights' \(probability\): weights\(\) returned float64 weights for float32 "
                     r"logits: return the logits' dtype", (torch.float32,)),
    ("almost_zero", r"^transform 'almost_zero' \(probability\): weights\(\) gives 1e-09 at a pair that is not "
                    r"allowed \(batch row \d, head \d, query position \d+, key position \d+; \d+ such pairs, in "
                    r"float(32|64)\): it must be exactly 0 there$", DTYPES),
    ("not_quite_normalised", r"^transform 'not_quite_normalised' \(probability\): a row of weights sums to 0\.999, "
                             r"not 1 \(off by -0\.001; batch row \d, head \d, query position \d+, in "
                             r"float(32|64)\), but the map declares its rows normalised \(normalised = True\)$",
     DTYPES),
])
def test_a_maps_weights_are_read_directly(tmp_path, kind, pattern, dtypes):
    reg = registry_with(tmp_path, f"name: mine\ntransforms: [{{kind: {kind}}}]\n", transforms=MAPS)
    results = run(reg, "weights")
    if pattern is None:
        assert [r.status for r in results] == ["pass", "pass"], runner.failure_lines(results)
        return
    for r in results:
        if r.dtype in [str(d).removeprefix("torch.") for d in dtypes]:
            assert r.status == "fail" and re.search(pattern, r.message), r
        else:
            assert r.status == "pass", r
    # the outputs agree with the float64 reference within the tolerance: only reading the weights shows the bug
    if kind in ("wide_weights", "almost_zero"):
        outputs = run(reg, "outputs/masked-rows-n33", (torch.float32,))
        assert [r.status for r in outputs] == ["pass"], runner.failure_lines(outputs)


def test_the_shipped_maps_pass_the_weights_check():
    results = runner.run_suite(runner.build_cases(attnzoo.get_registry(), ["sigmoid", "softpick", "stick-breaking",
                                                                          "diff"], ["reference"], DTYPES,
                                                  shapes=["weights"]))
    assert results and all(r.status == "pass" for r in results), runner.failure_lines(results)


# -- a probability map's blocked form ---------------------------------------------------------------------------
class MeanReluLastBlock(ReluMean):
    """The planted bug: update() keeps only the last key block's sums (= in place of +=); right for one key block."""

    kind = "mean_relu_last_block"

    def update(self, state, logits, allowed, values, ctx, params):
        allowed = allowed.expand_as(logits)
        return {"sum": torch.where(allowed, torch.relu(logits), 0.0) @ values,
                "count": allowed.sum(-1, keepdim=True)}


@pytest.mark.parametrize("kind", ["relu_mean", "mean_relu_last_block"])
def test_a_maps_blocked_form_is_checked_over_several_key_blocks(tmp_path, kind):
    """The blocked backend runs a map's weights while the visible keys fit one block of its size (256): the
    differential checks at the quick sizes never merge two key blocks, map-blocks does (blocks of 4)."""
    reg = registry_with(tmp_path, f"name: mine\ntransforms: [{{kind: {kind}}}]\n",
                        transforms=[ReluMean, MeanReluLastBlock])
    results = run(reg, "map-blocks", backend="blocked")
    if kind == "relu_mean":
        assert [r.status for r in results] == ["pass", "pass"], runner.failure_lines(results)
        return
    assert [r.status for r in results] == ["fail", "fail"], results
    assert all("map-blocks map-blocks-n21 (blocks of 4 keys): out" in r.message for r in results), results
    # the quick profile's differential shapes alone pass it: the bug needs two key blocks
    outputs = run(reg, "outputs/masked-rows-n33", (torch.float64,), backend="blocked")
    assert [r.status for r in outputs] == ["pass"], runner.failure_lines(outputs)


def test_a_map_without_a_blocked_form_is_not_checked_by_map_blocks(tmp_path):
    reg = registry_with(tmp_path, "name: mine\ntransforms: [{kind: sigmoid_map}]\n", transforms=[SigmoidMap])
    results = run(reg, "map-blocks", (torch.float64,))
    assert [r.status for r in results] == ["unsupported"] and "blocked backend declines" in results[0].message, \
        results


def test_the_shipped_maps_pass_the_map_blocks_check():
    results = runner.run_suite(runner.build_cases(attnzoo.get_registry(), ["sigmoid", "softpick", "stick-breaking",
                                                                          "diff"], ["reference"], DTYPES,
                                                  shapes=["map-blocks"]))
    assert results and all(r.status == "pass" for r in results), runner.failure_lines(results)


# -- evictors: tied keys, score shapes, independent scores ----------------------------------------------------------
class SinkOptions(attnzoo.EvictorOptions):
    sink: int = Field(1, ge=0)


class KNormSinkByScore(attnzoo.Evictor):
    """KNorm (evict the largest key norm) that keeps its sinks by giving them the smallest norm of their row rather
    than declaring them protected: right whenever norms differ, wrong when every key has the same norm (the sink
    ties with every other token, and ties go to the oldest)."""

    kind = "knorm_sink_by_score"
    Options = SinkOptions
    per_head = True
    largest = True
    independent_scores = True

    def check_budget(self, budget):
        return None if budget is None or budget > self.options.sink else "budget must exceed sink"

    def score(self, cache):
        norm = cache.keys.float().norm(dim=-1)
        return torch.where(cache.positions <= self.options.sink, norm.amin(-1, keepdim=True), norm)


class KNorm(KNormSinkByScore):
    """The same rule, written right: the sinks are protected."""

    kind = "knorm_plugin"

    def score(self, cache):
        return cache.keys.float().norm(dim=-1)

    def protected(self, cache):
        return cache.positions <= self.options.sink


class KNormTiesToNewest(KNorm):
    """A victim() of its own (for speed) that breaks ties to the newest token, where the declared rule says oldest."""

    kind = "knorm_ties_to_newest"

    def victim(self, cache):
        masked = self.score(cache).masked_fill(self.protected(cache), float("-inf"))
        m = masked.shape[-1]
        return (m - 1) - masked.flip(-1).argmax(-1)


class KNormWithoutHeads(KNorm):
    """The planted bug: the score is averaged over the key/value heads, (B, M) instead of (B, H_kv, M)."""

    kind = "knorm_without_heads"
    per_head = False

    def score(self, cache):
        return cache.keys.float().norm(dim=-1).mean(1)


EVICTORS = [KNormSinkByScore, KNorm, KNormTiesToNewest, KNormWithoutHeads]


def knorm_registry(tmp_path, evictor: str):
    return registry_with(tmp_path, f"name: mine\ntransforms: []\ncache: {{evictor: {evictor}, budget: 16, sink: 1}}\n",
                         evictors=EVICTORS)


@pytest.mark.parametrize("evictor, pattern", [
    ("knorm_plugin", None),
    ("knorm_sink_by_score", r"^evictor 'knorm_sink_by_score': budget \d+, (equal-norms|identical) keys: evicted "
                            r"position 1 \(batch row 0, key/value head 0\), but cache.sink is 1: the spec says "
                            r"positions 1..1 are never evicted"),
    ("knorm_ties_to_newest", r"^evictor 'knorm_ties_to_newest': budget \d+, [a-z-]+ keys: evicted position \d+ "
                             r"\(score [\d.]+\) in batch row \d, key/value head \d, but its declared rule \(largest "
                             r"score among unprotected, ties to the oldest\) names position \d+"),
])
def test_an_evictor_is_checked_on_tied_keys(tmp_path, evictor, pattern, monkeypatch):
    reg = knorm_registry(tmp_path, evictor)
    results = run(reg, "evictor")
    if pattern is None:
        assert [r.status for r in results] == ["pass", "pass"], runner.failure_lines(results)
        return
    for r in results:
        assert r.status == "fail" and re.search(pattern, r.message) and "\n" not in r.message, r.message
    # with random keys alone (what the suite crafted before), nothing ties and the bug passes
    monkeypatch.setattr(eviction, "KEY_MODES", ("random",))
    monkeypatch.setattr(eviction, "crafted_budgets", lambda factory, derived: derived)
    from attnzoo.conformance import checks_decode

    monkeypatch.setattr(checks_decode, "_tied_keys", lambda inputs, mode, gen: inputs)
    assert [r.status for r in run(reg, "evictor")] == ["pass", "pass"]


def test_a_tied_key_decode_catches_a_sink_evicted_in_update(tmp_path):
    """A KeyDiff-like evictor whose similarities are computed in update(): the crafted caches' own states do not tie,
    but decoding keys that are all the same vector does (every similarity is 1, the oldest goes: the sink)."""

    class KeyDiffSinkByScore(KNormSinkByScore):
        kind = "keydiff_sink_by_score"
        state_names = ("similarity",)
        evict_after_attention = True

        def update(self, cache, probs):
            unit = torch.nn.functional.normalize(cache.keys.float(), dim=-1)
            anchor = torch.nn.functional.normalize(unit.sum(2, keepdim=True), dim=-1)
            cache.state["similarity"] = (unit * anchor).sum(-1)

        def score(self, cache):
            s = cache.state["similarity"]
            return torch.where(cache.positions <= self.options.sink, s.amin(-1, keepdim=True), s)

    reg = registry_with(tmp_path, "name: mine\ntransforms: []\ncache: {evictor: keydiff_sink_by_score, budget: 16, "
                                  "sink: 1}\n", evictors=[KeyDiffSinkByScore])
    for r in run(reg, "evictor"):
        assert r.status == "fail" and re.search(r"^evictor 'keydiff_sink_by_score': budget \d+, [a-z-]+ keys: "
                                                r"evicted position 1 \(batch row 0, key/value head \d\), but cache."
                                                r"sink is 1", r.message), r.message


def test_a_score_without_the_head_axis_is_refused_at_first_use(tmp_path):
    reg = knorm_registry(tmp_path, "knorm_without_heads")
    variant = attnzoo.compile("mine", backend="reference", registry=reg)
    for batch in (1, 2):  # (B, M) broadcasts against (B, H_kv, M) for B = 1 and B = H_kv = 2
        cache = variant.new_cache(batch=batch, budget=4)
        q, k, v = torch.randn(batch, 2, 6, 4), torch.randn(batch, 2, 6, 4), torch.randn(batch, 2, 6, 4)
        with pytest.raises(ValueError, match=rf"^evictor 'knorm_without_heads': score\(\) returned shape \({batch}, "
                                             rf"\d+\), expected the cache's \(B, H_kv, M\) = \({batch}, 2, \d+\)"):
            variant.prefill(q, k, v, cache)
        cache = variant.new_cache(batch=batch, budget=4)
        with pytest.raises(ValueError, match=r"score\(\) returned shape"):  # one token at a time: victim()
            for i in range(6):
                variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
    (result, _) = run(reg, "evictor")
    assert result.status == "fail" and re.search(r"^evictor 'knorm_without_heads': score\(\) returned shape "
                                                 r"\(2, \d+\), expected the cache's \(B, H_kv, M\) = \(2, 2, \d+\)",
                                                 result.message), result.message


class DependentInRowOne(KNorm):
    """Declares independent scores, but in batch row 1 a token's score is its distance from the mean position of
    the held tokens (which moves when a token goes); batch row 0 is scored by its key norms alone."""

    kind = "dependent_in_row_one"

    def score(self, cache):
        norm = cache.keys.float().norm(dim=-1)
        positions = cache.positions.to(torch.float32)
        spread = (positions - positions.mean(-1, keepdim=True)).abs()
        row = torch.arange(norm.shape[0]).view(-1, 1, 1)
        return torch.where(row == 1, spread, norm)


def test_a_false_independent_scores_names_the_row_and_head_that_differ(tmp_path):
    reg = registry_with(tmp_path, "name: mine\ntransforms: []\ncache: {evictor: dependent_in_row_one, budget: 16, "
                                  "sink: 1}\n", evictors=[DependentInRowOne])
    (result, _) = run(reg, "evictor")
    match = re.search(r"declares independent_scores, but choosing 3 victims at once \(budget \d+(, [a-z-]+ keys)?, "
                      r"down to \d+\) kept positions (\[[\d, ]+\]) in batch row 1, key/value head \d, where one at a "
                      r"time keeps (\[[\d, ]+\])", result.message)
    assert result.status == "fail" and match, result.message
    assert match.group(2) != match.group(3)


def test_a_decode_only_drift_names_the_batch_row_and_head(tmp_path):
    """A logits transform that adds 0.5 to the logit of the query's own key when it decodes one token at a time
    only: the failure line spells out the batch row, head and token of the worst element."""

    class SelfBonusWhenDecoding(attnzoo.LogitsTransform):
        kind = "self_bonus_decoding"
        slot = attnzoo.Slot.LOGITS

        def apply(self, logits, ctx, params):
            if logits.shape[-2] != 1:
                return logits
            return logits + 0.5 * (ctx.kpos == ctx.qpos).to(logits.dtype)

    reg = registry_with(tmp_path, "name: mine\ntransforms: [{kind: self_bonus_decoding}]\n",
                        transforms=[SelfBonusWhenDecoding])
    for r in run(reg, "decode"):
        assert r.status == "fail" and re.search(r"prefill \+ decode from position 1 vs batch: out: error .* at "
                                                r"\(\d, \d, \d+, \d\) \(batch row \d, head \d, token \d+, dim \d\)",
                                                r.message), r.message

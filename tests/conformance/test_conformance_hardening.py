"""Conformance on plugins' specs, transforms and backends (issue 40, round 3): decoding past eviction is compared with
the reference for any spec with an evictor (no stored vectors needed), a transform that makes a whole row of logits
-inf is named like one that gives NaN, and an exception raised in plugin code says where. The backend's fast decoding
step is held to the full path's Python rule (``fast-step``, issue 41)."""

from __future__ import annotations

import importlib.util
import json
import re
import types

import pytest
import torch

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.conformance import checks, checks_decode, frames, runner, trace
from attnzoo.decode.fast import SlotView
from attnzoo.evictors.base import KernelRule
from attnzoo.evictors.builtin import H2O
from attnzoo.registry import new_registry
from attnzoo.transforms.base import LogitsTransform, Slot

F64 = (torch.float64,)
DTYPES = (torch.float64, torch.float32)


# -- decoding past eviction -----------------------------------------------------------------------------------------
class TooLargeAfterEviction(BlockedBackend):
    """The blocked backend, with decode outputs 10% too large once its cache has evicted (prefill outputs right).
    No fast step (``decode_step``): every step goes through :meth:`attend_held`."""

    decode_step = None

    def __init__(self):
        super().__init__(name="late_scale")

    def attend_held(self, plan, step, cache, params, *, want_probs=False):
        held = super().attend_held(plan, step, cache, params, want_probs=want_probs)
        return held._replace(out=held.out * 1.1) if cache.evicted and step.queries.shape[2] == 1 else held


class ScoresTheWrongTokens(BlockedBackend):
    """The blocked backend, handing the evictor each query's attention probabilities reversed along the keys (the
    scores credited to the wrong tokens): every output is right, the kept positions are not. No fast step."""

    decode_step = None

    def __init__(self):
        super().__init__(name="wrong_scores")

    def blocks(self, *args, **kwargs):
        out, f, carry, probs = super().blocks(*args, **kwargs)
        return out, f, carry, (probs.flip(-1) if probs is not None else None)


def _plugin(tmp_path, cache: str, backends=(), transforms=()):
    """A registry with a plugin's spec 'mine' (no stored vectors) and the given backends and transforms."""
    path = tmp_path / "mine.yaml"
    path.write_text(f"name: mine\ntransforms: [{{kind: selective_mask}}]\ncache: {cache}\n" if "selective" in cache
                    else f"name: mine\ntransforms: []\ncache: {cache}\n")
    module = types.ModuleType("mine")
    module.register_specs = attnzoo.hookimpl(lambda register: register(path))
    if backends:
        module.register_backends = attnzoo.hookimpl(lambda register: [register(b()) for b in backends])
    if transforms:
        module.register_transforms = attnzoo.hookimpl(lambda register: [register(t) for t in transforms])
    return new_registry(entry_points=False, extra_plugins=[("mine", module)])


def test_a_backend_wrong_after_eviction_fails_on_a_plugin_spec(tmp_path):
    """Seen: decode outputs 10% too large once the cache has evicted passed `--quick` on a plugin's spec (only the
    stored vectors, which plugin specs lack, decoded past eviction). Now the quick run fails, on the two checks that
    decode past eviction only (``evicted-decode``, and ``padded-decode``, whose rows alone are the reference's),
    naming the check, the spec, the budget and the step."""
    reg = _plugin(tmp_path, "{evictor: selective, budget: 16}", [TooLargeAfterEviction])
    cases = runner.build_cases(reg, ["mine"], ["late_scale"], F64, profile="quick", skip=["packed/*"])
    assert not [c for c in cases if c.check.startswith("vectors/")]
    results = runner.run_suite(cases)
    failed = [r for r in results if r.status == "fail"]
    assert [r.id for r in failed] == ["late_scale::mine::evicted-decode[float64]",
                                      "late_scale::mine::padded-decode[float64]"], runner.failure_lines(results)
    message = failed[0].message
    assert re.search(r"decode past eviction \(spec 'mine', budget \d+, prefill \d+ of \d+ tokens\): step \d+ "
                     r"\(the token at position \d+\), \d+ tokens? evicted so far: out: error", message), message
    assert "\n" not in message
    # float32 too
    f32 = runner.run_suite(runner.build_cases(reg, ["mine"], ["late_scale"], (torch.float32,),
                                              shapes=["evicted-decode"]))
    assert [r.status for r in f32] == ["fail"] and "decode past eviction (spec 'mine'" in f32[0].message


def test_wrong_kept_positions_fail_with_right_outputs(tmp_path):
    reg = _plugin(tmp_path, "{evictor: h2o, budget: 16}", [ScoresTheWrongTokens])
    results = runner.run_suite(runner.build_cases(reg, ["mine"], ["wrong_scores"], DTYPES,
                                                  shapes=["evicted-decode"]))
    assert [r.status for r in results] == ["fail", "fail"]
    for r in results:
        assert re.search(r"decode past eviction \(spec 'mine', budget \d+, prefill \d+ of \d+ tokens\): after "
                         r".*: the cache keeps positions \[[\d, ]+\] \(batch row \d, key/value head \d\) where the "
                         r"reference keeps \[[\d, ]+\]", r.message), r.message
    # the outputs themselves are right: the differential checks pass
    outputs = runner.run_suite(runner.build_cases(reg, ["mine"], ["wrong_scores"], F64, shapes=["outputs/n1"]))
    assert [r.status for r in outputs] == ["pass"]


@pytest.mark.parametrize("cache", ["{evictor: selective, budget: 16}", "{evictor: h2o, budget: 16}",
                                   "{evictor: tova, budget: 16}", "{evictor: sink_window, budget: 16, sink: 2}"])
def test_correct_backends_pass_decoding_past_eviction(tmp_path, cache):
    reg = _plugin(tmp_path, cache)
    results = runner.run_suite(runner.build_cases(reg, ["mine"], ["reference", "blocked"], DTYPES,
                                                  shapes=["evicted-decode"]))
    assert [r.status for r in results] == ["pass"] * 4, runner.failure_lines(results)


def test_decode_past_eviction_runs_evict_many_times_at_small_sizes():
    runs = checks_decode.evicted_runs([2, 8])
    assert runs == [(2, 1, 13), (2, 5, 17), (8, 4, 20), (8, 11, 27)]
    assert all(prefill < budget or prefill > budget for budget, prefill, _ in runs)  # shorter and longer
    assert all(n - prefill >= max(checks_decode.EVICTED_STEPS, 2 * budget) for budget, prefill, n in runs)


def test_decode_past_eviction_is_in_the_quick_profile_and_not_for_specs_without_an_evictor():
    reg = attnzoo.get_registry()
    quick = [c.check for c in runner.build_cases(reg, ["selective-pruned"], ["reference"], DTYPES, profile="quick")]
    assert quick.count("evicted-decode") == 2
    half = runner.build_cases(reg, ["selective-pruned"], ["reference"], (torch.float16,), profile="quick")
    assert "evicted-decode" not in [c.check for c in half]
    results = runner.run_suite(runner.build_cases(reg, ["vanilla"], ["reference"], F64, shapes=["evicted-decode"]))
    assert [(r.status, r.message) for r in results] == [("unsupported", "spec has no cache evictor")]


# -- the fast decoding step against the Python rule (attnzoo.decode.check.check_fast_step) ---------------------------
def _fast_step(specs, backends, dtypes=DTYPES):
    cases = runner.build_cases(attnzoo.get_registry(), specs, backends, dtypes, shapes=["fast-step"])
    return runner.run_suite(cases)


def test_the_fast_step_check_passes_on_h2o(lean_kind):
    results = _fast_step(["h2o"], ["blocked"])
    assert [(r.id, r.status) for r in results] == [("blocked::h2o::fast-step[float64]", "pass"),
                                                   ("blocked::h2o::fast-step[float32]", "pass")], \
        runner.failure_lines(results)


def _victim_after_the_rules(rule):
    """H2O's victim as the fast (torch) step sees it (over a :class:`SlotView`): the slot after the one the Python
    rule names; the full path (over the cache itself) keeps the rule's."""
    return lambda self, cache: ((rule(self, cache) + 1) % cache.positions.shape[-1] if isinstance(cache, SlotView)
                                else rule(self, cache))


def test_the_suite_fails_on_a_fast_step_that_parts_from_the_python_rule(monkeypatch, lean_kind):
    """A difference planted in the fast step alone fails `fast-step`, naming the budget, the dtype, the step and the
    kind of fast step: in the C step, the options the evictor hands the kernel (H2O's recent window one larger, as
    in tests/decode/test_decode_fast_rule.py); in the torch step, the victim it evicts."""
    if lean_kind == "fused":
        monkeypatch.setattr(H2O, "kernel_rule",
                            lambda self, budget: KernelRule("scoring", (0, self.recent(budget) + 1), "attention", 1))
    else:
        monkeypatch.setattr(H2O, "victim", _victim_after_the_rules(H2O.victim))
    results = _fast_step(["h2o"], ["blocked"])
    assert [r.status for r in results] == ["fail", "fail"], [r.message for r in results]
    for r, dtype in zip(results, ("float64", "float32"), strict=True):
        assert re.search(rf"fast step against the full path \(budget \d+, {dtype}\): spec 'h2o', step \d+, fast "
                         rf"step '{lean_kind}': (keeps positions|outputs differ)", r.message), r.message


def test_the_fast_step_check_is_unsupported_where_no_fast_step_is_offered():
    """With the reason: a backend that offers no fast step at all (the reference), a spec the blocked backend's
    fast steps do not cover (selective-ssa: an evictor, but a row map beside the accumulator), and a backend that
    switches its fast step off (``decode_step = None``)."""
    results = _fast_step(["h2o", "selective-ssa"], ["reference", "blocked"], F64)
    assert {r.id: (r.status, r.message) for r in results} == {
        "reference::h2o::fast-step[float64]":
            ("unsupported", "backend 'reference' offers no fast decoding step (Backend.decode_step)"),
        "reference::selective-ssa::fast-step[float64]":
            ("unsupported", "backend 'reference' offers no fast decoding step (Backend.decode_step)"),
        "blocked::h2o::fast-step[float64]": ("pass", ""),
        "blocked::selective-ssa::fast-step[float64]":
            ("unsupported", "backend 'blocked' offers no fast decoding step for this spec in float64 at budgets 2, 8: "
                            "every step takes the full path")}
    assert not checks_decode.offers_fast_steps(TooLargeAfterEviction())
    assert "fast-step" not in [c.check for c in runner.build_cases(attnzoo.get_registry(), ["h2o"], ["blocked"],
                                                                   (torch.float16,))]


# -- non-finite culprits: -inf ----------------------------------------------------------------------------------------
class EveryLogitNegInf(LogitsTransform):
    """A plugin's logits transform that returns -inf everywhere (every row fully masked: softmax 0/0)."""

    kind = "neginf_test"
    slot = Slot.LOGITS

    def apply(self, logits, ctx, params):
        return torch.full_like(logits, float("-inf"))


class MasksKeyTwo(LogitsTransform):
    """A plugin's logits transform that masks key position 2 with -inf (legitimate: other keys stay finite)."""

    kind = "mask_two_test"
    slot = Slot.LOGITS

    def apply(self, logits, ctx, params):
        return torch.where(ctx.kpos == 2, torch.full_like(logits, float("-inf")), logits)


def _transform_registry(*transforms):
    module = types.ModuleType("culprit_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(t) for t in transforms])
    return new_registry(entry_points=False, extra_plugins=[("culprit_plugin", module)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_transform_making_rows_all_neg_inf_is_named(dtype):
    reg = _transform_registry(EveryLogitNegInf)
    spec = attnzoo.load_spec({"name": "ninf", "transforms": [{"kind": "neginf_test"}]}, registry=reg)
    target = checks.Target(spec, "blocked", dtype, reg)
    with pytest.raises(AssertionError) as err:
        checks.check_differential(target, checks.Shape("gqa-n9", 1, 4, 2, 9, 8), grad=False)
    message = str(err.value)
    assert ("transform 'neginf_test' (logits slot) gives -inf at every pair of a row the spec's masks allow "
            "(query position 1, batch row 0, head 0)") in message and "own maths, not the backend" in message
    assert "\n" not in message


def test_neg_inf_the_masks_explain_is_not_blamed():
    """-inf at some of a row's allowed pairs (a transform masking key 2) and a whole row of -inf under a normaliser
    (a sink keeps the row finite) are not a culprit; a row the key mask leaves without keys is not either."""
    reg = _transform_registry(EveryLogitNegInf, MasksKeyTwo)
    sink = {"kind": "attention_sink", "value": 0.0, "learnable": False}
    for transforms in ([{"kind": "mask_two_test"}], [{"kind": "neginf_test"}, sink]):
        spec = attnzoo.load_spec({"name": "t", "transforms": transforms}, registry=reg)
        target = checks.Target(spec, "reference", torch.float64, reg)
        for shape in (checks.Shape("n9", 2, 2, 1, 9, 8), checks.Shape("masked-rows-n9", 2, 2, 1, 9, 8, True)):
            inputs = checks.random_case(target, shape)
            blame = checks._trace(target, inputs, torch.float64)
            if shape.masked_rows and transforms[0]["kind"] == "mask_two_test":
                # the key mask leaves query 2 of row 1 only key 2, which the transform masks: that row is 0/0
                assert "'mask_two_test' (logits slot) gives -inf at every pair of a row" in blame, blame
            else:
                assert blame is None, (transforms, shape.id, blame)
    before = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    after = torch.full_like(before, float("-inf"))
    no_key = torch.tensor([[True, False, False], [False, False, False]]).view(1, 1, 2, 3)
    assert trace._emptied_row(before, after, no_key) == (0, 0, 0)  # the second row has no key: not blamed
    assert trace._emptied_row(before, after, torch.zeros_like(no_key)) is None


# -- where a plugin's exception was raised --------------------------------------------------------------------------
PLUGIN_SOURCE = '''\
import torch
from attnzoo.transforms.base import LogitsTransform, Slot


class Gates(LogitsTransform):
    kind = "gates_test"
    slot = Slot.LOGITS

    def apply(self, logits, ctx, params):
        return logits * self.gate(params)

    def gate(self, params):
        return params["gates"]


class Asserts(LogitsTransform):
    kind = "asserts_test"
    slot = Slot.LOGITS

    def apply(self, logits, ctx, params):
        assert logits.shape[-1] > 1000, "needs a long row"
        return logits
'''


def _plugin_module(tmp_path):
    path = tmp_path / "gates_plugin.py"
    path.write_text(PLUGIN_SOURCE)
    spec = importlib.util.spec_from_file_location("gates_plugin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_an_exception_in_plugin_code_names_its_file_and_line(tmp_path):
    module, path = _plugin_module(tmp_path)
    reg = _transform_registry(module.Gates, module.Asserts)
    for kind, line, error in (("gates_test", _line_of(path, 'params["gates"]'), "KeyError: 'gates'"),
                              ("asserts_test", _line_of(path, "assert logits"), "AssertionError: needs a long row")):
        spec = attnzoo.load_spec({"name": kind, "transforms": [{"kind": kind}]}, registry=reg)
        reg.specs[kind] = spec
        reg.origin[("specs", kind)] = "culprit_plugin"
        results = runner.run_suite(runner.build_cases(reg, [kind], ["blocked"], F64, shapes=["outputs/n1"]))
        assert [r.status for r in results] == ["fail"]
        message = results[0].message
        assert message.startswith(error) and f"gates_plugin.py:{line} in " in message, message
        assert "\n" not in message


def test_an_exception_raised_in_attnzoo_names_no_plugin_frame():
    """A logits transform returning the wrong shape: attnzoo raises, after the plugin's code returned."""

    class WrongShape(LogitsTransform):
        kind = "wrong_shape_test"
        slot = Slot.LOGITS

        def apply(self, logits, ctx, params):
            return logits[..., :1]

    reg = _transform_registry(WrongShape)
    reg.specs["ws"] = attnzoo.load_spec({"name": "ws", "transforms": [{"kind": "wrong_shape_test"}]}, registry=reg)
    reg.origin[("specs", "ws")] = "culprit_plugin"
    results = runner.run_suite(runner.build_cases(reg, ["ws"], ["reference"], F64,
                                                  shapes=["outputs/masked-rows-n33"]))
    assert results[0].status == "fail" and "must keep the shape" in results[0].message
    assert "raised at" not in results[0].message, results[0].message


def test_core_frames():
    import os

    assert frames.is_core(attnzoo.__file__) and frames.is_core(torch.__file__) and frames.is_core(json.__file__)
    assert frames.is_core("<frozen importlib._bootstrap>")
    assert not frames.is_core(__file__) and not frames.is_core(os.path.join("/tmp", "some_plugin", "x.py"))

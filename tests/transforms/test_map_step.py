"""A probability map's blocked form gets the step's context (``attnzoo.MapStep``: the number of keys each query sees
over all the key blocks, the query positions) in each of ``start``, ``update`` and ``finish`` that declares a
parameter ``step``; the others are called as before. SSMax (Nakanishi 2025: softmax(s ln(n) l), n the number of keys
the query sees) written in one pass that way equals a float64 formula written here, on the reference and on the
blocked backend at 4-key blocks, with GQA, odd sizes, a key mask, a window, offset positions, and behind a decode
cache that evicts (n is the number of keys the cache holds, not the query's position)."""

import math
import types

import pytest
import torch
from map_plugins import SSMax  # examples/map_plugins.py: the docs' one-pass SSMax

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.registry import new_registry

BLOCK = 4
BACKENDS = ["reference", "blocked4"]
NEG = float("-inf")


class ReluMeanByStep(attnzoo.ProbabilityTransform):
    """ReLU attention averaged over the keys a query sees: only ``finish`` reads the step (the count)."""

    kind = "relu_mean_step"
    slot = attnzoo.Slot.PROBABILITY
    seen: list = []

    def weights(self, logits, allowed, ctx, params):
        allowed = allowed.expand_as(logits)
        return torch.where(allowed, torch.relu(logits), 0.0) / allowed.sum(-1, keepdim=True).clamp_min(1)

    def start(self, out_shape, like):
        return {"sum": like.new_zeros(out_shape)}

    def update(self, state, logits, allowed, values, ctx, params):
        return {"sum": state["sum"] + torch.where(allowed, torch.relu(logits), 0.0) @ values}

    def finish(self, state, params, step):
        type(self).seen.append(step)
        return state["sum"] / step.visible.clamp_min(1).to(state["sum"].dtype)


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("step_maps")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(c) for c in (SSMax, ReluMeanByStep)])
    module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(BLOCK, "blocked4")))
    made = new_registry(entry_points=False, extra_plugins=[("step_maps", module)])
    assert not made.errors()
    return made


def spec_of(kind, *more, cache=None):
    spec = {"name": "stepped", "attention": {"causal": True}, "transforms": [{"kind": kind}, *more]}
    return {**spec, "cache": cache} if cache else spec


# -- by hand (float64) ------------------------------------------------------------------------------------------------
def inputs(b, h, hkv, n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, x, n, d, generator=gen, dtype=torch.float64).requires_grad_() for x in (h, hkv, hkv)]


def ssmax_by_hand(q, k, v, allowed, s):
    """softmax(s_h ln(n_i) q_i·k_j / sqrt(D)) over the allowed keys j of query i, n_i their number; a row with no
    key gives 0. ``allowed`` (B, 1, Nq, Nk); keys and values repeated to the query heads (GQA)."""
    group = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = allowed.sum(-1, keepdim=True).to(torch.float64)
    x = torch.where(allowed, s.view(1, -1, 1, 1) * torch.log(n.clamp_min(1)) * logits, NEG)
    w = torch.where(allowed, torch.softmax(torch.where(n > 0, x, 0.0), -1), 0.0)
    return w @ v.repeat_interleave(group, 1)


def allowed_by_hand(positions, key_mask=None, window=None):
    """(B, 1, Nq, Nk) from positions (B, N): causal by position, the key mask, a sliding window."""
    allowed = positions[:, None, None, :] <= positions[:, None, :, None]
    if window is not None:
        allowed = allowed & (positions[:, None, :, None] - positions[:, None, None, :] < window)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed


def weighted_grads(out, tensors, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


# -- the batch form ----------------------------------------------------------------------------------------------
CASES = {
    "gqa-n13": dict(b=2, h=4, hkv=2, n=13, d=8),
    "gqa-keymask-offset-n11": dict(b=2, h=4, hkv=1, n=11, d=5, key_mask=True, offset=70),
    "window-n10": dict(b=1, h=2, hkv=2, n=10, d=3, window=4),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_ssmax_in_one_pass_equals_its_formula(registry, case, backend):
    """Outputs within 1e-12 and the gradients of q, k, v and s (a different s per head) within 1e-10 of the float64
    formula (real queries' rows). With a key mask (batch row 1's first three keys padding, a hole in row 0) and
    positions from 70, n is the number of keys a query sees, not its position; with a window, at most the window."""
    size = dict(CASES[case])
    key_mask, offset, window = size.pop("key_mask", False), size.pop("offset", 1), size.pop("window", None)
    b, n = size["b"], size["n"]
    q, k, v = inputs(**size, seed=3)
    s = torch.linspace(0.3, 1.2, size["h"], dtype=torch.float64).requires_grad_()
    positions = torch.arange(offset, offset + n).expand(b, n)
    mask = None
    if key_mask:
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[1, :3] = False
        mask[0, 4] = False
    more = [{"kind": "sliding_window", "window": window}] if window else []
    variant = attnzoo.compile(spec_of("ssmax", *more), backend=backend, registry=registry)
    got = variant(q, k, v, params={"ssmax.s": s}, positions=positions if offset != 1 else None, key_mask=mask)
    want = ssmax_by_hand(q, k, v, allowed_by_hand(positions, mask, window), s)
    if mask is not None:  # a padding query's output is not defined (it takes the next real token's position)
        real = mask[:, None, :, None].to(torch.float64)
        got, want = got * real, want * real
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(weighted_grads(got, (q, k, v, s)), weighted_grads(want, (q, k, v, s)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_ssmax_in_float32_stays_close(registry):
    """float32 inputs: the blocked form's sums in float32 against the float64 formula."""
    q, k, v = (t.detach() for t in inputs(b=1, h=4, hkv=2, n=37, d=16, seed=4))
    s = torch.full((4,), 0.7, dtype=torch.float64)
    variant = attnzoo.compile(spec_of("ssmax"), backend="blocked4", registry=registry)
    got = variant(q.float(), k.float(), v.float(), params={"ssmax.s": s.float()})
    want = ssmax_by_hand(q, k, v, allowed_by_hand(torch.arange(1, 38)[None]), s)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


# -- behind a cache ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_behind_a_cache_budget_n_is_the_keys_held(backend, registry):
    """sink_window (2 sinks, budget 6): a prefill of 5, then one token at a time up to 16. Each step's output is the
    formula over the keys the cache holds (the sinks and the newest four: n = 6 from position 7 on, not the
    position), and it differs from SSMax by position (n = i) where the two part."""
    spec = spec_of("ssmax", cache={"evictor": "sink_window", "sink": 2, "budget": 6})
    variant = attnzoo.compile(spec, backend=backend, registry=registry)
    q, k, v = (t.detach() for t in inputs(b=2, h=4, hkv=2, n=16, d=8, seed=5))
    s = torch.tensor([0.5, 0.9, 1.3, 2.0], dtype=torch.float64)
    cache = variant.new_cache(batch=2)
    variant.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache, params={"ssmax.s": s})
    for i in range(5, 16):
        got = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params={"ssmax.s": s})
        position = i + 1
        held = sorted({1, 2, *range(max(position - 3, 1), position + 1)})
        assert cache.positions[0, 0].tolist() == held  # what the query saw (sink_window evicts before attending)
        index = torch.tensor(held) - 1
        want = ssmax_by_hand(q[:, :, i:i + 1], k[:, :, index], v[:, :, index],
                             torch.ones(2, 1, 1, len(held), dtype=torch.bool), s)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        if position >= 8:  # ln 6 against ln(position): the test tells the two apart
            by_position = ssmax_by_hand(q[:, :, i:i + 1], k[:, :, index], v[:, :, index],
                                        torch.ones(2, 1, 1, len(held), dtype=torch.bool),
                                        s * math.log(position) / math.log(len(held)))
            assert not torch.allclose(got, by_position, rtol=0, atol=1e-6)


def test_chunks_over_a_padded_cache_agree_with_the_reference(registry):
    """A left-padded prompt of 7 (batch row 1: two padding tokens), then chunks of 3 and 2 over a cache of budget
    8 (sink_window, 1 sink) that evicts between and inside them: each chunk's rows sit at different offsets and see
    different numbers of keys. Blocked (4-key blocks) equals the reference, step by step."""
    spec = spec_of("ssmax", cache={"evictor": "sink_window", "sink": 1, "budget": 8})
    q, k, v = (t.detach() for t in inputs(b=2, h=4, hkv=2, n=17, d=6, seed=6))
    s = torch.tensor([0.4, 0.8, 1.1, 1.7], dtype=torch.float64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :2] = False
    outs = {}
    for backend in BACKENDS:
        variant = attnzoo.compile(spec, backend=backend, registry=registry)
        cache = variant.new_cache(batch=2)
        steps = [variant.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7], cache, params={"ssmax.s": s}, key_mask=mask)]
        for first, last in ((7, 10), (10, 12), (12, 15), (15, 17)):
            steps.append(variant.prefill(q[:, :, first:last], k[:, :, first:last], v[:, :, first:last], cache,
                                         params={"ssmax.s": s}))
        outs[backend] = torch.cat(steps, dim=2)
    torch.testing.assert_close(outs["blocked4"], outs["reference"], rtol=0, atol=1e-12)
    assert torch.isfinite(outs["blocked4"]).all()


# -- who gets the step ------------------------------------------------------------------------------------------------
def test_only_the_methods_that_declare_step_get_it():
    """Found once per class, by the parameter's name: a map without it (every built-in, every older plugin) is
    called as before; ``*args``/``**kwargs`` do not count."""

    class Loose(ReluMeanByStep):
        kind = "loose"

        def finish(self, state, params, *args, **kwargs):
            assert not args and not kwargs
            return state["sum"]

    assert SSMax.takes_step == frozenset({"update"})
    assert ReluMeanByStep.takes_step == frozenset({"finish"})
    assert Loose.takes_step == frozenset()
    registry = attnzoo.get_registry()
    assert all(cls.takes_step == frozenset() for cls in registry.transforms.values()
               if issubclass(cls, attnzoo.ProbabilityTransform))


def test_finish_reads_the_visible_counts(registry):
    """ReLU attention averaged over the keys a query sees, the count read in ``finish`` from the step: equal to the
    formula, and the step holds each query block's counts and positions (keys skipped before a window counted
    out, a padding key too). The first query block sees one key block (4 keys), and so does the last (position 9:
    keys before its window skipped): the backend takes the map's weights there, and finish runs for the middle
    block (queries at positions 5 to 8, keys 3 to 8)."""
    ReluMeanByStep.seen.clear()
    q, k, v = inputs(b=2, h=2, hkv=1, n=9, d=4, seed=7)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5] = False
    spec = spec_of("relu_mean_step", {"kind": "sliding_window", "window": 3})
    got = attnzoo.compile(spec, backend="blocked4", registry=registry)(q, k, v, key_mask=mask)
    positions = torch.arange(1, 10).expand(2, 9)
    allowed = allowed_by_hand(positions, mask, 3)
    logits = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 2.0
    want = (torch.relu(logits) * allowed / allowed.sum(-1, keepdim=True).clamp_min(1)) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    counts = torch.cat([step.visible for step in ReluMeanByStep.seen], dim=2)  # the query blocks in order
    assert counts.shape == (2, 2, 4, 1) and counts.dtype == torch.float64
    assert counts[:, 0, :, 0].tolist() == [[3, 3, 3, 3], [3, 2, 2, 2]]
    assert torch.cat([step.qpos for step in ReluMeanByStep.seen], dim=2)[:, 0, :, 0].tolist() == \
        positions[:, 4:8].tolist()


def test_conformance_passes_the_one_pass_ssmax(registry):
    """The suite on the plugin's spec, reference and blocked4, float64 and float32: outputs, gradients (its s
    included, by finite differences), the weights' checks, decoding."""
    from attnzoo.conformance import runner

    registry.specs["ssmax"] = attnzoo.load_spec({**spec_of("ssmax"), "name": "ssmax"}, registry=registry)
    registry.origin[("specs", "ssmax")] = "step_maps"
    cases = runner.build_cases(registry, ["ssmax"], BACKENDS, (torch.float64, torch.float32), profile="quick")
    results = runner.run_suite(cases)
    assert not runner.failed(results), [r.message for r in results if r.status == "fail"][:3]
    assert {r.backend for r in results if r.status == "pass"} == set(BACKENDS)

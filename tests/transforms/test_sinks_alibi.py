"""Attention sinks and learnable-slope ALiBi against float64 formulas written here from their definitions (gpt-oss's
sink, the off-by-one softmax, ALiBi with trained slopes), not from the reference backend; FlexAttention where it
can express them; the one-line refusals."""

import math
import sys

import pytest
import torch

import attnzoo
from attnzoo.transforms.logits import alibi_slopes


def by_hand(q, k, v, key_mask=None, sink=None, slope=None, positions=None, cap=None):
    """Causal attention in float64 written out: logits q·k/sqrt(D) (- slope_h |i - j|) (capped), an explicit
    exponential over the allowed keys, the sink's exp(s_h) added to each row's denominator."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    pos = torch.arange(1, n + 1) if positions is None else positions
    pos = pos.expand(b, n).to(torch.float64)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    if slope is not None:
        logits = logits - slope.view(1, h, 1, 1) * (pos[:, None, :, None] - pos[:, None, None, :]).abs()
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    allowed = pos[:, None, None, :] <= pos[:, None, :, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    top = logits.masked_fill(~allowed, -1e300).amax(-1, keepdim=True)
    if sink is not None:
        top = torch.maximum(top, sink.view(1, h, 1, 1))
    weights = torch.exp(logits - top) * allowed
    denominator = weights.sum(-1, keepdim=True)
    if sink is not None:
        denominator = denominator + torch.exp(sink.view(1, h, 1, 1) - top)
    return (weights / denominator.clamp_min(1e-300)) @ v


def inputs(b=2, h=4, hkv=2, n=37, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=gen, dtype=torch.float64) for x in (h, hkv, hkv))
    return [t.requires_grad_() for t in (q, k, v)]


def grads(out, tensors, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


def check(got, want, tensors):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    for g, w in zip(grads(got, tensors), grads(want, tensors), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("cap", [None, 20.0])  # a softcap sends blocked down its eager path
def test_attention_sink_equals_its_formula(backend, cap):
    q, k, v = inputs()
    sink = torch.tensor([-1.0, 0.0, 0.7, 2.5], dtype=torch.float64, requires_grad=True)
    key_mask = torch.ones(2, 37, dtype=torch.bool)
    key_mask[1, 0] = False  # row 1's first query sees no key: the sink takes all its weight, the output is 0
    key_mask[0, 10:14] = False
    transforms = [{"kind": "attention_sink"}] + ([{"kind": "softcap", "cap": cap}] if cap else [])
    spec = {"name": "sinky", "attention": {"causal": True}, "transforms": transforms}
    variant = attnzoo.compile(spec, backend=backend)
    got = variant(q, k, v, params={"attention_sink.sink": sink}, key_mask=key_mask)
    want = by_hand(q, k, v, key_mask=key_mask, sink=sink, cap=cap)
    check(got, want, (q, k, v, sink))
    assert torch.equal(got[1, :, 0], torch.zeros_like(got[1, :, 0]))
    assert bool(got.abs().sum() > 0)


def test_off_by_one_softmax_is_a_fixed_zero_sink():
    q, k, v = inputs(seed=3)
    got = attnzoo.attention(q, k, v, "off-by-one", backend="blocked")
    check(got, by_hand(q, k, v, sink=torch.zeros(4, dtype=torch.float64)), (q, k, v))
    assert attnzoo.compile("off-by-one").parameter_names() == []


def test_sink_decoding_equals_the_formula():
    q, k, v = (t.detach() for t in inputs(b=1, n=20, seed=4))
    sink = torch.tensor([0.5, -0.5, 1.0, 0.0], dtype=torch.float64)
    want = by_hand(q, k, v, sink=sink)
    for backend in ("reference", "blocked"):
        variant = attnzoo.compile("sink", backend=backend)
        cache = variant.new_cache(batch=1)
        params = {"attention_sink.sink": sink}
        steps = [variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params)
                 for i in range(20)]
        torch.testing.assert_close(torch.cat(steps, dim=2), want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_learnable_alibi_equals_its_formula(backend):
    q, k, v = inputs(h=6, hkv=3, n=41)
    variant = attnzoo.compile("alibi-learnable", backend=backend)
    initial = variant.init_params(num_heads=6, head_dim=16, num_kv_heads=3, dtype=torch.float64)
    # the slopes start at ALiBi's (for 6 heads: 4 of a power of two, then every other one of 8)
    expected = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    torch.testing.assert_close(initial["alibi_learnable.slope"], torch.tensor(expected, dtype=torch.float64))
    assert alibi_slopes(6) == pytest.approx(expected)
    slope = torch.tensor([0.9, 0.3, 0.05, 0.0, 1.5, 0.2], dtype=torch.float64, requires_grad=True)
    positions = torch.arange(70, 111)  # offsets: only distances matter
    got = variant(q, k, v, params={"alibi_learnable.slope": slope}, positions=positions)
    check(got, by_hand(q, k, v, slope=slope, positions=positions), (q, k, v, slope))


def test_learnable_alibi_matches_flex_attention_with_a_captured_tensor():
    """FlexAttention expresses the learnable slope as a score_mod that indexes a captured (H,) tensor."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 128, 16, generator=gen) for _ in range(3))
    slope = torch.tensor([0.5, 0.25, 0.1, 0.02])

    def score_mod(score, b, h, i, j):
        distance = torch.where(j <= i, i - j, j - i)
        return torch.where(j <= i, score - slope[h] * distance, float("-inf"))

    with torch.no_grad():
        want = flex_attention(q, k, v, score_mod=score_mod)
        got = attnzoo.attention(q, k, v, "alibi-learnable", params={"alibi_learnable.slope": slope},
                                backend="blocked")
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_an_init_of_the_wrong_shape_is_refused_naming_the_parameter():
    from attnzoo.transforms.base import Dims, ParamSpec

    bad = ParamSpec("slope", ("H",), lambda dims: [1.0, 2.0])
    with pytest.raises(ValueError, match=r"^parameter 'slope': its init gave shape \(2,\), declared \(4,\)$"):
        bad.initial(Dims(4, 8, 4))


def test_flex_declines_a_sink_with_a_reason():
    text = attnzoo.explain("sink", device="cpu", dtype=torch.float32)
    assert "flex       no: 'attention_sink' adds a term to the softmax denominator" in text


def test_a_second_normaliser_is_refused():
    spec = {"name": "two", "transforms": [{"kind": "attention_sink"}, {"kind": "attention_sink", "value": 1.0}]}
    with pytest.raises(attnzoo.SpecError, match="appears twice"):
        attnzoo.load_spec(spec)


def forgetting_by_hand(q, k, v, weight, bias, key_mask=None, gate=None):
    """The Forgetting Transformer in float64, written out: f_s = sigmoid(w_h · k_s + b_h) per head (or
    sigmoid(gate) for a gate logit (B, H, N) computed from the layer input); the logit of (i, j) gains sum over real
    tokens j < s <= i of log f_s (an explicit indicator, no cumulative sum)."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    kh = k.repeat_interleave(group, dim=1)
    if gate is None:
        gate = (kh * weight[None, :, None, :]).sum(-1) + bias[None, :, None]
    log_f = torch.log(torch.sigmoid(gate))  # (B, H, N)
    real = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask
    log_f = log_f * real[:, None, :]
    s, i, j = torch.arange(n).view(n, 1, 1), torch.arange(n).view(1, n, 1), torch.arange(n).view(1, 1, n)
    between = ((j < s) & (s <= i)).to(torch.float64)  # (S, I, J)
    decay = torch.einsum("bhs,sij->bhij", log_f, between)
    logits = q @ kh.transpose(-1, -2) / math.sqrt(d) + decay
    allowed = (j <= i)[0] & real[:, None, None, :]
    # a finite fill keeps rows with no key (padding queries) finite; their weights are then zeroed
    weights = torch.softmax(logits.masked_fill(~allowed, -1e300), dim=-1) * allowed
    return weights @ v.repeat_interleave(group, dim=1)


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_forgetting_gate_equals_its_formula(backend):
    q, k, v = inputs(n=29)
    gen = torch.Generator().manual_seed(7)
    weight = (0.5 * torch.randn(4, 16, generator=gen, dtype=torch.float64)).requires_grad_()
    bias = torch.tensor([2.0, 0.0, -1.0, 4.0], dtype=torch.float64, requires_grad=True)
    key_mask = torch.ones(2, 29, dtype=torch.bool)
    key_mask[0, :3] = False  # a left-padded row: padding adds no decay
    key_mask[1, 20] = False
    variant = attnzoo.compile("forgetting", backend=backend)
    got = variant(q, k, v, params={"forgetting_gate.weight": weight, "forgetting_gate.bias": bias},
                  key_mask=key_mask, positions=torch.arange(70, 99))
    want = forgetting_by_hand(q, k, v, weight, bias, key_mask)
    keep = key_mask[:, None, :, None]  # rows of padding queries are not compared (they attend under the mask)
    real_rows = torch.where(keep, got, 0.0), torch.where(keep, want, 0.0)
    check(*real_rows, (q, k, v, weight, bias))


FOX_INPUT = {"name": "fox-input", "attention": {"causal": True},
             "transforms": [{"kind": "forgetting_gate", "source": "input", "bias_init": 2.0}]}


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_forgetting_gate_from_the_layer_input_equals_its_formula(backend):
    """source: input, as the paper computes the gate: attnzoo.nn.Attention owns the projection of the layer input
    x (B, N, E) to one gate logit per head and token, f = sigmoid(x W^T + b); outputs and the gradients of q, k, v,
    x and the projection's weight and bias equal the hand-written formula (float64, GQA, padding)."""
    import attnzoo.nn

    q, k, v = inputs(n=29)
    x = torch.randn(2, 29, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    layer = attnzoo.nn.Attention(FOX_INPUT, num_heads=4, head_dim=16, num_kv_heads=2, backend=backend,
                                 input_dim=12, dtype=torch.float64)
    proj = layer.token_projections["forgetting_gate__gate"]
    assert float(proj.weight.detach().abs().max()) == 0.0 and bool((proj.bias == 2.0).all())  # sigmoid(2) at first
    with torch.no_grad():
        proj.weight.normal_(generator=torch.Generator().manual_seed(4))
    key_mask = torch.ones(2, 29, dtype=torch.bool)
    key_mask[0, :3] = False
    got = layer(q, k, v, key_mask=key_mask, x=x)
    want = forgetting_by_hand(q, k, v, None, None, key_mask, gate=(x @ proj.weight.T + proj.bias).transpose(1, 2))
    keep = key_mask[:, None, :, None]
    check(torch.where(keep, got, 0.0), torch.where(keep, want, 0.0), (q, k, v, x, proj.weight, proj.bias))
    with pytest.raises(ValueError, match=r"^spec 'fox-input' computes per-token inputs from the layer input: pass x"):
        layer(q, k, v)
    with pytest.raises(ValueError, match="needs the per-token input 'forgetting_gate.gate'"):
        layer.variant(q, k, v)


@pytest.mark.parametrize("backend", ["reference", "blocked",
                                     pytest.param("triton", marks=pytest.mark.interpreter)])
def test_forgetting_gate_from_the_layer_input_passes_conformance_and_decodes(tmp_path, backend):
    """The conformance suite draws the per-token inputs like parameters: reference and blocked (float64,
    float32) and triton in the interpreter (float32): outputs, gradients (the inputs' included), causality, batch
    invariance and decoding (each step's input passed with its token). One item per backend."""
    import json

    from attnzoo.conformance import runner

    path = tmp_path / "fox-input.json"
    path.write_text(json.dumps(FOX_INPUT))
    module = type(sys)("fox_input_spec")
    module.register_specs = attnzoo.hookimpl(lambda register: register(path))
    reg = attnzoo.new_registry(entry_points=False, extra_plugins=(("fox_input_spec", module),))
    if backend == "triton":
        keep = {"outputs/gqa-n63", "gradients/gqa-n63", "gradients/offset-gaps-n45"}
        cases = [c for c in runner.build_cases(reg, ["fox-input"], ["triton"], (torch.float32,))
                 if not c.check.startswith(("outputs/", "gradients/", "packed/")) or c.check in keep]
    else:
        cases = runner.build_cases(reg, ["fox-input"], [backend], (torch.float64, torch.float32))
    results = runner.run_suite(cases)
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    passed = {(r.backend, r.check.split("/")[0]) for r in results if r.status == "pass"}
    assert {(backend, c) for c in ("outputs", "gradients", "decode", "causality")} <= passed, backend


def test_forgetting_gate_matches_flex_attention_with_captured_features():
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 128, 16, generator=gen) for _ in range(3))
    weight, bias = 0.3 * torch.randn(4, 16, generator=gen), torch.tensor([1.0, 2.0, 3.0, 0.5])
    d_t = torch.nn.functional.logsigmoid(torch.einsum("bhnd,hd->bhn", k, weight) + bias[:, None]).cumsum(-1)

    def score_mod(score, b, h, i, j):
        return torch.where(j <= i, score + d_t[b, h, i] - d_t[b, h, j], float("-inf"))

    params = {"forgetting_gate.weight": weight, "forgetting_gate.bias": bias}
    with torch.no_grad():
        want = flex_attention(q, k, v, score_mod=score_mod)
        for backend in ("blocked", "flex"):
            got = attnzoo.attention(q, k, v, "forgetting", params=params, backend=backend)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # float32, two summation orders


def test_a_feature_transform_triton_cannot_load_is_declined_with_one_line():
    """Triton loads a feature transform's separable form (per-token terms); one without it is declined, naming
    the transform; the built-in forgetting gate decodes and runs on triton."""
    from attnzoo.transforms.base import LogitsTransform
    from attnzoo.transforms.forgetting import ForgettingGate

    class Inseparable(ForgettingGate):
        kind = "inseparable_gate"
        separable = LogitsTransform.separable

    module = type(sys)("inseparable_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(Inseparable))
    reg = attnzoo.new_registry(entry_points=False, extra_plugins=(("inseparable_plugin", module),))
    spec = {"name": "i", "attention": {"causal": True}, "transforms": [{"kind": "inseparable_gate"}]}
    text = attnzoo.explain(spec, device="cuda", dtype=torch.float16, registry=reg)
    assert ("transform 'inseparable_gate' computes per-token features but is not separable (the kernels load "
            "per-token terms row_i + col_j: LogitsTransform.separable)") in text
    decode = attnzoo.explain("forgetting", device="cpu", dtype=torch.float32, mode="decode")
    assert "reference  yes" in decode and "blocked    yes" in decode
    assert "triton     yes" in attnzoo.explain("forgetting", device="cuda", dtype=torch.float16)


def test_a_feature_of_the_wrong_shape_is_refused_naming_the_transform():
    from attnzoo.transforms.forgetting import ForgettingGate

    class Broken(ForgettingGate):
        kind = "broken_gate"

        def features(self, rows, params):
            return {"D": super().features(rows, params)["D"][:, :1]}

    module = type(sys)("broken_gate_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(Broken))
    reg = attnzoo.new_registry(entry_points=False, extra_plugins=(("broken_gate_plugin", module),))
    spec = {"name": "b", "attention": {"causal": True}, "transforms": [{"kind": "broken_gate"}]}
    x = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match=r"^transform 'broken_gate': feature 'D' has shape \(1, 1, 5\), "
                                         r"expected \(B, H, N\) = \(1, 4, 5\)$"):
        attnzoo.compile(spec, backend="reference", registry=reg)(x, x, x)

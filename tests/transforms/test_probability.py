"""The probability slot: sigmoid attention, softpick and stick-breaking against float64 formulas written here from
each paper (not from the reference backend), on the reference and on the blocked backend at 4-key blocks (so that
several blocks merge), with odd lengths, GQA, masked rows, windows, offset positions, a logits transform and the
selective accumulator beside them; decoding equals the batch form; the refusals, one line each; the backends that
decline them. A plugin's probability map registers, runs and passes the conformance suite."""

import math
import types

import pytest
import torch
from map_plugins import ReluMean  # examples/map_plugins.py: ReLU attention as a plugin map

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.backends.reference import ReferenceBackend
from attnzoo.backends.sigmoid_blocks import SigmoidCausal
from attnzoo.decode import fast
from attnzoo.registry import PluginWarning, new_registry
from attnzoo.transforms.base import Context, Dims, ProbabilityTransform
from attnzoo.transforms.probability import Softpick, later_sum

BLOCK = 4


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("small_blocks")
    module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(BLOCK, "blocked4")))
    return new_registry(entry_points=False, extra_plugins=[("small_blocks", module)])


BACKENDS = ["reference", "blocked4"]


# -- the formulas, by hand ------------------------------------------------------------------------------------------
def inputs(b=2, h=4, hkv=2, n=13, d=8, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (spread * torch.randn(b, x, n, d, generator=gen, dtype=torch.float64) for x in (h, hkv, hkv))
    return [t.requires_grad_() for t in (q, k, v)]


def logits_by_hand(q, k, cap=None):
    """q·k / sqrt(D) for every query head against its key/value head h // (H / H_kv), optionally softcapped."""
    group = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return logits if cap is None else cap * torch.tanh(logits / cap)


def allowed_by_hand(b, n, positions, key_mask=None, window=None):
    """(B, 1, N, N): causal by position, the key mask, a sliding window of ``window`` positions."""
    pos = positions.expand(b, n)
    allowed = pos[:, None, None, :] <= pos[:, None, :, None]
    if window is not None:
        allowed = allowed & (pos[:, None, :, None] - pos[:, None, None, :] < window)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed


def sigmoid_by_hand(logits, allowed, positions, v, bias=None, offset=None):
    """Ramapuram et al.: w_ij = sigmoid(l_ij + b), b = -log n (n: the query's position) unless given; no sum to 1."""
    b, h, n, _ = logits.shape
    pos = positions.expand(b, n).to(torch.float64)
    bias = -torch.log(pos)[:, None, :, None] if bias is None else torch.tensor(bias, dtype=torch.float64)
    if offset is not None:
        bias = bias + offset.view(1, h, 1, 1)
    weights = torch.sigmoid(logits + bias) * allowed
    return weights @ v.repeat_interleave(h // v.shape[1], dim=1)


def softpick_by_hand(logits, allowed, v, eps=1e-8):
    """Zuhri et al.: w_j = relu(e^{l_j} - 1) / (sum over allowed k of |e^{l_k} - 1| + eps), directly (no shift)."""
    h = logits.shape[1]
    e = torch.exp(torch.where(allowed, logits, 0.0)) - 1.0
    weights = torch.relu(e) * allowed / ((e.abs() * allowed).sum(-1, keepdim=True) + eps)
    return weights @ v.repeat_interleave(h // v.shape[1], dim=1)


def stick_by_hand(logits, allowed, positions, v, attend_current=False):
    """Tan et al., the stick broken key by key: for each query, walk its keys from the nearest position back; each
    allowed key j takes sigmoid(l_ij) of what is left of the stick, and leaves (1 - sigmoid(l_ij)) of it."""
    b, h, n, _ = logits.shape
    pos = positions.expand(b, n)
    allowed = allowed.expand(b, h, n, n)
    values = v.repeat_interleave(h // v.shape[1], dim=1)
    rows = []
    for i in range(n):
        left = torch.ones(b, h, dtype=torch.float64)
        out = torch.zeros(b, h, v.shape[-1], dtype=torch.float64)
        for j in reversed(range(n)):  # positions increase along the keys
            weighed = allowed[:, :, i, j] & ((pos[:, j] <= pos[:, i]) if attend_current else (pos[:, j] < pos[:, i]))[
                :, None]
            beta = torch.sigmoid(logits[:, :, i, j])
            out = out + torch.where(weighed, beta * left, 0.0)[..., None] * values[:, :, j]
            left = torch.where(weighed, left * (1.0 - beta), left)
        rows.append(out)
    return torch.stack(rows, dim=2)


def grads(out, tensors, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


def check(got, want, tensors):
    """Outputs within 1e-12, and the gradients (of a random weighting of the outputs) by autograd through the
    formula; returns the gradients."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    got_grads = grads(got, tensors)
    for g, w in zip(got_grads, grads(want, tensors), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    return got_grads


MAPS = {
    "sigmoid": ({"kind": "sigmoid"}, lambda l, a, p, v: sigmoid_by_hand(l, a, p, v)),
    "softpick": ({"kind": "softpick"}, lambda l, a, p, v: softpick_by_hand(l, a, v)),
    "stick_breaking": ({"kind": "stick_breaking"}, lambda l, a, p, v: stick_by_hand(l, a, p, v)),
    "stick_breaking-current": ({"kind": "stick_breaking", "attend_current": True},
                               lambda l, a, p, v: stick_by_hand(l, a, p, v, attend_current=True)),
}
SHAPES = {"n7": dict(b=2, h=2, hkv=2, n=7), "gqa-n13": dict(b=2, h=4, hkv=2, n=13)}


def spec_of(entry, *more, causal=True):
    return {"name": "mapped", "attention": {"causal": causal}, "transforms": [entry, *more]}


# -- each map equals its formula --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["masked-rows", "offset-gaps"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", MAPS)
def test_map_equals_its_formula(registry, name, shape, case, backend):
    """Outputs and gradients. ``masked-rows``: batch row 1's first three keys are padding (at positions 1..N), so
    its first queries see no key: output exactly 0, finite gradients. ``offset-gaps``: positions from 70 with a gap,
    so that n (sigmoid's bias) is the position and the stick is broken by position."""
    entry, by_hand = MAPS[name]
    size = SHAPES[shape]
    q, k, v = inputs(**size, seed=3)
    n = size["n"]
    key_mask = positions = None
    if case == "masked-rows":
        key_mask = torch.ones(size["b"], n, dtype=torch.bool)
        key_mask[1, :3] = False
        key_mask[0, 4] = False
    else:
        positions = torch.cat([torch.arange(70, 70 + n - 2), torch.arange(90, 92)])
    got = attnzoo.compile(spec_of(entry), backend=backend, registry=registry)(q, k, v, positions=positions,
                                                                              key_mask=key_mask)
    positions = torch.arange(1, n + 1) if positions is None else positions
    want = by_hand(logits_by_hand(q, k), allowed_by_hand(size["b"], n, positions, key_mask), positions, v)
    gradients = check(got, want, (q, k, v))
    assert all(torch.isfinite(g).all() for g in gradients)
    if case == "masked-rows":
        assert torch.equal(got[1, :, :3], torch.zeros_like(got[1, :, :3]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MAPS)
def test_map_composes_with_a_window_and_a_logits_transform(registry, name, backend):
    """A sliding window (the blocked backend skips keys before it) and a softcap (a non-additive logits transform):
    the map reads the capped logits over the window's keys."""
    entry, by_hand = MAPS[name]
    q, k, v = inputs(n=13, seed=4, spread=2.0)
    spec = spec_of(entry, {"kind": "sliding_window", "window": 5}, {"kind": "softcap", "cap": 3.0})
    got = attnzoo.compile(spec, backend=backend, registry=registry)(q, k, v)
    positions = torch.arange(1, 14)
    want = by_hand(logits_by_hand(q, k, cap=3.0), allowed_by_hand(2, 13, positions, window=5), positions, v)
    check(got, want, (q, k, v))


def selective_f_by_hand(logits, allowed, positions):
    """Selective attention's F (selector head 0, BOS protected, no self-mask): F[i, j] = sum over earlier queries k
    of ReLU(l_0[k, j]) where k may see j, j is not at position 1 and j is not k itself."""
    b, h, n, _ = logits.shape
    pos = positions.expand(b, n)
    keep = allowed[:, 0] & (pos[:, None, :] != 1) & (pos[:, None, :] != pos[:, :, None])
    s = torch.where(keep, torch.relu(logits[:, 0]), 0.0)
    f = torch.zeros_like(s)
    for i in range(1, n):
        f[:, i] = s[:, :i].sum(1)
    return f[:, None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["sigmoid", "softpick", "stick_breaking"])
def test_the_accumulator_subtracts_f_before_the_map(registry, name, backend):
    """The selective accumulator's F is subtracted from the logits whatever map follows (docs/specs.md)."""
    entry, by_hand = MAPS[name]
    q, k, v = inputs(n=11, seed=5, spread=1.5)
    spec = spec_of(entry, {"kind": "selective_mask"})
    got = attnzoo.compile(spec, backend=backend, registry=registry)(q, k, v)
    positions = torch.arange(1, 12)
    logits = logits_by_hand(q, k)
    allowed = allowed_by_hand(2, 11, positions)
    want = by_hand(logits - selective_f_by_hand(logits, allowed, positions), allowed, positions, v)
    check(got, want, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigmoid_bias_options(registry, backend):
    """A number for b, and a learnable per-head offset (its gradient too)."""
    q, k, v = inputs(n=9, seed=6)
    positions = torch.arange(1, 10)
    allowed = allowed_by_hand(2, 9, positions)
    got = attnzoo.compile(spec_of({"kind": "sigmoid", "bias": -2.0}), backend=backend, registry=registry)(q, k, v)
    check(got, sigmoid_by_hand(logits_by_hand(q, k), allowed, positions, v, bias=-2.0), (q, k, v))
    variant = attnzoo.compile(spec_of({"kind": "sigmoid", "learnable": True}), backend=backend, registry=registry)
    assert variant.parameter_names() == ["sigmoid.bias"]
    offset = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    got = variant(q, k, v, params={"sigmoid.bias": offset})
    check(got, sigmoid_by_hand(logits_by_hand(q, k), allowed, positions, v, offset=offset), (q, k, v, offset))


@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("bias", ["-log n", -1.5])
@pytest.mark.parametrize("size", [dict(b=2, h=4, hkv=2, n=11), dict(b=1, h=3, hkv=1, n=9, d=5)], ids=["gqa", "mqa"])
def test_sigmoid_fast_path_equals_its_formula(registry, monkeypatch, size, bias, learnable):
    """Causal sigmoid with nothing but row scales takes one autograd node (sigmoid_blocks.py), its query blocks of
    4 against every earlier key: outputs and gradients of q, k, v and the learnable offset against the paper's
    formula, at consecutive positions from 40 (n in b = -log n is the position), odd lengths, GQA and MQA."""
    ran = []
    forward = SigmoidCausal.forward
    monkeypatch.setattr(SigmoidCausal, "forward", staticmethod(lambda *a: ran.append(1) or forward(*a)))
    q, k, v = inputs(**size, seed=11, spread=1.5)
    n, h = size["n"], size["h"]
    positions = torch.arange(40, 40 + n)
    entry = {"kind": "sigmoid", "bias": bias, "learnable": learnable}
    variant = attnzoo.compile(spec_of(entry), backend="blocked4", registry=registry)
    tensors = [q, k, v]
    params = {}
    if learnable:
        offset = torch.linspace(-1.0, 1.0, h, dtype=torch.float64).requires_grad_()
        params, tensors = {"sigmoid.bias": offset}, [q, k, v, offset]
    got = variant(q, k, v, positions=positions, params=params)
    assert ran
    want = sigmoid_by_hand(logits_by_hand(q, k), allowed_by_hand(size["b"], n, positions), positions, v,
                           bias=None if bias == "-log n" else bias, offset=params.get("sigmoid.bias"))
    check(got, want, tensors)


def test_sigmoid_fast_path_composes_with_row_scales_and_float32(registry, monkeypatch):
    """Row scales (SSA's query and value temperatures) before the fast path, against the reference; float32 within
    float32's rounding."""
    ran = []
    forward = SigmoidCausal.forward
    monkeypatch.setattr(SigmoidCausal, "forward", staticmethod(lambda *a: ran.append(a[1].dtype) or forward(*a)))
    spec = spec_of({"kind": "sigmoid"}, {"kind": "query_temperature"}, {"kind": "value_temperature"})
    q, k, v = inputs(n=10, seed=12)
    fast_path = attnzoo.compile(spec, backend="blocked4", registry=registry)
    reference = attnzoo.compile(spec, backend="reference", registry=registry)
    params = {name: (torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64) * 0.3)
              .requires_grad_() for i, (name, p) in enumerate(reference.init_params(4, 8, 2).items())}
    assert params
    got, want = fast_path(q, k, v, params=params), reference(q, k, v, params=params)
    check(got, want, (q, k, v, *params.values()))
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    p32 = {name: t.detach().float() for name, t in params.items()}
    torch.testing.assert_close(fast_path(q32, k32, v32, params=p32), want.detach().float(), rtol=1e-5, atol=1e-5)
    assert ran == [torch.float64, torch.float32]


@pytest.mark.parametrize("name", MAPS)
def test_gradcheck_through_the_blocks(registry, name):
    entry, _ = MAPS[name]
    q, k, v = inputs(b=1, h=2, hkv=1, n=6, d=3, seed=7)
    variant = attnzoo.compile(spec_of(entry), backend="blocked4", registry=registry)
    assert torch.autograd.gradcheck(lambda q_, k_, v_: variant(q_, k_, v_), (q, k, v), fast_mode=True)


# -- decoding ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [*MAPS, "sigmoid-streaming"])
def test_decoding_equals_the_batch_form(registry, name, backend):
    """A prefill of 5 tokens, then one token at a time: the batch form's output (with the sink + window evictor
    and no budget reached: nothing evicted). The blocked backend's fast steps (softmax only) decline a map."""
    entry, _ = MAPS[name.removesuffix("-streaming")]
    spec = spec_of(entry)
    if name.endswith("-streaming"):
        spec["cache"] = {"evictor": "sink_window", "budget": 64}
    variant = attnzoo.compile(spec, backend=backend, registry=registry)
    q, k, v = (t.detach() for t in inputs(n=13, seed=8))
    want = variant(q, k, v)
    cache = variant.new_cache(batch=2)
    steps = [variant.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache)]
    steps += [variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache) for i in range(5, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=2), want, rtol=0, atol=1e-12)
    assert cache.step_state.fast is None  # every step took the full path
    assert fast.offer(variant.plan, cache, {}, None) is None


def test_stick_breaking_orders_keys_by_position_not_by_slot():
    """The same keys in another slot order (a decode cache may hold them so) give the same output: the stick is
    broken by position."""
    variant = attnzoo.compile("stick-breaking", backend="reference")
    q, k, v = (t.detach() for t in inputs(b=1, n=9, seed=9))
    qpos = torch.tensor([[9]])
    kpos = torch.arange(1, 10).view(1, 1, 9)
    shuffle = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5])
    params = variant.plan.split_params(None, Dims(4, 8, 2), q)
    ordered = ReferenceBackend().attend(variant.plan, q[:, :, -1:], k, v, qpos, kpos, params)[0]
    shuffled = ReferenceBackend().attend(variant.plan, q[:, :, -1:], k[:, :, shuffle], v[:, :, shuffle], qpos,
                                         kpos[..., shuffle], params)[0]
    torch.testing.assert_close(shuffled, ordered, rtol=0, atol=1e-14)
    a = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    order = torch.tensor([3, 6, 0, 1, 5, 2, 4])
    want = torch.stack([a[..., order > order[j]].sum(-1) for j in range(7)], dim=-1)
    torch.testing.assert_close(later_sum(a, order.view(1, 1, 1, 7)), want, rtol=0, atol=1e-13)


# -- softpick's edge cases ------------------------------------------------------------------------------------------
def _softpick_weights(logits, allowed=None):
    t = Softpick(Softpick.options_model()(kind="softpick"))
    allowed = torch.ones_like(logits, dtype=torch.bool) if allowed is None else allowed
    ctx = Context(qpos=torch.ones(1, 1, 1, 1), kpos=torch.ones(1, 1, 1, 1), heads=torch.zeros(1, 1, 1, 1), dims=None)
    return t.weights(logits, allowed, ctx, {})


def test_softpick_gives_zeros_to_a_row_of_negative_logits_and_stays_finite_far_out():
    zero = _softpick_weights(torch.tensor([[[[-0.5, -3.0, -1e-9, -800.0]]]], dtype=torch.float64))
    assert torch.equal(zero, torch.zeros_like(zero))
    big = torch.tensor([[[[1000.0, 999.0, -5.0]]]], dtype=torch.float64, requires_grad=True)
    w = _softpick_weights(big)
    # e^1000 overflows float64: the formula divided through by e^1000
    first = 1.0 / (1.0 + math.exp(-1.0))
    torch.testing.assert_close(w[0, 0, 0], torch.tensor([first, 1.0 - first, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    w[..., 0].sum().backward()
    assert torch.isfinite(big.grad).all()
    # a -inf logit masks its key, as the paper's code takes it (its limit would add 1 to the denominator)
    masked = _softpick_weights(torch.tensor([[[[1.0, float("-inf"), 0.5]]]], dtype=torch.float64))
    by_hand = torch.tensor([math.e - 1.0, 0.0, math.exp(0.5) - 1.0], dtype=torch.float64) / (
        math.e - 1.0 + math.exp(0.5) - 1.0 + 1e-8)
    torch.testing.assert_close(masked[0, 0, 0], by_hand, rtol=0, atol=1e-15)


# -- what composes and what is refused ---------------------------------------------------------------------------------
REFUSED = [
    (spec_of({"kind": "sigmoid"}, {"kind": "attention_sink"}),
     "transforms[1]: 'attention_sink' (normaliser) adds a logit to the softmax's denominator, and 'sigmoid' "
     "(probability) replaces the softmax: a normaliser needs the softmax"),
    ({**spec_of({"kind": "softpick"}), "cache": {"evictor": "h2o", "budget": 16}},
     "cache: evictor 'h2o' ranks tokens by their softmax attention probabilities, and transforms[0] ('softpick') "
     "replaces the softmax: its weights are no probabilities to rank by"),
    ({**spec_of({"kind": "diff"}), "cache": {"evictor": "tova", "budget": 16}},
     "cache: evictor 'tova' ranks tokens by their softmax attention probabilities, and transforms[0] ('diff') "
     "replaces the softmax: its weights are no probabilities to rank by"),
    (spec_of({"kind": "stick_breaking"}, causal=False),
     "transforms[0]: stick_breaking needs attention.causal: true (the stick is broken from the query back)"),
    (spec_of({"kind": "sigmoid"}, causal=False),
     "transforms[0]: sigmoid: bias '-log n' takes n from the query's position, a causal row's length: a non-causal "
     "spec gives bias a number (e.g. -log of its sequence length)"),
    (spec_of({"kind": "sigmoid"}, {"kind": "softpick"}),
     "transforms[1]: slot 'probability' already holds transforms[0] (one accumulator, one normaliser and one "
     "probability map per spec; row maps, logits and masks compose in spec order)"),
    (spec_of({"kind": "sigmoid", "bias": "-log N"}), "transforms[0].bias: must be a number or '-log n'"),
]


@pytest.mark.parametrize("spec, message", REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_refusals_are_one_line_naming_the_field(spec, message):
    with pytest.raises(attnzoo.SpecError) as caught:
        attnzoo.load_spec(spec)
    assert str(caught.value) == f"<mapping>: {message}"
    assert len(str(caught.value).splitlines()) == 1


def test_what_composes_validates():
    for spec in (spec_of({"kind": "sigmoid", "bias": -3.0}, causal=False),
                 {**spec_of({"kind": "stick_breaking"}), "cache": {"evictor": "sink_window", "budget": 16}},
                 {**spec_of({"kind": "softpick"}, {"kind": "selective_mask"}),
                  "cache": {"evictor": "selective", "budget": 16}},
                 spec_of({"kind": "sigmoid"}, {"kind": "alibi"}, {"kind": "query_temperature"},
                         {"kind": "chunked", "chunk": 8})):
        attnzoo.load_spec(spec)


@pytest.mark.parametrize("spec", ["sigmoid", "softpick", "stick-breaking", "diff"])
def test_flex_and_xformers_decline_with_a_reason(spec):
    """flex and xformers compute a softmax (flex takes diff, whose map is the softmax itself); the triton kernels
    take every map but stick-breaking (its key blocks go from the nearest back:
    tests/backends/test_triton_probability.py)."""
    text = attnzoo.explain(spec, device="cpu", dtype=torch.float32)
    kind = {"stick-breaking": "stick_breaking"}.get(spec, spec)
    flex = f"flex       no: '{kind}' replaces the softmax: FlexAttention's score_mod acts before a fixed softmax"
    if kind == "diff":  # a softmax map: flex runs its softmaxes over the pairs' values (test_differential.py)
        assert flex not in text and "flex       yes" in text
    else:
        assert flex in text
    assert f"probability map '{kind}' replaces the softmax: memory_efficient_attention computes a softmax" in text
    if kind == "stick_breaking":
        assert "triton     no: transform 'stick_breaking' (probability) takes key blocks in order 'reverse'" in text
    elif "triton     " in text:  # listed where triton is installed
        assert "triton     yes" in text
    assert "auto -> blocked" in text


def test_attnzoo_build_skips_stick_breaking_unless_named(tmp_path, capsys):
    pytest.importorskip("triton")
    from attnzoo.cli import main

    assert main(["build", "--cache-dir", str(tmp_path), "--json"]) == 0
    err = capsys.readouterr().err
    assert ("attnzoo: stick-breaking: skipped: transform 'stick_breaking' (probability) takes key blocks in order "
            "'reverse'") in err
    assert "sigmoid" not in err and "softpick" not in err
    assert main(["build", "stick-breaking", "--cache-dir", str(tmp_path)]) == 1
    assert "attnzoo: stick-breaking: cannot build: transform 'stick_breaking' (probability)" in capsys.readouterr().err


def test_only_a_map_takes_the_key_block_loop(monkeypatch):
    """A spec without a probability transform keeps blocked's paths (vanilla: one SDPA call); a map takes the
    generic loop, in the batch form and in decoding, except where a fast path takes it: causal sigmoid with only
    row scales (sigmoid_blocks.py, batch form), and a softmax map (diff), whose softmaxes take the softmax's paths."""
    calls, sigmoid_calls = [], []
    original = BlockedBackend.mapped_block
    original_sigmoid = SigmoidCausal.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    def counted_sigmoid(*args, **kwargs):
        sigmoid_calls.append(1)
        return original_sigmoid(*args, **kwargs)

    monkeypatch.setattr(BlockedBackend, "mapped_block", counted)
    monkeypatch.setattr(SigmoidCausal, "forward", staticmethod(counted_sigmoid))
    q, k, v = (t.detach() for t in inputs(n=9))
    for name in ("vanilla", "sink", "softcap", "selective", "diff"):
        attnzoo.compile(name, backend="blocked")(q, k, v)
        cache = attnzoo.compile(name, backend="blocked").new_cache(batch=2)
        attnzoo.compile(name, backend="blocked").decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache)
    assert not calls and not sigmoid_calls
    variant = attnzoo.compile("softpick", backend="blocked")
    variant(q, k, v)
    variant.decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], variant.new_cache(batch=2))
    assert len(calls) == 2
    variant = attnzoo.compile("sigmoid", backend="blocked")
    variant(q, k, v)
    assert len(sigmoid_calls) == 1 and len(calls) == 2
    variant.decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], variant.new_cache(batch=2))
    assert len(sigmoid_calls) == 1 and len(calls) == 3


# -- a plugin's probability map ---------------------------------------------------------------------------------------
def _plugin_registry(*classes, backends=True):
    module = types.ModuleType("maps")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(c) for c in classes])
    if backends:
        module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(BLOCK, "blocked4")))
    return new_registry(entry_points=False, extra_plugins=[("maps", module)])


def test_a_plugin_probability_map_registers_and_runs():
    registry = _plugin_registry(ReluMean)
    assert not registry.errors()
    assert registry.transforms["relu_mean"].slot is attnzoo.Slot.PROBABILITY
    spec = spec_of({"kind": "relu_mean"})
    q, k, v = inputs(n=10, seed=10)
    got = attnzoo.compile(spec, backend="blocked4", registry=registry)(q, k, v)
    allowed = allowed_by_hand(2, 10, torch.arange(1, 11))
    want = (torch.relu(logits_by_hand(q, k)) * allowed / allowed.sum(-1, keepdim=True)) @ v.repeat_interleave(2, 1)
    check(got, want, (q, k, v))


def test_a_plugin_map_without_a_blocked_form_runs_on_the_reference_only():
    class ReluOnly(ProbabilityTransform):
        kind = "relu_only"
        slot = attnzoo.Slot.PROBABILITY

        def weights(self, logits, allowed, ctx, params):
            return torch.where(allowed, torch.relu(logits), 0.0)

    registry = _plugin_registry(ReluOnly)
    text = attnzoo.explain(spec_of({"kind": "relu_only"}), registry=registry)
    assert ("blocked4   no: transform 'relu_only' (probability) has no blocked form (start, update, finish): the "
            "reference computes it") in text
    assert "auto -> reference" in text


def test_a_probability_map_must_implement_weights_and_all_or_none_of_its_blocked_form():
    class NoWeights(ProbabilityTransform):
        kind = "no_weights"
        slot = attnzoo.Slot.PROBABILITY

    class HalfBlocked(ReluMean):
        kind = "half_blocked"
        finish = ProbabilityTransform.finish

    with pytest.warns(PluginWarning) as caught:
        registry = _plugin_registry(NoWeights, backends=False)
    assert "transform 'no_weights': it does not implement weights(), which a transform in slot 'probability' must" in \
        str(caught[0].message)
    assert "no_weights" not in registry.transforms
    with pytest.warns(PluginWarning, match=r"it implements start\(\), update\(\) but not finish\(\): the blocked form "
                                           r"is all three \(or none\)"):
        _plugin_registry(HalfBlocked, backends=False)


def test_conformance_runs_a_plugin_map_on_every_backend_that_takes_it():
    from attnzoo.conformance import runner

    registry = _plugin_registry(ReluMean)
    registry.specs["relu-mean"] = attnzoo.load_spec({**spec_of({"kind": "relu_mean"}), "name": "relu-mean"},
                                                    registry=registry)
    registry.origin[("specs", "relu-mean")] = "maps"
    cases = runner.build_cases(registry, ["relu-mean"], ["reference", "blocked4"], (torch.float64,), profile="quick")
    results = runner.run_suite(cases)
    assert not runner.failed(results), [r.message for r in results if r.status == "fail"][:3]
    assert {r.backend for r in results if r.status == "pass"} == {"reference", "blocked4"}
    assert sum(r.status == "pass" for r in results) >= 20
    said = attnzoo.explain("relu-mean", registry=registry)  # and the others decline it, saying why
    assert "flex       no: 'relu_mean' replaces the softmax" in said
    assert "triton     no: transform 'relu_mean' (probability) has no Triton lowering" in said

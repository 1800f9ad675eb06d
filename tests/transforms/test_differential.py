"""Differential attention (Ye et al., ICLR 2025) against the paper's form written here in float64: heads taken in
pairs as the paper's two softmaxes of one head, ``(softmax(L_1) - λ softmax(L_2)) [V_1 | V_2]``, λ from its four
vectors, then the paper's subln (RMSNorm over the 2D outputs with a gain) times (1 - λ_init). Not from the
reference backend. Reference and blocked (4-key blocks), odd lengths, GQA, masked rows, windows, decoding; λ's
parameters get gradients from their first step; the refusals."""

import math
import types

import pytest
import torch

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.registry import new_registry

BACKENDS = ["reference", "blocked4"]
NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("small_blocks")
    module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(4, "blocked4")))
    return new_registry(entry_points=False, extra_plugins=[("small_blocks", module)])


def inputs(b=2, h=4, hkv=2, n=13, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=gen, dtype=torch.float64) for x in (h, hkv, hkv))
    return [t.requires_grad_() for t in (q, k, v)]


def parameters(d, seed=1, norm=True):
    gen = torch.Generator().manual_seed(seed)
    params = {f"diff.{name}": 0.3 * torch.randn(d, generator=gen, dtype=torch.float64) for name in NAMES}
    if norm:
        params["diff_norm.gain"] = 1.0 + 0.2 * torch.randn(2, d, generator=gen, dtype=torch.float64)
    return {key: value.requires_grad_() for key, value in params.items()}


def softmax_by_hand(logits, allowed):
    """exp(l - max) / sum over the allowed keys; 0 for a row with none."""
    top = torch.where(allowed, logits, -1e300).amax(-1, keepdim=True)
    e = torch.where(allowed, torch.exp(logits - torch.where(torch.isfinite(top) & (top > -1e299), top, 0.0)), 0.0)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, 1.0)


def diff_by_hand(q, k, v, params, allowed, lambda_init=0.8, norm=True, eps=1e-5):
    """The paper's MultiheadDiffAttn for the H / 2 heads its pairs make: head p's two softmaxes are attnzoo heads 2p
    and 2p + 1, its value (2D wide) is [V_2p | V_2p+1] (each query head's key/value head as GQA groups them)."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    attn = softmax_by_hand(q @ keys.transpose(-1, -2) / math.sqrt(d), allowed)  # (B, H, N, N)
    lam = (torch.exp(torch.dot(params["diff.lambda_q1"], params["diff.lambda_k1"]))
           - torch.exp(torch.dot(params["diff.lambda_q2"], params["diff.lambda_k2"])) + lambda_init)
    outs = []
    for p in range(h // 2):
        weights = attn[:, 2 * p] - lam * attn[:, 2 * p + 1]
        value = torch.cat([values[:, 2 * p], values[:, 2 * p + 1]], dim=-1)  # (B, N, 2D)
        o = weights @ value
        if norm:  # subln: RMSNorm(2D) with its gain, then (1 - λ_init)
            o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * params["diff_norm.gain"].reshape(2 * d)
            o = o * (1.0 - lambda_init)
        outs += [o[..., :d], o[..., d:]]
    return torch.stack(outs, dim=1)


def causal(b, n, key_mask=None, window=None):
    pos = torch.arange(n)
    allowed = (pos[None, :] <= pos[:, None])[None, None].expand(b, 1, n, n)
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed


def check(got, want, tensors):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=got.dtype)
    mine = torch.autograd.grad((got * weight).sum(), tensors)
    theirs = torch.autograd.grad((want * weight).sum(), tensors)
    for g, w in zip(mine, theirs, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    return mine


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [dict(h=2, hkv=2, n=7), dict(h=4, hkv=2, n=13), dict(h=4, hkv=1, n=13)],
                         ids=["n7", "gqa-n13", "mqa-n13"])
@pytest.mark.parametrize("masked", [True, False], ids=["key-mask", "no-mask"])
def test_diff_equals_the_papers_form(registry, size, backend, masked):
    """The shipped spec (diff + diff_norm), every parameter moved off its initial value; with ``masked``, batch row
    1's first three keys are padding, so its first three queries see nothing (the blocks); without, the blocked
    backend's softmaxes are causal SDPA calls over the pairs' values, a slice of D at a time."""
    q, k, v = inputs(**size, seed=3)
    params = parameters(q.shape[-1])
    key_mask = torch.ones(2, size["n"], dtype=torch.bool)
    key_mask[1, :3] = False
    got = attnzoo.compile("diff", backend=backend, registry=registry)(q, k, v, params=params,
                                                                      key_mask=key_mask if masked else None)
    want = diff_by_hand(q, k, v, params, causal(2, size["n"], key_mask if masked else None))
    gradients = check(got, want, (q, k, v, *params.values()))
    assert all(torch.isfinite(g).all() for g in gradients)


@pytest.mark.parametrize("backend", BACKENDS)
def test_diff_without_its_norm_and_with_a_window_and_another_lambda_init(registry, backend):
    spec = {"name": "bare-diff", "transforms": [{"kind": "diff", "lambda_init": 0.35},
                                                {"kind": "sliding_window", "window": 5}]}
    q, k, v = inputs(n=11, seed=4)
    params = parameters(8, norm=False)
    got = attnzoo.compile(spec, backend=backend, registry=registry)(q, k, v, params=params)
    check(got, diff_by_hand(q, k, v, params, causal(2, 11, window=5), lambda_init=0.35, norm=False),
          (q, k, v, *params.values()))


@pytest.mark.parametrize("size", [dict(h=4, hkv=2, n=13), dict(h=2, hkv=2, n=7)], ids=["gqa-n13", "n7"])
def test_flex_runs_diff_as_softmaxes_over_the_pairs_values(size):
    """FlexAttention (forward only on CPU, float32) computes diff's softmaxes over the pairs' values (2D wide) and
    the backend combines them: the paper's form within float32's rounding, with a window, a key mask and a position
    offset."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (t.detach().float() for t in inputs(**size, seed=9))
    params = {name: t.detach().float() for name, t in parameters(8).items()}
    n = size["n"]
    key_mask = torch.ones(2, n, dtype=torch.bool)
    key_mask[1, :3] = False
    spec = {"name": "diff-window", "transforms": [{"kind": "diff"}, {"kind": "diff_norm"},
                                                  {"kind": "sliding_window", "window": 6}]}
    variant = attnzoo.compile(spec, backend="flex")
    exact = (*(t.double() for t in (q, k, v)), {name: t.double() for name, t in params.items()})
    got = variant(q, k, v, params=params, key_mask=key_mask)
    torch.testing.assert_close(got, diff_by_hand(*exact, causal(2, n, key_mask, window=6)).float(), rtol=2e-5,
                               atol=2e-5)
    assert torch.equal(got[1, :, :3], torch.zeros_like(got[1, :, :3]))  # rows that see no key
    got = variant(q, k, v, params=params, positions=torch.arange(30, 30 + n))
    torch.testing.assert_close(got, diff_by_hand(*exact, causal(2, n, window=6)).float(), rtol=2e-5, atol=2e-5)


def test_lambda_starts_nonzero_and_its_vectors_get_gradients():
    variant = attnzoo.compile("diff", backend="blocked")
    initial = variant.init_params(num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64)
    assert sorted(initial) == ["diff.lambda_k1", "diff.lambda_k2", "diff.lambda_q1", "diff.lambda_q2",
                               "diff_norm.gain"]
    assert all(bool(initial[f"diff.{n}"].abs().min() > 0) for n in NAMES)
    assert not torch.equal(initial["diff.lambda_q1"], initial["diff.lambda_q2"])
    again = variant.init_params(num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64)
    assert all(torch.equal(initial[key], again[key]) for key in initial)  # deterministic
    params = {key: value.requires_grad_() for key, value in initial.items()}
    q, k, v = (t.detach() for t in inputs(seed=5))
    variant(q, k, v, params=params).square().sum().backward()
    assert all(bool(params[f"diff.{n}"].grad.abs().sum() > 0) for n in NAMES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_equals_the_batch_form(registry, backend):
    variant = attnzoo.compile("diff", backend=backend, registry=registry)
    q, k, v = (t.detach() for t in inputs(seed=6))
    params = {key: value.detach() for key, value in parameters(8).items()}
    want = variant(q, k, v, params=params)
    cache = variant.new_cache(batch=2)
    steps = [variant.prefill(q[:, :, :4], k[:, :, :4], v[:, :, :4], cache, params=params)]
    steps += [variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params)
              for i in range(4, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=2), want, rtol=0, atol=1e-12)


def test_an_odd_number_of_heads_is_refused_in_one_line():
    q, k, v = (t.detach() for t in inputs(h=3, hkv=1, n=5))
    with pytest.raises(ValueError) as caught:
        attnzoo.attention(q, k, v, "diff")
    assert str(caught.value) == ("diff takes the query heads in pairs (2p, 2p + 1): it needs an even number of "
                                 "heads, the call has 3")


@pytest.mark.parametrize("transforms, message", [
    ([{"kind": "diff_norm"}],
     "transforms[0]: diff_norm normalises differential attention's head pairs: the spec needs the transform 'diff'"),
    ([{"kind": "diff", "lambda_init": 0.5}, {"kind": "diff_norm"}],
     "transforms[1]: diff_norm.lambda_init (0.8) differs from diff.lambda_init (0.5): the paper scales by "
     "(1 - λ_init) of the same layer"),
    ([{"kind": "diff"}, {"kind": "attention_sink"}],
     "transforms[1]: 'attention_sink' (normaliser) adds a logit to the softmax's denominator, and 'diff' "
     "(probability) replaces the softmax: a normaliser needs the softmax"),
])
def test_refusals(transforms, message):
    with pytest.raises(attnzoo.SpecError) as caught:
        attnzoo.load_spec({"name": "d", "transforms": transforms})
    assert str(caught.value) == f"<mapping>: {message}"

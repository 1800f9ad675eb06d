"""The reference backend against hand-computed tiny cases (float64), one per built-in transform."""

import math

import pytest
import torch
from hand import causal, softmax_out

import attnzoo

# B = 1, H = 1, N = 3, D = 1, so the logit scale 1/sqrt(D) is 1 and l[i][j] = q_i * k_j.
Q = [1.0, 2.0, 0.5]
K = [1.0, -1.0, 2.0]
V = [1.0, 2.0, 4.0]
L = [[qi * kj for kj in K] for qi in Q]


def tensors(heads=1):
    q = torch.tensor(Q, dtype=torch.float64).view(1, 1, 3, 1).repeat(1, heads, 1, 1)
    k = torch.tensor(K, dtype=torch.float64).view(1, 1, 3, 1)
    v = torch.tensor(V, dtype=torch.float64).view(1, 1, 3, 1)
    return q, k, v


def run(spec, heads=1, **kwargs):
    q, k, v = tensors(heads)
    out = attnzoo.compile(spec, backend="reference")(q, k, v, **kwargs)
    return out[0, :, :, 0].tolist()


def spec(*transforms, causal_=True):
    return {"name": "t", "attention": {"causal": causal_}, "transforms": list(transforms)}


def test_vanilla_is_causal_softmax():
    assert run("vanilla")[0] == pytest.approx(softmax_out(causal(L), V), abs=1e-14)
    # row 1 written out: softmax([2, -2]) @ [1, 2]
    e = math.exp
    assert run("vanilla")[0][1] == pytest.approx((e(2) * 1 + e(-2) * 2) / (e(2) + e(-2)), abs=1e-14)


def test_non_causal_sees_everything():
    assert run(spec(causal_=False))[0] == pytest.approx(softmax_out(L, V), abs=1e-14)


def test_causal_mask_transform_equals_spec_causal():
    assert run(spec({"kind": "causal"}, causal_=False))[0] == pytest.approx(softmax_out(causal(L), V), abs=1e-14)


def test_sliding_window():
    rows = [[L[0][0], None, None], [L[1][0], L[1][1], None], [None, L[2][1], L[2][2]]]
    assert run(spec({"kind": "sliding_window", "window": 2}))[0] == pytest.approx(softmax_out(rows, V), abs=1e-14)


def test_chunked():
    """Chunks of 2 positions: {1, 2} and {3}; query 3 opens a chunk and sees itself alone."""
    rows = [[L[0][0], None, None], [L[1][0], L[1][1], None], [None, None, L[2][2]]]
    assert run(spec({"kind": "chunked", "chunk": 2}))[0] == pytest.approx(softmax_out(rows, V), abs=1e-14)


def test_softcap():
    cap = 1.5
    rows = [[cap * math.tanh(x / cap) for x in r] for r in L]
    out = run(spec({"kind": "softcap", "cap": cap}))[0]
    assert out == pytest.approx(softmax_out(causal(rows), V), abs=1e-14)


def test_alibi_single_head_slope():
    slope = 2.0 ** -8  # one head, max_bias 8: 2^(-8 * 1 / 1)
    rows = [[x - slope * abs(i - j) for j, x in enumerate(r)] for i, r in enumerate(L)]
    assert run(spec({"kind": "alibi"}))[0] == pytest.approx(softmax_out(causal(rows), V), abs=1e-14)


def test_alibi_slopes_match_the_paper():
    from attnzoo.transforms.logits import alibi_slopes

    assert alibi_slopes(8) == pytest.approx([2 ** -1, 2 ** -2, 2 ** -3, 2 ** -4, 2 ** -5, 2 ** -6, 2 ** -7, 2 ** -8])
    # 6 heads: the 4-head slopes, then every other slope of the 8-head set
    assert alibi_slopes(6) == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])
    from attnzoo.transforms.logits import head_slope

    for n in (1, 3, 6, 8, 12):
        slopes = head_slope(torch.arange(n, dtype=torch.float64), n, 8.0).tolist()
        assert slopes == pytest.approx(alibi_slopes(n), rel=1e-12)


def test_constant_temperature_and_yarn_agree_at_the_same_scale():
    rows = [[2.0 * x for x in r] for r in L]
    want = softmax_out(causal(rows), V)
    variant = attnzoo.compile(spec({"kind": "constant_temperature", "value": 1.0}), backend="reference")
    q, k, v = tensors()
    params = {"constant_temperature.temperature": torch.tensor([2.0], dtype=torch.float64)}
    assert variant(q, k, v, params=params)[0, 0, :, 0].tolist() == pytest.approx(want, abs=1e-14)
    assert run(spec({"kind": "constant_temperature", "value": 2.0, "learnable": False}))[0] == pytest.approx(want)
    # YaRN: 0.1 ln(s) + 1 = 2 at s = e^10
    assert run(spec({"kind": "yarn_scale", "factor": math.exp(10)}))[0] == pytest.approx(want, abs=1e-12)


def test_local_global_splits_heads():
    out = run(spec({"kind": "local_global", "window": 1, "global_heads": 1}), heads=2)
    assert out[0] == pytest.approx(softmax_out(causal(L), V), abs=1e-14)  # head 0: global
    assert out[1] == pytest.approx(V, abs=1e-14)  # head 1: window 1 sees only itself


def test_prefix_is_bidirectional_inside_the_prefix():
    rows = [[L[0][0], L[0][1], None], [L[1][0], L[1][1], None], L[2]]
    out = run(spec({"kind": "prefix", "length": 2}, causal_=False))[0]
    assert out == pytest.approx(softmax_out(rows, V), abs=1e-14)


def test_masked_row_outputs_zeros_not_nan():
    key_mask = torch.tensor([[False, True, True]])
    out = run("vanilla", key_mask=key_mask)[0]
    rows = [[None, None, None], [None, L[1][1], None], [None, L[2][1], L[2][2]]]
    assert out == pytest.approx(softmax_out(rows, V), abs=1e-14)
    assert out[0] == 0.0


def test_masked_row_has_finite_gradients():
    q, k, v = (t.clone().requires_grad_() for t in tensors())
    out = attnzoo.compile("vanilla")(q, k, v, key_mask=torch.tensor([[False, True, True]]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_explicit_scale_and_positions():
    out = run(spec(), positions=torch.tensor([5, 6, 7]))[0]  # positions alone change nothing here
    assert out == pytest.approx(softmax_out(causal(L), V), abs=1e-14)
    s = {"name": "t", "attention": {"scale": 0.5}, "transforms": []}
    rows = [[0.5 * x for x in r] for r in L]
    assert run(s)[0] == pytest.approx(softmax_out(causal(rows), V), abs=1e-14)


def test_gqa_shares_kv_heads():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64)
    k, v = torch.randn(2, 2, 5, 3, dtype=torch.float64), torch.randn(2, 2, 5, 3, dtype=torch.float64)
    out = attnzoo.attention(q, k, v, "vanilla", backend="reference")
    full = attnzoo.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), "vanilla", backend="reference")
    torch.testing.assert_close(out, full, rtol=0, atol=0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda v, q, k: v(q[0], k, k), "q must have 4 dims"),
        (lambda v, q, k: v(q, k.float(), k), "share a dtype"),
        (lambda v, q, k: v(q, torch.randn(1, 3, 3, 1, dtype=torch.float64), k), "k and v must have the same"),
        (lambda v, q, k: v(q.repeat(1, 3, 1, 1), k.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1)), "multiple of key"),
        (lambda v, q, k: v(q, k[:, :, :2], k[:, :, :2]), "tokens but q has"),
        (lambda v, q, k: v(q, k, k, positions=torch.tensor([0, 1, 2])), "1-based"),
        (lambda v, q, k: v(q, k, k, positions=torch.tensor([1.0, 2.0, 3.0])), "integer tensor"),
        (lambda v, q, k: v(q, k, k, key_mask=torch.ones(1, 3)), "key_mask must be a bool"),
        (lambda v, q, k: v(q.long(), k.long(), k.long()), "floating-point"),
    ],
)
def test_shape_and_dtype_mistakes_raise_one_clear_valueerror(call, match):
    q, k, _ = tensors()
    with pytest.raises(ValueError, match=match) as info:
        call(attnzoo.compile("vanilla"), q, k)
    assert "\n" not in str(info.value)


def test_param_mistakes_name_the_key():
    variant = attnzoo.compile("ssa-query")
    q, k, v = tensors()
    params = variant.init_params(num_heads=1, head_dim=1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'query_temperature.token_weight' must have shape \(1, 1\)"):
        variant(q, k, v, params={**params, "query_temperature.token_weight": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match="missing parameter 'query_temperature.position_logit'"):
        variant(q, k, v, params={"query_temperature.token_weight": params["query_temperature.token_weight"]})
    with pytest.raises(ValueError, match="unknown parameter 'bogus.x'"):
        variant(q, k, v, params={**params, "bogus.x": torch.zeros(())})


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        attnzoo.compile("vanilla", backend="nope")


def test_explain_lists_every_backend():
    text = attnzoo.explain("selective", device="cpu", dtype=torch.float32, requires_grad=True)
    assert "reference  yes" in text and "blocked    yes" in text and "auto -> blocked" in text
    assert "forward+backward" in text

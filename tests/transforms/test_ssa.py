"""SSA temperatures (docs/papers.md §1) against hand-computed cases, and their properties."""

import math

import pytest
import torch
from hand import causal, gelu, softmax_out

import attnzoo
from attnzoo.transforms.temperature import POSITION_INIT

SQRT2 = math.sqrt(2.0)
Q = [[1.0, -0.5], [0.2, 0.7], [-1.0, 1.5]]
K = [[0.5, 1.0], [-1.0, 0.3], [0.8, -0.6]]
V = [[1.0, 0.0], [2.0, -1.0], [4.0, 3.0]]
U = [0.5, -1.0]
B = 0.3


def dot(a, b):
    return sum(x * y for x, y in zip(a, b, strict=True))


def t_hand(row, i, u=U, b=B, coefficient=lambda b: math.exp(-math.exp(b))):
    """1 + c log(i) + tanh(u · GELU(row)), i 1-based."""
    return 1.0 + coefficient(b) * math.log(i) + math.tanh(dot(u, [gelu(x) for x in row]))


def tensors():
    return tuple(torch.tensor(x, dtype=torch.float64).view(1, 1, 3, 2) for x in (Q, K, V))


def params(kind):
    return {f"{kind}.token_weight": torch.tensor([U], dtype=torch.float64),
            f"{kind}.position_logit": torch.tensor(B, dtype=torch.float64)}


def out_hand(logits, values):
    return [softmax_out(causal(logits), [v[d] for v in values]) for d in range(2)]


def assert_matches(out, logits, values):
    want = out_hand(logits, values)
    for d in range(2):
        assert out[0, 0, :, d].tolist() == pytest.approx(want[d], abs=1e-14)


def test_initial_parameters_are_the_authors_start():
    variant = attnzoo.compile("ssa")
    p = variant.init_params(num_heads=4, head_dim=8, num_kv_heads=2)
    assert set(p) == {"query_temperature.token_weight", "query_temperature.position_logit",
                      "value_temperature.token_weight", "value_temperature.position_logit"}
    assert p["query_temperature.token_weight"].shape == (4, 8)
    assert p["value_temperature.token_weight"].shape == (2, 8)  # rows per key/value head
    assert p["query_temperature.position_logit"].shape == ()
    assert float(p["query_temperature.position_logit"]) == 2.0
    assert math.exp(-math.exp(2.0)) == pytest.approx(6.1797e-4, rel=1e-4)
    assert all(float(p[k].abs().max()) == 0.0 for k in p if k.endswith("token_weight"))


def test_query_temperature_hand_case():
    q, k, v = tensors()
    out = attnzoo.compile("ssa-query")(q, k, v, params=params("query_temperature"))
    logits = [[t_hand(Q[i], i + 1) * dot(Q[i], K[j]) / SQRT2 for j in range(3)] for i in range(3)]
    assert_matches(out, logits, V)


def test_value_temperature_hand_case():
    q, k, v = tensors()
    out = attnzoo.compile("ssa-value")(q, k, v, params=params("value_temperature"))
    logits = [[dot(Q[i], K[j]) / SQRT2 for j in range(3)] for i in range(3)]
    scaled = [[t_hand(V[j], j + 1) * x for x in V[j]] for j in range(3)]
    assert_matches(out, logits, scaled)


def test_key_temperature_scales_keys_not_queries():
    q, k, v = tensors()
    out = attnzoo.compile("ssa-key")(q, k, v, params=params("key_temperature"))
    logits = [[t_hand(K[j], j + 1) * dot(Q[i], K[j]) / SQRT2 for j in range(3)] for i in range(3)]
    assert_matches(out, logits, V)


@pytest.mark.parametrize("coefficient, fn", [
    ("gompertz", lambda b: math.exp(-math.exp(b))),
    ("sigmoid", lambda b: 1 / (1 + math.exp(-b))),
    ("linear", lambda b: b),
])
def test_position_coefficients(coefficient, fn):
    spec = {"name": "p", "transforms": [{"kind": "query_temperature", "token_aware": False,
                                         "position_coefficient": coefficient}]}
    variant = attnzoo.compile(spec)
    q, k, v = tensors()
    b = 0.7
    out = variant(q, k, v, params={"query_temperature.position_logit": torch.tensor(b, dtype=torch.float64)})
    logits = [[(1 + fn(b) * math.log(i + 1)) * dot(Q[i], K[j]) / SQRT2 for j in range(3)] for i in range(3)]
    want = out_hand(logits, V)
    assert out[0, 0, :, 0].tolist() == pytest.approx(want[0], abs=1e-14)
    start = float(variant.init_params(num_heads=1, head_dim=2)["query_temperature.position_logit"])
    assert start == pytest.approx(POSITION_INIT[coefficient])
    assert fn(start) == pytest.approx(1e-5 if coefficient == "linear" else math.exp(-math.exp(2.0)), rel=1e-6)


def test_shared_token_weight_has_one_vector():
    spec = {"name": "s", "transforms": [{"kind": "query_temperature", "token_weight": "shared"}]}
    variant = attnzoo.compile(spec)
    p = variant.init_params(num_heads=3, head_dim=2, dtype=torch.float64)
    assert p["query_temperature.token_weight"].shape == (2,)
    q = torch.tensor(Q, dtype=torch.float64).view(1, 1, 3, 2).repeat(1, 3, 1, 1)
    k = torch.tensor(K, dtype=torch.float64).view(1, 1, 3, 2)
    v = torch.tensor(V, dtype=torch.float64).view(1, 1, 3, 2)
    p["query_temperature.token_weight"] = torch.tensor(U, dtype=torch.float64)
    p["query_temperature.position_logit"] = torch.tensor(B, dtype=torch.float64)
    out = variant(q, k, v, params=p)
    logits = [[t_hand(Q[i], i + 1) * dot(Q[i], K[j]) / SQRT2 for j in range(3)] for i in range(3)]
    for h in range(3):
        assert out[0, h, :, 0].tolist() == pytest.approx(out_hand(logits, V)[0], abs=1e-14)


def test_positions_are_absolute():
    """A chunk at positions 10..12 uses log(10..12), not log(1..3)."""
    q, k, v = tensors()
    positions = torch.tensor([10, 11, 12])
    out = attnzoo.compile("ssa-query")(q, k, v, params=params("query_temperature"), positions=positions)
    logits = [[t_hand(Q[i], i + 10) * dot(Q[i], K[j]) / SQRT2 for j in range(3)] for i in range(3)]
    assert out[0, 0, :, 0].tolist() == pytest.approx(out_hand(logits, V)[0], abs=1e-14)


def test_token_only_ssa_at_init_is_vanilla():
    spec = {"name": "tok", "transforms": [{"kind": "query_temperature", "position_aware": False},
                                          {"kind": "value_temperature", "position_aware": False}]}
    q, k, v = torch.randn(2, 4, 63, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 63, 8, dtype=torch.float64)
    out = attnzoo.attention(q, k, v, spec)
    torch.testing.assert_close(out, attnzoo.attention(q, k, v, "vanilla"), rtol=0, atol=1e-15)


def test_full_ssa_at_init_is_next_to_vanilla():
    q, k, v = torch.randn(1, 2, 127, 8, dtype=torch.float64), *torch.randn(2, 1, 2, 127, 8, dtype=torch.float64)
    diff = (attnzoo.attention(q, k, v, "ssa") - attnzoo.attention(q, k, v, "vanilla")).abs().max()
    assert 0 < diff < 1e-2  # logits scaled by at most 1 + 6e-4 log(127), values by the same


def half_case(n=24, h=2, d=8):
    """float16 q, k, v and SSA params (a sizeable position term), and their exact float64 copies."""
    q, k, v = (torch.randn(1, h, n, d).half() for _ in range(3))
    variant = attnzoo.compile("ssa")
    params = {key: (value + 0.3 * torch.randn_like(value)).half()
              for key, value in variant.init_params(num_heads=h, head_dim=d).items()}
    params = {**params, "query_temperature.position_logit": torch.tensor(0.3).half(),
              "value_temperature.position_logit": torch.tensor(0.5).half()}  # c ≈ 0.26 and 0.19
    wide = {key: value.double() for key, value in params.items()}
    return (q, k, v, params), (q.double(), k.double(), v.double(), wide)


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_float16_positions_past_the_float16_range(backend):
    """log(position) in float16 is inf once the position rounds past 65,504 (from 65,520 on): the position term is
    computed in float32 (numerics contract), so long contexts stay finite and accurate."""
    (q, k, v, params), (q64, k64, v64, params64) = half_case()
    positions = torch.arange(70_000, 70_024)
    truth = attnzoo.compile("ssa", backend="reference")(q64, k64, v64, params=params64, positions=positions)
    out = attnzoo.compile("ssa", backend=backend)(q, k, v, params=params, positions=positions)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    # float16 rounding (eps ~1e-3) of logits scaled by t_q ≈ 3.9 and values by t_v ≈ 3.1: measured ≤ 2e-3 · max
    torch.testing.assert_close(out.double(), truth, rtol=0, atol=4e-3 * float(truth.abs().max()))

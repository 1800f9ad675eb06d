"""Row maps: QK-norm against a float64 formula written here from its definition (not from the reference backend),
composition in spec order, and the contract's one-line refusals."""

import math

import pytest
import torch

import attnzoo
from attnzoo.transforms.base import ParamSpec, RowMapTransform, Slot


def rms(x, gain, eps, over_heads=False):
    """x / sqrt(mean(x²) + eps) * gain: the mean over D (or over heads and D), written out."""
    if over_heads:
        ms = (x * x).sum(dim=(1, 3), keepdim=True) / (x.shape[1] * x.shape[3])
    else:
        ms = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    g = gain if gain.dim() == 1 else gain[:, None, :]
    return x / torch.sqrt(ms + eps) * g


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(D) + causal mask) v with GQA, in float64, by hand."""
    h, hkv, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    weights = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return weights @ v


@pytest.mark.parametrize("gain, over", [("shared", "head"), ("per_head", "head"), ("per_head", "all_heads")])
@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_qk_norm_equals_its_formula_outputs_and_gradients(gain, over, backend):
    torch.manual_seed(0)
    spec = {"name": "qkn", "attention": {"causal": True},
            "transforms": [{"kind": "query_norm", "gain": gain, "over": over, "eps": 1e-5},
                           {"kind": "key_norm", "gain": gain, "over": over, "eps": 1e-5}]}
    variant = attnzoo.compile(spec, backend=backend)
    q = (3 * torch.randn(2, 4, 37, 8, dtype=torch.float64)).requires_grad_()
    k = torch.randn(2, 2, 37, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 37, 8, dtype=torch.float64, requires_grad=True)
    params = {key: (p + 0.5 * torch.randn_like(p)).requires_grad_()
              for key, p in variant.init_params(num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64).items()}
    out = variant(q, k, v, params=params)
    want = causal_attention(rms(q, params["query_norm.gain"], 1e-5, over == "all_heads"),
                            rms(k, params["key_norm.gain"], 1e-5, over == "all_heads"), v)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    cot = torch.randn_like(out)
    inputs = [q, k, v, *params.values()]
    got = torch.autograd.grad(out, inputs, cot)
    expected = torch.autograd.grad(want, inputs, cot)
    for name, a, b in zip(["q", "k", "v", *params], got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


def test_qk_norm_in_flex_and_decoding_match_the_batch_form():
    torch.manual_seed(1)
    ref = attnzoo.compile("qk-norm", backend="reference")
    params = {key: p + 0.3 * torch.randn_like(p) for key, p in ref.init_params(num_heads=4, head_dim=8,
                                                                                 num_kv_heads=2).items()}
    q, k, v = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    want = ref(q.double(), k.double(), v.double(), params={n: p.double() for n, p in params.items()})
    flex = attnzoo.compile("qk-norm", backend="flex")(q, k, v, params=params)
    torch.testing.assert_close(flex.double(), want, rtol=0, atol=2e-5)
    for backend in ("reference", "blocked"):
        variant = attnzoo.compile("qk-norm", backend=backend)
        cache = variant.new_cache(batch=1)
        steps = [variant.prefill(q[:, :, :9], k[:, :, :9], v[:, :, :9], cache, params=params)]
        steps += [variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params)
                  for i in range(9, 40)]
        torch.testing.assert_close(torch.cat(steps, dim=2).double(), want, rtol=0, atol=2e-5)


def test_row_maps_compose_in_spec_order():
    """query_norm then query_temperature: the temperature scales the normalised row (order matters)."""
    torch.manual_seed(2)
    spec = {"name": "norm-then-temp", "attention": {"causal": True},
            "transforms": [{"kind": "query_norm"}, {"kind": "query_temperature", "token_aware": False}]}
    variant = attnzoo.compile(spec, backend="reference")
    params = variant.init_params(num_heads=2, head_dim=4, dtype=torch.float64)
    params["query_temperature.position_logit"] = torch.tensor(-1.0, dtype=torch.float64)  # c = exp(-e^-1)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    c = math.exp(-math.exp(-1.0))
    t = 1 + c * torch.log(torch.arange(1, 7, dtype=torch.float64)).view(1, 1, 6, 1)
    want = causal_attention(rms(q, params["query_norm.gain"], 1e-6) * t, k, v)
    torch.testing.assert_close(variant(q, k, v, params=params), want, rtol=0, atol=1e-12)


class WrongShape(RowMapTransform):
    kind = "drops_a_dim"
    slot = Slot.QUERY

    def parameters(self):
        return [ParamSpec("w", (), 1.0)]

    def map(self, rows, positions, params):
        return rows[..., :-1]


def test_a_row_map_that_changes_the_shape_is_refused_in_one_line():
    reg = attnzoo.new_registry(entry_points=False)
    reg.transforms["drops_a_dim"] = WrongShape
    reg._spec_model = None
    variant = attnzoo.compile({"name": "bad", "transforms": [{"kind": "drops_a_dim"}]}, backend="reference",
                              registry=reg)
    x = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"^transform 'drops_a_dim' \(query\) returned rows of shape") as caught:
        variant(x, x, x)
    assert "\n" not in str(caught.value)

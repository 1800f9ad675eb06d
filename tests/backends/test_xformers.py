"""The xformers backend: on CPU it declines every case with its reason; the attention biases it builds, materialised
on CPU, give the reference's attention (xformers' bias classes need no GPU)."""

import pytest
import torch

import attnzoo
from attnzoo.backends.xformers_backend import attention_bias
from attnzoo.conformance import runner
from attnzoo.registry import get_registry
from attnzoo.transforms.base import Dims, Slot

attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias")


def eager(q, k, v, bias, has_key, scale):
    """softmax(q k^T * scale + bias) v, written out in float64 (rows with no key output 0)."""
    logits = (q @ k.transpose(-1, -2)) * scale + bias
    out = torch.softmax(logits, dim=-1) @ v
    return torch.where(has_key, out, 0.0) if has_key is not None else out


@pytest.mark.parametrize("spec, kind, padded", [
    ("vanilla", attn_bias.LowerTriangularMask, False),
    ("ssa", attn_bias.LowerTriangularMask, False),
    ("local", attn_bias.LowerTriangularFromBottomRightLocalAttentionMask, False),
    ("alibi", torch.Tensor, False),
    ("forgetting", torch.Tensor, False),
    ("local-global", torch.Tensor, False),
    ("vanilla", torch.Tensor, True),
    ("alibi-learnable", torch.Tensor, True),
    ({"name": "chunked", "transforms": [{"kind": "chunked", "chunk": 16}]}, torch.Tensor, False),
    ({"name": "chunked", "transforms": [{"kind": "chunked", "chunk": 7}]}, torch.Tensor, True),
])
def test_the_bias_materialised_on_cpu_gives_the_reference(spec, kind, padded):
    variant = attnzoo.compile(spec, backend="reference")
    plan = variant.plan
    b, h, hkv, n, d = 2, 4, 2, 70, 8
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    params = {key: value + 0.3 * torch.randn(value.shape, generator=gen, dtype=torch.float64)
              for key, value in variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv,
                                                    dtype=torch.float64).items()}
    key_mask = None
    positions = torch.arange(1, n + 1).expand(b, n)
    if padded:  # a left-padded row: tensor bias, its padding queries have no key
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[1, :9] = False
    grouped = plan.split_params(params, Dims(h, d, hkv), q)
    pos = positions.unsqueeze(1)
    qs, ks, vs = (plan.composition.row_scale(slot, t, pos, grouped) for slot, t in
                  ((Slot.QUERY, q), (Slot.KEY, k), (Slot.VALUE, v)))
    ks, vs = ks.repeat_interleave(h // hkv, dim=1), vs.repeat_interleave(h // hkv, dim=1)
    bias, has_key = attention_bias(plan, qs, ks, vs, positions, key_mask, grouped)
    assert isinstance(bias, kind)
    dense = bias if isinstance(bias, torch.Tensor) else bias.materialize((b, h, n, n), dtype=torch.float64)
    got = eager(qs, ks, vs, dense, has_key, plan.logit_scale(d))
    got = plan.composition.row_scale(Slot.OUTPUT, got, pos, grouped)
    want = variant(q, k, v, params=params, key_mask=key_mask)
    keep = key_mask[:, None, :, None] if key_mask is not None else torch.ones((), dtype=torch.bool)
    torch.testing.assert_close(torch.where(keep, got, 0.0), torch.where(keep, want, 0.0), rtol=0, atol=1e-12)


def test_on_cpu_every_case_is_declined_with_its_reason():
    cases = runner.build_cases(get_registry(), ["vanilla", "selective", "softcap"], ["xformers"], (torch.float32,))
    results = runner.run_suite(cases)
    assert results and all(r.status == "unsupported" for r in results), [r.id for r in results if
                                                                         r.status != "unsupported"]
    assert all("no CPU kernels" in r.message for r in results if r.check.startswith("outputs/"))
    text = attnzoo.explain("selective", device="cuda", dtype=torch.float16)
    assert "xformers   no: the accumulator (selective attention) needs F" in text
    assert "not an additive bias" in attnzoo.explain("softcap", device="cuda", dtype=torch.float16)
    assert "an attention sink is not an attention bias" in attnzoo.explain("sink", device="cuda",
                                                                           dtype=torch.float16)

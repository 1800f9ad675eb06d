"""Gradients of q, k, v and every transform parameter pass torch.autograd.gradcheck (float64, GQA, odd N)."""

import pytest
import torch

import attnzoo

SPECS = sorted(attnzoo.get_registry().specs)


@pytest.mark.parametrize("spec", SPECS)
def test_gradcheck_every_shipped_spec(spec):
    variant = attnzoo.compile(spec)
    b, h, hkv, n, d = 1, 4, 2, 5, 3
    q = torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, n, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, n, d, dtype=torch.float64, requires_grad=True)
    init = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    names = sorted(init)
    values = [(init[name] + 0.3 * torch.randn_like(init[name])).requires_grad_() for name in names]

    def fn(q, k, v, *params):
        return variant(q, k, v, params=dict(zip(names, params, strict=True)))

    assert torch.autograd.gradcheck(fn, (q, k, v, *values), eps=1e-6, atol=1e-5, fast_mode=True)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_gradcheck_selective_ssa_odd_lengths_with_masked_rows(n):
    variant = attnzoo.compile("selective-ssa")
    q = torch.randn(2, 2, n, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, n, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, n, 3, dtype=torch.float64, requires_grad=True)
    key_mask = torch.ones(2, n, dtype=torch.bool)
    key_mask[1, 0] = False  # batch row 1: query 0 sees no key at all
    assert torch.autograd.gradcheck(lambda q, k, v: variant(q, k, v, key_mask=key_mask), (q, k, v))


def test_every_parameter_receives_a_gradient():
    variant = attnzoo.compile("selective-ssa")
    params = {k: v.clone().requires_grad_() for k, v in
              variant.init_params(num_heads=2, head_dim=4, dtype=torch.float64).items()}
    q, k, v = torch.randn(3, 1, 2, 9, 4, dtype=torch.float64)
    variant(q, k, v, params=params).square().sum().backward()
    for name, p in params.items():
        assert p.grad is not None and p.grad.abs().max() > 0, name

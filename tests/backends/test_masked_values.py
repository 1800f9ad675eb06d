"""A masked key contributes exactly nothing, whatever its key or value holds (issue 51): a NaN or an infinity at a
padding key or at a key a query may not see yet reaches no output of a query it is hidden from, on every backend
and in decoding; NaN where the reference says NaN (an allowed pair that meets it), nowhere else. The weighing is
a select, not a multiply (0 × NaN is NaN): ``core.numerics.weighted_rows`` and the reference's ``weigh`` against a
formula written out pair by pair."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.backends.reference import weigh
from attnzoo.core.numerics import weighted_rows

SPECS = sorted(p.stem for p in Path(__file__).resolve().parents[2].joinpath("specs").iterdir())
B, H, HKV, N, D = 2, 4, 2, 9, 8
NAN, INF = float("nan"), float("inf")


def by_hand(weights, rows, allowed):
    """sum over the allowed pairs of weight × value, one float at a time (Python's IEEE arithmetic)."""
    *lead, nq, nk = weights.shape
    out = torch.empty(*lead, nq, rows.shape[-1], dtype=torch.float64)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in (*lead, nq, rows.shape[-1]))).tolist():
        *head, i, d = index
        total = 0.0
        for j in range(nk):
            if allowed[(*head, i, j)]:
                total += float(weights[(*head, i, j)]) * float(rows[(*head, j, d)])
        out[tuple(index)] = total
    return out


def assert_same(actual, expected, atol=1e-9):
    """The same NaN and infinities, and the finite elements close."""
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), (actual, expected)
    assert torch.equal(actual == INF, expected == INF) and torch.equal(actual == -INF, expected == -INF)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=0, atol=atol)


@pytest.mark.parametrize("weigher", [weighted_rows, weigh], ids=["weighted_rows", "reference.weigh"])
def test_weighing_selects_the_allowed_pairs_by_hand(weigher):
    torch.manual_seed(5)
    allowed = torch.rand(2, 5, 11) < 0.6
    weights = torch.where(allowed, torch.randn(2, 5, 11, dtype=torch.float64), 0.0)
    weights[0, 1, 2] = 0.0  # an allowed weight of exactly 0 (softpick's rectified weights)
    weights[1, 3, :] = -weights[1, 3, :].abs()  # negative weights flip an infinity's sign
    rows = torch.randn(2, 11, 3, dtype=torch.float64)
    rows[0, 2, 0], rows[0, 4, 1], rows[0, 6, 2], rows[1, 3, 0], rows[1, 5, 0], rows[1, 7, 1] = (
        NAN, INF, -INF, INF, -INF, NAN)
    allowed[0, 1, 2] = True
    assert_same(weigher(weights, rows, allowed), by_hand(weights, rows, allowed))
    finite = torch.randn(2, 11, 3, dtype=torch.float64)  # finite rows: the product itself
    torch.testing.assert_close(weigher(weights, finite, allowed), weights @ finite, rtol=0, atol=1e-12)
    zero, nan = torch.zeros(1, 1, 1, dtype=torch.float64), torch.full((1, 1, 1), NAN, dtype=torch.float64)
    assert math.isnan(float(weigher(zero, nan, torch.ones(1, 1, 1, dtype=torch.bool))))  # allowed: 0 × NaN is NaN


def _inputs(case, dtype=torch.float64):
    """q, k, v, key_mask, and which outputs may see the planted element: ``seen`` (B, N) bool per query."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, N, D, dtype=dtype, generator=g)
    k, v = (torch.randn(B, HKV, N, D, dtype=dtype, generator=g) for _ in range(2))
    key_mask = None
    seen = torch.zeros(B, N, dtype=torch.bool)
    if case.startswith("padding"):  # row 0 left-padded by 3; the padding key 1 holds the element
        key_mask = torch.ones(B, N, dtype=torch.bool)
        key_mask[0, :3] = False
        (k if case == "padding-key" else v)[0, :, 1] = NAN
    else:  # row 1's key 6 holds it: the queries before it must not see it
        v[1, :, 6] = NAN if case == "future-nan" else INF
        seen[1, 6:] = True
    return q, k, v, key_mask, seen


@pytest.mark.parametrize("case", ["padding-value", "padding-key", "future-nan", "future-inf"])
@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_masked_element_reaches_no_hidden_query(spec, backend, case):
    """Every query hidden from the planted element computes what it computes with a 0 there; a query that sees it
    (causal, not padding) is where the reference puts NaN and infinities, and the backend puts them there too."""
    variant = attnzoo.compile(spec, backend=backend)
    params = {name: t + 0.3 * torch.randn_like(t) for name, t in
              variant.init_params(num_heads=H, head_dim=D, num_kv_heads=HKV, dtype=torch.float64).items()}
    q, k, v, key_mask, seen = _inputs(case)
    out = variant(q, k, v, params=params, key_mask=key_mask)
    clean = variant(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0), params=params, key_mask=key_mask)
    hidden = ~seen[:, None, :, None].expand_as(out)
    if key_mask is not None:
        hidden = hidden & key_mask[:, None, :, None]  # padding queries' outputs are anything
    torch.testing.assert_close(out[hidden], clean[hidden], rtol=0, atol=1e-10)
    if backend != "reference":
        ref = attnzoo.compile(spec, backend="reference")(q, k, v, params=params, key_mask=key_mask)
        rows = seen[:, None, :, None].expand_as(out)
        assert_same(out[rows], ref[rows], atol=1e-8)


@pytest.mark.parametrize("spec", ["vanilla", "selective", "softpick", "forgetting"])
def test_gradients_of_the_hidden_queries_ignore_a_padding_nan(spec):
    """A NaN value at a padding key: the real queries' loss has the gradients it has with a 0 there."""
    variant = attnzoo.compile(spec, backend="blocked")
    q, k, v, key_mask, _ = _inputs("padding-value")
    real = key_mask[:, None, :, None].expand(B, H, N, D)

    def grads(v_in):
        leaves = [t.clone().requires_grad_() for t in (q, k, v_in)]
        out = variant(*leaves, key_mask=key_mask)
        out[real].square().sum().backward()
        return [t.grad for t in leaves]

    with_nan, with_zero = grads(v), grads(v.nan_to_num(0.0))
    for a, b in zip(with_nan, with_zero, strict=True):  # the real tokens' gradients (row 0 from its token 3 on)
        torch.testing.assert_close(a[0, :, 3:], b[0, :, 3:], rtol=0, atol=1e-10)
        torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("spec", ["vanilla", "h2o", "tova", "selective-pruned", "streaming", "local", "forgetting"])
def test_a_padded_prompt_with_nan_decodes_as_with_zeros(spec, backend):
    """A left-padded batch whose padding keys and values are NaN decodes every real token as with zeros there:
    the prefill, the lean steps after it (fused or torch) and eviction."""
    variant = attnzoo.compile(spec, backend=backend)
    prompt, steps = 7, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, prompt + steps, D, dtype=torch.float64, generator=g)
    k, v = (torch.randn(B, HKV, prompt + steps, D, dtype=torch.float64, generator=g) for _ in range(2))
    key_mask = torch.ones(B, prompt, dtype=torch.bool)
    key_mask[0, :4] = False
    pad = ~key_mask[:, None, :, None].expand(B, HKV, prompt, D)
    budget = 5 if variant.spec.cache is not None else None

    def run(fill):
        kk, vv = k.clone(), v.clone()
        kk[:, :, :prompt][pad] = fill
        vv[:, :, :prompt][pad] = fill
        cache = variant.new_cache(batch=B, budget=budget)
        with torch.no_grad():
            outs = [variant.prefill(q[:, :, :prompt], kk[:, :, :prompt], vv[:, :, :prompt], cache, key_mask=key_mask)]
            for t in range(prompt, prompt + steps):
                outs.append(variant.decode(q[:, :, t:t + 1], kk[:, :, t:t + 1], vv[:, :, t:t + 1], cache))
        return torch.cat(outs, dim=2)

    out, clean = run(NAN), run(0.0)
    real = torch.cat([key_mask, torch.ones(B, steps, dtype=torch.bool)], dim=1)[:, None, :, None].expand_as(out)
    assert torch.isfinite(out[real]).all()
    torch.testing.assert_close(out[real], clean[real], rtol=0, atol=1e-10)


def _marks_only_what_sees_it(backend, spec, case):
    """Outputs of a kernel that weighs over finite values and marks what an allowed pair reaches (float32) against
    the float64 reference: the same NaN and infinities, the rest close."""
    variant, ref = attnzoo.compile(spec, backend=backend), attnzoo.compile(spec, backend="reference")
    q, k, v, key_mask, _ = _inputs(case, torch.float32)
    with torch.no_grad():
        out = variant(q, k, v, key_mask=key_mask)
        want = ref(q.double(), k.double(), v.double(), key_mask=key_mask).float()
    rows = torch.ones_like(out, dtype=torch.bool) if key_mask is None else key_mask[:, None, :, None].expand_as(out)
    assert_same(out[rows], want[rows], atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["padding-value", "future-nan", "future-inf"])
@pytest.mark.parametrize("spec", ["vanilla", "forgetting", "diff"])
def test_flex_marks_only_the_queries_that_see_it(spec, case):
    _marks_only_what_sees_it("flex", spec, case)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["padding-value", "future-nan", "future-inf"])
@pytest.mark.parametrize("spec", ["vanilla", "selective", "diff"])
def test_triton_marks_only_the_queries_that_see_it(spec, case):
    _marks_only_what_sees_it("triton", spec, case)

@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("spec", ["selective", "selective-ssa", "selective-pruned"])
def test_a_padding_query_between_real_tokens_selects_nothing(spec, backend):
    """Padding between a row's real tokens (each padding token at the next real token's position): its query's
    selection would reach the real queries after it through F. The real outputs equal the row without it, in the
    batch form and through a decode cache's prefill."""
    variant = attnzoo.compile(spec, backend=backend)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, H, N, D, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, HKV, N, D, dtype=torch.float64, generator=g) for _ in range(2))
    key_mask = torch.ones(1, N, dtype=torch.bool)
    key_mask[0, 4:6] = False
    positions = torch.tensor([[1, 2, 3, 4, 5, 5, 5, 6, 7]])
    real = key_mask[0]
    alone = variant(q[:, :, real], k[:, :, real], v[:, :, real])
    out = variant(q, k, v, key_mask=key_mask, positions=positions)
    torch.testing.assert_close(out[:, :, real], alone, rtol=0, atol=1e-10)
    cache, alone_cache = variant.new_cache(batch=1, budget=None), variant.new_cache(batch=1, budget=None)
    with torch.no_grad():
        out = variant.prefill(q, k, v, cache, key_mask=key_mask)
        alone = variant.prefill(q[:, :, real], k[:, :, real], v[:, :, real], alone_cache)
    torch.testing.assert_close(out[:, :, real], alone, rtol=0, atol=1e-10)
    torch.testing.assert_close(cache.accumulated()[:, real], alone_cache.accumulated(), rtol=0, atol=1e-10)

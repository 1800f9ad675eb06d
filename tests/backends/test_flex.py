"""The flex backend: conformance on specs that exercise each lowering (row scales, score_mod, mask_mod), and the
cases it must decline with a reason. Each new shape compiles (seconds on CPU), so this covers a few specs; the
full matrix runs with `attnzoo conformance --backend flex`."""

import pytest
import torch

import attnzoo
from attnzoo.conformance import runner


def test_conformance_forward_on_representative_specs():
    cases = runner.build_cases(attnzoo.get_registry(), ["ssa", "alibi", "local-global"], ["flex"], (torch.float32,))
    cases = [c for c in cases if c.check.startswith(("outputs/", "causality"))]
    results = runner.run_suite(cases)
    failures = [f"{r.id}: {r.message}" for r in results if r.status != "pass"]
    assert not failures, failures


@pytest.mark.parametrize("case, reason", [
    (("selective", torch.float32, False), "not a pointwise score_mod"),
    (("vanilla", torch.float32, True), "no backward on CPU"),
    (("vanilla", torch.float64, False), "does not compile float64"),
])
def test_declines_with_a_reason(case, reason):
    spec, dtype, grad = case
    text = attnzoo.explain(spec, device="cpu", dtype=dtype, requires_grad=grad)
    line = next(line for line in text.splitlines() if line.strip().startswith("flex"))
    assert reason in line
    with pytest.raises(attnzoo.UnsupportedError, match=reason):
        attnzoo.compile(spec, backend="flex").backend_for("cpu", dtype, grad)


@pytest.mark.parametrize("spec", ["vanilla", "local"])
def test_a_nan_logit_gives_the_references_nan(spec):
    """FlexAttention's CPU kernel drops a NaN logit (a row that sees a NaN key or holds a NaN query came out finite):
    the flex backend marks those rows NaN by a second pass over the same mask, as the reference has them."""
    ref = attnzoo.compile(spec, backend="reference")
    flex = attnzoo.compile(spec, backend="flex")
    for where in ("query", "key"):
        q = torch.randn(1, 4, 37, 16)
        k, v = (torch.randn(1, 2, 37, 16) for _ in range(2))
        {"query": q[0, 2, 20], "key": k[0, 1, 9]}[where][3] = float("nan")
        want = ref(q.double(), k.double(), v.double())
        got = flex(q, k, v)
        assert bool(want.isnan().any())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)

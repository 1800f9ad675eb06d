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

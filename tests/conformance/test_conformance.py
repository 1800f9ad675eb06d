"""The conformance suite: vectors regenerate (within the tolerance rule, on any x86 CPU), the reference passes,
every broken implementation fails, reports and expected-failure files behave."""

import json
import warnings

import pytest
import torch
from broken import (
    BosUnprotected,
    EvictsNewest,
    registry_replacing,
    registry_with_broken_backends,
)

import attnzoo
from attnzoo.cli import main
from attnzoo.conformance import runner
from attnzoo.conformance.tolerance import check_close
from attnzoo.conformance.vectors import VECTOR_DIR, load, write_all


def run(registry, specs, backends, dtypes=(torch.float64, torch.float32), expected=()):
    cases = runner.build_cases(registry, specs, backends, dtypes)
    return runner.run_suite(cases, list(expected))


def test_vectors_regenerate_within_the_tolerance_rule(tmp_path):
    """float64 results are not bit-identical across CPUs (Intel, AMD) and torch builds: the regenerated vectors
    must carry the same cases and metadata, and tensors equal under the float64 rule, never byte for byte."""
    written = write_all(tmp_path)
    shipped = sorted(p.name for p in VECTOR_DIR.iterdir())
    assert sorted(p.name for p in written) == shipped
    for path in written:
        if path.suffix != ".json":
            continue
        assert json.loads(path.read_text()) == json.loads((VECTOR_DIR / path.name).read_text()), path.name
        _, fresh = load(path.stem, tmp_path)
        _, stored = load(path.stem)
        assert sorted(fresh) == sorted(stored), path.name
        for name, value in stored.items():
            if value.dtype.is_floating_point:
                check_close(f"{path.stem}/{name}", fresh[name], value, None, torch.float64)
            else:
                assert torch.equal(fresh[name], value), f"{path.stem}/{name}"


def test_stored_vectors_pass_when_every_float_moves_by_an_ulp():
    """A CPU that rounds the last bit differently still passes: the vector check is under the tolerance rule."""
    _, stored = load("selective-pruned")
    for name, value in stored.items():
        if value.dtype == torch.float64 and ".expected." in name:
            nudged = torch.nextafter(value, torch.full_like(value, float("inf")))
            check_close(name, nudged, value, None, torch.float64)


def test_vector_metadata_names_cases_and_flags():
    meta = json.loads((VECTOR_DIR / "selective-pruned.json").read_text())
    ids = {c["id"]: c for c in meta["cases"]}
    assert {"single-token", "gqa-17", "odd-length-63", "masked-row", "decode-budget", "decode-tie"} == set(ids)
    assert "eviction-tie" in ids["decode-tie"]["flags"] and "masked-row" in ids["masked-row"]["flags"]
    assert ids["gqa-17"]["comment"] and ids["gqa-17"]["seed"] and meta["spec_hash"]


@pytest.mark.parametrize("spec", sorted(attnzoo.get_registry().specs))
def test_reference_passes_the_whole_suite(spec):
    """One item per registered spec, so xdist spreads the suite's cases over its workers."""
    results = run(attnzoo.get_registry(), [spec], ["reference"])
    assert not runner.failed(results), [r for r in results if r.status == "fail"][:3]
    assert sum(r.status == "pass" for r in results) >= 10, spec
    unsupported = {r.message for r in results if r.status == "unsupported"}
    not_decoded = ("transform 'forgetting_gate' computes per-token features, which decoding does not keep in the "
                   "cache yet")
    no_fast_step = "backend 'reference' offers no fast decoding step (Backend.decode_step)"  # the fast-step check
    assert unsupported <= {"spec has no cache evictor", "spec has no accumulator", not_decoded, no_fast_step}


BROKEN = [
    ("broken_cumsum_keys", "selective", "cumulative sum over keys"),
    ("broken_no_shift", "selective", "one-off shift in the accumulator"),
    ("broken_zero_f_decode", "selective", "F = 0 during cached decoding"),
    ("broken_position_collapse", "ssa-position", "position collapsing to 1 in decoding"),
    ("broken_missing_scale", "vanilla", "missing 1/sqrt(D)"),
    ("broken_last_block", "vanilla", "last block of a row not written"),
    ("broken_temperature_on_keys", "ssa-query", "temperature applied to keys instead of queries"),
]


@pytest.mark.parametrize("backend, spec, bug", BROKEN, ids=[b[2] for b in BROKEN])
def test_suite_catches_broken_backend(backend, spec, bug):
    reg = registry_with_broken_backends()
    results = run(reg, [spec], [backend, "reference"])
    by_backend = {name: [r for r in results if r.backend == name] for name in (backend, "reference")}
    assert not runner.failed(by_backend["reference"])
    assert runner.failed(by_backend[backend]), f"{bug} was not caught"


def test_suite_catches_unprotected_bos():
    results = run(registry_replacing("selective_mask", BosUnprotected), ["selective"], ["reference"])
    failures = [r for r in results if r.status == "fail"]
    assert failures and all(r.check.startswith("vectors/") for r in failures)


def test_suite_catches_evictor_dropping_newest():
    results = run(registry_replacing("selective", EvictsNewest, "evictors"), ["selective-pruned"], ["reference"])
    failures = {r.check for r in results if r.status == "fail"}
    assert "vectors/decode-budget" in failures


def test_nan_poisoned_output_is_reported_as_unwritten():
    results = run(registry_with_broken_backends(), ["vanilla"], ["broken_last_block"], dtypes=(torch.float32,))
    messages = [r.message for r in results if r.status == "fail"]
    assert any("non-finite value" in m for m in messages)


def test_tolerance_rule():
    truth = torch.tensor([1.0, 2.0], dtype=torch.float64)
    check_close("x", truth.float(), truth, truth.float(), torch.float32)
    with pytest.raises(AssertionError, match=r"x: error 0.001 > allowed .* at \(0,\)"):
        check_close("x", truth + 1e-3, truth, truth.float(), torch.float32)
    # a few times the reference's own low-precision error is allowed
    check_close("x", truth + 2.9e-3, truth, truth + 1e-3, torch.float16)


def test_tolerance_is_element_wise_and_not_fooled_by_one_large_entry():
    """A half-precision gradient [200, 0.01 x 9] whose small entries have the wrong sign and are 30x too large
    used to pass: the floor took max|truth| of the whole tensor."""
    truth = torch.tensor([200.3] + [0.01] * 9, dtype=torch.float64)
    low = truth.half().double()  # the reference in float16: each entry rounded
    wrong = truth.clone()
    wrong[1:] = -0.3
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        check_close("grad", truth.to(dtype), truth, low, dtype)
        with pytest.raises(AssertionError, match=r"grad: error 0.31\d* > allowed .* 9 of 10 elements over"):
            check_close("grad", wrong.to(dtype), truth, low, dtype)


def test_tolerance_ignores_non_finite_reference_errors():
    """One inf in the reference-in-dtype used to make the allowance infinite (anything passed)."""
    truth = torch.tensor([1.0, 70000.0, 3.0], dtype=torch.float64)
    low = torch.tensor([1.0, float("inf"), 3.0])  # 70,000 overflows float16
    with pytest.raises(AssertionError, match="error 5 > allowed"):
        check_close("x", torch.tensor([1.0, 70000.0, 8.0]), truth, low, torch.float16)
    check_close("x", torch.tensor([1.0, 70000.0, 3.0]), truth, low, torch.float16)


def test_tolerance_floor_of_an_all_zero_tensor():
    zero = torch.zeros(4, dtype=torch.float64)
    check_close("g", torch.full((4,), 1e-17, dtype=torch.float64), zero, None, torch.float64)
    with pytest.raises(AssertionError):
        check_close("g", torch.full((4,), 1e-3, dtype=torch.float64), zero, None, torch.float64)


def test_expected_failures_xfail_xpass_and_unmatched(tmp_path):
    reg = registry_with_broken_backends()
    cases = runner.build_cases(reg, ["vanilla"], ["broken_missing_scale", "reference"], (torch.float64,))
    entries = ["broken_missing_scale::vanilla::outputs/*", "reference::vanilla::causality[float64]",
               "nothing::matches::this"]
    with pytest.warns(UserWarning, match="matches no test: nothing::matches::this"):
        results = runner.run_suite(cases, entries)
    status = {r.id: r.status for r in results}
    assert status["broken_missing_scale::vanilla::outputs/n127[float64]"] == "xfail"
    assert status["broken_missing_scale::vanilla::gradients/n127[float64]"] == "fail"
    assert status["reference::vanilla::causality[float64]"] == "xpass"
    assert runner.failed(results)


def test_reports(tmp_path):
    reg = registry_with_broken_backends()
    specs, backends = ["vanilla", "h2o"], ["reference", "broken_missing_scale"]
    results = run(reg, specs, backends, dtypes=(torch.float64,))
    head = runner.header(reg, specs, backends, (torch.float64,))
    md = runner.to_markdown(head, results)
    assert "| spec | reference | broken_missing_scale |" in md
    assert "| vanilla | pass (" in md and "FAIL " in md
    data = json.loads(runner.to_json(head, results))
    assert data["header"]["torch"] == torch.__version__ and data["header"]["backends"]["reference"]
    assert data["matrix"]["h2o"]["reference"].startswith("pass")
    assert {r["status"] for r in data["results"]} >= {"pass", "fail", "unsupported"}


def test_cli_conformance(tmp_path, capsys):
    report = tmp_path / "report.md"
    assert main(["conformance", "vanilla", "selective-pruned", "--backend", "reference", "--dtype", "float64",
                 "--report", str(report), "--report", str(tmp_path / "report.json")]) == 0
    assert "| selective-pruned | pass" in report.read_text()
    assert json.loads((tmp_path / "report.json").read_text())["header"]["specs"]["vanilla"]
    out = capsys.readouterr().out
    assert "0 fail" in out
    assert main(["conformance", "nope"]) == 2
    assert "unknown spec 'nope'" in capsys.readouterr().err


def test_unmatched_expected_failure_warns_in_cli(tmp_path):
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("# comment\nreference::vanilla::nothing[float64]\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["conformance", "vanilla", "--backend", "reference", "--dtype", "float64",
                     "--expected-failures", str(xfail)]) == 0
    assert any("matches no test" in str(w.message) for w in caught)


def _plugin_spec_registry(tmp_path):
    import types

    from attnzoo.registry import new_registry

    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\ntransforms: [{kind: selective_mask}]\n")
    module = types.ModuleType("mine")
    module.register_specs = attnzoo.hookimpl(lambda register: register(path))
    return new_registry(entry_points=False, extra_plugins=[("mine", module)])


def test_named_backend_declining_a_plugin_spec_fails(tmp_path):
    """Seen: `0 pass, 0 fail, 15 unsupported`, exit 0, for a plugin spec whose lowering the named backend rejects."""
    reg = _plugin_spec_registry(tmp_path)
    named = run(reg, ["mine"], ["flex"])
    failures = [r for r in named if r.status == "fail"]
    assert failures and {r.status for r in named} == {"fail", "unsupported"}
    assert {r.message for r in named if r.status == "unsupported"} == {"spec has no cache evictor"}
    assert "backend 'flex' declines spec 'mine', which was named for it" in failures[0].message
    assert runner.failed(named)
    listed = run(reg, ["mine"], ["flex"], expected=["flex::mine::*"])
    assert {r.status for r in listed} == {"xfail", "unsupported"} and not runner.failed(listed)
    # not named: the backend's verdict is information, not a failure (other backends ran the spec)
    cases = runner.build_cases(reg, ["mine"], None, (torch.float64,))
    results = runner.run_suite([c for c in cases if c.backend in ("flex", "reference")])
    assert {r.status for r in results if r.backend == "flex"} == {"unsupported"}
    assert not runner.failed(results)


def test_a_run_that_checks_nothing_fails(capsys):
    assert main(["conformance", "selective", "--backend", "flex", "--dtype", "float64"]) == 1
    assert "nothing was checked" in capsys.readouterr().out


def test_cli_device_option(capsys):
    assert main(["conformance", "vanilla", "--backend", "reference", "--device", "nonsense"]) == 2
    assert "unknown device 'nonsense'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["conformance", "vanilla", "--backend", "reference", "--device", "cuda"]) == 2
        assert "not available here" in capsys.readouterr().err

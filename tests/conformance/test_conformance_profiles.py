"""Conformance profiles and filters, and the output a plugin author reads: --quick and --shape/--skip (CLI, pytest
plugin, Python API), one line per declined spec and dtype, FAIL lines with their dtype, a summary that never
contradicts itself, and pytest's collection count equal to the items it lists. Fast: the reference and blocked
backends (flex only declines here), tiny selections, one tiny Triton case."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import pytest
import torch
from broken import registry_with_broken_backends

import attnzoo
from attnzoo.cli import main
from attnzoo.conformance import checks, runner
from attnzoo.conformance.runner import Result

F64 = (torch.float64,)
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _checks(cases) -> list[str]:
    return [c.check for c in cases]


def _shape_part(check: str) -> str | None:
    kind, _, shape = check.partition("/")
    return shape if kind in ("outputs", "gradients") else None


# -- profiles -------------------------------------------------------------------------------------------------------
def test_quick_selects_fewer_cases_and_keeps_every_check():
    reg = attnzoo.get_registry()
    full = runner.build_cases(reg, ["selective"], ["reference"], F64)
    quick = runner.build_cases(reg, ["selective"], ["reference"], F64, profile="quick")
    assert 0 < len(quick) < len(full)
    kinds = {c.split("/")[0] if _shape_part(c) else c for c in _checks(full)}
    assert kinds == {c.split("/")[0] if _shape_part(c) else c for c in _checks(quick)}  # every check, fewer shapes
    assert {c for c in _checks(full) if c.startswith("vectors/")} <= set(_checks(quick))
    assert {_shape_part(c) for c in _checks(quick)} - {None} == set(checks.QUICK_SHAPES)
    assert not [c for c in _checks(quick) if "n1030" in c]
    # the quick shapes cover what the full set's shapes are there for: N = 1, GQA with a masked row at an odd N,
    # offset positions
    shapes = {s.id: s for s in checks.DIFFERENTIAL_SHAPES}
    quick_shapes = [shapes[s] for s in checks.QUICK_SHAPES]
    assert any(s.length == 1 for s in quick_shapes)
    assert any(s.kv_heads < s.heads and s.masked_rows and s.length % 2 for s in quick_shapes)
    assert any(s.offset for s in quick_shapes) and max(s.length for s in quick_shapes) < 100
    half = runner.build_cases(reg, ["selective"], ["reference"], (torch.float16,), profile="quick")
    assert {_shape_part(c) for c in _checks(half)} - {None} == set(checks.HALF_SHAPES)
    with pytest.raises(ValueError, match="unknown conformance profile 'fast'"):
        runner.build_cases(reg, ["vanilla"], ["reference"], F64, profile="fast")


def test_the_quick_estimate_is_shorter_and_only_under_the_interpreter(monkeypatch):
    reg = attnzoo.get_registry()
    full = runner.build_cases(reg, ["selective"], ["triton"], (torch.float32,))
    quick = runner.build_cases(reg, ["selective"], ["triton"], (torch.float32,), profile="quick")
    assert 0 < runner.estimate(quick) < runner.estimate(full) / 2
    assert runner.estimate(runner.build_cases(reg, ["selective"], ["reference"], F64)) == 0  # triton cases only
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runner.interpreted(["reference", "triton"]) and not runner.interpreted(["reference"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runner.interpreted(["triton"])


# -- filters --------------------------------------------------------------------------------------------------------
def test_shape_and_skip_filter_by_check_shape_or_id():
    reg = attnzoo.get_registry()

    def build(**kw):
        return _checks(runner.build_cases(reg, ["selective"], ["reference"], F64, **kw))

    assert build(shapes=["outputs/*"]) == [f"outputs/{s.id}" for s in checks.DIFFERENTIAL_SHAPES]
    assert build(shapes=["gqa-n63"]) == ["outputs/gqa-n63", "gradients/gqa-n63"]
    assert build(shapes=["decode", "*::causality[float64]"]) == ["decode", "causality"]
    skipped = build(skip=["gqa-n1030", "vectors/*"])
    assert "decode" in skipped and not [c for c in skipped if "n1030" in c or c.startswith("vectors/")]
    assert build(shapes=["outputs/*"], skip=["n1*"]) == ["outputs/gqa-n63", "outputs/masked-rows-n33",
                                                         "outputs/offset-gaps-n45", "outputs/gqa-n1030"]
    assert build(profile="quick", shapes=["gradients/*"]) == [f"gradients/{s}" for s in checks.QUICK_SHAPES]
    with pytest.raises(ValueError, match="an empty pattern matches no check"):
        build(shapes=[""])
    with pytest.raises(ValueError, match="skip pattern 'nope' matches no check of this run"):
        build(skip=["nope"])
    with pytest.raises(ValueError, match="shape pattern 'gqa-n1030' matches no check of this run .profile quick"):
        build(profile="quick", shapes=["gqa-n1030"])
    with pytest.raises(ValueError, match="leave no case to run"):
        build(skip=["*"])


def test_cli_filters_and_quick(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["conformance", "vanilla", "--backend", "reference", "--dtype", "float64", "--quick",
                 "--shape", "outputs/*", "--shape", "decode", "--skip", "n1", "--report", str(report)]) == 0
    import json

    ids = [r["id"] for r in json.loads(report.read_text())["results"]]
    assert ids == ["reference::vanilla::outputs/masked-rows-n33[float64]",
                   "reference::vanilla::outputs/offset-gaps-n45[float64]", "reference::vanilla::decode[float64]"]
    assert "3 cases: 3 pass, 0 fail" in capsys.readouterr().out


# -- declined specs: one line per spec and dtype --------------------------------------------------------------------
def _plugin_spec(tmp_path):
    """A plugin's spec that flex declines outright (its accumulator is not a pointwise score_mod), in any dtype."""
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\ntransforms: [{kind: selective_mask}]\n")
    module = types.ModuleType("mine")
    module.register_specs = attnzoo.hookimpl(lambda register: register(path))
    return attnzoo.new_registry(entry_points=False, extra_plugins=[("mine", module)]), path


def test_a_declined_spec_is_one_case_per_dtype(tmp_path):
    reg, _ = _plugin_spec(tmp_path)
    named = runner.run_suite(runner.build_cases(reg, ["mine"], ["flex"], ALL_DTYPES))
    fails = [r for r in named if r.status == "fail"]
    assert [r.id for r in fails] == [f"flex::mine::all-checks[{d}]" for d in ("float64", "float32", "float16",
                                                                                "bfloat16")]
    assert all("declines spec 'mine', which was named for it" in r.message and "not a pointwise score_mod"
               in r.message for r in fails)
    # beside it only the checks that do not apply to the spec at all (it has no evictor), with their own reason
    not_applicable = {(check, "spec has no cache evictor") for check in ("evictor", "evicted-decode", "padded-decode")}
    assert {(r.check, r.message) for r in named if r.status != "fail"} == not_applicable
    assert len(runner.failure_lines(named)) == 4
    # not named: one unsupported case per dtype, with the reason, and no failure
    cases = runner.build_cases(reg, ["mine"], None, ALL_DTYPES)
    flex = runner.run_suite([c for c in cases if c.backend == "flex"])
    assert [r.check for r in flex if r.check not in ("evictor", "evicted-decode", "padded-decode")] == \
        ["all-checks"] * 4
    assert {r.status for r in flex} == {"unsupported"} and not runner.failure_lines(flex)
    assert "not a pointwise score_mod" in runner.matrix(flex)["mine"]["flex"]
    # an expected-failures pattern still covers it
    listed = runner.run_suite(runner.build_cases(reg, ["mine"], ["flex"], F64), ["flex::mine::*"])
    assert {r.status for r in listed} == {"xfail", "unsupported"} and not runner.failed(listed)


def test_a_mode_a_backend_never_implements_is_one_unsupported_line_per_check(capsys):
    """vanilla on flex (CPU): forward runs; decode (flex has no extend) and gradients (no CPU backward) are
    unsupported with their reasons, never failures."""
    reg = attnzoo.get_registry()
    cases = runner.build_cases(reg, ["vanilla"], ["flex"], (torch.float32,), shapes=["decode", "gradients/n1"])
    results = runner.run_suite(cases)
    assert [(r.check, r.status) for r in results] == [("gradients/n1", "unsupported"), ("decode", "unsupported")]
    assert "does not implement decoding" in results[1].message and "no backward on CPU" in results[0].message


def test_cli_declined_plugin_spec_prints_one_fail_line_per_dtype(tmp_path, monkeypatch, capsys):
    import attnzoo.registry

    _, path = _plugin_spec(tmp_path)
    fresh = attnzoo.new_registry(entry_points=False)  # the spec file registers 'mine': not in the shared registry
    monkeypatch.setattr(attnzoo.registry, "get_registry", lambda: fresh)
    assert main(["conformance", str(path), "--backend", "flex", "--dtype", "float64", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert [line.split(": ", 1)[0] for line in fails] == ["FAIL flex::mine::all-checks[float64]",
                                                          "FAIL flex::mine::all-checks[float32]"], out
    assert "nothing was checked" not in out and "FAILED: 2 failed" in out
    # the evictor checks (evictor, evicted-decode, padded-decode): not applicable
    assert "8 cases: 0 pass, 2 fail, 6 unsupported, 0 xfail, 0 xpass" in out


# -- FAIL lines and summaries ---------------------------------------------------------------------------------------
def test_fail_lines_show_the_dtype(monkeypatch, capsys):
    import attnzoo.registry

    reg = registry_with_broken_backends()
    monkeypatch.setattr(attnzoo.registry, "get_registry", lambda: reg)
    assert main(["conformance", "vanilla", "--backend", "broken_missing_scale", "--dtype", "float64",
                 "--dtype", "float32", "--shape", "outputs/n127"]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 2, out
    assert fails[0].startswith("FAIL broken_missing_scale::vanilla::outputs/n127[float64]: outputs n127: out")
    assert fails[1].startswith("FAIL broken_missing_scale::vanilla::outputs/n127[float32]: ")
    assert "FAIL 2/2: outputs/n127[float64]" in out.split("\nFAIL ")[0]  # the matrix cell keeps its dtype too


def test_identical_failures_of_one_spec_and_dtype_are_one_line():
    results = [Result(f"b::s::{c}[float32]", "s", "b", "float32", c, "fail", "same") for c in ("x", "y", "z")]
    results.append(Result("b::s::x[float64]", "s", "b", "float64", "x", "fail", "same"))
    assert runner.failure_lines(results) == ["FAIL b::s::x[float32] (and 2 more with this message: y, z): same",
                                             "FAIL b::s::x[float64]: same"]


@pytest.mark.parametrize("statuses, verdict", [
    (["fail"] * 21, "FAILED: 21 failed"),
    (["fail", "unsupported", "unsupported"], "FAILED: 1 failed"),
    (["unsupported"] * 3, "nothing was checked: every case was unsupported (see the reasons above)"),
    (["xpass", "unsupported"], "FAILED: 1 expected failure passed"),
    (["pass", "xfail", "unsupported"], "ok: 1 passed, 1 failed as expected, 1 unsupported (declined or not "
                                       "applicable)"),
    ([], "nothing was checked: no case to run"),
])
def test_the_summary_never_contradicts_itself(statuses, verdict):
    results = [Result(f"b::s::c{i}[float32]", "s", "b", "float32", f"c{i}", s) for i, s in enumerate(statuses)]
    counts, said = runner.summary(results)
    assert said == verdict
    numbers = [int(n) for n in re.findall(r"(\d+) (?:pass|fail|unsupported|xfail|xpass)", counts)]
    assert counts.startswith(f"{len(results)} case") and sum(numbers) == len(results)
    assert ("FAILED" in said) == any(s in ("fail", "xpass") for s in statuses)
    assert said.startswith("FAILED") or said.startswith("ok") or not runner.checked(results)


def test_cli_summary_all_unsupported(capsys):
    assert main(["conformance", "selective", "--backend", "flex", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    assert "1 case: 0 pass, 0 fail, 1 unsupported" in out and "FAIL" not in out
    assert "nothing was checked: every case was unsupported" in out


def test_triton_under_the_interpreter_prints_an_estimate_up_front(monkeypatch, capsys):
    """One tiny Triton case (N = 1, forward) in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["conformance", "vanilla", "--backend", "triton", "--dtype", "float32", "--shape", "outputs/n1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("estimate: about ") and "triton cases in Triton's interpreter" in lines[0]
    assert any(line.startswith("1 case: 1 pass") and " in " in line for line in lines)


# -- the pytest plugin ----------------------------------------------------------------------------------------------
def _pytest(tmp_path, *args):
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    pass\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--attnzoo-conformance", "--attnzoo-spec", "vanilla", "--attnzoo-backend", "reference",
                           "--attnzoo-dtype", "float64", *args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)


def test_pytest_collection_count_equals_the_listed_items(tmp_path):
    run = _pytest(tmp_path, "--attnzoo-quick", "--collect-only", "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    listed = [line for line in run.stdout.splitlines() if "::" in line]
    conformance = [line for line in listed if "attnzoo-conformance" in line]
    expected = runner.build_cases(attnzoo.get_registry(), ["vanilla"], ["reference"], F64, profile="quick")
    assert len(conformance) == len(expected) and len(listed) == len(expected) + 1
    assert f"{len(listed)} tests collected" in run.stdout, run.stdout[-500:]
    # -k deselects among them, and the count says so
    run = _pytest(tmp_path, "--attnzoo-quick", "--collect-only", "-q", "-k", "not causality and not plain")
    kept = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(kept) == len(listed) - 2 and f"{len(kept)}/{len(listed)} tests collected (2 deselected)" in run.stdout


def test_pytest_plugin_profile_and_filters(tmp_path):
    run = _pytest(tmp_path, "--attnzoo-shape", "outputs/*", "--attnzoo-skip", "gqa-n1030", "--collect-only", "-q")
    ids = [line.rsplit("::", 1)[-1] for line in run.stdout.splitlines() if "attnzoo-conformance" in line]
    assert ids == [f"outputs/{s.id}[float64]" for s in checks.DIFFERENTIAL_SHAPES if s.id != "gqa-n1030"]
    run = _pytest(tmp_path, "--attnzoo-quick", "--attnzoo-shape", "gqa-n1030")
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "matches no check of this run" in lines[0], lines

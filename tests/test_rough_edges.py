"""What a newcomer met (issue "The outsider's path"): each rough edge fixed, one test each."""

import json
import subprocess
import sys
import types

import pytest
import torch

import attnzoo
from attnzoo.backends.triton import codegen
from attnzoo.bench import main as bench_main
from attnzoo.cli import main
from attnzoo.plan import Plan
from attnzoo.registry import PluginWarning, new_registry
from attnzoo.transforms.base import RowScaleTransform, Slot
from attnzoo.transforms.logits import Softcap
from attnzoo.transforms.lowering import TritonLogits


def _one_line_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("text, want", [
    ("name: x\ntransforms:\n  - {kind: softcap, capp: 3}\n",
     "transforms[0].capp: unknown key (did you mean 'cap'?); valid keys: cap, kind"),
    ("name: x\ntransforms:\n  - {kind: sofcap, cap: 3}\n", "unknown kind 'sofcap' (did you mean 'softcap'?)"),
    ("name: x\nattention: {causall: true}\n", "attention.causall: unknown key (did you mean 'causal'?); valid keys:"),
    ("name: x\ncache: {evictor: h2o, budgt: 3}\n", "cache.budgt: unknown key (did you mean 'budget'?)"),
])
def test_misspellings_get_did_you_mean_and_the_valid_keys(tmp_path, capsys, text, want):
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    assert want in _one_line_exit_2(capsys, ["validate", str(path)])


def test_unknown_spec_name_gets_did_you_mean(capsys):
    assert "(did you mean 'selective'?)" in _one_line_exit_2(capsys, ["explain", "selectve"])
    assert "(did you mean 'selective'?)" in _one_line_exit_2(capsys, ["conformance", "selectve"])
    assert "(did you mean 'blocked'?)" in _one_line_exit_2(capsys, ["conformance", "vanilla", "--backend", "blockd"])


def test_explain_on_a_device_torch_does_not_know(capsys):
    assert _one_line_exit_2(capsys, ["explain", "ssa", "--device", "tpu"]).startswith("attnzoo: unknown device 'tpu'")


def test_conformance_report_that_cannot_be_written_stops_before_the_run(capsys, monkeypatch):
    from attnzoo.conformance import runner

    monkeypatch.setattr(runner, "run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    line = _one_line_exit_2(capsys, ["conformance", "vanilla", "--report", "/nonexistent/x.md"])
    assert line == "attnzoo: --report /nonexistent/x.md: no such directory '/nonexistent'"


def test_conformance_takes_spec_files(tmp_path, capsys):
    path = tmp_path / "good.yaml"
    path.write_text("name: good\ntransforms:\n  - {kind: softcap, cap: 20.0}\n")
    report = tmp_path / "report.json"
    assert main(["conformance", str(path), "--backend", "reference", "--dtype", "float64",
                 "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert list(data["matrix"]) == ["good"] and {r["spec"] for r in data["results"]} == {"good"}
    assert not [r for r in data["results"] if r["status"] == "fail"]


@pytest.mark.subprocess
def test_pytest_plugin_with_an_unknown_plugin_is_one_line_and_exit_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--attnzoo-conformance",
                          "--attnzoo-plugin", "nonexistent"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert len(lines) == 1 and "no loaded plugin is named 'nonexistent'" in lines[0], lines
    assert "INTERNALERROR" not in run.stdout + run.stderr


def test_help_texts_are_plain_and_complete(capsys):
    """Every argument of every command has a help text, and none shows raw RST backticks."""
    import argparse

    from attnzoo.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction) and name != "bench":
                assert action.help and "``" not in action.help, (name, action.dest)


def test_bench_with_lengths_skips_the_memory_phase(tmp_path, monkeypatch):
    from attnzoo import bench

    seen = {}
    monkeypatch.setattr(bench, "run_benchmark", lambda cfg, log=print: seen.update(cfg=cfg) or {})
    monkeypatch.setattr(bench, "to_markdown", lambda result: "")
    monkeypatch.setattr(bench, "plot", lambda result, path: False)
    bench_main(["vanilla", "--lengths", "64", "128", "--out", str(tmp_path)])
    assert seen["cfg"].lengths == (64, 128) and seen["cfg"].memory_lengths == ()
    bench_main(["vanilla", "--lengths", "64", "--memory-lengths", "256", "--out", str(tmp_path)])
    assert seen["cfg"].memory_lengths == (256,)


class _Typo(Softcap):
    def triton(self):
        return TritonLogits(forward="{cap} * tl.tanh({x} / {p_weight})", derivative="1.0")


class _Unparsable(Softcap):
    def triton(self):
        return TritonLogits(forward="{x} * (2 +", derivative="1.0")


@pytest.mark.parametrize("cls, want", [
    (_Typo, "transform 'softcap': Triton fragment forward '{cap} * tl.tanh({x} / {p_weight})' uses the placeholder "
            "{cap}, which is not one of {x}"),
    (_Unparsable, "transform 'softcap': Triton fragment forward '{x} * (2 +' is not a Python expression"),
])
def test_a_broken_triton_fragment_is_named_with_its_transform(cls, want):
    plan = Plan.from_spec(attnzoo.load_spec("softcap"), attnzoo.get_registry())
    plan.by_slot[Slot.LOGITS][0].__class__ = cls
    assert any(r.startswith(want) for r in codegen.problems(plan)), codegen.problems(plan)


def test_row_scale_of_the_wrong_shape_is_named():
    class Wide(RowScaleTransform):
        kind, slot, summary = "wide_scale", Slot.QUERY, "returns (B, H, N, 1): wrong"

        def scale(self, rows, positions, params):
            return torch.ones(rows.shape[:-1] + (1,), dtype=rows.dtype)

    module = types.ModuleType("wide")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(Wide))
    reg = new_registry(entry_points=False, extra_plugins=[("wide", module)])
    variant = attnzoo.compile({"name": "w", "transforms": [{"kind": "wide_scale"}]}, backend="reference",
                              registry=reg)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"^transform 'wide_scale' \(query\) returned a scale of shape \(1, 2, 5, 1\)"):
        variant(q, q, q)


def test_misspelled_hook_is_named_and_the_plugins_other_hooks_still_work():
    module = types.ModuleType("typo")
    module.register_transfroms = attnzoo.hookimpl(lambda register: None)
    module.register_backends = attnzoo.hookimpl(lambda register: None)
    with pytest.warns(PluginWarning, match=r"unknown hook 'register_transfroms' \(did you mean 'register_transforms'"):
        reg = new_registry(entry_points=False, extra_plugins=[("typo", module)])
    assert reg.plugins["typo"].hooks == ["register_backends"]


@pytest.mark.slow
def test_demo_tells_the_story_in_one_screen(capsys):
    from attnzoo import demo

    assert demo.main([]) == 0
    out = capsys.readouterr().out
    steps = [line.split("  ", 1)[0] for line in out.splitlines() if line[:2] in {f"{i}." for i in range(1, 6)}]
    assert steps == ["1. Declare", "2. Compile", "3. Run", "4. Decode with eviction", "5. Verify"]
    assert len(out.splitlines()) <= 24 and "unsupported" not in out and "0 fail" in out

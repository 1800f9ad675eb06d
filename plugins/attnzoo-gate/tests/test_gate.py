"""The example plugin, tested as its author would, against the installed attnzoo."""

import json
import subprocess
import sys

import pytest
import torch

import attnzoo


def test_discovered_through_the_entry_point():
    reg = attnzoo.get_registry()
    assert reg.origin[("transforms", "sigmoid_output_gate")] == "gate"
    assert reg.plugins["gate"].package == "attnzoo-gate"
    assert reg.plugins["gate"].errors == []
    assert "gated" in reg.specs


def test_listed_by_the_cli():
    out = subprocess.run([sys.executable, "-m", "attnzoo.cli", "list", "--json"], capture_output=True, text=True,
                         check=True).stdout
    data = json.loads(out)
    assert {"kind": "sigmoid_output_gate", "slot": "output", "plugin": "gate"}.items() <= next(
        t for t in data["transforms"] if t["kind"] == "sigmoid_output_gate").items()
    assert any(p["package"] == "attnzoo-gate" and p["version"] == "0.1.0" for p in data["plugins"])


def test_validated_like_a_builtin(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntransforms:\n  - {kind: sigmoid_output_gate, weight: per_token}\n")
    with pytest.raises(attnzoo.SpecError, match=r"bad.yaml: transforms\[0\]\.weight: "):
        attnzoo.load_spec(bad)


def test_gate_computes_its_formula():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    gated = attnzoo.compile("gated", backend="reference")
    params = gated.init_params(num_heads=3, head_dim=4, dtype=torch.float64)
    base = attnzoo.attention(q, k, v, "vanilla", backend="reference")
    torch.testing.assert_close(gated(q, k, v, params=params), base)  # gate is exactly 1 at init
    params["sigmoid_output_gate.weight"] = torch.randn(3, 4, dtype=torch.float64)
    params["sigmoid_output_gate.bias"] = torch.randn(3, dtype=torch.float64)
    gate = 2 * torch.sigmoid(torch.einsum("bhnd,hd->bhn", base, params["sigmoid_output_gate.weight"])
                             + params["sigmoid_output_gate.bias"].view(1, 3, 1))
    torch.testing.assert_close(gated(q, k, v, params=params), base * gate.unsqueeze(-1))


def test_passes_the_conformance_suite_through_the_cli(tmp_path):
    report = tmp_path / "conformance.md"
    # the blocked backend (its fast paths; flex is checked on the shipped specs in tests/backends/test_flex.py, where
    # its torch.compile per shape costs a minute here)
    run = subprocess.run([sys.executable, "-m", "attnzoo.cli", "conformance", "--plugin", "attnzoo-gate",
                          "--backend", "blocked", "--report", str(report)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    text = report.read_text()
    assert "attnzoo-gate 0.1.0" in text
    assert "| gated | pass (" in text


def test_passes_the_conformance_suite_through_the_pytest_plugin(tmp_path):
    # the reference backend only: the CLI test above runs the blocked backend on the same cases
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--attnzoo-conformance",
                          "--attnzoo-plugin", "attnzoo-gate", "--attnzoo-backend", "reference"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "attnzoo conformance: attnzoo" in run.stdout and "attnzoo-gate 0.1.0" in run.stdout
    assert "reference::gated::gradients/gqa-n63[float32] PASSED" in run.stdout
    assert " failed" not in run.stdout

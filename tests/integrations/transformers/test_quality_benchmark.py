"""benchmarks/quality.py (issue 52, item 1) at a tiny size on the real model: one passkey case of 512 tokens at one
depth, one short perplexity text, the full cache and one evicting spec at one kept fraction. Checks the JSON's
shape, the markdown and the plot, and that the full cache answers the pass key. Skipped, with the reason, where
SmolLM2 is neither cached nor convertible here."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from attnzoo.integrations.transformers import models  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def quality():
    try:
        models.ensure(models.SMOLLM2, progress=False)
    except models.ModelError as exc:
        pytest.skip(f"SmolLM2 is not cached and cannot be converted here: {exc}")
    spec = importlib.util.spec_from_file_location("quality_benchmark", ROOT / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evicting_specs_are_discovered_from_the_registry(quality):
    names, aliases = quality.evicting_specs(None)
    assert {"h2o", "tova", "streaming", "selective-pruned"} <= set(names)
    assert "vanilla" not in names and aliases.get("selective") == "selective-pruned"


def test_the_benchmark_runs_at_a_tiny_size(quality, tmp_path):
    result = quality.main(["--contexts", "512", "--depths", "0.5", "--cases", "1", "--fractions", "0.5",
                           "--specs", "streaming", "--ppl-docs", "1", "--ppl-prefix", "96", "--ppl-continuation",
                           "16", "--out", str(tmp_path), "--name", "q", "--plot", str(tmp_path / "q.png"),
                           "--no-progress"])
    saved = json.loads((tmp_path / "q.json").read_text())
    assert set(saved) >= {"meta", "config", "passkey", "ppl", "summary", "kvpress"}
    assert saved["config"]["methods"] == ["full", "streaming"]
    assert saved["meta"]["cpu"] and saved["meta"]["wall_s"] > 0
    full = saved["passkey"]["full"]
    assert len(full) == 1 and full[0]["correct"], full  # the full cache answers the pass key
    assert str(full[0]["key"]) in full[0]["answer"]
    assert [(r["fraction"], r["context"]) for r in saved["passkey"]["streaming"]] == [(0.5, 512)]
    assert saved["summary"]["passkey"]["full"]["1.0"]["512"] == {"correct": 1, "total": 1, "by_depth": {"0.5": [1, 1]}}
    ppl = saved["summary"]["ppl"]
    assert 1 < ppl["full"]["1.0"]["ppl"] < 1000 and 1 < ppl["streaming"]["0.5"]["ppl"] < 1000
    assert 0.4 < saved["held"]["streaming"]["0.5"] <= 0.55  # 48 of 96 prefix tokens held, in bytes
    assert "not measured in this run" in (tmp_path / "q.md").read_text()
    assert (tmp_path / "q.png").stat().st_size > 10_000
    assert result["summary"] == saved["summary"]

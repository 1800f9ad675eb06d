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
                           "--specs", "streaming", "--kv-bits", "none", "4", "--layers", "flat", "pyramid",
                           "--ppl-docs", "1", "--ppl-prefix", "96", "--ppl-continuation",
                           "16", "--out", str(tmp_path), "--name", "q", "--plot", str(tmp_path / "q.png"),
                           "--no-progress"])
    saved = json.loads((tmp_path / "q.json").read_text())
    assert set(saved) >= {"meta", "config", "passkey", "ppl", "summary", "kvpress"}
    assert saved["config"]["methods"] == ["full", "streaming", "streaming+pyramid", "streaming@4",
                                          "streaming@4+pyramid"]
    assert saved["meta"]["cpu"] and saved["meta"]["wall_s"] > 0
    full = saved["passkey"]["full"]
    assert len(full) == 1 and full[0]["correct"], full  # the full cache answers the pass key
    assert str(full[0]["key"]) in full[0]["answer"]
    assert [(r["fraction"], r["context"]) for r in saved["passkey"]["streaming"]] == [(0.5, 512)]
    assert saved["summary"]["passkey"]["full"]["1.0"]["512"] == {"correct": 1, "total": 1, "by_depth": {"0.5": [1, 1]}}
    ppl = saved["summary"]["ppl"]
    assert 1 < ppl["full"]["1.0"]["ppl"] < 1000 and 1 < ppl["streaming"]["0.5"]["ppl"] < 1000
    # half a bfloat16 full cache's bytes: the tokens that fit beside each one's position (int64, per head)
    assert 0.45 < saved["held"]["streaming"]["0.5"] <= 0.5, saved["held"]
    assert saved["config"]["axis"] == "bytes"
    # in 4 bits the same bytes hold ~3x the tokens (240 of 768 bytes a token per layer): more than these short
    # prompts have, so the cache holds them all, in under half the bytes
    assert 0.2 < saved["held"]["streaming@4"]["0.5"] <= 0.5, saved["held"]
    budgets = {m: saved["passkey"][m][0]["budget"] for m in ("streaming", "streaming@4")}
    assert budgets["streaming@4"] > 2.5 * budgets["streaming"], budgets
    # the pyramid holds the same bytes in all (more in early layers, fewer in late ones)
    assert abs(saved["held"]["streaming+pyramid"]["0.5"] - saved["held"]["streaming"]["0.5"]) < 0.01, saved["held"]
    assert "not measured in this run" in (tmp_path / "q.md").read_text()
    assert (tmp_path / "q.png").stat().st_size > 10_000
    assert result["summary"] == saved["summary"]


def test_bytes_per_token_by_hand(quality):
    """SmolLM2's 3 KV heads of 64: a bfloat16 full cache 3 x 2 x 64 x 2 = 768 bytes a token per layer; attnzoo adds
    an int64 position and a float32 per score (snapkv: one) per head; 8 bits: 64 codes + float16 scale and zero
    point per tensor; 4 bits: 32 bytes of codes."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_key_value_heads=3, head_dim=64)
    assert quality.token_bytes(config, None, None) == 768
    assert quality.token_bytes(config, "snapkv", None) == 3 * (256 + 8 + 4)
    assert quality.token_bytes(config, "snapkv", 8) == 3 * (2 * (64 + 4) + 8 + 4)
    assert quality.token_bytes(config, "streaming", 4) == 3 * (2 * (32 + 4) + 8)
    # 12.5% of a 1,024-token bfloat16 cache (98,304 bytes a layer) in 444-byte tokens: 221
    assert quality.byte_budget(0.125, 1024, config, "snapkv", 8) == 98_304 // 444


def test_two_and_three_bit_rows_and_the_contexts_run(quality):
    """--kv-bits takes 3 and 2 (and 3u, 2u): 64 elements in 24 or 16 bytes of codes, the same float16 scale and zero
    point; --run-contexts must be among --contexts (the cases are drawn for all of them)."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_key_value_heads=3, head_dim=64)
    assert quality.token_bytes(config, "snapkv", 3) == 3 * (2 * (24 + 4) + 8 + 4)
    assert quality.token_bytes(config, "snapkv", 2) == 3 * (2 * (16 + 4) + 8 + 4)
    # 12.5% of a 2,048-token bfloat16 cache (196,608 bytes a layer) in 156-byte tokens: 1,260
    assert quality.byte_budget(0.125, 2048, config, "snapkv", 2) == 196_608 // 156 == 1260
    assert [quality.kv_bits_choice(v) for v in ("none", "2", "3u")] == [None, "2", "3u"]
    assert quality.cache_options("snapkv@2u") == {"kv_bits": 2, "kv_rotate": False}
    assert quality.cache_options("snapkv@3") == {"kv_bits": 3}
    args = quality.parse(["--contexts", "1024", "2048", "--run-contexts", "2048", "--kv-bits", "4", "3", "2"])
    assert args.run_contexts == [2048] and args.kv_bits == ["4", "3", "2"]
    for bad in (["--kv-bits", "1"], ["--kv-bits", "5u"], ["--run-contexts", "4096"]):
        with pytest.raises(SystemExit):
            quality.parse(bad)

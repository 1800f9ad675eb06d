"""benchmarks/quality.py --merge: runs on the same passkey cases join into one result (no model needed)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("quality_benchmark_merge", ROOT / "benchmarks" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)


def run(methods: dict, keys=(11111, 22222), ppl: dict | None = None, kvpress=None) -> dict:
    """A result as main() writes it: two passkey cases at 1,024 tokens, the full cache answering both."""
    rows = lambda method, fraction, right: [  # noqa: E731
        {"fraction": fraction, "context": 1024, "depth": 0.5, "case": i, "key": k, "answer": str(k if ok else 0),
         "correct": ok} for i, (k, ok) in enumerate(zip(keys, right, strict=True))]
    passkey = {"full": rows("full", 1.0, (True, True))}
    passkey.update({m: rows(m, 0.25, right) for m, right in methods.items()})
    result = {"meta": {"method_seconds": {"full": 1.0, **{m: 2.0 for m in methods}}, "complete": True,
                       "command": "python benchmarks/quality.py ...", "cpu": "x", "threads": 1, "torch": "t",
                       "transformers": "t", "wall_s": 3.0},
              "config": {"contexts": [1024], "depths": [0.5], "cases": 2, "fractions": [0.25], "seed": 0,
                         "max_new_tokens": 10, "axis": "bytes", "methods": ["full", *methods],
                         "ppl": {"docs": 1, "prefix": 8, "continuation": 4}},
              "aliases": {}, "passkey": passkey,
              "ppl": {"full": [{"fraction": 1.0, "doc": 0, "nll": 4.0, "tokens": 4}], **(ppl or {})},
              "held": {m: {"0.25": 0.25} for m in methods}, "kvpress": kvpress or {"why": "none"}}
    result["summary"] = quality.summarise(result)
    return result


def test_runs_on_the_same_cases_join(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run({"snapkv@4": (True, False)})))
    b.write_text(json.dumps(run({"kvpress KeyDiffPress": (False, False)}, kvpress={"live": {"versions": {}}},
                                ppl={"kvpress KeyDiffPress": [{"fraction": 0.25, "doc": 0, "nll": 8.0, "tokens": 4}]})))
    merged = quality.merge([str(a), str(b)])
    table = merged["summary"]["passkey"]
    assert table["snapkv@4"]["0.25"]["1024"]["correct"] == 1 and table["kvpress KeyDiffPress"]["0.25"]["1024"][
        "correct"] == 0
    assert merged["config"]["methods"] == ["full", "snapkv@4", "kvpress KeyDiffPress"]
    assert merged["kvpress"]["live"] == {"versions": {}}
    assert abs(merged["summary"]["ppl"]["kvpress KeyDiffPress"]["0.25"]["ppl"] - 7.389) < 1e-3  # exp(8 / 4)
    assert "kvpress KeyDiffPress" in quality.to_markdown(merged)


def test_other_cases_or_a_method_twice_are_refused(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(run({"snapkv@4": (True, True)})))
    b.write_text(json.dumps(run({"h2o": (True, True)}, keys=(11111, 33333))))
    c.write_text(json.dumps(run({"snapkv@4": (True, True)})))
    with pytest.raises(SystemExit, match="other passkey cases"):
        quality.merge([str(a), str(b)])
    with pytest.raises(SystemExit, match="'snapkv@4' is in"):
        quality.merge([str(a), str(c)])

"""attnzoo bench on a tiny configuration: the figures are ratios to SDPA from the same run, reports render."""

import json

import pytest

from attnzoo.bench import Config, cpu_model, main, run_benchmark, to_markdown

pytestmark = pytest.mark.slow


def test_tiny_benchmark_reports_ratios():
    cfg = Config(specs=("vanilla", "selective"), lengths=(64,), memory_lengths=(), repeats=1,
                 fresh_process_measurements=False)
    result = run_benchmark(cfg, log=lambda line: None)
    rows = {(r["spec"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in ("vanilla", "selective") for m in ("forward", "forward+backward")}
    for row in rows.values():
        assert row["blocked_vs_sdpa"] == pytest.approx(row["blocked_s"] / row["sdpa_s"])
        assert row["blocked_vs_reference"] == pytest.approx(row["blocked_s"] / row["reference_s"])
    assert "flex_s" in rows[("vanilla", "forward")]
    assert "flex_s" not in rows[("vanilla", "forward+backward")]  # flex declines CPU backward
    assert "flex_s" not in rows[("selective", "forward")]  # and the accumulator
    text = to_markdown(result)
    assert "| selective | 64 | forward+backward |" in text and "blocked / SDPA" in text


def test_cli_writes_json_markdown(tmp_path):
    assert main(["selective", "--lengths", "32", "--memory-lengths", "--repeats", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["rows"] and (tmp_path / "bench.md").read_text().startswith(f"CPU ({cpu_model()}), float32")


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["nope", "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, on one line (attnzoo.cli.Parser)
        main(["vanilla", "--lengths", "0", "--out", str(tmp_path)])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("attnzoo bench: nope: no such file")

"""The experiments (docs/experiments.md): the task generators against hand-made answers, the model's decoding
path against its batch form, and every experiment end to end at a tiny size through the CLI (JSON + plot)."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext

import pytest
import torch

from attnzoo import experiments
from attnzoo.cli import main
from attnzoo.experiments import common, denoising, graph, language_model, pruning, variable_assignment

pytestmark = pytest.mark.slow


def test_variable_assignment_answers_the_latest_value():
    gen = torch.Generator().manual_seed(0)
    tokens, targets, mask = variable_assignment.batch(gen, 200, 6, variables=3, values=5)
    assert tokens.shape == (200, 31) and (tokens[:, 0] == variable_assignment.BOS).all()
    for row, tgt, m in zip(tokens.tolist(), targets.tolist(), mask.tolist(), strict=True):
        latest = {}
        for t in range(6):
            var, val, ask, asked, answer = row[1 + 5 * t: 6 + 5 * t]
            latest[var] = val  # later assignments overwrite earlier ones
            assert ask == variable_assignment.ASK and asked in latest and answer == latest[asked]
            assert m[4 + 5 * t] and tgt[4 + 5 * t] == answer
        assert sum(m) == 6


def test_parity_and_copy_targets():
    gen = torch.Generator().manual_seed(1)
    tokens, targets, mask = pruning.parity_batch(gen, 50, 9)
    for row, tgt, m in zip(tokens.tolist(), targets.tolist(), mask.tolist(), strict=True):
        bits = [t - 1 for t in row[1::2]]
        assert [t - 3 for t in row[2::2]] == [sum(bits[: i + 1]) % 2 for i in range(9)]
        assert [tgt[i] for i in range(len(row)) if m[i]] == row[2::2]  # at b_i the target is p_i
    tokens, targets, mask = pruning.copy_batch(gen, 20, 7, 16)
    assert tokens.shape == (20, 16) and mask.sum() == 20 * 7
    assert torch.equal(tokens[:, 1:8], tokens[:, 9:16]) and (tokens[:, 8] == pruning.SEP).all()
    assert torch.equal(targets[mask].view(20, 7), tokens[:, 1:8])


def test_denoising_bayes_estimator_meets_its_risk():
    gen = torch.Generator().manual_seed(2)
    d, k, sigma_s = 4, 5, 0.5
    tokens, mu, signal = denoising.batch(gen, 40000, 12, k, d, sigma_s, 3.0)
    assert (signal.sum(1) == k).all() and (tokens[:, -1, -1] == 1).all() and (tokens[:, :-1, -1] == 0).all()
    risk = denoising.mse(denoising.bayes_given_labels(tokens, signal, d, sigma_s), mu)
    assert risk == pytest.approx(d * sigma_s**2 / (k + sigma_s**2), rel=0.03)  # the posterior variance, summed
    assert denoising.mse(torch.zeros_like(mu), mu) == pytest.approx(d, rel=0.03)


def test_graph_rows_are_uniform_over_the_degree():
    p = graph.make_graph(torch.Generator().manual_seed(3), 12, [1, 3, 5])
    degree = (p > 0).sum(1)
    assert set(degree.tolist()) <= {1, 3, 5} and torch.allclose(p.sum(1), torch.ones(12))
    assert (p.diagonal() == 0).all()
    assert torch.allclose(p[p > 0], (1.0 / degree.to(p.dtype))[:, None].expand_as(p)[p > 0])


def test_query_temperature_by_its_formula():
    common.seed_everything(0)
    model = graph.OneHead("ssa-query", 6, 8, 8)
    with torch.no_grad():
        for value in model.attn.transform_params.values():
            value.normal_()
    tokens, _, _ = graph.batch(torch.Generator().manual_seed(0), graph.make_graph(torch.Generator(), 6, [2]), 3)
    params = {key: value.detach() for key, value in model.attn.params().items()}
    q = model.q(model.norm(model.embed(tokens)))[:, -1].detach()
    c = math.exp(-math.exp(float(params["query_temperature.position_logit"])))
    u = params["query_temperature.token_weight"].reshape(-1)
    by_hand = [1 + c * math.log(7) + math.tanh(float(torch.nn.functional.gelu(row) @ u)) for row in q]
    assert model.query_temperature(tokens).tolist() == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("spec", ["selective-pruned", "ssa"])
def test_decoding_equals_the_batch_form_without_eviction(spec):
    common.seed_everything(0)
    model = common.TinyTransformer(spec, 20, 32, 2, 2).eval()
    tokens = torch.randint(0, 20, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model.decode_logits(tokens), model(tokens), atol=1e-5, rtol=1e-4)


def test_a_budget_changes_what_selective_decoding_sees():
    common.seed_everything(0)
    model = common.TinyTransformer("selective", 20, 32, 2, 2).with_spec("selective-pruned")
    tokens = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(5))
    full, pruned = model.decode_logits(tokens), model.decode_logits(tokens, budget=4)
    torch.testing.assert_close(full[:, :4], pruned[:, :4])  # nothing evicted yet
    assert (full[:, 5:] - pruned[:, 5:]).abs().max() > 1e-4


def test_with_spec_copies_every_weight():
    common.seed_everything(0)
    model = common.TinyTransformer("selective", 20, 32, 2, 2)
    other = model.with_spec("selective-pruned")
    assert other.blocks[0].attn.spec.name == "selective-pruned"
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_corpus_is_the_documented_text():
    data = language_model.corpus()
    assert len(data) == 1_544_347  # data/README.md
    text = data.decode("utf-8")
    assert "Python" in text and ":func:`len`" not in text and "|release|" not in text
    train, valid = language_model.split(data)
    assert len(train) + len(valid) == len(data) and int(train.max()) < 256
    inputs, targets = language_model.windows(valid, torch.tensor([0, 10]), 8)
    assert (inputs[:, 0] == language_model.BOS).all() and torch.equal(inputs[:, 1:], targets[:, :-1])


TINY = {
    "variable-assignment": ["--steps", "3", "--set", "dim=16", "--set", "heads=2", "--set", "layers=1",
                            "--set", "test_size=20", "--set", "min_assignments=1", "--set", "train_assignments=2",
                            "--set", "test_assignments=[2, 3]"],
    "pruning": ["--steps", "3", "--set", "dim=16", "--set", "heads=2", "--set", "layers=1", "--set", "test_size=4",
                "--set", "parity_bits=5", "--set", "copy_length=4",
                "--set", 'budgets={"parity": [2, 11], "copy": [3, 10]}'],
    "denoising": ["--steps", "3", "--set", "test_size=64", "--set", "n=6", "--set", "k=2"],
    "graph": ["--steps", "3", "--set", "test_size=64", "--set", "nodes=8", "--set", "head_dim=8",
              "--set", "degrees=[1, 2, 4]"],
    "language-model": ["--steps", "2", "--spec", "vanilla", "selective+memory", "--set", "dim=16",
                       "--set", "heads=2", "--set", "layers=1", "--set", "context=12", "--set", "batch=2",
                       "--set", "valid_windows=3", "--set", "budgets=[4, 12]"],
}


# finetune trains the real model: tests/experiments/test_finetune.py runs it from the CLI (slow tier)
@pytest.mark.parametrize("name", [n for n in experiments.EXPERIMENTS if n != "finetune"])
def test_every_experiment_runs_from_the_cli(name, tmp_path, capsys):
    assert main(["experiment", name, "--seed", "0", "1", "--no-progress", "--out", str(tmp_path), *TINY[name]]) == 0
    results = json.loads((tmp_path / f"{name}.json").read_text())
    assert results["experiment"] == name and results["config"]["seeds"] == [0, 1]
    assert results["environment"]["cpu"] and results["runs"] and results["summary"]
    assert {r["seed"] for r in results["runs"]} == {0, 1}
    for plot in results["plots"]:
        assert (tmp_path / plot).stat().st_size > 1000
    out = capsys.readouterr().out
    assert "results:" in out and "±" in out


def test_seeded_runs_repeat():
    kwargs = dict(seeds=[3], steps=3, test_size=64, n=6, k=2)
    a = experiments.run_experiment("denoising", None, show_progress=False, **kwargs)
    b = experiments.run_experiment("denoising", None, show_progress=False, **kwargs)
    for ra, rb in zip(a["runs"], b["runs"], strict=True):
        assert ra["mse"] == pytest.approx(rb["mse"], rel=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["experiment", "varable-assignment"], "invalid choice"),
    (["experiment", "graph", "--set", "nodez=3"], "has no setting 'nodez'"),
    (["experiment", "graph", "--set", "nodes"], "expected KEY=VALUE"),
    (["experiment", "graph", "--spec", "vanila"], "vanilla"),
    (["experiment", "graph", "--steps", "-5"], "steps=-5: must be an integer from 1 to 10,000,000"),
    (["experiment", "graph", "--set", "lr=NaN"], "lr=nan: must be a finite number > 0"),
    (["experiment", "graph", "--set", "lr=abc"], "lr='abc': must be a finite number > 0"),
    (["experiment", "graph", "--set", "batch=0"], "batch=0: must be an integer from 1"),
    (["experiment", "denoising", "--set", "head_dim=-3"], "head_dim=-3: must be an integer from 1"),
    (["experiment", "graph", "--set", "batch=true"], "batch=True: must be an integer"),
    (["experiment", "graph", "--set", "seeds=[]"], "seeds=[]: must be a list of 1 to 1000 integers"),
    (["experiment", "graph", "--set", "nodes=40"], "head_dim (32) must be at least nodes (40)"),
    (["experiment", "graph", "--set", "degrees=[31, 32]"], "every degree must be below nodes (32)"),
    (["experiment", "variable-assignment", "--set", "heads=5"], "dim (96) must be a multiple of heads (5)"),
    (["experiment", "pruning", "--set", 'tasks=["parity", "sort"]'], "unknown task 'sort'"),
    (["experiment", "graph", "--steps", "3", "--set", "steps=2"], "--steps and --set steps= disagree"),
    (["experiment", "graph", "--steps", "1000000"], "pass --yes to run it"),
])
def test_bad_experiment_input_is_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) if "invalid choice" in message else nullcontext():
        code = main([*argv, "--out", str(tmp_path)])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written



def test_set_wins_over_the_defaults_and_the_out_folder_is_checked_first(tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["experiment", "denoising", "--seed", "0", "--no-progress", "--set", "steps=4", "--set", "test_size=64",
            "--set", "n=6", "--set", "k=2", "--spec", "vanilla"]
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads((out / "denoising.json").read_text())["config"]["steps"] == 4
    capsys.readouterr()
    (tmp_path / "a-file").write_text("kept")
    for bad, why in ((tmp_path / "a-file", "exists and is not a folder"),
                     (tmp_path / "a-file" / "below", "is not a folder")):
        assert main([*argv, "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.splitlines()) == 1
    assert (tmp_path / "a-file").read_text() == "kept"


def test_a_long_run_is_estimated_before_it_starts_and_runs_with_yes(tmp_path, capsys, monkeypatch):
    """The estimate comes from steps timed here: a 6-step run passes the gate only with --yes when the limit is
    set below it."""
    from attnzoo import cli

    argv = ["experiment", "graph", "--seed", "0", "--no-progress", "--spec", "vanilla", "--steps", "6",
            "--out", str(tmp_path), *TINY["graph"][2:]]
    monkeypatch.setattr(cli, "LONG_RUN_SECONDS", 0.0)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "h of training (1 models x 6 steps at" in err and "--yes" in err and not list(tmp_path.iterdir())
    assert main([*argv, "--yes"]) == 0
    assert (tmp_path / "graph.json").exists()

"""`attnzoo experiment finetune` (attnzoo/experiments/finetune.py, issue 53) on a 2-layer slice of the real model
(SmolLM2-135M-Instruct, `attnzoo model smollm2`): the loss falls, selective attention's memory loss reaches the
projections that make F, a resumed training ends where an uninterrupted one does, and the whole experiment runs,
saves models that load back, and evaluates them. Skipped where the model is neither cached nor convertible."""

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import attnzoo.nn as zoo_nn  # noqa: E402
from attnzoo import experiments  # noqa: E402
from attnzoo.experiments import common, finetune  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached(smollm2_cached):
    return smollm2_cached


def sliced(spec: str, train: str = "attention"):
    model, tokenizer = finetune.load_model(2)
    finetune._apply(model, finetune.spec_for(spec), None)
    finetune.freeze_for(model, train)
    return model, tokenizer


def batch(tokenizer, n=2, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 20000, (n, length), generator=g)
    ids[:, 0] = tokenizer.bos_token_id
    return ids


def test_selective_gets_its_evictor_and_attention_only_trains_the_projections(cached):
    assert finetune.spec_for("selective").cache.evictor == "selective"  # registered with its evictor
    bare = finetune.spec_for({"name": "mine", "transforms": [{"kind": "selective_mask"}]})
    assert bare.cache.evictor == "selective" and bare.name == "mine-pruned"
    assert finetune.spec_for("ssa").cache is None  # no accumulator: as registered
    assert finetune.spec_for("selective-ssa").cache.budget == 256  # has its evictor: as registered
    model, _ = sliced("ssa")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(any(f".{m}." in n for m in finetune.TRAINED) or ".attnzoo." in n for n in trained)
    assert any(".attnzoo." in n for n in trained)  # SSA's temperatures
    assert not any("mlp" in n or "embed" in n for n in trained)


def test_the_loss_falls_and_the_memory_loss_reaches_the_projections(cached):
    torch.manual_seed(0)
    model, tokenizer = sliced("selective")
    ids = batch(tokenizer)
    with zoo_nn.recording_accumulated(model) as record:
        model(ids, use_cache=False)
    record.memory_loss(eps=0.1).backward()  # the memory loss alone
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj"):  # the selector head's logits make F
            grad = getattr(layer.self_attn, name).weight.grad
            assert grad is not None and float(grad.abs().sum()) > 0, name
    last = model.model.layers[-1].self_attn.v_proj.weight.grad  # F is made of logits: the last layer's values
    assert last is None or float(last.abs().sum()) == 0  # reach no F (an earlier layer's reach later layers' q, k)
    model.zero_grad(set_to_none=True)

    def loss_fn(model, ids):
        return model(ids, labels=ids, use_cache=False).loss

    log = common.train(model, lambda step: ids, 8, 1e-3, loss_fn, "test", False, memory_eps=0.1, warmup=1,
                       log_every=1)
    assert log.done == 8 and log.losses[-1] < 0.9 * log.losses[0], log.losses


class Interrupted(Exception):
    pass


def test_a_resumed_training_ends_where_an_uninterrupted_one_does(cached, tmp_path):
    def loss_fn(model, ids):
        return model(ids, labels=ids, use_cache=False).loss

    def run(folder, stop_at=None):
        torch.manual_seed(0)
        model, tokenizer = sliced("ssa")
        data = [batch(tokenizer, n=1, length=24, seed=s) for s in range(4)]

        def batches(step):
            if step == stop_at:
                raise Interrupted
            return data[step]

        ckpt = finetune.Checkpoints(folder, "f" * 16)
        log = common.train(model, batches, 4, 1e-3, loss_fn, "test", False, transform_lr=1e-2, warmup=1,
                           log_every=1, checkpoints=ckpt, checkpoint_every=2)
        return model, log

    whole, log = run(tmp_path / "whole")
    with pytest.raises(Interrupted):
        run(tmp_path / "cut", stop_at=3)  # the checkpoint of step 2 stays
    assert json.loads((tmp_path / "cut" / "checkpoint.json").read_text())["step"] == 2
    resumed, again = run(tmp_path / "cut")
    assert again.resumed_at == 2 and again.done == 4 and again.steps == log.steps
    torch.testing.assert_close(again.losses, log.losses, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    other = finetune.Checkpoints(tmp_path / "cut", "0" * 16)  # other settings: refused in one line
    with pytest.raises(ValueError, match="written with other settings") as info:
        other.done()
    assert "\n" not in str(info.value)


def test_the_experiment_runs_from_the_cli_saves_and_evaluates(cached, tmp_path, capsys):
    from attnzoo.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["experiment", "finetune", "--seed", "0", "--no-progress", "--out", str(tmp_path), "--steps", "3",
                     "--spec", "vanilla", "selective+memory", "--set", "batch=1", "--set", "context=32",
                     "--set", "layers=2", "--set", "eval_context=32", "--set", "valid_windows=1",
                     "--set", "budgets=[6, 8]", "--set", "checkpoint_every=2",
                     "--set", 'baselines=["streaming"]']) == 0
    assert "results:" in capsys.readouterr().out
    res = json.loads((tmp_path / "finetune.json").read_text())
    by_spec = res["summary"]["by_spec"]
    assert set(by_spec["vanilla"]) == {"full"} and set(by_spec["selective+memory"]) == {"full", "6", "8"}
    assert set(res["summary"]["baselines"]["streaming"]) == {"6", "8"}
    assert all(r["train"]["done"] == 3 and r["tokens"] == 3 * 32 for r in res["runs"])
    assert (tmp_path / "finetune.json").exists() and (tmp_path / "finetune.png").exists()
    model_dir = tmp_path / "finetune" / "selective-memory-seed0" / "model"
    record = json.loads((model_dir / "config.json").read_text())["attnzoo"]
    assert record["name"] == "selective" and record["budget"] == 128
    # run again, writing elsewhere but with the first run's trainings (runs=): loaded, not trained again, the same
    again = experiments.run_experiment(
        "finetune", tmp_path / "again", show_progress=False, specs=["vanilla", "selective+memory"], steps=3,
        batch=1, context=32, layers=2, eval_context=32, valid_windows=1, budgets=[6, 8], checkpoint_every=2,
        baselines=[], runs=str(tmp_path / "finetune"))
    assert not (tmp_path / "again" / "finetune").exists()
    assert all("loaded" in r for r in again["runs"])
    for name, per in by_spec.items():
        for key, value in per.items():
            assert again["summary"]["by_spec"][name][key]["mean"] == pytest.approx(value["mean"], rel=1e-4)


@pytest.mark.parametrize(("key", "value", "why"), [("train", "mlp", "must be one of attention, all"),
                                                    ("minutes", -1, "must be a finite number"),
                                                    ("save", 2, "must be an integer from 0 to 1")])
def test_bad_settings_are_one_line(key, value, why):
    with pytest.raises(ValueError, match=why) as info:
        experiments.config("finetune", **{key: value})
    assert "\n" not in str(info.value) and f"{key}=" in str(info.value)

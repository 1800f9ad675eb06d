"""A transformers model after ``zt.apply``, its sequence sharded over 2 gloo ranks (``zt.shard_sequence``: a
``ShardedAttention`` core in every layer), gives the unsharded model's loss and the gradients of every parameter
(the model's and the spec's) in float64; decoding a sharded model is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned import finish

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

pytest.importorskip("transformers")

VOCAB, N = 64, 23


def _model(spec: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0)
    model = LlamaForCausalLM(config).to(torch.float64)
    zt.apply(model, spec)
    with torch.no_grad():  # trained-looking (random) transform parameters
        for name, p in model.named_parameters():
            if ".attnzoo." in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _loss(model, n_items, **kw):
    labels = kw.pop("shift_labels")
    logits = model(**kw).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum",
                                             ignore_index=-100) / n_items


def _worker(rank, world, store, out_dir, specs):
    from attnzoo.distributed import Layout, sum_gradients
    from attnzoo.integrations import transformers as zt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    failures = []
    try:
        for spec in specs:
            model = _model(spec)
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(0, VOCAB, (2, N), generator=gen)
            labels = ids.clone()
            labels[0, 5] = -100  # an ignored label
            layout = Layout(N, world)
            whole = zt.sequence_shard(Layout(N, 1), 0, ids, labels)
            n_items = int((whole["shift_labels"] != -100).sum())

            truth = _loss(model, n_items, **whole)
            truth.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            model.zero_grad()

            zt.shard_sequence(model, block_size=4)
            if not zt.is_sharded(model):
                failures.append(f"{spec}: not sharded")
            loss = _loss(model, n_items, **zt.sequence_shard(layout, rank, ids, labels))
            loss.backward()
            sum_gradients(model.parameters())
            total = loss.detach().clone()
            dist.all_reduce(total)
            if not torch.allclose(total, truth.detach(), rtol=1e-10, atol=0):
                failures.append(f"{spec}: loss {float(total)} != {float(truth)}")
            for name, p in model.named_parameters():
                if not torch.allclose(p.grad, grads[name], rtol=1e-8, atol=1e-11):
                    failures.append(f"{spec}: grad {name}")
            paths = {m.attnzoo.parallel.last_pairs for m in model.modules() if hasattr(m, "attnzoo")}
            try:
                model.generate(ids[:, :4], max_new_tokens=1)
                failures.append(f"{spec}: generate on a sharded model was not refused")
            except zt.IntegrationError as exc:
                if "unshard_sequence" not in str(exc) or "\n" in str(exc):
                    failures.append(f"{spec}: refusal {exc}")
            zt.unshard_sequence(model)
            if zt.is_sharded(model):
                failures.append(f"{spec}: still sharded")
            failures += [] if paths else [f"{spec}: no layer ran sharded"]
            (out_dir / f"{spec}-{rank}.paths").write_text(json.dumps(sorted(paths)))
    finally:
        dist.destroy_process_group()
    finish(out_dir / f"rank{rank}.json", failures)


def test_a_sharded_transformers_model_equals_the_whole_one(tmp_path):
    specs = ["selective-ssa", "vanilla"]
    mp.start_processes(_worker, args=(2, tmp_path / "store", tmp_path, specs), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == []
    # the kernels that ran: the fused selective pairs and the CPU flash pairs
    assert json.loads((tmp_path / "selective-ssa-0.paths").read_text()) == ["fused"]
    assert json.loads((tmp_path / "vanilla-0.paths").read_text()) == ["flash"]

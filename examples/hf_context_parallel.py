"""A transformers model trained with its sequence sharded (docs/distributed.md): ``zt.apply`` puts a spec in, then
``zt.shard_sequence`` makes every attention layer context-parallel (``ShardedAttention``, sharing the parameters).
Each rank runs the model on its tokens with their true positions and labels shifted along the whole sequence; the
gradients are summed over the ranks. Rank 0 checks the loss and gradients against the unsharded model.

    torchrun --nproc-per-node 2 examples/hf_context_parallel.py --spec selective-ssa --length 2048
    python examples/hf_context_parallel.py          # one process: a world of size 1

A tiny Llama built from a config (no download); gloo on CPU, NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from attnzoo.distributed import Layout, sum_gradients
from attnzoo.integrations import transformers as zt


def loss_of(model, n_items: int, **batch) -> torch.Tensor:
    """This rank's share of the mean next-token loss: its summed cross-entropy over every rank's label count."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["shift_labels"]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                                             ignore_index=-100) / n_items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="selective-ssa", help="spec name or file")
    parser.add_argument("--length", type=int, default=512, help="tokens in the whole sequence")
    parser.add_argument("--method", default="auto", choices=["auto", "ring", "allgather"], help="K/V exchange")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)

    torch.manual_seed(0)  # the same weights and batch on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.length)
    model = zt.apply(LlamaForCausalLM(config).to(device), args.spec)
    ids = torch.randint(0, config.vocab_size, (1, args.length), device=device)
    whole = zt.sequence_shard(Layout(args.length, 1), 0, ids, labels=ids)
    n_items = int((whole["shift_labels"] != -100).sum())

    # the unsharded model's loss and gradients (rank 0 checks against them)
    truth = loss_of(model, n_items, **whole)
    truth.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    zt.shard_sequence(model, method=args.method)  # every attention layer: ShardedAttention, same parameters
    layout = Layout(args.length, world)  # balanced: rank r holds chunks r and 2R-1-r of 2R
    loss = loss_of(model, n_items, **zt.sequence_shard(layout, rank, ids, labels=ids))
    loss.backward()
    sum_gradients(model.parameters())  # each rank holds its tokens' share
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        worst = max(((p.grad - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-30)).item()
                    for name, p in model.named_parameters())
        print(f"{args.spec}: {world} ranks, N = {args.length}: loss {total.item():.6f} (unsharded "
              f"{truth.item():.6f}), largest relative gradient difference {worst:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A model's attention layer run context-parallel (docs/distributed.md): every rank holds its shard of the sequence,
the layer is ``attnzoo.distributed.ShardedAttention``, and rank 0 checks the result against the unsharded layer.

    torchrun --nproc-per-node 4 examples/context_parallel.py --spec selective --length 4096
    python examples/context_parallel.py            # one process: a world of size 1

gloo on CPU, NCCL when CUDA is available (one GPU per rank, ``LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import attnzoo
from attnzoo.distributed import Layout, ShardedAttention, sum_gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="selective", help="spec name or file")
    parser.add_argument("--length", type=int, default=1024, help="tokens in the whole sequence")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
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
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)

    torch.manual_seed(0)  # the same weights and inputs on every rank
    layer = attnzoo.nn.Attention(args.spec, num_heads=args.heads, head_dim=args.head_dim,
                                 num_kv_heads=args.kv_heads, device=device)
    sharded = ShardedAttention.from_attention(layer, method=args.method)  # shares layer's parameters
    n, h, hkv, d = args.length, args.heads, args.kv_heads, args.head_dim
    q, k, v = (torch.randn(1, x, n, d, device=device) for x in (h, hkv, hkv))

    layout = Layout(n, world)  # balanced: rank r holds chunks r and 2R-1-r of 2R
    q_r, k_r, v_r = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
    out_r = sharded(q_r, k_r, v_r, positions=layout.positions(rank, device=device))  # the true positions
    out_r.sum().backward()
    sum_gradients(sharded.parameters())  # each rank holds its queries' share of the parameters' gradients

    every = [torch.empty_like(out_r) for _ in range(world)]
    dist.all_gather(every, out_r.detach().contiguous())
    if rank == 0:
        with torch.no_grad():
            whole = layer(q, k, v)
        error = (layout.unshard(every) - whole).abs().max().item()
        print(f"{args.spec}: {world} ranks ({sharded.parallel.last_method}), N = {n}, max |sharded - whole| = "
              f"{error:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

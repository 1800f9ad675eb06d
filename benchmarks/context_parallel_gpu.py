"""Context-parallel attention on the triton backend's kernels (attnzoo/distributed/kernel_pairs.py): R ranks
against the single-process triton backend on the whole sequence, in the same run; called by
benchmarks/gpu_check.py, or alone:

    python benchmarks/context_parallel_gpu.py [--ranks 2] [--length 16384] [--specs vanilla selective]
                                              [--dtype bfloat16] [--heads 16] [--head-dim 128]

Ranks take the GPUs in turn (rank r on cuda:(r mod GPUs)). With a GPU per rank the group is NCCL; with fewer (2
ranks on 1 GPU: NCCL refuses two ranks on one device) it is gloo, whose exchanges cross through host memory, and
the ranks' kernels queue on the shared GPU: the figure is then the cost of sharding (kernels per pair, host
copies, the merge), not a speedup.

Per spec: **check**, every rank's output and q/k/v gradients against the whole-sequence triton run's (largest
error relative to the largest magnitude); **time**, forward and forward+backward, the slowest rank's wall time
(median of ``--repeats`` rounds, each after a barrier, CUDA synchronised) against the triton backend on the whole
sequence in rank 0 while the others wait. Prints one JSON line of rows (the last line).

``--device cpu --smoke`` (under TRITON_INTERPRET=1) runs the same code at tiny sizes in Triton's interpreter, to
test this script without a GPU; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall(fn, repeats, device, world) -> float:
    """Median over rounds of the slowest rank's milliseconds (after one warm-up call)."""
    fn()
    rounds = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        mine = (time.perf_counter() - start) * 1e3
        every = [None] * world
        dist.all_gather_object(every, mine)
        rounds.append(max(every))
    return statistics.median(rounds)


def _alone(fn, repeats, device, rank) -> float | None:
    """Rank 0's median milliseconds of ``fn`` while the other ranks wait (None elsewhere)."""
    dist.barrier()
    result = None
    if rank == 0:
        fn()
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        result = statistics.median(times)
    dist.barrier()
    return result


def _relative(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(fn, tensors, grad):
    """fn on (q, k, v): the output, and with ``grad`` the q/k/v gradients of cot · output."""
    q, k, v, cot = tensors
    if not grad:
        with torch.no_grad():
            return fn(q, k, v), None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(cot)
    return o, (q.grad, k.grad, v.grad)


def _spec_row(spec, rank, world, layout, device, args) -> dict:
    """Check and time one spec (every rank)."""
    import attnzoo
    from attnzoo.distributed import ContextParallel

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, args.heads, args.length, args.head_dim, generator=gen).to(device, dtype)
             for _ in range(4)]  # q, k, v, cot
    mine = [layout.shard(t, rank).contiguous() for t in whole]
    single = attnzoo.compile(spec, backend="triton")
    cp = ContextParallel(spec, backend="triton", method="ring")
    row = {}
    ref_out, ref_grads = _run(single, whole, True)
    got_out, got_grads = _run(cp, mine, True)
    errors = [_relative(got_out, layout.shard(ref_out, rank))]
    errors += [_relative(g, layout.shard(r, rank)) for g, r in zip(got_grads, ref_grads, strict=True)]
    every = [None] * world
    dist.all_gather_object(every, max(errors))
    row["max_relative_error"] = max(every)
    row["pairs"] = cp.last_pairs
    del ref_out, ref_grads, got_out, got_grads
    for grad in (False, True):
        label = "fwd_bwd" if grad else "fwd"
        row[f"cp_{label}_ms"] = _wall(lambda g=grad: _run(cp, mine, g), args.repeats, device, world)
        row[f"whole_{label}_ms"] = _alone(lambda g=grad: _run(single, whole, g), args.repeats, device, rank)
    return row


def _worker(rank, world, store, args, out):
    from attnzoo.distributed import Layout

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = torch.device(f"cuda:{rank % gpus}") if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    backend = "nccl" if gpus >= world else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    layout = Layout(args.length, world)
    rows = []
    try:
        for spec in args.specs:
            row = {"spec": spec, "n": args.length, "ranks": world, "gpus": gpus, "group": backend}
            try:
                row.update(_spec_row(spec, rank, world, layout, device, args))
            except Exception as exc:  # noqa: BLE001 - report it, go on with the other specs
                row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            rows.append(row)
            if gpus:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (out / "rows.json").write_text(json.dumps(rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--specs", nargs="+", default=["vanilla", "selective", "selective-ssa"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, float32 (the interpreter, on CPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("context_parallel_gpu: no CUDA device here (use --device cpu --smoke under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    if args.smoke:
        args.length, args.heads, args.head_dim, args.repeats, args.dtype = 40, 2, 16, 1, "float32"
        args.specs = args.specs[:2]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.ranks, Path(tmp) / "store", args, Path(tmp)), nprocs=args.ranks,
                           join=True, start_method="spawn")
        rows = json.loads((Path(tmp) / "rows.json").read_text())
    for row in rows:
        for label in ("fwd", "fwd_bwd"):
            if row.get(f"cp_{label}_ms") and row.get(f"whole_{label}_ms"):
                row[f"{label}_vs_whole"] = row[f"cp_{label}_ms"] / row[f"whole_{label}_ms"]
    print(json.dumps(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Context-parallel attention on CPU processes (gloo): bytes sent and time per rank against the sequence length,
and memory per rank at one long length, against the single-process baseline measured in the same run
(docs/distributed.md).

Every rank runs ``torch.set_num_threads(1)``. For each world size a fresh process group is spawned; world size 1
is the baseline: the same sharded code on one rank (no communication), and the ``blocked`` backend (attnzoo's
fastest single-process CPU path) on the same inputs. Times are the median of ``--repeats`` rounds, each after a
barrier: ``wall`` is the slowest rank's, ``cpu`` the mean of the ranks' own CPU time (``time.process_time``),
which does not count waiting for another rank or for a core (with more ranks than cores, wall time includes
queueing for a core). Bytes are what each rank hands to gloo (``attnzoo.distributed.counting``).

The inputs (a rank's shard; the whole sequence for ``blocked``), with ``requires_grad`` set for a backward, exist
before any timing or measurement, for both.

Memory per rank: the peak resident set above what the process held before the call (Linux: the peak is reset
through ``/proc/self/clear_refs`` once the inputs exist and a small warm-up call has set up gloo's buffers), with
glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``), so that every tensor of 128 KiB or more is its
own mapping, counted while alive and returned to the system when freed: the peak is the peak of live tensor bytes
plus small allocations. Memory is measured in processes of its own: the timings run with glibc's default
allocator settings (a fixed threshold makes every large tensor a fresh mapping, which slowed the sharded backward
by up to 1.5x and distorted the time ratios).

    python benchmarks/distributed.py [--ranks 2 4] [--lengths 2048 4096 8192] [--memory-length 16384]
                                     [--specs vanilla selective] [--out benchmarks/results]

Run it under torchrun instead for real devices: see docs/distributed.md (examples/context_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnzoo.bench import rss_kib

MMAP_THRESHOLD = 128 * 1024


def _inputs(n, heads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, head_dim, generator=gen) for _ in range(4)]  # q, k, v, output cotangent


def _shards(layout, rank, tensors, grad):
    """The rank's inputs (q, k, v requiring grad when ``grad``, the output cotangent), made before any measurement:
    both the sharded call and the baseline are measured on inputs that already exist."""
    q, k, v, cot = (layout.shard(t, rank).contiguous() for t in tensors)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, cot


def _call(fn, inputs, grad):
    """One call of ``fn`` (a ContextParallel or a compiled variant) on prepared inputs; with ``grad``, forward and
    backward (the inputs' gradients are dropped first, so they do not accumulate over rounds)."""
    q, k, v, cot = inputs
    if grad:
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(cot)
    else:
        with torch.no_grad():
            fn(q, k, v)


def _timed(fn, base, repeats, world, rank):
    """Interleaved rounds, each after a barrier: ``fn`` on every rank (the slowest rank's wall time, the ranks'
    mean CPU time), then ``base`` (the single-process baseline) on rank 0 alone while the others wait. Returns the
    medians (wall, cpu, base wall; base None off rank 0)."""
    walls, cpus, bases = [], [], []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        cpu = time.process_time() - cpu
        wall = torch.tensor([time.perf_counter() - start, cpu], dtype=torch.float64)
        if world > 1:
            every = [torch.empty_like(wall) for _ in range(world)]
            dist.all_gather(every, wall)
            wall = torch.stack(every)
        else:
            wall = wall[None]
        walls.append(float(wall[:, 0].max()))
        cpus.append(float(wall[:, 1].mean()))
        if world > 1:
            dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            base()
            bases.append(time.perf_counter() - start)
    if world > 1:
        dist.barrier()
    return statistics.median(walls), statistics.median(cpus), statistics.median(bases) if bases else None


def _peak_mib(fn) -> float:
    Path("/proc/self/clear_refs").write_text("5")
    base = rss_kib("VmRSS")
    fn()
    return (rss_kib("VmHWM") - base) / 1024


def _worker(rank, world, store, args, out_dir, phase):
    import attnzoo
    from attnzoo.distributed import ContextParallel, Layout, counting

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    for spec in args.specs:
        cp = ContextParallel(spec, method=args.method, block_size=args.block_size, balanced=args.balanced)
        blocked = attnzoo.compile(spec, backend="blocked")
        warm = _inputs(8 * world, args.heads, args.head_dim)
        _call(cp, _shards(Layout(8 * world, world, args.balanced), rank, warm, True), grad=True)
        for n in sorted({*args.lengths, args.memory_length}):
            layout = Layout(n, world, args.balanced)
            row = {"spec": spec, "world": world, "n": n}
            if n in args.lengths and phase == "time":
                tensors = _inputs(n, args.heads, args.head_dim)
                for grad in (False, True):
                    label = "fwd_bwd" if grad else "fwd"
                    inputs = _shards(layout, rank, tensors, grad)
                    # the whole sequence, as it is, for rank 0's baseline rounds
                    whole = _shards(Layout(n, 1), 0, tensors, grad) if rank == 0 else None
                    with counting() as counter:
                        _call(cp, inputs, grad)
                    row[f"{label}_bytes_per_rank"] = counter.bytes_sent
                    row[f"{label}_bytes_by_kind"] = counter.by_kind
                    row[f"{label}_wall_s"], row[f"{label}_cpu_s"], row[f"blocked_{label}_wall_s"] = _timed(
                        partial(_call, cp, inputs, grad), partial(_call, blocked, whole, grad), args.repeats, world,
                        rank)
                    del inputs, whole
                del tensors
            if n == args.memory_length and phase == "memory":
                small = _inputs(8 * world, args.heads, args.head_dim)
                # one rank running the whole sequence forward+backward through the sharded code takes minutes
                # here: its forward is the baseline unless asked
                grads = (False, True) if world > 1 or args.full_baseline else (False,)
                for grad in grads:
                    label = "fwd_bwd" if grad else "fwd"
                    inputs = _shards(layout, rank, _inputs(n, args.heads, args.head_dim), grad)
                    _call(cp, _shards(Layout(8 * world, world, args.balanced), rank, small, grad), grad)  # warm
                    peak = _peak_mib(partial(_call, cp, inputs, grad))
                    every = [peak]
                    if world > 1:
                        every = [None] * world
                        dist.all_gather_object(every, peak)
                    row[f"{label}_peak_mib_per_rank"] = every
                    del inputs
                if world == 1:
                    for grad in (False, True):
                        label = "fwd_bwd" if grad else "fwd"
                        whole = _shards(Layout(n, 1), 0, _inputs(n, args.heads, args.head_dim), grad)
                        _call(blocked, _shards(Layout(8, 1), 0, small, grad), grad)
                        row[f"blocked_{label}_peak_mib"] = _peak_mib(partial(_call, blocked, whole, grad))
                        del whole
            rows.append(row)
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if "by_kind" not in k}), flush=True)
    if rank == 0:
        (out_dir / f"world{world}-{phase}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def to_markdown(result) -> str:
    cfg = result["config"]
    rows = result["rows"]
    base = {(r["spec"], r["n"]): r for r in rows if r["world"] == 1}
    lines = [
        "# Context-parallel attention on CPU processes (gloo)", "",
        f"`python benchmarks/distributed.py` on {result['cpu']} ({os.cpu_count()} cores visible), torch "
        f"{result['torch']}, one thread per rank; B 1, H {cfg['heads']}, D {cfg['head_dim']}, float32, "
        f"{'balanced' if cfg.get('balanced', True) else 'contiguous'} layout, method {cfg['method']}, block "
        f"{cfg['block_size']}. World size 1 is the same sharded code on one rank. `blocked` is attnzoo's "
        "single-process CPU backend (one thread) on the whole sequence, timed in the same rounds: each round runs "
        "the sharded call on every rank, then `blocked` in rank 0 while the others wait. wall: the slowest rank "
        "(median of the rounds); cpu: the ranks' mean own CPU time.", "",
        "## Bytes and time per rank against the sequence length", "",
        "| spec | N | ranks | fwd MiB sent/rank | fwd+bwd MiB sent/rank | fwd wall s | fwd cpu s | fwd+bwd wall s "
        "| fwd+bwd cpu s | cpu/rank vs 1 rank (fwd+bwd) | `blocked` fwd / fwd+bwd s (same rounds) "
        "| wall vs `blocked` (fwd) | wall vs `blocked` (fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "fwd_wall_s" not in r:
            continue
        b = base.get((r["spec"], r["n"]), {})
        lines.append(
            f"| {r['spec']} | {r['n']} | {r['world']} | {r['fwd_bytes_per_rank'] / 2**20:.2f} | "
            f"{r['fwd_bwd_bytes_per_rank'] / 2**20:.2f} | {r['fwd_wall_s']:.2f} | {r['fwd_cpu_s']:.2f} | "
            f"{r['fwd_bwd_wall_s']:.2f} | {r['fwd_bwd_cpu_s']:.2f} | "
            f"{_ratio(r['fwd_bwd_cpu_s'], b.get('fwd_bwd_cpu_s'))} | "
            f"{r['blocked_fwd_wall_s']:.2f} / {r['blocked_fwd_bwd_wall_s']:.2f} | "
            f"{_ratio(r['fwd_wall_s'], r['blocked_fwd_wall_s'])} | "
            f"{_ratio(r['fwd_bwd_wall_s'], r['blocked_fwd_bwd_wall_s'])} |")
    n = cfg["memory_length"]
    lines += ["", f"## Memory per rank at N = {n}", "",
              "Peak resident memory above the inputs during one call, per rank (MiB; the method is in the "
              "benchmark's docstring). The ideal O(N / R) scaling halves it with each doubling of R.", "",
              "| spec | ranks | fwd MiB/rank (max) | fwd vs 1 rank | fwd vs blocked | fwd+bwd MiB/rank (max) "
              "| fwd+bwd vs blocked |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["n"] != n or "fwd_peak_mib_per_rank" not in r:
            continue
        b = base.get((r["spec"], n), {})
        fwd = max(r["fwd_peak_mib_per_rank"])
        both = max(r["fwd_bwd_peak_mib_per_rank"]) if "fwd_bwd_peak_mib_per_rank" in r else None
        lines.append(f"| {r['spec']} | {r['world']} | {fwd:.0f} | {_ratio(fwd, max(b['fwd_peak_mib_per_rank']))} | "
                     f"{_ratio(fwd, b.get('blocked_fwd_peak_mib'))} | {'-' if both is None else f'{both:.0f}'} | "
                     f"{_ratio(both, b.get('blocked_fwd_bwd_peak_mib'))} |")
    blocked = [(spec, b) for (spec, m), b in sorted(base.items()) if m == n and "blocked_fwd_peak_mib" in b]
    lines += ["", "Single-process `blocked` at the same N: " + ", ".join(
        f"{spec} {b['blocked_fwd_peak_mib']:.0f} MiB forward, {b['blocked_fwd_bwd_peak_mib']:.0f} MiB forward+backward"
        for spec, b in blocked) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (1 always runs)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="timed lengths")
    parser.add_argument("--memory-length", type=int, default=16384, help="the length memory is measured at")
    parser.add_argument("--specs", nargs="+", default=["vanilla", "selective"], help="spec names")
    parser.add_argument("--heads", type=int, default=2, help="query (and key/value) heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument("--method", default="ring", choices=["ring", "allgather", "auto"], help="K/V exchange")
    parser.add_argument("--block-size", type=int, default=256, help="queries per block inside a pair")
    parser.add_argument("--contiguous", dest="balanced", action="store_false",
                        help="the contiguous layout (rank r holds chunk r) instead of the balanced one")
    parser.add_argument("--full-baseline", action="store_true",
                        help="also measure one rank's forward+backward memory at --memory-length (slow)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per timing (the median is kept)")
    parser.add_argument("--out", type=Path, default=None, help="directory for distributed.json and .md")
    args = parser.parse_args(argv)
    from attnzoo.bench import cpu_model

    merged: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # timings in processes with glibc's own allocator settings; memory in processes whose mmap threshold is
        # fixed (an allocation per tensor: it would slow the timings, by up to 1.5x for the sharded backward)
        for phase in ("time", "memory"):
            if phase == "memory":
                os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # inherited by the spawned ranks
            for world in [1, *sorted(set(args.ranks) - {1})]:
                store = Path(tmp) / f"store{world}-{phase}"
                mp.start_processes(_worker, args=(world, store, args, Path(tmp), phase), nprocs=world, join=True,
                                   start_method="spawn")
                for row in json.loads((Path(tmp) / f"world{world}-{phase}.json").read_text()):
                    merged.setdefault((row["spec"], row["world"], row["n"]), {}).update(row)
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    rows = list(merged.values())
    result = {"cpu": cpu_model(), "torch": torch.__version__, "config": {
        "heads": args.heads, "head_dim": args.head_dim, "method": args.method, "block_size": args.block_size,
        "balanced": args.balanced,
        "repeats": args.repeats, "lengths": args.lengths, "memory_length": args.memory_length,
        "specs": args.specs, "ranks": args.ranks, "threads_per_rank": 1,
        "memory_method": f"peak RSS above the inputs, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"}, "rows": rows}
    text = to_markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "distributed.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "distributed.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where selective attention's time goes on CPU: the blocked backend's fused path, phase by phase, against SDPA.

    python benchmarks/selective_phases.py [--length 4096] [--heads 8] [--head-dim 64] [--repeats 5]

Times, in one run and interleaved, ``scaled_dot_product_attention(is_causal=True)`` and the blocked backend's
selective path (forward, and forward + backward), each as the median of ``--repeats``, with two inputs:

- **random**: q, k, v from ``torch.randn`` (as ``attnzoo bench``). The selector's ReLU logits make F grow with
  every query, so most keys become negligible for later queries, and the kernel leaves them out exactly
  (``selective_tiles.Keys``);
- **dense**: the selector head's queries set to 0, so S = 0 and F = 0: no key is ever left out (the worst case
  for the kernel, the same arithmetic as a trained selector that selects nothing).

Then one profiled call per case gives the phases (``torch.profiler`` ranges named in
``attnzoo/backends/selective_kernel.py`` and ``selective_tiles.py``), as ms and as a share of SDPA's time in the
same run. Writes ``--out`` (default benchmarks/results/selective-phases.md) with the CPU model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench import cpu_model


def _inputs(b, h, n, d, dense, grad):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    if dense:
        q[:, 0] = 0.0  # the selector head (head 0): S = ReLU(0) = 0, F = 0
    return [t.requires_grad_(grad) for t in (q, k, v)], torch.randn(b, h, n, d, generator=gen)


def _runs(variant, q, k, v, cot, grad):
    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if grad:
            torch.autograd.grad(out, (q, k, v), cot)

    def selective():
        out = variant(q, k, v)
        if grad:
            torch.autograd.grad(out, (q, k, v), cot)

    return sdpa, selective


def _time(fns, repeats):
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def _phases(fn) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()
            if e.key.startswith(("forward: ", "backward: "))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks/results/selective-phases.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = attnzoo.compile("selective", backend="blocked")
    b, h, n, d = args.batch, args.heads, args.length, args.head_dim
    lines = [f"# Selective attention on CPU, phase by phase ({cpu_model()}, {torch.get_num_threads()} threads)", "",
             f"attnzoo {attnzoo.__version__}, torch {torch.__version__}; float32, B={b}, H={h}, D={d}, N={n}, "
             f"causal; the blocked backend's fused path against `scaled_dot_product_attention(is_causal=True)` "
             f"timed in the same run (median of {args.repeats} interleaved repeats). Phases come from one "
             "profiled call each (the profiler adds a little to them). Written by "
             "`benchmarks/selective_phases.py`.", ""]
    for dense in (False, True):
        label = "dense (no key negligible: the selector's queries are 0)" if dense else "random (torch.randn)"
        lines += [f"## Inputs: {label}", "", "| mode | SDPA ms | selective ms | selective / SDPA |",
                  "|---|---|---|---|"]
        phase_rows = {}
        for grad in (False, True):
            (q, k, v), cot = _inputs(b, h, n, d, dense, grad)
            sdpa, selective = _runs(variant, q, k, v, cot, grad)
            context = torch.no_grad() if not grad else torch.enable_grad()
            with context:
                times = _time({"sdpa": sdpa, "selective": selective}, args.repeats)
                phases = _phases(selective)
            mode = "forward+backward" if grad else "forward"
            lines.append(f"| {mode} | {times['sdpa']:.1f} | {times['selective']:.1f} | "
                         f"{times['selective'] / times['sdpa']:.2f}x |")
            phase_rows[mode] = (times, phases)
            print(f"{label}: {mode}: SDPA {times['sdpa']:.1f} ms, selective {times['selective']:.1f} ms "
                  f"({times['selective'] / times['sdpa']:.2f}x)", file=sys.stderr)
        lines += ["", "| phase (forward+backward call) | ms | share of SDPA's forward+backward |", "|---|---|---|"]
        times, phases = phase_rows["forward+backward"]
        for name, ms in sorted(phases.items(), key=lambda item: (not item[0].startswith("forward"), item[0])):
            lines.append(f"| {name} | {ms:.1f} | {ms / times['sdpa']:.2f} |")
        rest = times["selective"] - sum(phases.values())
        lines += [f"| the unprofiled call minus the phases (allocation, autograd, Python; negative: the profiler's own "
                  f"cost) | {rest:.1f} | {rest / times['sdpa']:.2f} |", ""]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

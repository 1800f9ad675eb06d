"""A prompt scored by an evictor that reads attention probabilities, against one causal SDPA call (issue 52).

One attention layer of SmolLM2-135M's shapes (9 query heads, 3 key/value heads, head_dim 64), batch 1, float32,
``--length`` tokens (4096) prefilled by the blocked backend into an empty cache of budget ``--budget`` (512) for
``snapkv`` (window 32), ``tova`` and ``h2o``, against ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=True, enable_gqa=True)`` on the same q, k, v. Each evictor is timed twice: as it declares
``probability_rows`` (SnapKV its window, TOVA 1: the output by the prompt's one SDPA call, then the last rows'
probabilities; H2O declares every row) and forced to the whole step's (B, H, T, M) probabilities by setting the
cache's ``evictor.probability_rows = None`` (the path before issue 52). Two floors of the same run: ``knorm`` (the same
budget and eviction, scores from the keys, no probabilities) and ``none`` (the prefill with no evictor nor budget:
the cache's append and the prompt's SDPA call). Rounds interleaved, the median kept, ratios
to SDPA's median of the same run. Peak memory: resident memory above the inputs, in a fresh process per measurement
(Linux: the peak is reset once the inputs exist, through /proc/self/clear_refs).

    python benchmarks/prefill_scoring.py [--length 4096] [--rounds 5] [--threads 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench import cpu_model, peak_growth_mib  # the model name from /proc/cpuinfo

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
EVICTORS = {"snapkv": {"window": 32}, "tova": {}, "h2o": {}, "knorm": {}, "none": None}


def inputs(length: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, length, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen)
    return q, k, v


def variant_of(kind: str):
    if EVICTORS[kind] is None:  # the same prefill with no evictor (and no budget)
        return attnzoo.compile({"name": "bench-none"}, backend="blocked")
    return attnzoo.compile({"name": f"bench-{kind}", "cache": {"evictor": kind, **EVICTORS[kind]}},
                           backend="blocked")


def run(case: str, variant, q, k, v, budget: int):
    """One measured call: ``sdpa``, or ``<evictor>`` / ``<evictor>-full`` (the whole step's probabilities)."""
    with torch.no_grad():
        if case == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        cache = variant.new_cache(batch=1, budget=None if case == "none" else budget)
        if case.endswith("-full"):
            cache.evictor.probability_rows = None  # every row: the path before issue 52
        out = variant.prefill(q, k, v, cache)
        assert cache.num_tokens == (q.shape[2] if case == "none" else budget)
        return out


def peak_mib(case: str, length: int, budget: int, threads: int) -> float:
    """Peak resident memory above the inputs and the compiled variant, in a fresh process (MiB), after one warm-up
    call of a shorter prompt (so that one-time imports and builds are not counted)."""
    kind = case.removesuffix("-full")
    setup = (f"import torch, sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
             f"from prefill_scoring import inputs, run, variant_of; torch.set_num_threads({threads});"
             f"v = variant_of({kind!r}) if {case!r} != 'sdpa' else None;"
             f"run({case!r}, v, *inputs({2 * budget}), {budget});"
             f"t = inputs({length})")
    return peak_growth_mib(setup, f"run({case!r}, v, *t, {budget})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=512, help="the cache's budget (tokens)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--out", type=Path, default=None, help="directory for prefill-scoring<tag>.json and .md")
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # other processes' share of the CPUs, which every parallel op waits on
    q, k, v = inputs(args.length)
    variants = {kind: variant_of(kind) for kind in EVICTORS}
    cases = ["sdpa", "snapkv", "snapkv-full", "tova", "tova-full", "h2o", "knorm", "none"]
    times: dict[str, list[float]] = {case: [] for case in cases}
    for case in cases:  # warm up, and the rows path's output checked against the whole step's
        run(case, variants.get(case.removesuffix("-full")), q, k, v, args.budget)
    for _ in range(args.rounds):
        for case in cases:
            start = time.perf_counter()
            run(case, variants.get(case.removesuffix("-full")), q, k, v, args.budget)
            times[case].append(time.perf_counter() - start)
    sdpa = statistics.median(times["sdpa"])
    rows = []
    for case in cases:
        median = statistics.median(times[case])
        peak = None if args.no_memory else peak_mib(case, args.length, args.budget, args.threads)
        per_round = statistics.median(t / s for t, s in zip(times[case], times["sdpa"], strict=True))
        row = {"case": case, "median_ms": median * 1e3, "ratio_to_sdpa": median / sdpa,
               "round_ratio_median": per_round, "times_ms": [t * 1e3 for t in times[case]], "peak_mib": peak}
        rows.append(row)
        print(f"{case:12s} {row['median_ms']:9.1f} ms  {row['ratio_to_sdpa']:6.2f}x SDPA  (per round "
              f"{per_round:5.2f}x)" + (f"  peak {peak:7.1f} MiB" if peak is not None else ""), flush=True)
    header = (f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, backend blocked, "
              f"float32, B 1, H {HEADS}, H_kv {KV_HEADS}, D {HEAD_DIM} (SmolLM2-135M's attention), prompt "
              f"{args.length} tokens into a cache of budget {args.budget}; median of {args.rounds} interleaved "
              f"rounds, same run; `-full`: the evictor forced to the whole step's probabilities (before issue 52); "
              f"load average at the start {load:.1f} on {os.cpu_count()} CPUs.")
    print(header)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"prefill-scoring{args.tag}"
        (args.out / f"{stem}.json").write_text(json.dumps({"setup": header, "rows": rows}, indent=1) + "\n")
        lines = [header, "", "| case | median ms | median / SDPA's | median of the rounds' ratios | peak MiB above the "
                 "inputs |", "|---|---|---|---|---|"]
        for row in rows:
            peak = "" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
            lines.append(f"| {row['case']} | {row['median_ms']:.1f} | {row['ratio_to_sdpa']:.2f}x | "
                         f"{row['round_ratio_median']:.2f}x | {peak} |")
        (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

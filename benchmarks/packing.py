"""Packed documents against the same documents as a batch, measured in one run (docs/packing.md).

Baseline: ``variant(q, k, v)`` on a batch of ``--docs`` rows of ``--length`` tokens. Candidate: the same tokens
packed in one row, ``variant(q, k, v, documents=[length] * docs)``. Both forward and forward+backward, rounds
interleaved, the median kept; the ratio is packed / batch. Peak memory: resident memory above the inputs, in a
fresh process per measurement.

    python benchmarks/packing.py [--specs selective vanilla] [--docs 8] [--length 512] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench import peak_growth_mib

sys.path.insert(0, str(Path(__file__).parent))
from decode import cpu_model  # noqa: E402


def inputs(packed: bool, docs: int, length: int, heads: int, head_dim: int, grad: bool):
    gen = torch.Generator().manual_seed(0)
    shape = (1, heads, docs * length, head_dim) if packed else (docs, heads, length, head_dim)
    return [torch.randn(shape, generator=gen).requires_grad_(grad) for _ in range(3)]


def run(variant, tensors, packed: bool, docs: int, length: int, grad: bool) -> None:
    kwargs = {"documents": [length] * docs} if packed else {}
    if grad:
        out = variant(*tensors, **kwargs)
        out.sum().backward()
    else:
        with torch.no_grad():
            variant(*tensors, **kwargs)


def peak_mib(spec: str, backend: str, packed: bool, docs: int, length: int, heads: int, head_dim: int,
             grad: bool) -> float:
    """Peak resident memory above the inputs, in a fresh process (MiB; Linux: the peak is reset once the inputs
    exist, through /proc/self/clear_refs)."""
    setup = (f"import torch, attnzoo, sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
             f"from packing import inputs, run; torch.set_num_threads(2);"
             f"v = attnzoo.compile({spec!r}, backend={backend!r});"
             f"t = inputs({packed}, {docs}, {length}, {heads}, {head_dim}, {grad})")
    return peak_growth_mib(setup, f"run(v, t, {packed}, {docs}, {length}, {grad})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", nargs="+", default=["selective", "vanilla", "forgetting"], help="spec names")
    parser.add_argument("--backend", default="blocked", help="attnzoo backend")
    parser.add_argument("--docs", type=int, default=8, help="documents")
    parser.add_argument("--length", type=int, default=512, help="tokens per document")
    parser.add_argument("--heads", type=int, default=8, help="query (and key/value) heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (the median is kept)")
    parser.add_argument("--out", type=Path, default=None, help="directory for packing.json and packing.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for spec in args.specs:
        variant = attnzoo.compile(spec, backend=args.backend)
        for grad in (False, True):
            tensors = {packed: inputs(packed, args.docs, args.length, args.heads, args.head_dim, grad)
                       for packed in (False, True)}
            times = {False: [], True: []}
            for packed in (False, True):  # warm up
                run(variant, tensors[packed], packed, args.docs, args.length, grad)
            for _ in range(args.repeats):
                for packed in (False, True):
                    start = time.perf_counter()
                    run(variant, tensors[packed], packed, args.docs, args.length, grad)
                    times[packed].append(time.perf_counter() - start)
            batch, packed = statistics.median(times[False]), statistics.median(times[True])
            peaks = [peak_mib(spec, args.backend, p, args.docs, args.length, args.heads, args.head_dim, grad)
                     for p in (False, True)]
            row = {"spec": spec, "mode": "forward+backward" if grad else "forward", "batch_ms": batch * 1e3,
                   "packed_ms": packed * 1e3, "ratio": packed / batch, "batch_peak_mib": peaks[0],
                   "packed_peak_mib": peaks[1]}
            rows.append(row)
            print(f"{spec:12s} {row['mode']:16s} batch {row['batch_ms']:8.1f} ms  packed {row['packed_ms']:8.1f} ms"
                  f"  {row['ratio']:.3f}x  peak MiB {peaks[0]:.0f} / {peaks[1]:.0f}", flush=True)
    header = (f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, backend "
              f"{args.backend}, float32, H {args.heads} D {args.head_dim}; {args.docs} documents of {args.length} "
              f"tokens packed in one row against the same documents as a batch of {args.docs}; median of "
              f"{args.repeats} interleaved rounds, same run.")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packing.json").write_text(json.dumps({"setup": header, "rows": rows}, indent=1) + "\n")
        lines = [header, "", "| spec | mode | batch ms | packed ms | packed / batch | peak MiB (batch, packed) |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['spec']} | {r['mode']} | {r['batch_ms']:.1f} | {r['packed_ms']:.1f} | {r['ratio']:.3f}x | "
                  f"{r['batch_peak_mib']:.0f}, {r['packed_peak_mib']:.0f} |" for r in rows]
        (args.out / "packing.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

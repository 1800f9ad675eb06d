"""A plugin's probability map on ``blocked`` (its generic key-block loop) against ``reference`` (issue 54, item 4).

Three maps with no fast path: a plugin's SSMax written in one pass (``update`` reads the step's visible-key counts,
``attnzoo.MapStep``), a plugin's ReLU mean (counts its keys itself, no step), and the built-in ``softpick``. One
attention layer, forward, float32, batch 1, 4 heads, head size 64, causal, at each of ``--lengths`` (256 1024); causal
SDPA timed beside them. Every round times every case once, in turn (interleaved), and the median of the rounds is
kept; the ratios come from the same run.

    python benchmarks/plugin_map.py [--rounds 11] [--threads 1] [--lengths 256 1024] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import types
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench import cpu_model


def _example_maps():
    """SSMax and ReluMean from examples/map_plugins.py (the plugin maps the docs and the tests use)."""
    spec = importlib.util.spec_from_file_location("map_plugins", Path(__file__).resolve().parents[1] / "examples"
                                                  / "map_plugins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SSMax, module.ReluMean


SSMax, ReluMean = _example_maps()


MAPS = ("ssmax", "relu_mean", "softpick")
BACKENDS = ("reference", "blocked")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--out", type=Path, default=None, help="write plugin-map.md and .json there")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plugin = types.ModuleType("bench_maps")
    plugin.register_transforms = attnzoo.hookimpl(lambda register: [register(c) for c in (SSMax, ReluMean)])
    registry = attnzoo.new_registry(entry_points=False, extra_plugins=[("bench_maps", plugin)])
    cases = {}
    for n in args.lengths:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, 4, n, 64, generator=gen) for _ in range(3))
        cases[(n, "sdpa", "sdpa")] = (
            lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        for kind in MAPS:
            for backend in BACKENDS:
                variant = attnzoo.compile({"name": kind, "transforms": [{"kind": kind}]}, backend=backend,
                                          registry=registry)
                params = variant.init_params(num_heads=4, head_dim=64, num_kv_heads=4)
                cases[(n, kind, backend)] = lambda f=variant, q=q, k=k, v=v, p=params: f(q, k, v, params=p)
    times = {key: [] for key in cases}
    with torch.no_grad():
        for fn in cases.values():
            fn()
        for _ in range(args.rounds):
            for key, fn in cases.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
    median = {key: statistics.median(t) for key, t in times.items()}
    rows = []
    for n in args.lengths:
        sdpa = median[(n, "sdpa", "sdpa")]
        for kind in MAPS:
            ref, blk = median[(n, kind, "reference")], median[(n, kind, "blocked")]
            rows.append({"n": n, "map": kind, "sdpa_ms": sdpa * 1e3, "reference_ms": ref * 1e3,
                         "blocked_ms": blk * 1e3, "blocked_over_reference": blk / ref})
    result = {"cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
              "shape": "B1 H4 D64 float32, causal, forward", "rows": rows}
    lines = ["# A plugin's probability map: blocked against reference", "",
             f"{result['cpu']}, {args.threads} thread(s), torch {torch.__version__}; {result['shape']}; "
             f"{args.rounds} rounds interleaved, median.", "",
             "| N | map | SDPA ms | reference ms (x SDPA) | blocked ms (x SDPA) | blocked / reference |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['map']} | {r['sdpa_ms']:.2f} | {r['reference_ms']:.2f} "
                     f"({r['reference_ms'] / r['sdpa_ms']:.1f}x) | {r['blocked_ms']:.2f} "
                     f"({r['blocked_ms'] / r['sdpa_ms']:.1f}x) | {r['blocked_over_reference']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plugin-map.md").write_text(text)
        (args.out / "plugin-map.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

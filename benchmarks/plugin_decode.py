"""A plugin's selective attention decodes at the built-in's speed (issue 54, item 1).

Three specs with the ``selective`` evictor at ``--budget`` (128): the built-in ``selective_mask``, a plugin's
subclass of it registered under its own name (the same maths), and a plugin accumulator that subclasses nothing of
it but declares the same selection (``pointwise()``: the rule ``relu``; left out where attnzoo has no rules). One
attention layer, batch 1, 8 query heads, 2 key/value heads, head size 64, float32: a ``--prompt`` (512) token
prefill, then ``--steps`` (128) decodes per round; each decode is timed alone, the specs interleaved round by
round, and the median step of all rounds kept. Reports each spec's median step, its ratio to the built-in's, and how
many of its decodes took a fast step (``cache.lean_step_kind``: "fused", "torch", or the full path).

    python benchmarks/plugin_decode.py [--rounds 5] [--threads 1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from collections import Counter
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench import cpu_model
from attnzoo.transforms.base import AccumulatorTransform, PointwiseSelection, Slot
from attnzoo.transforms.selective import SelectiveMask, SelectiveMaskOptions

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


class PluginSubclass(SelectiveMask):
    kind = "plugin_selective"


class PluginLookalike(AccumulatorTransform):
    kind = "plugin_lookalike"
    slot = Slot.ACCUMULATOR
    Options = SelectiveMaskOptions

    def heads(self):
        return [self.options.selector_head]

    def pointwise(self):
        return PointwiseSelection(rule="relu", exclude_first=self.options.protect_bos,
                                  exclude_self=not self.options.self_mask)


def _has_rules() -> bool:
    try:
        PointwiseSelection(rule="relu")
    except TypeError:  # attnzoo before issue 54: no named rules
        return False
    return True


def registry():
    plugins = [PluginSubclass] + ([PluginLookalike] if _has_rules() else [])
    module = types.ModuleType("bench_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(t) for t in plugins] and None)
    return attnzoo.new_registry(entry_points=False, extra_plugins=[("bench_plugin", module)]), [
        "selective_mask"] + [t.kind for t in plugins]


def one_round(variant, budget: int, prompt: int, steps: int, seed: int):
    """The decode steps' times (s) of one round and the fast step kind each took."""
    gen = torch.Generator().manual_seed(seed)
    n = prompt + steps
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen) for _ in range(2))
    cache = variant.new_cache(1, budget=budget)
    times, kinds = [], []
    with torch.no_grad():
        variant.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], cache)
        for t in range(prompt, n):
            step = (q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
            kinds.append(cache.lean_step_kind or "full")
            start = time.perf_counter()
            variant.decode(*step, cache)
            times.append(time.perf_counter() - start)
    return times, kinds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write plugin-decode.md and .json there")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    reg, kinds = registry()
    variants = {kind: attnzoo.compile({"name": f"bench-{kind.replace('_', '-')}", "transforms": [{"kind": kind}],
                                       "cache": {"evictor": "selective", "budget": args.budget}},
                                      backend="blocked", registry=reg) for kind in kinds}
    for variant in variants.values():  # warm: the fused ops built or loaded, the first call's costs paid
        one_round(variant, args.budget, args.prompt, 8, seed=99)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    taken: dict[str, Counter] = {kind: Counter() for kind in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            t, k = one_round(variants[kind], args.budget, args.prompt, args.steps, seed=r)
            times[kind] += t
            taken[kind].update(k)
    base = statistics.median(times["selective_mask"])
    rows = []
    for kind in kinds:
        median = statistics.median(times[kind])
        rows.append({"transform": kind, "median_step_us": round(median * 1e6, 2), "ratio": round(median / base, 3),
                     "steps": dict(taken[kind])})
    result = {"cpu": cpu_model(), "threads": args.threads, "budget": args.budget, "prompt": args.prompt,
              "steps_per_round": args.steps, "rounds": args.rounds,
              "shape": f"B1 H{HEADS}/{KV_HEADS} D{HEAD_DIM} float32", "rows": rows}
    lines = ["# A plugin's selective attention against the built-in: decode step (issue 54)", "",
             f"{result['cpu']}, {args.threads} thread(s); {result['shape']}, budget {args.budget} after a "
             f"{args.prompt}-token prompt, {args.steps} steps x {args.rounds} rounds interleaved, median step.", "",
             "| transform | median step (us) | ÷ built-in | steps taken (fast kind: count) |", "|---|---|---|---|"]
    lines += [f"| `{row['transform']}` | {row['median_step_us']} | {row['ratio']:.2f}x | "
              f"{', '.join(f'{k}: {n}' for k, n in sorted(row['steps'].items()))} |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plugin-decode.md").write_text(text)
        (args.out / "plugin-decode.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a pruned vLLM layer's decode step spends its time (issue 55: "the attention itself, the C step and its
inputs, >= 60% of ``attend_pruned``'s time").

``--layers`` serving layers (``attnzoo.integrations.vllm.layer.Layer``, made as vLLM's worker makes them, without
an engine or a checkpoint; 30 as SmolLM2-135M has) with SmolLM2-135M's attention geometry (9 heads, 3 key/value
heads of 64, float32 as the benchmarks serve it), each with its own ring pages for ``--requests`` requests holding
``--budget`` tokens, prefilled, then decode steps: each step one metadata object for every layer (vLLM builds one
per forward) and fresh q, k, v rows. Timed, interleaved, per layer and step:

- ``attend_pruned``: the layer's whole step (what a vLLM forward calls per layer), pages full, one batch;
- ``core.decode``: the attention alone, the core's decode step (the fused C step and what feeds it) on one
  attnzoo cache per layer of the same batch already full at the budget, no pages: the floor a page-based step can
  reach;

and a cProfile of ``attend_pruned`` (its top functions by own time). Needs vLLM (``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/vllm_step_profile.py --requests 8 --budget 64 --steps 400

Writes ``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def metadata(counts, lengths, table):
    """vLLM's attention metadata for one forward (the fields the serving layer reads), a new object each call."""
    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return types.SimpleNamespace(num_actual_tokens=sum(counts), query_start_loc=starts,
                                 seq_lens=torch.tensor(lengths, dtype=torch.int32), block_table=table)


def build(spec: str, requests: int, budget: int, prompt: int, dtype, seed: int, layers: int = 1):
    """The serving layer, its page geometry and cache tensor with every request prefilled and past its budget, and
    a plain attnzoo cache of the same batch at the same point (the reference of the attention alone)."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.integrations.vllm.layer import Layer
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for
    from attnzoo.nn import Attention
    from attnzoo.spec import load_spec

    heads, kv_heads, d = 9, 3, 64
    torch.manual_seed(seed)
    core = Attention(load_spec(spec), heads, d, kv_heads, backend="blocked", dtype=dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(kv_heads, d, dtype, budget, names, accumulator_dtype(dtype), block_size_for(4096))
    blocks = requests + 2
    table = torch.arange(1, requests + 1, dtype=torch.int32).unsqueeze(1)  # consecutive blocks, as vLLM hands out
    gen = torch.Generator().manual_seed(seed)
    n = requests * prompt
    q, k, v = (torch.randn(n, h, d, generator=gen, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    out = torch.empty(n, heads * d, dtype=dtype)
    meta = metadata([prompt] * requests, [prompt] * requests, table)
    served, plain = [], []
    for _ in range(layers):
        layer = Layer(core, budget, "profile", max_rows=requests)
        kv_cache = torch.zeros(blocks, geometry.page_bytes // torch.empty((), dtype=dtype).element_size(),
                               dtype=dtype)
        layer.attend_pruned(geometry, q, k, v, kv_cache, meta, out)
        served.append((layer, kv_cache))
        cache = core.new_cache(requests, budget=budget)
        core.prefill(*(t.view(requests, prompt, -1, d).transpose(1, 2) for t in (q, k, v)), cache)
        plain.append(cache)
    return core, served, geometry, table, plain, gen


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="snapkv")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--layers", type=int, default=30, help="serving layers stepped per forward (SmolLM2: 30)")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens per request (above the budget)")
    ap.add_argument("--steps", type=int, default=40, help="decode steps (forwards) timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=14, help="functions listed from the profile")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="vllm-step-profile")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    core, layers, geometry, table, plain, gen = build(args.spec, args.requests, args.budget, args.prompt, dtype,
                                                      args.seed, args.layers)
    r, heads, kv_heads, d = args.requests, 9, 3, 64
    length = [args.prompt]
    q, k, v = (torch.randn(r, h, d, generator=gen, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    q4, k4, v4 = (t.unsqueeze(2) for t in (q, k, v))  # the same rows every step: the time, not the tokens, is read

    def served(steps):
        out = torch.empty(r, heads * d, dtype=dtype)
        t0 = time.perf_counter()
        for _ in range(steps):
            length[0] += 1
            meta = metadata([1] * r, [length[0]] * r, table)  # one per forward, every layer's
            for layer, kv_cache in layers:
                layer.attend_pruned(geometry, q, k, v, kv_cache, meta, out)
        return (time.perf_counter() - t0) / len(layers)

    def alone(steps):
        t0 = time.perf_counter()
        for _ in range(steps):
            for cache in plain:
                core.decode(q4, k4, v4, cache)
        return (time.perf_counter() - t0) / len(plain)

    served(5), alone(5)  # warm: the fast step chosen, buffers sized
    times = {"attend_pruned": [], "core.decode": []}
    for _ in range(args.rounds):  # interleaved rounds: a loaded host slows both alike
        times["attend_pruned"].append(served(args.steps) / args.steps)
        times["core.decode"].append(alone(args.steps) / args.steps)
    best = {name: min(t) for name, t in times.items()}
    share = best["core.decode"] / best["attend_pruned"]
    prof = cProfile.Profile()
    prof.enable()
    served(args.steps)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    total = sum(v[2] for v in stats.stats.values())
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})", v[1]) for k, v in stats.stats.items()),
                 reverse=True)[:args.top]
    import vllm

    from attnzoo import bench

    result = {
        "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]),
        "cpu": bench.cpu_model(), "threads": args.threads, "torch": torch.__version__, "vllm": vllm.__version__,
        "spec": args.spec, "requests": r, "budget": args.budget, "dtype": args.dtype,
        "layers": args.layers, "fast_step": plain[0].lean_step_kind,
        "us_per_step": {name: [round(t * 1e6, 2) for t in ts] for name, ts in times.items()},
        "best_us": {name: round(t * 1e6, 2) for name, t in best.items()},
        "attention_share": round(share, 3),
        "profile_top": [{"function": f, "own_s": round(t, 4), "share": round(t / total, 3), "calls": c}
                        for t, f, c in top],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# A pruned vLLM layer's decode step: where the time goes (issue 55)", "",
             f"`{result['command']}` on {result['cpu']} ({args.threads} thread), torch {torch.__version__}, "
             f"vLLM {vllm.__version__}; spec `{args.spec}`, {r} requests, budget {args.budget}, {args.dtype}, "
             f"{args.layers} layers a forward (times per layer and step), "
             f"SmolLM2-135M's attention geometry (9 heads, 3 key/value heads of 64); best of {args.rounds} "
             f"interleaved rounds of {args.steps} steps.", "",
             "| step | us a step (best) | rounds |", "|---|---|---|"]
    for name in times:
        lines.append(f"| `{name}` | {best[name] * 1e6:.1f} | {', '.join(f'{t * 1e6:.1f}' for t in times[name])} |")
    lines += ["", f"**The attention alone (`core.decode`, fast step `{result['fast_step']}`) is {share:.0%} of "
              f"`attend_pruned`'s time.**", "", "Profile of `attend_pruned` (own time, top functions):", "",
              "| function | own s | share | calls |", "|---|---|---|---|"]
    lines += [f"| `{p['function']}` | {p['own_s']:.3f} | {p['share']:.0%} | {p['calls']} |"
              for p in result["profile_top"]]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()

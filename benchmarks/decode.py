"""Decoding speed and cache memory, measured in one run against a hand-written baseline.

Baseline: a preallocated key/value buffer and one ``scaled_dot_product_attention`` call per token, the fastest
plain-torch decode loop. Candidates: attnzoo ``decode`` for each spec and backend, with the spec's budget or none.
Each candidate prefills ``--context`` tokens (not timed) and decodes ``--steps`` tokens (timed); rounds are
interleaved and the median per candidate is kept. Reports tokens/s, the ratio to the baseline and to attnzoo
``vanilla``, and the cache bytes held at the end (attnzoo ``KVCache.nbytes``).

    python benchmarks/decode.py [--context 4096] [--steps 128] [--out benchmarks/results]

With ``--hf`` it also times Hugging Face ``generate()`` on a small Llama-style model built from a config (no
download): HF's own ``DynamicCache`` against the attnzoo integration at several budgets, tokens/s and peak
memory (see docs/transformers.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.bench import cpu_model

#: the prefill (not timed) goes in chunks of this many tokens, so that evictors whose prefill materialises the
#: attention probabilities (H2O, TOVA) fit in memory at long contexts
PREFILL_CHUNK = 2048


def inputs(batch, heads, kv_heads, head_dim, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, head_dim, generator=gen)
    return q, k, v


def baseline(q, k, v, context, real=None):
    """Hand-written: preallocated buffers, one SDPA call per token (with ``real`` (B, context), the prompt's
    padding masked out). Returns (seconds, bytes held)."""
    b, hkv, n, d = k.shape
    kbuf, vbuf = k.new_empty(b, hkv, n, d), v.new_empty(b, hkv, n, d)
    kbuf[:, :, :context], vbuf[:, :, :context] = k[:, :, :context], v[:, :, :context]
    gqa = q.shape[1] != hkv
    mask = None
    if real is not None:
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
        mask[:, 0, 0, :context] = real
    start = time.perf_counter()
    for i in range(context, n):
        kbuf[:, :, i:i + 1], vbuf[:, :, i:i + 1] = k[:, :, i:i + 1], v[:, :, i:i + 1]
        F.scaled_dot_product_attention(q[:, :, i:i + 1], kbuf[:, :, :i + 1], vbuf[:, :, :i + 1],
                                       attn_mask=None if mask is None else mask[..., :i + 1], enable_gqa=gqa)
    return time.perf_counter() - start, 2 * kbuf.numel() * kbuf.element_size()


def baseline_window(q, k, v, context, keys: int):
    """Hand-written over the last ``keys`` tokens: a preallocated buffer of ``keys`` slots written round-robin and
    one SDPA call per token (the work of a cache pruned to ``keys``, with no policy). Returns (seconds, bytes)."""
    b, hkv, n, d = k.shape
    kbuf, vbuf = k[:, :, context - keys:context].clone(), v[:, :, context - keys:context].clone()
    gqa = q.shape[1] != hkv
    start = time.perf_counter()
    for i in range(context, n):
        s = i % keys
        kbuf[:, :, s:s + 1], vbuf[:, :, s:s + 1] = k[:, :, i:i + 1], v[:, :, i:i + 1]
        F.scaled_dot_product_attention(q[:, :, i:i + 1], kbuf, vbuf, enable_gqa=gqa)
    return time.perf_counter() - start, 2 * kbuf.numel() * kbuf.element_size()


def run_sweep(args) -> dict:
    """The context sweep: at each context, the hand loop over the full cache and over ``--budget`` keys, attnzoo
    vanilla and every built-in evictor at ``--budget`` (blocked backend), ratios to both hand loops and to
    vanilla in the same run."""
    return {"rows": [row for context in args.sweep for row in _sweep_at(args, context)]}


def ragged_mask(batch: int, context: int) -> torch.Tensor | None:
    """Left padding for ``--ragged``: row i of the prompt holds context - i * context / (2 * batch) real tokens
    (the last row about half), the rest padding; (B, context) bool, True = real."""
    lengths = [context - i * context // (2 * batch) for i in range(batch)]
    real = torch.zeros(batch, context, dtype=torch.bool)
    for row, length in enumerate(lengths):
        real[row, context - length:] = True
    return real


def _sweep_at(args, context: int) -> list[dict]:
    evicting = [("selective-pruned", "selective"), ("h2o", "h2o"), ("tova", "tova"), ("streaming", "sink_window")]
    q, k, v = inputs(args.batch, args.heads, args.kv_heads, args.head_dim, context + args.steps)
    real = ragged_mask(args.batch, context) if args.ragged else None
    candidates = {"hand loop, full cache": lambda: baseline(q, k, v, context, real),
                  f"hand loop, {args.budget} keys": lambda: baseline_window(q, k, v, context, args.budget),
                  "attnzoo vanilla": lambda: attnzoo_decode("vanilla", "blocked", None, q, k, v, context, real)}
    for spec, evictor in evicting:
        candidates[f"attnzoo {spec} ({evictor}), budget {args.budget}"] = (
            lambda s=spec: attnzoo_decode(s, "blocked", args.budget, q, k, v, context, real))
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, fn in candidates.items():
                times[name].append(fn()[0])
    med = {name: statistics.median(t) for name, t in times.items()}
    full, window = med["hand loop, full cache"], med[f"hand loop, {args.budget} keys"]
    return [{"context": context, "batch": args.batch, "candidate": name,
             "tokens_per_s": args.steps * args.batch / t, "vs_hand_full": full / t,
             f"vs_hand_{args.budget}": window / t, "vs_attnzoo_vanilla": med["attnzoo vanilla"] / t}
            for name, t in med.items()]


def attnzoo_decode(spec, backend, budget, q, k, v, context, real=None):
    variant = attnzoo.compile(spec, backend=backend)
    cache = variant.new_cache(batch=q.shape[0], budget=budget)
    for start in range(0, context, PREFILL_CHUNK):  # chunks: H2O/TOVA's prefill materialises its probabilities
        stop = min(context, start + PREFILL_CHUNK)
        variant.prefill(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], cache,
                        key_mask=None if real is None else real[:, start:stop])
    n = q.shape[2]
    start = time.perf_counter()
    for i in range(context, n):
        variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
    return time.perf_counter() - start, cache.nbytes


def run_kernels(args) -> dict:
    q, k, v = inputs(args.batch, args.heads, args.kv_heads, args.head_dim, args.context + args.steps)
    candidates = {"hand-written SDPA loop": lambda: baseline(q, k, v, args.context)}
    for spec, backend, budget in (("vanilla", "blocked", None), ("ssa", "blocked", None),
                                  ("selective", "blocked", None), ("selective-pruned", "blocked", args.budget),
                                  ("selective-pruned", "reference", args.budget)):
        label = f"attnzoo {spec} ({backend}, budget {budget})"
        candidates[label] = (lambda s=spec, bk=backend, bu=budget: attnzoo_decode(s, bk, bu, q, k, v, args.context))
    times: dict[str, list[float]] = {name: [] for name in candidates}
    held: dict[str, int] = {}
    with torch.no_grad():
        for fn in candidates.values():  # warm-up
            fn()
        for _ in range(args.repeats):
            for name, fn in candidates.items():
                seconds, nbytes = fn()
                times[name].append(seconds)
                held[name] = nbytes
    rows = []
    base = statistics.median(times["hand-written SDPA loop"])
    vanilla = statistics.median(times["attnzoo vanilla (blocked, budget None)"])
    base_bytes = held["hand-written SDPA loop"]
    for name in candidates:
        t = statistics.median(times[name])
        rows.append({"candidate": name, "tokens_per_s": args.steps / t, "vs_baseline": base / t,
                     "vs_attnzoo_vanilla": vanilla / t, "cache_bytes": held[name],
                     "bytes_vs_baseline": held[name] / base_bytes})
    return {"rows": rows}


class _PeakRss:
    """Samples the process's resident memory every millisecond in a thread; ``peak`` is the largest seen."""

    def __init__(self) -> None:
        import threading

        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self.start = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def hf_one(candidate: str, context: int, steps: int, model_name: str = "tiny") -> dict:
    """One HF generate() measurement (run in a fresh process): tokens/s of the decoding steps (timed from the
    first token's logits to the last), cache bytes at the end and the peak resident memory growth during
    generate()."""
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    from attnzoo.integrations import transformers as integration

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    torch.manual_seed(0)
    if model_name == "smollm2":  # the real model (attnzoo model smollm2: cached locally, never downloaded here)
        model, tokenizer = integration.smollm2(progress=False)
        from attnzoo.experiments.language_model import corpus

        text = corpus().decode("utf-8", errors="replace")[: context * 8]  # real text, enough for `context` tokens
        prompt = tokenizer(text, return_tensors="pt").input_ids[:, :context]
    else:
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=context + steps + 8)
        model = LlamaForCausalLM(config).eval()
        prompt = torch.randint(0, 512, (1, context))
    if candidate != "dynamic":
        spec, _, budget = candidate.partition(":")
        integration.apply(model, spec, budget=int(budget) if budget else None)
    kwargs = dict(do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        model.generate(prompt[:, :64], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        clock = Clock()
        with _PeakRss() as rss:
            out = model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                                 logits_processor=LogitsProcessorList([clock]), **kwargs)
    cache = out.past_key_values
    if candidate == "dynamic":
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    else:
        nbytes = sum(layer["bytes"] for layer in cache.memory())
    return {"decode_tokens_per_s": (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]),
            "cache_bytes": nbytes, "peak_rss_growth_mb": (rss.peak - rss.start) / 2**20,
            "tokens": out.sequences[0, context:].tolist()}


def run_hf(args) -> dict:
    """HF generate() on a small Llama-style model: DynamicCache vs the attnzoo cache at several budgets, each
    candidate in a fresh process (peak memory)."""
    import subprocess
    import sys

    if args.hf_specs:
        candidates = ["dynamic", *args.hf_specs]
    else:
        candidates = ["dynamic", "vanilla", "selective"] + [f"selective-pruned:{b}" for b in args.hf_budgets]
    rows, results = [], {}
    for candidate in candidates:
        run = subprocess.run([sys.executable, __file__, "--hf-one", candidate, "--hf-context", str(args.hf_context),
                              "--hf-steps", str(args.hf_steps), "--threads", str(args.threads),
                              "--hf-model", args.hf_model],
                             capture_output=True, text=True, check=True)
        result = results[candidate] = json.loads(run.stdout.strip().splitlines()[-1])
        base = results["dynamic"]
        label = {"dynamic": "HF DynamicCache (sdpa)", "vanilla": "attnzoo vanilla (no budget)",
                 "selective": "attnzoo selective (no budget)"}.get(
            candidate, f"attnzoo {candidate.replace(':', ', budget ')}")
        # the same model's tokens: vanilla against HF's own attention, selective-pruned against no eviction
        same_as = "dynamic" if candidate in ("dynamic", "vanilla") or args.hf_specs else "selective"
        rows.append({"candidate": label, "tokens_per_s": result["decode_tokens_per_s"],
                     "vs_dynamic_cache": result["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                     "cache_bytes": result["cache_bytes"],
                     "bytes_vs_dynamic_cache": result["cache_bytes"] / base["cache_bytes"],
                     "peak_rss_growth_mb": result["peak_rss_growth_mb"],
                     "same_tokens_as": f"{same_as}: {result['tokens'] == results[same_as]['tokens']}"})
    return {"rows": rows}


def table(rows) -> str:
    keys = list(rows[0])
    for row in rows[1:]:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = []
        for key in keys:
            value = row.get(key, "")
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf", action="store_true", help="also time HF generate() (needs the transformers extra)")
    parser.add_argument("--hf-context", type=int, default=4096)
    parser.add_argument("--hf-steps", type=int, default=64)
    parser.add_argument("--hf-budgets", type=int, nargs="+", default=[4096, 512, 128])
    parser.add_argument("--hf-model", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny: a 4-layer Llama from a config; smollm2: the real model (attnzoo model smollm2)")
    parser.add_argument("--hf-specs", nargs="+", metavar="SPEC[:BUDGET]",
                        help="the attnzoo candidates of --hf (default: vanilla, selective, selective-pruned at "
                             "--hf-budgets)")
    parser.add_argument("--hf-one", help=argparse.SUPPRESS)
    parser.add_argument("--sweep", type=int, nargs="+", metavar="CONTEXT",
                        help="also the context sweep at these contexts (e.g. 1024 8192 32768): both hand loops, "
                        "vanilla and every evictor at --budget")
    parser.add_argument("--ragged", action="store_true",
                        help="sweep: left-padded prompts of different lengths (row i has context - i*context/(2B) "
                        "real tokens); the hand full-cache loop masks the padding")
    parser.add_argument("--skip-kernels", action="store_true", help="only the sweep and/or --hf")
    parser.add_argument("--name", default="decode", help="file stem of the results (default: decode)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.hf_one:
        print(json.dumps(hf_one(args.hf_one, args.hf_context, args.hf_steps, args.hf_model)))
        return
    from attnzoo.decode import fused_build

    steps = fused_build.status()  # compiles the fused steps now, outside every timed loop
    result = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "lean_steps": steps,
              "config": {k: v for k, v in vars(args).items() if k != "out"}}
    lines = [f"# Decoding ({result['cpu']}, {args.threads} threads, torch {torch.__version__})", "",
             f"Blocked backend's decode steps at a budget: {steps}."]
    if not args.skip_kernels:
        result["kernels"] = run_kernels(args)
        lines += ["", f"Context {args.context} + {args.steps} decoded, B{args.batch} H{args.heads}/{args.kv_heads} "
                  f"D{args.head_dim} float32; median of {args.repeats} interleaved rounds "
                  "(`python benchmarks/decode.py`).", "", table(result["kernels"]["rows"])]
    print("\n".join(lines))
    if args.sweep:
        result["sweep"] = run_sweep(args)
        ragged = (" with left-padded prompts of different lengths (`--ragged`: row i holds context - "
                  "i * context / (2B) real tokens)") if args.ragged else ""
        sweep = ["", f"Context sweep: B{args.batch} H{args.heads}/{args.kv_heads} D{args.head_dim} float32"
                 f"{ragged}, {args.steps} decoded after each context, blocked backend, median of {args.repeats} "
                 f"interleaved rounds (`--sweep`).", "", table(result["sweep"]["rows"])]
        print("\n".join(sweep))
        lines += sweep
    if args.hf:
        result["hf"] = run_hf(args)
        model = ("SmolLM2-135M-Instruct (30 layers, H9/3, D64; real text of the shipped corpus)"
                 if args.hf_model == "smollm2" else "Llama 4 layers, width 256, H8/2")
        hf = ["", f"HF generate(): {model}, context {args.hf_context} + {args.hf_steps} "
              "decoded, float32, each candidate in a fresh process (`--hf`).", "", table(result["hf"]["rows"])]
        print("\n".join(hf))
        lines += hf
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""kvpress's presses on the original SmolLM2-135M, on the fine-tune experiment's held-out windows (issue 53).

``attnzoo experiment finetune`` (attnzoo/experiments/finetune.py, docs/finetune.md) scores the held-out windows
(``valid_windows`` windows of ``eval_context`` tokens from the last 10% of the shipped corpus, each after the BOS):
the first three quarters (768 tokens) prefilled into an ``AttnzooCache`` of B tokens, the last quarter (256)
teacher-forced token by token with eviction on, at B = 64, 128, 256 (1/16, 1/8, 1/4 of the window). This script
scores kvpress's presses on the original model, on **the same windows** (built by finetune.py's own functions: the
same tokens), kvpress's own way: the 768-token prefix compressed at prefill to B tokens (``compression_ratio`` such
that kvpress's ``int(768 x (1 - ratio))`` is B), then the 256 tokens teacher-forced token by token with no eviction
(kvpress's presses do not run at decode): its cache grows to B + 255 tokens by the last scored token, where
attnzoo's holds B throughout.

kvpress runs in its side interpreter through ``benchmarks/quality.py``'s worker (``run_kvpress``; the same
``--kvpress-python/--kvpress-path/--kvpress-side``). The check that both routes see the same tokens: the original
model's full-cache perplexity from finetune.py's ``nll_full`` here (transformers of this environment), and from the
kvpress worker with ``compression_ratio`` 0 (nothing compressed; its transformers, token by token), both beside the
figure the experiment recorded (``--recorded``, the experiment's JSON).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/finetune_kvpress.py --kvpress-python .venv/bin/python \\
        --kvpress-path /tmp/kvpress-tf --kvpress-side /tmp/kvpress-side --threads 1

Output: ``--out`` (default ``benchmarks/results/finetune-kvpress``) ``.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402  (benchmarks/quality.py: its kvpress worker)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presses", nargs="*", default=["KeyDiffPress", "SnapKVPress", "ExpectedAttentionPress"])
    ap.add_argument("--attnzoo", nargs="*", default=[],
                    help="attnzoo methods on the original model, same windows: SPEC (B held at every step, as the "
                         "experiment scores) or SPEC/prefill (the prefix compressed to B, every later token kept: "
                         "AttnzooCache(evict='prefill'), kvpress's way)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256], help="tokens kept of the prefix")
    ap.add_argument("--valid-windows", type=int, default=4)
    ap.add_argument("--eval-context", type=int, default=1024)
    ap.add_argument("--recorded", default=str(ROOT / "docs" / "experiments" / "finetune.json"),
                    help="the experiment's JSON: its baselines printed beside kvpress's rows ('' for none)")
    ap.add_argument("--no-check", action="store_true", help="skip the full-cache perplexity from both routes")
    ap.add_argument("--kvpress-python", default=None, help="needed for --presses and the check")
    ap.add_argument("--kvpress-path", action="append", default=[])
    ap.add_argument("--kvpress-side", action="append", default=[])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "finetune-kvpress"))
    return ap.parse_args(argv)


def windows_of(valid_windows: int, eval_context: int):
    """The experiment's held-out windows, by its own code: (windows (count, length) long tensor, tokenizer)."""
    from attnzoo.experiments import finetune

    tokenizer = finetune.load_tokenizer()
    _, valid_ids = finetune.split(finetune.corpus_ids(tokenizer))
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return finetune.held_out_windows(valid_ids, valid_windows, eval_context, bos), tokenizer


def fraction_for(budget: int, prefix: int) -> float:
    """The kept fraction handed to the worker (it builds ``compression_ratio = 1 - fraction``) so that kvpress keeps
    exactly ``budget`` of ``prefix`` tokens (``int(prefix * (1 - ratio))``: B / prefix alone can round to B - 1)."""
    fraction = (budget + 0.5) / prefix
    assert int(prefix * (1 - (1 - fraction))) == budget, (budget, prefix)
    return fraction


def ppl_of(rows) -> float:
    return math.exp(sum(r["nll"] for r in rows) / sum(r["tokens"] for r in rows))


def worker(args, folder, docs, tokenizer, presses, fractions, prefix) -> dict:
    ns = SimpleNamespace(kvpress_presses=presses, fractions=fractions, ppl_prefix=prefix, max_new_tokens=1,
                         kvpress_path=args.kvpress_path, kvpress_side=args.kvpress_side,
                         kvpress_python=args.kvpress_python)
    live = quality.run_kvpress(ns, folder, [], docs, tokenizer, SimpleNamespace(update=lambda n: None))
    if "error" in live:
        raise SystemExit(f"the kvpress worker failed: {live['error']}")
    if live["errors"]:
        raise SystemExit("kvpress errors: " + "; ".join(live["errors"]))
    return live


def nll_prefill(model, window, prefix: int, budget: int) -> float:
    """finetune.nll_through_cache with ``AttnzooCache(evict="prefill")``: the prefix compressed to ``budget`` at
    prefill, every later token kept."""
    from attnzoo.experiments.finetune import nll_through_cache

    return nll_through_cache(model, window, prefix, budget, evict="prefill")


def attnzoo_rows(method: str, windows, prefix: int, budgets) -> dict:
    """{budget: perplexity} of an attnzoo method on the original model."""
    from attnzoo.experiments import finetune

    spec, _, mode = method.partition("/")
    model, _ = finetune.load_model(30)
    model.eval()
    scored = windows.shape[0] * (windows.shape[1] - prefix)
    out = {}
    for budget in budgets:
        finetune._apply(model, spec, budget)
        if mode == "prefill":
            nll = sum(nll_prefill(model, w, prefix, budget) for w in windows)
        else:
            nll = sum(finetune.nll_through_cache(model, w, prefix, budget) for w in windows)
        out[str(budget)] = math.exp(nll / scored)
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the kvpress worker inherits it
    import torch
    import transformers

    from attnzoo.bench import cpu_model
    from attnzoo.experiments import finetune
    from attnzoo.integrations.transformers import models

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    windows, tokenizer = windows_of(args.valid_windows, args.eval_context)
    prefix = args.eval_context * 3 // 4
    docs = [{"doc": i, "ids": w.tolist()} for i, w in enumerate(windows)]
    folder = models.ensure(models.SMOLLM2, progress=False).folder
    seconds: dict = {}
    check: dict = {}
    if (args.presses or not args.no_check) and not args.kvpress_python:
        raise SystemExit("--kvpress-python is needed for --presses and the check (or --presses --no-check)")
    if not args.no_check:
        t0 = time.perf_counter()
        model, _ = finetune.load_model(30)
        model.eval()
        scored = windows.shape[0] * (windows.shape[1] - prefix)
        check["attnzoo_nll_full"] = math.exp(sum(finetune.nll_full(model, w, prefix) for w in windows) / scored)
        del model
        seconds["check_attnzoo"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        live = worker(args, folder, docs, tokenizer, [args.presses[0]], [1.0], prefix)  # ratio 0: nothing pressed
        check["kvpress_ratio0"] = ppl_of(next(iter(live["ppl"].values())))
        check["kvpress_ratio0_press"] = args.presses[0]
        seconds["check_kvpress"] = time.perf_counter() - t0
        print(f"full-cache perplexity: finetune.nll_full {check['attnzoo_nll_full']:.4f}, kvpress worker "
              f"(ratio 0) {check['kvpress_ratio0']:.4f}", flush=True)
    recorded = {}
    if args.recorded:
        rec = json.loads(Path(args.recorded).read_text())
        recorded = {"source": str(Path(args.recorded).relative_to(ROOT)) if Path(args.recorded).is_absolute()
                    and Path(args.recorded).is_relative_to(ROOT) else args.recorded,
                    "baselines": rec["baselines"], "held_out": rec["held_out"],
                    "by_spec": {k: {b: v["mean"] for b, v in per.items()}
                                for k, per in rec["summary"]["by_spec"].items()}}
        check["recorded_original_full"] = rec["baselines"]["original"]["full"]
    results: dict = {}
    ours: dict = {}
    versions = None
    for press in args.presses:  # one worker per press: its rows are saved as it finishes
        t0 = time.perf_counter()
        fractions = [fraction_for(b, prefix) for b in args.budgets]
        live = worker(args, folder, docs, tokenizer, [press], fractions, prefix)
        versions = live["versions"]
        rows = live["ppl"][f"kvpress {press}"]
        results[press] = {str(b): ppl_of([r for r in rows if r["fraction"] == f])
                          for b, f in zip(args.budgets, fractions, strict=True)}
        results[press]["rows"] = rows
        seconds[press] = time.perf_counter() - t0
        print(press, {b: round(results[press][str(b)], 3) for b in args.budgets}, f"{seconds[press]:.0f} s",
              flush=True)
        write(args, windows, prefix, check, recorded, results, versions, seconds, started, argv, torch,
              transformers, cpu_model, done=press == args.presses[-1] and not args.attnzoo)
    for method in args.attnzoo:
        t0 = time.perf_counter()
        ours[method] = attnzoo_rows(method, windows, prefix, args.budgets)
        seconds[f"attnzoo {method}"] = time.perf_counter() - t0
        took = seconds[f"attnzoo {method}"]
        print(method, {b: round(ours[method][str(b)], 3) for b in args.budgets}, f"{took:.0f} s", flush=True)
        write(args, windows, prefix, check, recorded, results, versions, seconds, started, argv, torch,
              transformers, cpu_model, done=method == args.attnzoo[-1], ours=ours)
    return results


def write(args, windows, prefix, check, recorded, results, versions, seconds, started, argv, torch, transformers,
          cpu_model, done, ours=None) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n, length = windows.shape
    result = {
        "meta": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                 "torch": torch.__version__, "transformers": transformers.__version__, "kvpress": versions,
                 "python": platform.python_version(), "model": "SmolLM2-135M-Instruct (original, float32)",
                 "command": "python benchmarks/finetune_kvpress.py " + " ".join(sys.argv[1:] if argv is None
                                                                             else argv),
                 "wall_s": time.perf_counter() - started, "seconds": seconds,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "complete": done},
        "config": {"windows": n, "tokens": length, "prefix": prefix, "scored_per_window": length - prefix,
                   "budgets": args.budgets, "presses": args.presses, "attnzoo": args.attnzoo,
                   "fractions_passed": {str(b): fraction_for(b, prefix) for b in args.budgets},
                   "how": "the experiment's held-out windows (attnzoo.experiments.finetune.held_out_windows); the "
                          "prefix compressed at prefill by the press to B tokens, the rest teacher-forced token by "
                          "token with no eviction: the cache grows to B + scored - 1 tokens"},
        "check": check, "recorded": recorded,
        "perplexity": {p: {k: v for k, v in r.items() if k != "rows"} for p, r in results.items()},
        "rows": {p: r["rows"] for p, r in results.items()},
        "attnzoo": ours or {},
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(to_markdown(result) + "\n")


def to_markdown(result: dict) -> str:
    meta, cfg, check, rec = result["meta"], result["config"], result["check"], result["recorded"]
    budgets = cfg["budgets"]
    scored = cfg["scored_per_window"]
    lines = ["# kvpress and attnzoo on the fine-tune's held-out windows (issue 53)", "",
             f"`{meta['command']}` on {meta['cpu']} ({meta['threads']} thread(s)), torch {meta['torch']}, "
             f"transformers {meta['transformers']}"
             + (f" (kvpress's worker: {meta['kvpress']})" if meta["kvpress"] else "") + "; float32; "
             f"{meta['wall_s']:.0f} s in all. {'' if meta['complete'] else '**Partial run.**'}", "",
             f"{cfg['windows']} held-out windows of {cfg['tokens']} tokens (finetune.py's own); the last {scored} of "
             f"each scored after the first {cfg['prefix']}. kvpress (and attnzoo's `/prefill` rows): the prefix "
             f"compressed at prefill to B tokens, the rest teacher-forced with no eviction (the cache ends at "
             f"B + {scored - 1} tokens). attnzoo's other rows (\"this run\", or from the experiment's JSON): the "
             f"prefix compressed to B and B held at every step.", ""]
    if "attnzoo_nll_full" in check:
        lines += [f"Same tokens, checked: the original model's full-cache perplexity is "
                  f"{check.get('attnzoo_nll_full', float('nan')):.4f} by finetune.py's `nll_full` (one forward), "
                  f"{check.get('kvpress_ratio0', float('nan')):.4f} through kvpress's worker with nothing pressed "
                  f"(token by token, transformers {meta['kvpress'] and meta['kvpress'].get('transformers')}), and "
                  f"{check.get('recorded_original_full', float('nan')):.4f} as the experiment recorded.", ""]
    lines += ["| method (original model) | " + " | ".join(f"budget {b}" for b in budgets) + " |",
              "|---|" + "---|" * len(budgets)]
    for press, per in result["perplexity"].items():
        lines.append(f"| kvpress {press} (cache grows at decode) | "
                     + " | ".join(f"{per[str(b)]:.2f}" for b in budgets) + " |")
    for method, per in result.get("attnzoo", {}).items():
        how = "prefix compressed to B, cache grows at decode" if method.endswith("/prefill") else "B held throughout"
        lines.append(f"| attnzoo {method} ({how}; this run) | " + " | ".join(f"{per[str(b)]:.2f}" for b in budgets)
                     + " |")
    for evictor, per in (rec.get("baselines") or {}).items():
        if evictor == "original":
            continue
        lines.append(f"| attnzoo {evictor} (B held throughout) | "
                     + " | ".join(f"{per[str(b)]:.2f}" if str(b) in per else "" for b in budgets) + " |")
    for spec, per in (rec.get("by_spec") or {}).items():
        if any(str(b) in per for b in budgets):
            lines.append(f"| {spec}, fine-tuned (its own evictor, B held) | "
                         + " | ".join(f"{per[str(b)]:.2f}" for b in budgets) + " |")
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in meta["seconds"].items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

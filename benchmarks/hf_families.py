"""HF ``generate()`` through attnzoo against the model's own attention, measured in one run.

A small model of a family (default: Qwen3, 4 layers, width 256, H8/2 D32, float32, built from a config: no
download) prefills ``--context`` tokens and decodes ``--steps``; the baseline is transformers' ``sdpa`` with its
``DynamicCache``, the candidate attnzoo's ``vanilla`` spec (the model's native specs) with its ``AttnzooCache``.
Each measurement runs in a fresh process; rounds alternate the two and the median per candidate is kept. Reports
decode tokens/s, the ratio to the baseline, whether the greedy tokens are the same, the cache bytes held at the end
and the CPU model.

    python benchmarks/hf_families.py [--family qwen3] [--context 2048] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from attnzoo.bench import cpu_model


def build(family: str, context: int, steps: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=context + steps + 8)
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **sizes)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def one(family: str, candidate: str, context: int, steps: int) -> dict:
    """One measurement in this process: decode tokens/s (from the first token's logits to the last)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from attnzoo.integrations import transformers as zt

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    model = build(family, context, steps)
    if candidate != "sdpa":
        zt.apply(model, candidate)
    prompt = torch.randint(1, 512, (1, context), generator=torch.Generator().manual_seed(1))  # no pad id (0)
    kwargs = dict(do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompt[:, :64], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        clock = Clock()
        out = model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                             logits_processor=LogitsProcessorList([clock]), **kwargs)
    cache = out.past_key_values
    if candidate == "sdpa":
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    else:
        nbytes = cache.nbytes
    return {"tokens_per_s": (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]), "cache_bytes": nbytes,
            "tokens": out.sequences[0, context:].tolist()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3", help="config.model_type of the model (default qwen3)")
    parser.add_argument("--spec", default="vanilla", help="the attnzoo spec of the candidate (default vanilla)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.context, args.steps)))
        return
    runs: dict[str, list[dict]] = {"sdpa": [], args.spec: []}
    for _ in range(args.rounds):
        for candidate in runs:
            done = subprocess.run([sys.executable, __file__, "--one", args.family, candidate, "--context",
                                   str(args.context), "--steps", str(args.steps), "--threads", str(args.threads)],
                                  capture_output=True, text=True, check=True)
            runs[candidate].append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["tokens_per_s"] for r in runs["sdpa"])
    rows = []
    for candidate, results in runs.items():
        speed = statistics.median(r["tokens_per_s"] for r in results)
        label = "HF sdpa + DynamicCache" if candidate == "sdpa" else f"attnzoo {candidate} + AttnzooCache"
        rows.append({"candidate": label, "tokens_per_s": round(speed, 1), "vs_hf_sdpa": round(speed / base, 3),
                     "same_tokens_as_sdpa": results[0]["tokens"] == runs["sdpa"][0]["tokens"],
                     "cache_bytes": results[0]["cache_bytes"]})
    result = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
              "config": {k: str(v) for k, v in vars(args).items() if k != "one"}, "rows": rows}
    head = (f"# HF generate(): {args.family}, attnzoo against the model's own attention ({result['cpu']}, "
            f"{args.threads} threads, torch {torch.__version__})")
    lines = [head, "",
             f"{args.family} 4 layers, width 256, H8/2 D32, float32; context {args.context} + {args.steps} decoded; "
             f"median of {args.rounds} rounds, each run in a fresh process (`python benchmarks/hf_families.py`).",
             "", "| candidate | tokens/s | vs HF sdpa | same greedy tokens | cache bytes |", "|---|---|---|---|---|"]
    lines += [f"| {r['candidate']} | {r['tokens_per_s']} | {r['vs_hf_sdpa']} | {r['same_tokens_as_sdpa']} | "
              f"{r['cache_bytes']} |" for r in rows]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"hf-{args.family}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""HF ``generate()`` through attnzoo against the model's own attention, measured in one run.

A small model of a family (default: Qwen3, 4 layers, width 256, H8/2 D32, float32, built from a config: no
download) prefills ``--context`` tokens and decodes ``--steps``; the baseline is transformers' ``sdpa`` with its
``DynamicCache``, the candidate attnzoo's ``vanilla`` spec (the model's native specs) with its ``AttnzooCache``.
Both models live in one process (same weights) and every round generates with each, alternating: on a shared,
noisy host the ratio of the two runs of one round is steadier than timings taken apart. Reports the median decode
tokens/s, the median of the per-round ratios to the baseline with their range, whether the greedy tokens are the
same, the cache bytes held at the end and the CPU model.

    python benchmarks/hf_families.py [--family qwen3] [--context 2048] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
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


class _Clock:
    """A logits processor that stamps the time of each generated token's logits."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def generate(model, prompt, steps: int) -> dict:
    """Decode tokens/s (from the first token's logits to the last), the cache bytes held and the tokens."""
    from transformers import LogitsProcessorList

    clock = _Clock()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([clock]))
    cache = out.past_key_values
    if hasattr(cache, "nbytes"):
        nbytes = cache.nbytes
    else:
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return {"tokens_per_s": (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]), "cache_bytes": nbytes,
            "tokens": out.sequences[0, prompt.shape[1]:].tolist()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3", help="config.model_type of the model (default qwen3)")
    parser.add_argument("--spec", default="vanilla", help="the attnzoo spec of the candidate (default vanilla)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from attnzoo.integrations import transformers as zt

    baseline = build(args.family, args.context, args.steps)
    candidate = build(args.family, args.context, args.steps)
    zt.apply(candidate, args.spec)
    prompt = torch.randint(1, 512, (1, args.context), generator=torch.Generator().manual_seed(1))  # no pad id (0)
    models = {"sdpa": baseline, args.spec: candidate}
    for model in models.values():  # warm-up
        generate(model, prompt[:, :64], 4)
    runs: dict[str, list[dict]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            runs[name].append(generate(model, prompt, args.steps))
    rows = []
    for name, results in runs.items():
        speed = statistics.median(r["tokens_per_s"] for r in results)
        # each round's ratio to the baseline of the same round: the spread this machine's noise gives
        paired = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results, runs["sdpa"], strict=True)]
        label = "HF sdpa + DynamicCache" if name == "sdpa" else f"attnzoo {name} + AttnzooCache"
        rows.append({"candidate": label, "tokens_per_s": round(speed, 1),
                     "vs_hf_sdpa": round(statistics.median(paired), 3),
                     "round_ratios": f"{min(paired):.2f}-{max(paired):.2f}",
                     "same_tokens_as_sdpa": results[0]["tokens"] == runs["sdpa"][0]["tokens"],
                     "cache_bytes": results[0]["cache_bytes"]})
    result = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
              "config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    head = (f"# HF generate(): {args.family}, attnzoo against the model's own attention ({result['cpu']}, "
            f"{args.threads} threads, torch {torch.__version__})")
    lines = [head, "",
             f"{args.family} 4 layers, width 256, H8/2 D32, float32; context {args.context} + {args.steps} decoded; "
             f"{args.rounds} rounds, the two models alternating in one process; vs HF sdpa: the median of the "
             f"per-round ratios (`python benchmarks/hf_families.py`).",
             "", "| candidate | tokens/s (median) | vs HF sdpa | per-round ratios | same greedy tokens | cache bytes |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['candidate']} | {r['tokens_per_s']} | {r['vs_hf_sdpa']} | {r['round_ratios']} | "
              f"{r['same_tokens_as_sdpa']} | {r['cache_bytes']} |" for r in rows]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"hf-{args.family}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

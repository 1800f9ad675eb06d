"""Tokens per second of attnzoo's vLLM backend against vLLM's own CPU attention (docs/vllm.md), same run.

One tiny Llama (head_dim 64), saved twice with the same weights: with the ``vanilla`` spec applied (vLLM runs
attnzoo's backend) and without (vLLM runs its own CPU attention kernel). Each engine runs in its own process
(``LLM(..., enforce_eager=True)``, float32), warms up on two short prompts, then generates ``--new`` tokens for each
of ``--prompts`` prompts of ``--length`` tokens in one ``generate`` call (greedy, EOS ignored); the engines
alternate for ``--repeats`` rounds and the median is kept. Reports generated tokens per second (and prompt plus
generated tokens per second), their ratio, and whether the two produced the same tokens.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py [--prompts 8] [--length 512] [--new 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=2048,
              gpu_memory_utilization=0.2)


def _save(path: Path, spec: str | None, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(config)
    if spec is not None:
        zt.apply(model, spec)
    model.save_pretrained(path)


def _one(path: str, prompts: int, length: int, new: int, rounds: int) -> dict:
    """In a fresh process: the engine's generation times for ``rounds`` calls, and its tokens."""
    from vllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(1)
    batch = [{"prompt_token_ids": [1] + torch.randint(3, 512, (length - 1,), generator=gen).tolist()}
             for _ in range(prompts)]
    llm = LLM(model=path, **ENGINE)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new)
    llm.generate(batch[:2], SamplingParams(temperature=0, ignore_eos=True, max_tokens=4))  # warm up
    times, tokens = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        outs = llm.generate(batch, greedy, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"times": times, "tokens": tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="generated tokens per prompt")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (engine processes per side)")
    parser.add_argument("--out", type=Path, default=None, help="directory for vllm.json and vllm.md")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        Path(args.one[1]).write_text(json.dumps(_one(args.one[0], args.prompts, args.length, args.new, 1)))
        return 0

    from attnzoo.bench import cpu_model

    with tempfile.TemporaryDirectory() as tmp:
        paths = {"attnzoo": Path(tmp) / "attnzoo", "vllm": Path(tmp) / "vllm"}
        _save(paths["attnzoo"], "vanilla", args.layers)
        _save(paths["vllm"], None, args.layers)
        runs: dict[str, list] = {"attnzoo": [], "vllm": []}
        for _ in range(args.repeats):
            for side in ("vllm", "attnzoo"):
                result = Path(tmp) / f"{side}.json"
                subprocess.run([sys.executable, __file__, "--prompts", str(args.prompts), "--length",
                                str(args.length), "--new", str(args.new), "--one", str(paths[side]), str(result)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[side].append(json.loads(result.read_text()))
    generated = args.prompts * args.new
    total = args.prompts * (args.length + args.new)
    rows = {}
    for side, results in runs.items():
        wall = statistics.median(t for r in results for t in r["times"])
        rows[side] = {"wall_s": wall, "generated_tok_s": generated / wall, "total_tok_s": total / wall}
    same = runs["attnzoo"][-1]["tokens"] == runs["vllm"][-1]["tokens"]
    ratio = rows["attnzoo"]["generated_tok_s"] / rows["vllm"]["generated_tok_s"]
    result = {"cpu": cpu_model(), "torch": torch.__version__, "config": vars(args) | {"out": None, "one": None},
              "rows": rows, "ratio": ratio, "same_tokens": same}
    lines = ["# attnzoo's vLLM backend against vLLM's own CPU attention", "",
             f"`benchmarks/vllm_throughput.py` on {result['cpu']}, torch {result['torch']}, vLLM 0.32 (CPU build), "
             f"float32, eager: a tiny Llama ({args.layers} layers, width 256, 4 heads of 64, 2 KV heads), "
             f"{args.prompts} prompts of {args.length} tokens + {args.new} generated each, one `generate` call, "
             f"median of {args.repeats} engine processes per side, alternating.", "",
             "| attention | wall s | generated tok/s | prompt + generated tok/s | vs vLLM's own |",
             "|---|---|---|---|---|"]
    for side, label in (("vllm", "vLLM's CPU attention (no attnzoo record)"), ("attnzoo", "attnzoo, `vanilla`")):
        r = rows[side]
        lines.append(f"| {label} | {r['wall_s']:.2f} | {r['generated_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                     f"{r['generated_tok_s'] / rows['vllm']['generated_tok_s']:.2f}x |")
    lines += ["", f"Same greedy tokens from both: {'yes' if same else 'no'}.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "vllm.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

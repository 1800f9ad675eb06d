"""A checkpoint saved after ``zt.apply`` (e.g. the fine-tuned selective model of ``attnzoo experiment finetune``),
served by vLLM with its recorded spec and budget: its greedy tokens against HF + attnzoo's evicting ``generate()``
on the same prompts (issue 53). Prompts: 6 evenly spaced held-out windows of the shipped corpus in SmolLM2's tokens
(BOS first), ``LENGTH`` tokens each (default 600), 32 new tokens, EOS ignored. Prints one JSON line.

    .venv-vllm/bin/python benchmarks/vllm_serve_check.py CHECKPOINT [LENGTH]
"""

from __future__ import annotations

import json
import sys
import time

PROMPTS, NEW = 6, 32


def prompts(length: int) -> list[list[int]]:
    import torch

    from attnzoo.experiments import finetune

    tokenizer = finetune.load_tokenizer()
    _, held_out = finetune.split(finetune.corpus_ids(tokenizer))
    starts = torch.linspace(0, len(held_out) - length - 1, PROMPTS).long()
    return [[tokenizer.bos_token_id, *held_out[s:s + length - 1].tolist()] for s in starts]


def main() -> None:
    import torch

    from attnzoo.integrations import transformers as zt

    path = sys.argv[1]
    length = int(sys.argv[2]) if len(sys.argv) > 2 else 600
    asked = prompts(length)
    model = zt.from_pretrained(path, dtype=torch.float32)
    record = model.config.attnzoo
    start = time.perf_counter()
    want = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(p):].tolist() for p in asked]
    hf_seconds = time.perf_counter() - start
    del model
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=2048,
              gpu_memory_utilization=0.2)
    outs = llm.generate([{"prompt_token_ids": p} for p in asked],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    got = [list(o.outputs[0].token_ids) for o in outs]
    pairs = list(zip(got, want, strict=True))
    print(json.dumps({"checkpoint": path, "spec": record["name"], "budget": record["budget"], "prompts": PROMPTS,
                      "length": length, "new": NEW, "prompts_equal": sum(g == w for g, w in pairs),
                      "tokens_equal": sum(a == b for g, w in pairs for a, b in zip(g, w, strict=True)),
                      "tokens": PROMPTS * NEW, "hf_seconds": round(hf_seconds, 1)}))


if __name__ == "__main__":
    main()

"""Which of a pass key's digit tokens each layer and key/value head holds after a compressed prefill (issue 52; the
diagnosis behind the shipped ``snapkv-span``, docs/quality.md).

For the committed passkey cases of ``benchmarks/quality.py`` (seed 0), each named case's prompt is prefilled on
SmolLM2 through ``AttnzooCache(budget=B, kv_bits=4, kv_rotate=False, evict="prefill")`` under each spec, and every
layer's held positions are read back: one row per layer, one group per key/value head, one mark per digit token of
each place the key appears in the prompt (``X`` held, ``.`` evicted). ``snapkv`` (a pool of 7 positions) keeps the
start of a key and drops its end in many layers; ``snapkv-span`` (31) keeps it whole::

    .venv/bin/python benchmarks/snapkv_span_probe.py --cases 0.1:0 0.1:2 --specs snapkv snapkv-span
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["0.1:0", "0.1:2", "0.1:4"],
                    help="DEPTH:INDEX of the committed cases (7 per context and depth)")
    ap.add_argument("--context", type=int, default=2048, choices=[1024, 2048])
    ap.add_argument("--specs", nargs="+", default=["snapkv", "snapkv-span"])
    ap.add_argument("--fraction", type=float, default=0.125, help="of a bfloat16 full cache's bytes (4-bit rows)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from attnzoo.integrations import transformers as zt

    found = importlib.util.spec_from_file_location("quality_benchmark", ROOT / "benchmarks" / "quality.py")
    quality = importlib.util.module_from_spec(found)
    found.loader.exec_module(quality)
    model, tokenizer = zt.smollm2(progress=False)
    cases = quality.passkey_cases(tokenizer, [1024, 2048], [0.1, 0.5, 0.9], 7, 0)
    budget = quality.byte_budget(args.fraction, args.context, model.config, args.specs[0], 4)
    for name in args.specs:
        zt.apply(model, name, budget=budget)
        for wanted in args.cases:
            depth, index = float(wanted.split(":")[0]), int(wanted.split(":")[1])
            case = next(c for c in cases if (c["context"], c["depth"], c["case"]) == (args.context, depth, index))
            ids = case["ids"]
            digits = tokenizer(str(case["key"]), add_special_tokens=False)["input_ids"]
            starts = [i for i in range(len(ids) - len(digits) + 1) if ids[i:i + len(digits)] == digits]
            cache = zt.AttnzooCache(model, budget=budget, kv_bits=4, kv_rotate=False, evict="prefill")
            with torch.no_grad():
                model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
            print(f"== {name}, budget {budget}: depth {depth} case {index}, key {case['key']} at tokens {starts}")
            for number, layer in enumerate(cache.layers):
                positions = layer.kv.positions[0]  # (H_kv, M): the newest held is the prompt's last token
                shift = int(positions.max()) - (len(ids) - 1)
                groups = []
                for head in positions:
                    held = set((head - shift).tolist())
                    groups.append(" ".join("".join("X" if s + j in held else "." for j in range(len(digits)))
                                           for s in starts))
                print(f"layer {number:2d}  " + " | ".join(groups))


if __name__ == "__main__":
    main()

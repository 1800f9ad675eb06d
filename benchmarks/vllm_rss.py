"""Resident memory of vLLM's OpenAI server over rounds of requests, the plain checkpoint against a pruned one (issue
55: "the pruned server's resident memory is flat (within 2%) from round 3 to round 8 of 32 requests each, as the
plain server's is").

Each side is one OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, as ``vllm serve`` runs
it: the server process, vLLM's engine-core process and its worker), started here on 127.0.0.1 with the same
``--kv-cache-memory-bytes`` (``VLLM_CPU_KVCACHE_SPACE``, which would override it, removed from its environment),
``--enforce-eager``, ``--skip-tokenizer-init``, float32. It is warmed up on two short requests, then given
``--rounds`` rounds of ``--requests`` completion requests, all of a round sent at once (one thread each), greedy,
``--new`` tokens each, EOS ignored. Every prompt is new (random token ids, seeded by round and request, the BOS
first): the plain server's prefix cache finds nothing to reuse, as in a server's ordinary traffic. After each round
(every answer in, one second's pause) the resident set size of the server's whole process tree is summed (psutil:
the server and every descendant; shared pages counted in each process that maps them, as ``ps`` does) and printed.

Sides: ``plain`` (the checkpoint without an attnzoo record: vLLM's own CPU attention over its paged cache) and
``pruned`` (the same weights saved after ``zt.apply(model, --spec, budget=--budget)``: attnzoo's ring pages). Models:
``--model tiny`` (the tiny Llama of ``vllm_throughput.py``, 4 layers, random weights: a quick run) or ``--model
smollm2`` (SmolLM2-135M-Instruct, ``zt.smollm2()``, float32, 30 layers). Every server runs with tcmalloc preloaded
(``--allocator tcmalloc``, the default: what vLLM's CPU setup and docs/vllm.md recommend) or glibc's malloc
(``--allocator glibc``).

``--long N``: after the rounds (``--rounds 0``: instead of them), one prompt of N tokens alone, ``--long-new``
tokens generated (1 by default; their ids kept in the results), and each process's peak resident memory during it
(``VmHWM``, reset first by writing ``5`` to ``/proc/<pid>/clear_refs``): the plain checkpoint prefills it in chunks
of ``--chunk`` tokens (its ``--max-num-batched-tokens``; vLLM's default when 0), so does a pruned checkpoint whose
evictor allows it (its prompt staged until the last chunk, docs/vllm.md "Chunked prefill of a pruned checkpoint"),
while with ``--whole`` (``--no-enable-chunked-prefill``) or an evictor that does not (H2O, selective) attnzoo raises
``max_num_batched_tokens`` to ``max_model_len`` and prefills it whole in one step.

The KV memory is ``--hold`` full-cache requests for both sides. At ``--hold 2`` the pruned server (SmolLM2, budget
64: 3,070,080 bytes of pages per request) has room for 19 requests' pages (vLLM keeps one block as its null block),
so a round's requests are admitted as others finish, into blocks out of order, and its batched decode steps gather
their pages (the path whose memory grew: docs/vllm.md, "Measured"); at the default 8 (room for 76) every request of
a round is admitted at once, and the server measured flat before the fix as well.

Results: ``vllm-rss[-tiny][-glibc].{json,md}`` under ``--out`` (``--name``: another name)::

    .venv-vllm/bin/python benchmarks/vllm_rss.py --model smollm2 --spec snapkv --budget 64 --length 512 --new 32 \\
        --hold 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, num_hidden_layers=4)
TCMALLOC = "tcmalloc_minimal"


def _save_tiny(path: Path, spec: str | None, budget: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    if spec is not None:
        zt.apply(model, spec, budget=budget)
    model.save_pretrained(path)


def _save_smollm2(path: Path, spec: str, budget: int) -> None:
    from attnzoo.integrations import transformers as zt

    model, _ = zt.smollm2(progress=False)
    zt.apply(model, spec, budget=budget)
    model.save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 1800) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def tree_rss(pid: int) -> dict[str, int]:
    """{process name and pid: resident bytes} of ``pid`` and every descendant (psutil)."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            out[f"{proc.name()}[{proc.pid}]"] = proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return out


def tree_peaks(pid: int, reset: bool = False) -> dict[str, int]:
    """{process name and pid: peak resident bytes (``VmHWM``)} of ``pid`` and every descendant; ``reset``: set each
    peak back to the process's resident size first (``5`` into ``/proc/<pid>/clear_refs``, Linux >= 4.0)."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            if reset:
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
            status = Path(f"/proc/{proc.pid}/status").read_text()
            kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
            out[f"{proc.name()}[{proc.pid}]"] = kib * 1024
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return out


def _prompt(vocab: int, length: int, round_: int, index: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * round_ + index)
    return [1] + torch.randint(3, vocab, (length - 1,), generator=gen).tolist()


def serve_rounds(path: str, args, env: dict, kv_bytes: int, max_model_len: int, vocab: int, log: Path) -> dict:
    """One server for ``path``: warm-up, then ``args.rounds`` rounds of ``args.requests`` concurrent requests; the
    process tree's RSS after each round."""
    port = _free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-num-seqs", str(max(args.requests, 8))]
    if args.chunk:
        argv += ["--max-num-batched-tokens", str(args.chunk)]
    if args.whole:
        argv += ["--no-enable-chunked-prefill"]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as fh:
        server = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 900
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"the server for {path} exited ({server.returncode}):\n"
                                     + log.read_text()[-3000:])
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the server for {path} did not come up") from None
                    time.sleep(1)

            def ask(prompt, new):
                body = {"model": path, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                return _post(f"{url}/v1/completions", body)["choices"][0]["token_ids"]

            for i in range(2):
                ask(_prompt(vocab, 16, -1, i), 4)
            time.sleep(1)
            start_rss = tree_rss(server.pid)
            rounds = []
            with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
                for r in range(args.rounds):
                    t0 = time.perf_counter()
                    answers = list(pool.map(lambda i, r=r: ask(_prompt(vocab, args.length, r, i), args.new),
                                            range(args.requests)))
                    wall = time.perf_counter() - t0
                    if any(len(a) != args.new for a in answers):
                        raise SystemExit(f"round {r + 1}: an answer of other than {args.new} tokens")
                    time.sleep(1)
                    rss = tree_rss(server.pid)
                    rounds.append({"round": r + 1, "wall_s": wall, "rss": rss, "total": sum(rss.values())})
                    print(f"  round {r + 1}: {sum(rss.values()) / 2**20:,.0f} MiB ("
                          + ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in rss.items()) + f"), {wall:.1f} s",
                          file=sys.stderr, flush=True)
            long = None
            if args.long:  # one long prompt alone: each process's peak resident memory during its prefill
                before = tree_rss(server.pid)
                tree_peaks(server.pid, reset=True)
                t0 = time.perf_counter()
                tokens = ask(_prompt(vocab, args.long, 99, 0), args.long_new)
                wall = time.perf_counter() - t0
                peaks = tree_peaks(server.pid)
                worker = next((k for k in peaks if "Worker" in k), max(peaks, key=peaks.get))
                long = {"prompt_tokens": args.long, "new_tokens": args.long_new, "tokens": tokens, "wall_s": wall,
                        "rss_before": before, "peak": peaks,
                        "worker": worker, "worker_peak_over_before": peaks[worker] - before.get(worker, 0)}
                print(f"  a prompt of {args.long} tokens: worker peak {peaks[worker] / 2**20:,.0f} MiB, "
                      f"{long['worker_peak_over_before'] / 2**20:+,.0f} MiB over its resident size before, "
                      f"{wall:.1f} s", file=sys.stderr, flush=True)
            return {"after_warmup": start_rss, "after_warmup_total": sum(start_rss.values()), "rounds": rounds,
                    "long": long}
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--spec", default="snapkv", help="the pruned side's evicting spec")
    parser.add_argument("--budget", type=int, default=64, help="tokens the evicting spec keeps per layer")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="requests per round, sent at once")
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--hold", type=int, default=8, help="full-cache requests the shared KV memory holds")
    parser.add_argument("--allocator", choices=("tcmalloc", "glibc"), default="tcmalloc")
    parser.add_argument("--sides", nargs="+", choices=("plain", "pruned"), default=["plain", "pruned"])
    parser.add_argument("--long", type=int, default=0,
                        help="after the rounds, one prompt of this many tokens alone (1 generated): each process's "
                             "peak resident memory during its prefill (0: none)")
    parser.add_argument("--chunk", type=int, default=0,
                        help="the servers' --max-num-batched-tokens (0: vLLM's default; attnzoo raises it to "
                             "max_model_len for a pruned checkpoint, whose prompts are prefilled whole)")
    parser.add_argument("--long-new", type=int, default=1,
                        help="tokens generated after the --long prompt (their ids are kept in the results: past 1, "
                             "a pruned checkpoint's decode steps run over the evicted prompt)")
    parser.add_argument("--whole", action="store_true",
                        help="the servers run with --no-enable-chunked-prefill (a pruned checkpoint: its prompts "
                             "prefilled whole in one step, as attnzoo served every evictor before its chunked "
                             "prefill; leave --chunk out: vLLM refuses a max_num_batched_tokens below max_model_len "
                             "without chunks)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default=None, help="the results' file name (default vllm-rss[-tiny][-glibc])")
    args = parser.parse_args(argv)
    if min(args.requests, args.length, args.new, args.budget, args.hold) < 1 or args.rounds < 0:
        parser.error("--requests, --length, --new, --budget and --hold must be at least 1, --rounds at least 0")
    if args.long < 0 or args.chunk < 0 or args.long_new < 1 or (args.rounds == 0 and not args.long):
        parser.error("--long and --chunk must be at least 0, --long-new at least 1, and --rounds 0 needs --long")
    if args.name is not None and (not args.name or Path(args.name).name != args.name or args.name.startswith(".")):
        parser.error(f"--name {args.name!r}: a file name (no folder, not hidden)")

    from attnzoo.bench import cpu_model

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    preload = None
    if args.allocator == "tcmalloc":
        import ctypes.util

        preload = ctypes.util.find_library(TCMALLOC)
        if preload is None:
            raise SystemExit(f"lib{TCMALLOC} is not installed (apt-get install libtcmalloc-minimal4), or run with "
                             f"--allocator glibc")
        env["LD_PRELOAD"] = ":".join(filter(None, (preload, env.get("LD_PRELOAD"))))
    source = _source()  # at the start: the servers import attnzoo from this tree
    max_model_len = math.ceil(max(args.length + args.new, args.long + 1) / 128) * 128
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model == "tiny":
            layers, kv_heads, head_dim, vocab = TINY["num_hidden_layers"], 2, 64, TINY["vocab_size"]
            paths = {"plain": tmp / "plain", "pruned": tmp / "pruned"}
            _save_tiny(paths["plain"], None, args.budget)
            _save_tiny(paths["pruned"], args.spec, args.budget)
        else:
            import transformers

            from attnzoo.integrations.transformers import models

            folder = models.ensure(models.SMOLLM2, progress=False).folder
            config = transformers.AutoConfig.from_pretrained(folder)
            layers, kv_heads, vocab = config.num_hidden_layers, config.num_key_value_heads, config.vocab_size
            head_dim = config.head_dim
            paths = {"plain": folder, "pruned": tmp / "pruned"}
            if "pruned" in args.sides:
                _save_smollm2(paths["pruned"], args.spec, args.budget)
        kv_bytes = args.hold * math.ceil((args.length + args.new) / 128) * 128 * 2 * kv_heads * head_dim * 4 * layers
        for side in args.sides:
            print(f"{side}:", file=sys.stderr, flush=True)
            results[side] = serve_rounds(str(paths[side]), args, env, kv_bytes, max_model_len, vocab,
                                         tmp / f"{side}.log")
    summary = {}
    for side, r in results.items():
        totals = [x["total"] for x in r["rounds"]]
        if not totals:
            continue
        third = totals[2] if len(totals) >= 3 else totals[0]
        summary[side] = {"round_3_mib": third / 2**20, "last_mib": totals[-1] / 2**20,
                         "growth_3_to_last": totals[-1] / third - 1,
                         "flat_within_2pct": abs(totals[-1] / third - 1) <= 0.02,
                         "median_wall_s": statistics.median(x["wall_s"] for x in r["rounds"])}
    result = {"cpu": cpu_model(), "torch": torch.__version__, "vllm": _vllm_version(), "source": source,
              "command": "python benchmarks/vllm_rss.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "allocator": preload or "glibc malloc", "kv_cache_memory_bytes": kv_bytes,
              "max_model_len": max_model_len, "config": vars(args) | {"out": None}, "sides": results,
              "summary": summary}
    text = _markdown(result, args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.name or "vllm-rss" + ("" if args.model == "smollm2" else f"-{args.model}") + (
            "-glibc" if args.allocator == "glibc" else "")
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"{name}.md").write_text(text)
    return 0


def _markdown(result: dict, args) -> str:
    model = ("SmolLM2-135M-Instruct (float32, 30 layers)" if args.model == "smollm2"
             else "the tiny Llama of vllm_throughput.py (4 layers)")
    sides = result["sides"]
    chunk = (f"`--max-num-batched-tokens {args.chunk}`" if args.chunk else "vLLM's default `max_num_batched_tokens`")
    whole = (", `--no-enable-chunked-prefill` (a pruned checkpoint's `max_num_batched_tokens` raised to "
             "`max_model_len`: its prompts are prefilled whole)" if args.whole else
             " (a pruned checkpoint's prompts in chunks too where its evictor allows it; otherwise its "
             "`max_num_batched_tokens` is raised to `max_model_len`, its prompts prefilled whole)")
    lines = ["# Resident memory of vLLM's OpenAI server over rounds of requests", "",
             f"`{result['command']}` on {result['cpu']} (2 cores shared with other jobs), torch {result['torch']}, "
             f"vLLM {result['vllm']} (CPU build), allocator: {result['allocator']}. {model}; "
             f"{args.rounds} rounds of {args.requests} concurrent completion requests, {args.length} prompt tokens "
             f"(new random ids each request) + {args.new} generated, greedy; `--kv-cache-memory-bytes "
             f"{result['kv_cache_memory_bytes']}` for both, `max_model_len` {result['max_model_len']}, {chunk}"
             f"{whole}. Pruned: "
             f"`{args.spec}` at budget {args.budget}. RSS: the server's process tree (server, engine core, worker) "
             f"summed, after each round. attnzoo at commit {result['source']['commit']}; changed under attnzoo/ at "
             f"the start: {', '.join(result['source']['attnzoo_changed']) or 'nothing'}.", ""]
    if args.rounds:
        lines += ["| round | " + " | ".join(f"{s} MiB" for s in sides) + " | " + " | ".join(f"{s} s" for s in sides)
                  + " |", "|---|" + "---|" * (2 * len(sides)),
                  "| after warm-up | " + " | ".join(f"{r['after_warmup_total'] / 2**20:,.0f}" for r in sides.values())
                  + " |" + " - |" * len(sides)]
        for i in range(args.rounds):
            lines.append(f"| {i + 1} | " + " | ".join(f"{r['rounds'][i]['total'] / 2**20:,.0f}" for r in sides.values())
                         + " | " + " | ".join(f"{r['rounds'][i]['wall_s']:.1f}" for r in sides.values()) + " |")
        lines.append("")
        for side, s in result["summary"].items():
            lines.append(f"- {side}: round 3 {s['round_3_mib']:,.0f} MiB, round {args.rounds} {s['last_mib']:,.0f} "
                         f"MiB ({s['growth_3_to_last']:+.2%}): {'flat' if s['flat_within_2pct'] else 'not flat'} "
                         f"within 2%")
        lines.append("")
    for side, r in sides.items():
        long = r.get("long")
        if long:
            peak, over = long["peak"][long["worker"]], long["worker_peak_over_before"]
            lines.append(f"- {side}, one prompt of {long['prompt_tokens']} tokens alone "
                         f"({long.get('new_tokens', 1)} generated: {long.get('tokens')}, "
                         f"{long['wall_s']:.1f} s): the worker's peak resident memory {peak / 2**20:,.0f} MiB, "
                         f"{over / 2**20:+,.0f} MiB over its resident size before (VmHWM, reset before the request)")
    lines.append("")
    return "\n".join(lines)


def _pruned_benchmark():
    """benchmarks/vllm_pruned.py, imported from its file: the run's source and vLLM version records are its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_pruned_benchmark", ROOT / "benchmarks" / "vllm_pruned.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source() -> dict:
    """The commit attnzoo came from and the files under attnzoo/ changed from it (a shared working tree)."""
    return _pruned_benchmark()._source()


def _vllm_version() -> str:
    return _pruned_benchmark()._vllm_version()

if __name__ == "__main__":
    sys.exit(main())

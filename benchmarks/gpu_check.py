"""Check and time the generated Triton kernels on a CUDA GPU: one command, meant to finish in under 8 minutes.

    python benchmarks/gpu_check.py                # every shipped spec: check, then time at N = 4096 and 16384
    python benchmarks/gpu_check.py --quick        # check every spec, time vanilla/ssa/selective at N = 4096

1. **Check**: the conformance suite (``attnzoo.conformance``) for the triton backend on the GPU, float32 and
   bfloat16: outputs and gradients of q, k, v and every parameter against the reference in float64 (N = 1 to
   1,030, GQA, masked rows, offset positions), ``return_accumulated``'s F, prefill + decoding, evictors; the same
   checks and tolerance rule as ``attnzoo conformance --backend triton --device cuda``.
2. **Time** (bf16, B=1, H=16, D=128, causal): forward and forward+backward of the triton backend against
   SDPA's flash backend and compiled FlexAttention, each measured in the same run (median of interleaved
   repeats, CUDA events), with peak memory. For selective specs FlexAttention gets F as a captured N×N float32
   tensor (the only way it can express the accumulator); computing F is not included in its time.
3. **Context parallel** (GPU only): 2 ranks, their pairs on the triton kernels, against the triton backend on the
   whole sequence, same run, with the ranks' outputs and gradients checked against it
   (``benchmarks/context_parallel_gpu.py``: with one GPU both ranks share it over gloo, so the figure is the cost
   of sharding, not a speedup).
4. **First call** (vanilla, ssa, selective; GPU only): the first forward and backward call in a fresh process
   with an empty Triton cache, without and with the kernels compiled at build time (``attnzoo build
   --compile-for``), and how many kernels Triton compiled (``benchmarks/first_call.py``).

Prints a markdown table of ratios to SDPA flash (and, for selective, to FlexAttention) and writes it with the raw
figures to ``--out`` (default benchmarks/results/gpu.{md,json}). Exit code 1 if any check fails.

On CPU (``TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --smoke``) it runs the same code at
tiny sizes, to test this script without a GPU; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.registry import get_registry
from attnzoo.transforms.base import Dims, Slot

TIMED_SPECS_QUICK = ("vanilla", "ssa", "selective")
#: timed at every length with FlexAttention too; the other specs are timed at the first length against SDPA only
MAIN_SPECS = ("vanilla", "ssa", "selective", "selective-ssa")


# -- checks ------------------------------------------------------------------------------------------------------
#: the checks a --smoke run keeps (the interpreter is slow; the full suite runs on a GPU)
SMOKE_CHECKS = ("outputs/n1", "gradients/masked-rows-n33", "accumulated", "decode")


def run_checks(specs, device, dtypes, smoke) -> dict[str, list[str]]:
    """The conformance suite (``attnzoo.conformance``) for the triton backend on ``device``: the same checks,
    shapes and tolerance rule as ``attnzoo conformance --backend triton --device cuda`` (the reference runs on
    CPU in float64). Returns each spec's failure messages."""
    from attnzoo.conformance import runner

    backends = ["triton"] + (["xformers"] if device.type == "cuda" else [])  # xformers has no CPU kernels
    cases = runner.build_cases(get_registry(), specs, backends, dtypes, device=str(device))
    if smoke:
        cases = [c for c in cases if c.check in SMOKE_CHECKS]
    failures: dict[str, list[str]] = {name: [] for name in specs}
    for name in specs:
        start = time.perf_counter()
        results = [runner.run_case(c) for c in cases if c.spec == name]
        failures[name] = [f"{r.check}[{r.dtype}]: {r.message}" for r in results if r.status in ("fail", "xpass")]
        ran = sum(r.status == "pass" for r in results)
        status = "ok" if not failures[name] else f"FAIL ({len(failures[name])})"
        print(f"check {name:<22} {status} ({ran} pass)  [{time.perf_counter() - start:.1f} s]", flush=True)
        for problem in failures[name][:4]:
            print(f"    {problem}", flush=True)
    return failures


# -- timing ------------------------------------------------------------------------------------------------------
def _time(fn, repeats, device) -> float:
    """Median milliseconds of fn() (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _peak(fn, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _selective_f(spec_name, q, k, params) -> torch.Tensor:
    """F (B, N, N) float32 for FlexAttention's score_mod, from the attnzoo blocked backend (not timed)."""
    variant = attnzoo.compile(spec_name, backend="blocked")
    with torch.no_grad():
        _, f = variant(q.float(), k.float(), k.float(), params=params, return_accumulated=True)
    return f.float().contiguous()


def _xformers_runs(plan, device, dtype, grad) -> bool:
    """Whether the xformers backend accepts the spec here (it declines, with reasons, what it cannot run)."""
    from attnzoo.backends.base import batch_mode

    backend = get_registry().backends.get("xformers")
    return backend is not None and not backend.verdict(plan, device, dtype, batch_mode(grad))


def _candidates(spec_name, q, k, v, grad, device):
    """name -> callable running one forward (and backward when grad)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    spec = attnzoo.load_spec(spec_name)
    variant = attnzoo.compile(spec, backend="triton")
    b, h, n, d = q.shape
    params = {key: p.requires_grad_(grad) for key, p in
              variant.init_params(h, d, k.shape[1], dtype=q.dtype, device=device).items()}
    cot = torch.randn_like(q)

    def finish(out):
        if grad:
            out.backward(cot)

    def triton_run():
        finish(variant(q, k, v, params=params))

    def sdpa_run():
        if device.type == "cuda":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                finish(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != h))
        else:
            finish(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != h))

    runs = {"triton": triton_run, "sdpa": sdpa_run}
    plan = variant.plan
    if device.type == "cuda" and _xformers_runs(plan, device, q.dtype, grad):
        xvariant = attnzoo.compile(spec, backend="xformers")

        def xformers_run():
            finish(xvariant(q, k, v, params=params))

        runs["xformers"] = xformers_run
    has_acc = plan.one(Slot.ACCUMULATOR) is not None
    if spec_name in MAIN_SPECS:
        block_mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, n, n, device=device.type)
        compiled = torch.compile(flex_attention, dynamic=False)
        fsel = _selective_f(spec_name, q.detach(), k.detach(), {key: p.detach().float() for key, p in
                                                                  params.items()}) if has_acc else None
        scale = plan.logit_scale(d)

        def score_mod(score, b_, h_, qi, ki):
            return score - fsel[b_, qi, ki]

        positions = torch.arange(1, n + 1, device=device).expand(b, 1, n)

        def flex_run():
            # row scales (SSA) are applied as in attnzoo's flex backend: a pre-scale of q and v
            grouped = plan.split_params(params, Dims(h, d, k.shape[1]), q)
            qs = plan.composition.row_scale(Slot.QUERY, q, positions, grouped)
            vs = plan.composition.row_scale(Slot.VALUE, v, positions, grouped)
            out = compiled(qs, k, vs, score_mod=score_mod if has_acc else None, block_mask=block_mask,
                           scale=scale, enable_gqa=k.shape[1] != h)
            finish(out)

        runs["flex"] = flex_run
    return runs


def run_timing(specs, lengths, device, dtype, heads, head_dim, repeats, deadline) -> list[dict]:
    rows = []
    plan = [(n, name) for n in lengths for name in specs if name in MAIN_SPECS or n == lengths[0]]
    plan.sort(key=lambda item: (item[1] not in MAIN_SPECS, item[0]))  # the headline cases first
    for n, name in plan:
        for grad in (False, True):
            if time.perf_counter() > deadline:
                rows.append({"spec": name, "n": n, "mode": "fwd+bwd" if grad else "fwd",
                             "error": "skipped: time budget spent"})
                continue
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, heads, n, head_dim, generator=gen, device=device, dtype=dtype)
                       .requires_grad_(grad) for _ in range(3))
            row = {"spec": name, "n": n, "mode": "fwd+bwd" if grad else "fwd"}
            try:
                runs = _candidates(name, q, k, v, grad, device)
            except Exception as exc:  # noqa: BLE001 - report, go on with the other cases
                row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(f"time  {name} N={n} {row['mode']}: {row['error']}", flush=True)
                continue
            for cand, fn in runs.items():
                if device.type == "cpu" and grad and cand == "flex":
                    continue  # FlexAttention has no CPU backward
                try:
                    row[f"{cand}_ms"] = _time(fn, repeats, device)
                    row[f"{cand}_peak_mib"] = _peak(fn, device)
                except Exception as exc:  # noqa: BLE001
                    row[f"{cand}_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            if "triton_ms" in row and "sdpa_ms" in row:
                row["vs_sdpa"] = row["triton_ms"] / row["sdpa_ms"]
            if "triton_ms" in row and "flex_ms" in row:
                row["vs_flex"] = row["triton_ms"] / row["flex_ms"]
            if "xformers_ms" in row and "sdpa_ms" in row:
                row["xformers_vs_sdpa"] = row["xformers_ms"] / row["sdpa_ms"]
            rows.append(row)
            print(f"time  {name:<16} N={n:<6} {row['mode']:<8} " + "  ".join(
                f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                for key, value in row.items() if key not in ("spec", "n", "mode")), flush=True)
            del q, k, v, runs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# -- context parallel ----------------------------------------------------------------------------------------------
CONTEXT_PARALLEL_SPECS = ("vanilla", "selective", "selective-ssa")


def run_context_parallel(length, dtype, heads, head_dim, repeats) -> list[dict]:
    """2 ranks on the GPUs there are (benchmarks/context_parallel_gpu.py, in a process of its own): rows of the
    ranks' largest relative error against the whole-sequence triton run and both sides' milliseconds."""
    import subprocess

    script = str(Path(__file__).with_name("context_parallel_gpu.py"))
    done = subprocess.run([sys.executable, script, "--ranks", "2", "--length", str(length), "--specs",
                           *CONTEXT_PARALLEL_SPECS, "--dtype", str(dtype).removeprefix("torch."), "--heads",
                           str(heads), "--head-dim", str(head_dim), "--repeats", str(repeats)],
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return [{"spec": "*", "n": length, "error": tail}]


def context_parallel_markdown(rows) -> str:
    first = next((r for r in rows if "group" in r), {})
    lines = ["", f"## Context parallel: 2 ranks on {first.get('gpus', '?')} GPU(s), {first.get('group', '?')} group",
             "", "Each rank's pairs on the triton kernels (attnzoo.distributed); whole: the triton backend on the "
             "whole sequence, same run. Error: the ranks' largest, relative to the largest magnitude.", "",
             "| spec | N | pairs | error | fwd ms | whole fwd ms | fwd ratio | fwd+bwd ms | whole fwd+bwd ms | "
             "fwd+bwd ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['spec']} | {r['n']} | {r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['spec']} | {r['n']} | {r['pairs']} | {r['max_relative_error']:.1e} | "
                     f"{r['cp_fwd_ms']:.2f} | {r['whole_fwd_ms']:.2f} | {r['fwd_vs_whole']:.2f}x | "
                     f"{r['cp_fwd_bwd_ms']:.2f} | {r['whole_fwd_bwd_ms']:.2f} | {r['fwd_bwd_vs_whole']:.2f}x |")
    return "\n".join(lines) + "\n"


# -- first-call latency ------------------------------------------------------------------------------------------
FIRST_CALL_SPECS = ("vanilla", "ssa", "selective")


def run_first_call(specs, dtype, heads, head_dim) -> list[dict]:
    """First forward and backward call of each spec in a fresh process with an empty Triton cache: once without
    build-time artifacts (Triton compiles every kernel), once after ``attnzoo build --compile-for`` for this GPU
    (the runtime loads them: ``compiled`` should be 0). benchmarks/first_call.py does the timing."""
    import os
    import subprocess
    import tempfile

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    script = str(Path(__file__).with_name("first_call.py"))
    name = str(dtype).removeprefix("torch.")
    rows = []
    for spec in specs:
        row = {"spec": spec, "arch": arch}
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            for mode in ("cold", "built"):
                env.update(ATTNZOO_CACHE_DIR=f"{tmp}/{mode}-artifacts", TRITON_CACHE_DIR=f"{tmp}/{mode}-build")
                if mode == "built":
                    done = subprocess.run([sys.executable, "-m", "attnzoo.cli", "build", spec, "--compile-for", arch,
                                           "--dtype", name, "--head-dim", str(head_dim)], env=env,
                                          capture_output=True, text=True)
                    if done.returncode:
                        row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "build failed"
                        break
                env["TRITON_CACHE_DIR"] = f"{tmp}/{mode}-run"  # empty: only the artifact can spare a compile
                done = subprocess.run([sys.executable, script, spec, "--dtype", name, "--heads", str(heads),
                                       "--head-dim", str(head_dim)], env=env, capture_output=True, text=True)
                if done.returncode:
                    row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "run failed"
                    break
                row[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
    return rows


def first_call_markdown(rows) -> str:
    lines = ["", "## First call (fresh process, empty Triton cache, N = 1024)", "",
             "| spec | without build-time kernels: fwd ms / bwd ms (compiled) | after `attnzoo build --compile-for`: "
             "fwd ms / bwd ms (compiled, loaded) | second call fwd ms / bwd ms |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['spec']} | {r['error']} | | |")
            continue
        cold, built = r["cold"], r["built"]
        lines.append(f"| {r['spec']} | {cold['first']['forward_ms']:.0f} / {cold['first']['backward_ms']:.0f} "
                     f"({cold['compiled']}) | {built['first']['forward_ms']:.0f} / {built['first']['backward_ms']:.0f}"
                     f" ({built['compiled']}, {built['loaded']}) | {built['second']['forward_ms']:.2f} / "
                     f"{built['second']['backward_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def to_markdown(rows, header) -> str:
    lines = [f"# Triton kernels on {header['device']}", "",
             f"attnzoo {header['attnzoo']}, torch {header['torch']}, triton {header['triton']}; "
             f"{header['dtype']}, B=1, H={header['heads']}, D={header['head_dim']}, causal. Ratios: triton time / "
             "baseline time in the same run (lower is better).", "",
             "| spec | N | mode | triton ms | SDPA flash ms | triton / SDPA | flex ms | triton / flex | "
             "triton peak MiB | flex peak MiB | xformers ms | xformers / SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(row, key, fmt="{:.2f}"):
        value = row.get(key)
        if isinstance(value, float):
            return fmt.format(value)
        if key.endswith("_ms"):
            return row.get(key.replace("_ms", "_error")) or row.get("error") or "-"
        return "-"

    for r in rows:
        lines.append(f"| {r['spec']} | {r['n']} | {r['mode']} | {f(r, 'triton_ms')} | {f(r, 'sdpa_ms')} | "
                     f"{f(r, 'vs_sdpa', '{:.2f}x')} | {f(r, 'flex_ms')} | {f(r, 'vs_flex', '{:.2f}x')} | "
                     f"{f(r, 'triton_peak_mib', '{:.0f}')} | {f(r, 'flex_peak_mib', '{:.0f}')} | "
                     f"{f(r, 'xformers_ms')} | {f(r, 'xformers_vs_sdpa', '{:.2f}x')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--specs", nargs="*", help="specs to check and time (default: every registered spec)")
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="time only vanilla, ssa, selective at N = 4096")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (to test the script itself on CPU)")
    parser.add_argument("--cp-length", type=int, default=16384, help="the context-parallel timing's N")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop starting new timing cases after this many seconds (the run stays under 8 min)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu --smoke under TRITON_INTERPRET=1 to test the "
              "script)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    specs = args.specs or sorted(get_registry().specs)
    timed = args.specs or (TIMED_SPECS_QUICK if args.quick else specs)
    lengths = [4096] if args.quick else args.lengths
    heads, head_dim, repeats = args.heads, args.head_dim, args.repeats
    if args.smoke:
        lengths, heads, head_dim, repeats, timed = [64], 2, 16, 1, timed[:3]
    check_dtypes = [torch.float32] + ([dtype] if dtype != torch.float32 else [])
    if device.type == "cpu" and torch.bfloat16 in check_dtypes:
        check_dtypes = [torch.float32, torch.float16]  # the interpreter computes bfloat16 wrongly

    start = time.perf_counter()
    failures = {} if args.skip_check else run_checks(specs, device, check_dtypes, args.smoke)
    rows = [] if args.skip_timing else run_timing(timed, lengths, device, dtype if device.type == "cuda"
                                                  else torch.float32, heads, head_dim, repeats,
                                                  start + args.budget_s)
    on_gpu = device.type == "cuda" and not args.skip_timing
    context = (run_context_parallel(args.cp_length, dtype, heads, head_dim, repeats)
               if on_gpu and time.perf_counter() < start + args.budget_s else [])
    first_calls = run_first_call(FIRST_CALL_SPECS, dtype, heads, head_dim) if on_gpu else []
    from attnzoo.backends.triton.build import triton_version

    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "attnzoo": attnzoo.__version__, "torch": torch.__version__, "triton": triton_version(),
              "dtype": args.dtype if device.type == "cuda" else "float32", "heads": heads, "head_dim": head_dim,
              "seconds": time.perf_counter() - start}
    text = to_markdown(rows, header) + (context_parallel_markdown(context) if context else "")
    text += first_call_markdown(first_calls) if first_calls else ""
    failed = {name: p for name, p in failures.items() if p}
    text += "\n" + (f"Checks: {len(failures) - len(failed)} of {len(failures)} specs pass." if failures else
                    "Checks: skipped.") + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"header": header, "timing": rows, "context_parallel": context,
                                                    "first_call": first_calls,
                                                    "checks": failures},
                                                   indent=2) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} in {header['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

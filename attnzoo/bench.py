"""``attnzoo bench``: time specs against torch's SDPA (``is_causal=True``) measured in the same run.

For each spec, sequence length and mode (forward, forward+backward) the candidates (SDPA, each backend) are
timed in interleaved rounds and the median is kept; figures are reported as ratios to SDPA and to the reference
backend. Peak memory and first-call latency come from a fresh subprocess per measurement (peak resident memory
above the process's resident memory once the inputs exist). Writes JSON, a markdown table and, when matplotlib is
installed, a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

#: the longest sequence the benchmark times (its SDPA baseline holds N x N scores at the largest lengths)
MAX_LENGTH = 1 << 17


@dataclass
class Config:
    specs: tuple[str, ...] = ("vanilla", "ssa", "selective", "selective-ssa")
    lengths: tuple[int, ...] = (1024, 4096)
    memory_lengths: tuple[int, ...] = (8192,)
    backends: tuple[str, ...] = ("blocked", "flex", "reference")
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    threads: int = 2
    repeats: int = 5
    reference_max_length: int = 4096  # the reference materialises H·N² logits: keep it to lengths that fit
    fresh_process_measurements: bool = True  # peak memory and first call, one subprocess each


def _inputs(cfg: Config, n: int, grad: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.batch, cfg.heads, n, cfg.head_dim)
    return [torch.randn(shape, generator=gen).requires_grad_(grad) for _ in range(3)]


def _callable(name: str, spec: str, cfg: Config, grad: bool):
    """A function of (q, k, v) running one candidate; backward included when ``grad``."""
    import attnzoo

    if name == "sdpa":
        def run(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        variant = attnzoo.compile(spec, backend=name)
        params = variant.init_params(num_heads=cfg.heads, head_dim=cfg.head_dim)
        params = {key: p.requires_grad_(grad) for key, p in params.items()}

        def run(q, k, v):
            return variant(q, k, v, params=params)

    if not grad:
        def forward(q, k, v):
            with torch.no_grad():
                return run(q, k, v)
        return forward

    def forward_backward(q, k, v):
        out = run(q, k, v)
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None
        return out
    return forward_backward


def _runs(cfg: Config, backend: str, spec: str, n: int, grad: bool) -> bool:
    """Whether ``backend`` takes this case (it may decline: flex has no CPU backward and no accumulator)."""
    import attnzoo

    if backend == "reference" and n > cfg.reference_max_length:
        return False
    try:
        attnzoo.compile(spec, backend=backend).backend_for("cpu", torch.float32, grad)
    except attnzoo.UnsupportedError:
        return False
    return True


def time_case(cfg: Config, spec: str, n: int, grad: bool) -> dict[str, float]:
    """Median seconds per candidate, interleaved: round r times every candidate once."""
    names = ["sdpa", *(b for b in cfg.backends if _runs(cfg, b, spec, n, grad))]
    fns = {name: _callable(name, spec, cfg, grad) for name in names}
    q, k, v = _inputs(cfg, n, grad)
    for fn in fns.values():  # warm up (allocator, first-call work)
        fn(q, k, v)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(cfg.repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(q, k, v)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def rss_kib(field: str) -> int:
    """A memory field of this process's /proc/self/status (``VmRSS``, ``VmHWM``), in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_growth_mib(setup: str, measured: str) -> float:
    """Peak resident memory that ``measured`` (Python statements) adds in a fresh process after ``setup`` ran
    (MiB; Linux: the peak is reset through /proc/self/clear_refs once ``setup`` made its inputs), for benchmarks
    that report peak memory beside their times."""
    code = (f"{setup}\nfrom attnzoo.bench import rss_kib\n"
            f"open('/proc/self/clear_refs', 'w').write('5'); base = rss_kib('VmRSS')\n"
            f"{measured}\nprint(rss_kib('VmHWM') - base)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(result.stdout.strip().splitlines()[-1]) / 1024


def worker(cfg: Config, name: str, spec: str, n: int, grad: bool) -> dict[str, float]:
    """In a fresh process: first-call latency and peak memory above the inputs."""
    torch.set_num_threads(cfg.threads)
    fn = _callable(name, spec, cfg, grad)
    q, k, v = _inputs(cfg, n, grad)
    before = rss_kib("VmRSS")
    start = time.perf_counter()
    fn(q, k, v)
    first = time.perf_counter() - start
    peak = rss_kib("VmHWM")
    return {"first_call_s": first, "peak_mib": max(0, peak - before) / 1024}


def measure_in_subprocess(cfg: Config, name: str, spec: str, n: int, grad: bool) -> dict[str, float] | None:
    cmd = [sys.executable, "-m", "attnzoo.bench", "--worker", name, spec, str(n), "1" if grad else "0",
           "--config", json.dumps(asdict(cfg))]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_benchmark(cfg: Config, log=print) -> dict:
    torch.set_num_threads(cfg.threads)
    rows = []
    for spec in cfg.specs:
        for n in cfg.lengths:
            for grad in (False, True):
                times = time_case(cfg, spec, n, grad)
                row = {"spec": spec, "n": n, "mode": "forward+backward" if grad else "forward",
                       "sdpa_s": times["sdpa"]}
                for backend in cfg.backends:
                    if backend in times:
                        row[f"{backend}_s"] = times[backend]
                        row[f"{backend}_vs_sdpa"] = times[backend] / times["sdpa"]
                if "reference" in times:
                    for backend in cfg.backends:
                        if backend != "reference" and backend in times:
                            row[f"{backend}_vs_reference"] = times[backend] / times["reference"]
                for backend in ("sdpa", *cfg.backends):
                    if cfg.fresh_process_measurements and backend in times:
                        extra = measure_in_subprocess(cfg, backend, spec, n, grad)
                        if extra:
                            row[f"{backend}_peak_mib"] = extra["peak_mib"]
                            row[f"{backend}_first_call_s"] = extra["first_call_s"]
                rows.append(row)
                log(_line(row, cfg))
    memory = []
    for spec in cfg.specs:
        for n in cfg.memory_lengths:
            for grad in (False, True):
                entry = {"spec": spec, "n": n, "mode": "forward+backward" if grad else "forward"}
                for backend in ("sdpa", *cfg.backends):
                    if backend == "reference" and grad and n > cfg.reference_max_length:
                        continue  # H·N² saved activations of every op: more than this machine holds
                    if backend != "sdpa" and backend != "reference" and not _runs(cfg, backend, spec, 0, grad):
                        continue
                    extra = measure_in_subprocess(cfg, backend, spec, n, grad)
                    entry[f"{backend}_peak_mib"] = extra["peak_mib"] if extra else None
                memory.append(entry)
                log(f"memory {spec} N={n} {entry['mode']}: " + ", ".join(
                    f"{k.removesuffix('_peak_mib')} {v:.0f} MiB" for k, v in entry.items()
                    if k.endswith("_peak_mib") and v is not None))
    return {"config": asdict(cfg), "torch": torch.__version__, "cpu": cpu_model(), "rows": rows, "memory": memory}


def _line(row: dict, cfg: Config) -> str:
    parts = [f"{row['spec']:<14} N={row['n']:<5} {row['mode']:<16} sdpa {row['sdpa_s'] * 1e3:8.1f} ms"]
    for backend in cfg.backends:
        if f"{backend}_vs_sdpa" in row:
            parts.append(f"{backend} {row[f'{backend}_vs_sdpa']:.2f}x")
    return "  ".join(parts)


def cpu_model() -> str:
    """The CPU's model name, as benchmark figures report it (``/proc/cpuinfo``; ``platform.processor()``
    elsewhere)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    backends = cfg["backends"]
    lines = [f"CPU ({result.get('cpu', 'model not recorded')}), float32, B={cfg['batch']} H={cfg['heads']} "
             f"D={cfg['head_dim']}, {cfg['threads']} threads, "
             f"torch {result['torch']}; median of {cfg['repeats']} interleaved repeats; ratios to "
             "`scaled_dot_product_attention(is_causal=True)` in the same run.", "",
             "| spec | N | mode | SDPA ms | " + " | ".join(f"{b} / SDPA" for b in backends)
             + " | blocked / reference | peak MiB (SDPA, " + ", ".join(backends) + ") | first call s ("
             + ", ".join(b for b in backends if b != "reference") + ") |",
             "|---|---|---|---|" + "---|" * len(backends) + "---|---|---|"]
    for row in result["rows"]:
        ratios = " | ".join(f"{row[f'{b}_vs_sdpa']:.2f}x" if f"{b}_vs_sdpa" in row else "-" for b in backends)
        vs_ref = f"{row['blocked_vs_reference']:.3f}x" if "blocked_vs_reference" in row else "-"
        peaks = ", ".join(_fmt(row.get(f"{b}_peak_mib"), ".0f") for b in ("sdpa", *backends))
        first_text = ", ".join(_fmt(row.get(f"{b}_first_call_s"), ".2f") for b in backends if b != "reference")
        lines.append(f"| {row['spec']} | {row['n']} | {row['mode']} | {row['sdpa_s'] * 1e3:.1f} | {ratios} | "
                     f"{vs_ref} | {peaks} | {first_text} |")
    lines += ["", "Peak memory (MiB above the inputs, fresh process per measurement):", "",
              "| spec | N | mode | " + " | ".join(("SDPA", *backends)) + " |",
              "|---|---|---|" + "---|" * (len(backends) + 1)]
    for entry in result["memory"]:
        cells = []
        for b in ("sdpa", *backends):
            value = entry.get(f"{b}_peak_mib")
            cells.append(f"{value:.0f}" if value is not None else "not run")
        lines.append(f"| {entry['spec']} | {entry['n']} | {entry['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("forward", "forward+backward"), strict=True):
        labels, values = [], []
        for row in rows:
            if row["mode"] == mode and "blocked_vs_sdpa" in row:
                labels.append(f"{row['spec']}\nN={row['n']}")
                values.append(row["blocked_vs_sdpa"])
        ax.bar(range(len(values)), values)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(values)), labels, rotation=60, fontsize=7)
        ax.set_title(f"blocked / SDPA, {mode}")
    axes[0].set_ylabel("time ratio (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def build_parser():
    from .cli_input import Parser, int_in

    parser = Parser(prog="attnzoo bench", description=__doc__)
    length = int_in(1, MAX_LENGTH)
    parser.add_argument("specs", nargs="*", help="spec names (default: vanilla ssa selective selective-ssa)")
    parser.add_argument("--lengths", type=length, nargs="+", help="sequence lengths to time")
    parser.add_argument("--memory-lengths", type=length, nargs="*", help="lengths for peak memory only (default "
                        "8192, or none when --lengths is given)")
    parser.add_argument("--repeats", type=int_in(1, 1000), help="interleaved repeats (median is kept)")
    parser.add_argument("--out", default="bench-results", help="directory for JSON, markdown and plot")
    parser.add_argument("--worker", nargs=4, metavar=("BACKEND", "SPEC", "N", "GRAD"), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    from .cli_input import folder_for_writing, int_in

    args = build_parser().parse_args(argv)
    length = int_in(1, MAX_LENGTH)
    cfg = Config()
    try:  # the worker's arguments are written by run_benchmark, but refused in one line all the same
        if args.config:
            data = json.loads(args.config)
            cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
        if args.worker:
            name, spec, n, grad = args.worker
            n = length(n)
    except (ValueError, TypeError, AttributeError, argparse.ArgumentTypeError) as exc:
        print(f"attnzoo bench: bad worker arguments: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.worker:
        print(json.dumps(worker(cfg, name, spec, n, grad == "1")))
        return 0
    if args.specs:
        cfg.specs = tuple(args.specs)
    if args.lengths:
        cfg.lengths = tuple(args.lengths)
    if args.memory_lengths is not None:
        cfg.memory_lengths = tuple(args.memory_lengths)
    elif args.lengths:  # lengths given: the memory-only phase (N = 8192 by default) only when asked for
        cfg.memory_lengths = ()
    if args.repeats:
        cfg.repeats = args.repeats
    from .errors import SpecError
    from .spec import load_spec

    try:
        for spec in cfg.specs:
            load_spec(spec)
    except SpecError as exc:
        print(f"attnzoo bench: {exc}", file=sys.stderr)
        return 2
    from .cli_input import BadInput

    try:
        folder_for_writing(args.out, "--out")
    except BadInput as exc:
        print(f"attnzoo bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    result = run_benchmark(cfg)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(to_markdown(result))
    plotted = plot(result, out / "bench.png")
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``attnzoo experiment NAME``: the seed papers' effects, reproduced at small scale on a CPU (docs/experiments.md).

Each experiment is a module with ``DEFAULTS`` (its configuration: specs, seeds, steps, sizes), ``run(cfg,
show_progress)`` returning ``{"runs": [...], "summary": {...}}`` and ``plot(results, folder)`` writing its figures.
:func:`run_experiment` adds the configuration and the machine to the results and writes
``<out>/<name>.json`` and the plots.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

EXPERIMENTS = {
    "variable-assignment": ("variable_assignment", "selective vs vanilla, in and out of distribution"),
    "pruning": ("pruning", "parity and copy accuracy against the selective KV budget per layer"),
    "denoising": ("denoising", "SSA value temperature vs vanilla, naive averaging and Bayes"),
    "graph": ("graph", "SSA query temperature on a random-graph next-token task"),
    "language-model": ("language_model", "byte-level LM on the Python docs: perplexity and the budget curve"),
}


def module(name: str):
    if name not in EXPERIMENTS:
        from ..spec import did_you_mean

        raise ValueError(f"unknown experiment '{name}'{did_you_mean(name, EXPERIMENTS)} "
                         f"(one of: {', '.join(EXPERIMENTS)})")
    return importlib.import_module(f"{__name__}.{EXPERIMENTS[name][0]}")


def config(name: str, **overrides) -> dict:
    """The experiment's default configuration with ``overrides`` (None values are ignored); unknown keys are
    refused with the valid ones."""
    cfg = dict(module(name).DEFAULTS)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in cfg:
            raise ValueError(f"experiment '{name}' has no setting '{key}' (settings: {', '.join(sorted(cfg))})")
        cfg[key] = value
    return cfg


def run_experiment(name: str, out: str | Path | None, show_progress: bool = True, **overrides) -> dict:
    """Run experiment ``name`` with its defaults and ``overrides`` (e.g. ``seeds=[0]``, ``steps=100``), write
    ``<out>/<name>.json`` (configuration, machine, per-run and summary figures, seconds) and its plots (``out``
    None: write nothing); returns the results."""
    from . import common

    mod = module(name)
    cfg = config(name, **overrides)
    start = time.perf_counter()
    results = {"experiment": name, "config": cfg, "environment": common.environment()}
    results.update(mod.run(cfg, show_progress=show_progress))
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["plots"], results["json"] = [], None
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        results["plots"] = mod.plot(results, folder)
        results["json"] = str(common.write_results(folder, name, results))
    return results


def format_summary(results: dict) -> str:
    """The summary as indented lines, every ``{"mean", "std"}`` as ``mean ± std (n runs)``."""
    lines = [f"{results['experiment']}: {EXPERIMENTS[results['experiment']][1]}"]

    def walk(node, depth):
        for key, value in node.items():
            if isinstance(value, dict) and "mean" in value and "std" in value:
                runs = len(value.get("runs", []))
                lines.append(f"{'  ' * depth}{key}: {value['mean']:.4g} ± {value['std']:.2g} ({runs} runs)")
            elif isinstance(value, dict):
                lines.append(f"{'  ' * depth}{key}:")
                walk(value, depth + 1)
            else:
                lines.append(f"{'  ' * depth}{key}: {value}")

    walk(results["summary"], 1)
    return "\n".join(lines)

"""``attnzoo experiment NAME``: the seed papers' effects, reproduced at small scale on a CPU (docs/experiments.md).

Each experiment is a module with ``DEFAULTS`` (its configuration: specs, seeds, steps, sizes), ``run(cfg,
show_progress)`` returning ``{"runs": [...], "summary": {...}}`` and ``plot(results, folder)`` writing its figures.
:func:`run_experiment` adds the configuration and the machine to the results and writes
``<out>/<name>.json`` and the plots.
"""

from __future__ import annotations

import importlib
import inspect
import time
from pathlib import Path

EXPERIMENTS = {
    "variable-assignment": ("variable_assignment", "selective vs vanilla, in and out of distribution"),
    "pruning": ("pruning", "parity and copy accuracy against the selective KV budget per layer"),
    "denoising": ("denoising", "SSA value temperature vs vanilla, naive averaging and Bayes"),
    "graph": ("graph", "SSA query temperature on a random-graph next-token task"),
    "language-model": ("language_model", "byte-level LM on the Python docs: perplexity and the budget curve"),
    "finetune": ("finetune", "SmolLM2-135M fine-tuned with SSA / selective + memory loss, then pruned"),
}


def module(name: str):
    if name not in EXPERIMENTS:
        from ..spec import did_you_mean

        raise ValueError(f"unknown experiment '{name}'{did_you_mean(name, EXPERIMENTS)} "
                         f"(one of: {', '.join(EXPERIMENTS)})")
    return importlib.import_module(f"{__name__}.{EXPERIMENTS[name][0]}")


def config(name: str, **overrides) -> dict:
    """The experiment's default configuration with ``overrides`` (None values are ignored), every value typed and
    range-checked (:mod:`.settings`); an unknown key is refused with the valid ones."""
    from . import settings

    mod = module(name)
    cfg = dict(mod.DEFAULTS)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in cfg:
            raise ValueError(f"experiment '{name}' has no setting '{key}' (settings: {', '.join(sorted(cfg))})")
        cfg[key] = value
    settings.check(name, cfg, tasks=getattr(mod, "TASKS", None))
    return cfg


def trainings(name: str, cfg: dict) -> int:
    """How many models a run of ``cfg`` trains: one per spec, seed (and task)."""
    return len(cfg["specs"]) * len(cfg["seeds"]) * len(cfg.get("tasks", [None]))


def estimate_seconds(name: str, cfg: dict, probe_steps: int = 3) -> tuple[float, float]:
    """(seconds of training ``cfg`` would take, seconds per step) at the step rate measured here: each spec's first
    run is started and stopped after ``probe_steps`` steps past the first (its warm-up), nothing evaluated or
    written. Measured per spec, as specs differ in cost; a run of ``probe_steps + 1`` steps or fewer is not
    measured (0.0, 0.0)."""
    from . import common

    mod = module(name)
    total, rates = 0.0, []
    if cfg["steps"] <= probe_steps + 1:
        return total, 0.0
    for spec in cfg["specs"]:
        probe = {**cfg, "specs": [spec], "seeds": cfg["seeds"][:1]}
        if "tasks" in cfg:
            probe["tasks"] = cfg["tasks"][:1]
        with common.probing(probe_steps) as probed:
            mod.run(probe, show_progress=False)
        if probed.seconds_per_step is None:  # the experiment trains nothing for this spec
            continue
        rates.append(probed.seconds_per_step)
        total += probed.seconds_per_step * cfg["steps"] * trainings(name, {**cfg, "specs": [spec]})
    return total, (sum(rates) / len(rates) if rates else 0.0)


def run_experiment(name: str, out: str | Path | None, show_progress: bool = True, **overrides) -> dict:
    """Run experiment ``name`` with its defaults and ``overrides`` (e.g. ``seeds=[0]``, ``steps=100``), write
    ``<out>/<name>.json`` (configuration, machine, per-run and summary figures, seconds) and its plots (``out``
    None: write nothing); returns the results."""
    from . import common

    mod = module(name)
    cfg = config(name, **overrides)
    start = time.perf_counter()
    results = {"experiment": name, "config": cfg, "environment": common.environment()}
    extra = {"out": Path(out)} if out is not None and "out" in inspect.signature(mod.run).parameters else {}
    results.update(mod.run(cfg, show_progress=show_progress, **extra))
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

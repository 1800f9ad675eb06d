"""The experiments' settings, typed and range-checked before anything trains: every key any experiment has, with
what it may hold (``--set KEY=VALUE`` on the command line; docs/experiments.md). A bad value is one line naming
the key, the value and the valid range."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """What one setting holds: ``kind`` is ``int``, ``float``, ``ints`` (a non-empty list of ints), ``names`` (a
    non-empty list of names), ``name``, ``spec`` (a name or a spec mapping) or ``budgets`` (``ints``, or a mapping
    of task to ``ints``); numbers lie in ``[low, high]``, and a float above ``low`` strictly when ``open_low``."""

    kind: str
    low: float = 1
    high: float = 1_000_000
    open_low: bool = False
    choices: tuple[str, ...] = ()

    def range(self) -> str:
        if self.kind == "float":
            return f"a finite number {'>' if self.open_low else '>='} {self.low:g} and <= {self.high:g}"
        what = "integers" if self.kind in ("ints", "budgets") else "an integer"
        return f"{what} from {int(self.low):,} to {int(self.high):,}"


COUNT = Setting("int")
RATE = Setting("float", 0, 10, open_low=True)
SIZE = Setting("int", 1, 65_536)

#: every setting of every experiment
SETTINGS: dict[str, Setting] = {
    "specs": Setting("names"), "window_for": Setting("names", low=0), "tasks": Setting("names"),
    "seeds": Setting("ints", 0, 2**32 - 1), "steps": Setting("int", 1, 10_000_000),
    "batch": COUNT, "test_size": COUNT, "valid_windows": COUNT,
    "lr": RATE, "transform_lr": RATE, "memory_eps": Setting("float", 0, 10),
    "sigma_s": Setting("float", 0, 1000, open_low=True), "sigma_n": Setting("float", 0, 1000, open_low=True),
    "layers": Setting("int", 1, 256), "heads": Setting("int", 1, 1024), "dim": SIZE, "head_dim": SIZE,
    "width": SIZE, "d": SIZE, "n": SIZE, "k": SIZE, "nodes": SIZE, "context": SIZE, "variables": SIZE,
    "values": SIZE, "min_assignments": SIZE, "train_assignments": SIZE, "parity_bits": SIZE, "copy_length": SIZE,
    "test_assignments": Setting("ints", 1, 65_536), "degrees": Setting("ints", 1, 65_536),
    "budgets": Setting("budgets", 1, 1_000_000),
    "pruned_spec": Setting("name"), "window_spec": Setting("spec"),
    "train": Setting("choice", choices=("attention", "all")), "minutes": Setting("float", 0, 100_000),
    "checkpoint_every": Setting("int", 0, 10_000_000), "eval_context": SIZE, "baselines": Setting("names", low=0),
    "serve_budget": Setting("int", 1, 1_000_000), "save": Setting("int", 0, 1), "runs": Setting("path"),
}


def check_value(experiment: str, key: str, value: Any) -> None:
    """One line (ValueError) unless ``value`` is what setting ``key`` holds."""
    setting = SETTINGS[key]

    def bad(why: str) -> ValueError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
        return ValueError(f"experiment '{experiment}': {key}={shown}: {why}")

    def number(x: Any) -> bool:
        if setting.kind == "float":
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                return False
            return (x > setting.low if setting.open_low else x >= setting.low) and x <= setting.high
        return isinstance(x, int) and not isinstance(x, bool) and setting.low <= x <= setting.high

    def ints(x: Any) -> bool:
        return isinstance(x, list) and 0 < len(x) <= 1000 and all(number(i) for i in x)

    if setting.kind in ("int", "float"):
        if not number(value):
            raise bad(f"must be {setting.range()}")
    elif setting.kind == "ints":
        if not ints(value):
            raise bad(f"must be a list of 1 to 1000 {setting.range()}, e.g. [1, 2]")
    elif setting.kind == "budgets":
        if not (ints(value) or (isinstance(value, dict) and value and all(
                isinstance(t, str) and ints(b) for t, b in value.items()))):
            raise bad(f"must be a list of {setting.range()}, or a mapping of task to such a list")
    elif setting.kind == "names":
        if not (isinstance(value, list) and len(value) >= setting.low and len(value) <= 100
                and all(isinstance(n, str) and n for n in value)):
            raise bad("must be a list of names" + (" (at least one)" if setting.low else ""))
    elif setting.kind == "name":
        if not (isinstance(value, str) and value):
            raise bad("must be a spec name")
    elif setting.kind == "spec" and not (isinstance(value, (str, dict)) and value):
        raise bad("must be a spec name or a spec mapping")
    elif setting.kind == "path" and not isinstance(value, str):
        raise bad("must be a folder path (a JSON string, e.g. \"runs/finetune\"), or \"\" for the default")
    elif setting.kind == "choice" and value not in setting.choices:
        raise bad(f"must be one of {', '.join(setting.choices)}")


def check(experiment: str, cfg: dict, tasks=None) -> None:
    """Every value of ``cfg`` (the defaults with the overrides), its tasks against the experiment's ``tasks``, and
    the rules that tie settings together."""
    for key, value in cfg.items():
        check_value(experiment, key, value)

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(f"experiment '{experiment}': {why}")

    unknown = [t for t in cfg.get("tasks", []) if tasks is not None and t not in tasks]
    need(not unknown, f"unknown task '{unknown[0]}' (tasks: {', '.join(tasks)})" if unknown else "")

    if {"dim", "heads"} <= set(cfg):
        need(cfg["dim"] % cfg["heads"] == 0, f"dim ({cfg['dim']}) must be a multiple of heads ({cfg['heads']})")
    if {"min_assignments", "train_assignments"} <= set(cfg):
        need(cfg["min_assignments"] <= cfg["train_assignments"], f"min_assignments ({cfg['min_assignments']}) "
             f"must be at most train_assignments ({cfg['train_assignments']})")
    if {"nodes", "head_dim"} <= set(cfg):
        need(cfg["head_dim"] >= cfg["nodes"], f"head_dim ({cfg['head_dim']}) must be at least nodes "
             f"({cfg['nodes']}): the values are one-hot codes of the nodes")
    if {"nodes", "degrees"} <= set(cfg):
        need(max(cfg["degrees"]) < cfg["nodes"], f"every degree must be below nodes ({cfg['nodes']}): a node "
             "moves to that many other nodes")
    if {"n", "k"} <= set(cfg):
        need(cfg["k"] <= cfg["n"], f"k ({cfg['k']}) must be at most n ({cfg['n']}): k of the n tokens carry the "
             "signal")
    if {"context", "eval_context"} <= set(cfg):
        need(cfg["eval_context"] >= 8, f"eval_context ({cfg['eval_context']}) must be at least 8 tokens: its last "
             "quarter is scored")
    if "tasks" in cfg and isinstance(cfg.get("budgets"), dict):
        missing = [t for t in cfg["tasks"] if t not in cfg["budgets"]]
        need(not missing, f"budgets names no budgets for task '{missing[0]}'" if missing else "")

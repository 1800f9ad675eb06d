"""Parity and Copy under KV-cache pruning (selective attention paper; the recipes are ours, docs/experiments.md).

A selective model (trained with the memory loss) is decoded token by token through per-layer caches that keep
``budget`` tokens each, evicting the largest F (the ``selective`` evictor). Per-token accuracy as a function of
the budget shows how much memory each task needs:

- *Parity*: ``BOS b1 p1 b2 p2 ...`` with ``p_i`` the parity of ``b1..b_i``, predicted at ``b_i``. The answer
  depends on the last parity and the new bit only: constant memory, so a tiny budget should cost nothing.
- *Copy*: ``BOS s1 .. sL SEP s1 .. sL``, the second half predicted. Every symbol must be remembered until it is
  copied: a budget below L must fail.
"""

from __future__ import annotations

import torch

from . import common

BOS = 0
PARITY_VOCAB = 5  # BOS, bit 0, bit 1, parity 0, parity 1
SEP = 1


def parity_batch(gen: torch.Generator, size: int, bits: int):
    """Tokens (B, 2·bits + 1), targets (B, N) and the mask of scored positions (the bits)."""
    b = torch.randint(0, 2, (size, bits), generator=gen)
    p = torch.cumsum(b, dim=1) % 2
    tokens = torch.cat([torch.zeros(size, 1, dtype=torch.long),
                        torch.stack([1 + b, 3 + p], dim=2).reshape(size, -1)], dim=1)
    targets = torch.zeros_like(tokens)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    targets[:, 1::2], mask[:, 1::2] = 3 + p, True
    return tokens, targets, mask


def copy_batch(gen: torch.Generator, size: int, length: int, symbols: int):
    """Tokens (B, 2·L + 2), targets (B, N) (the next token) and the mask of scored positions (the copy)."""
    s = 2 + torch.randint(0, symbols, (size, length), generator=gen)
    tokens = torch.cat([torch.zeros(size, 1, dtype=torch.long), s, torch.full((size, 1), SEP), s], dim=1)
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, length + 1: 2 * length + 1] = True
    return tokens, targets, mask


TASKS = {
    "parity": dict(vocab=PARITY_VOCAB, make=lambda gen, n, cfg: parity_batch(gen, n, cfg["parity_bits"])),
    "copy": dict(vocab=2 + 16, make=lambda gen, n, cfg: copy_batch(gen, n, cfg["copy_length"], 16)),
}

DEFAULTS = dict(specs=["selective"], pruned_spec="selective-pruned", tasks=["parity", "copy"], seeds=[0, 1, 2],
                steps=600, batch=32, lr=2e-3, layers=3, heads=3, dim=96, memory_eps=0.1, parity_bits=24,
                copy_length=16, budgets={"parity": [2, 3, 4, 6, 8, 16, 49],
                                         "copy": [4, 8, 12, 16, 17, 18, 20, 24, 34]},
                test_size=256)


def _accuracy(logits, targets, mask) -> float:
    return float((logits.argmax(-1)[mask] == targets[mask]).double().mean())


def run(cfg: dict, show_progress: bool = True) -> dict:
    runs = []
    for spec in cfg["specs"]:
        for task in cfg["tasks"]:
            info = TASKS[task]
            for seed in cfg["seeds"]:
                gen = common.seed_everything(seed)
                model = common.TinyTransformer(spec, info["vocab"], cfg["dim"], cfg["layers"], cfg["heads"])

                def batches(step, gen=gen, info=info):
                    return info["make"](gen, cfg["batch"], cfg)

                def loss_fn(model, b):
                    tokens, targets, mask = b
                    return common.masked_cross_entropy(model(tokens), targets, mask)

                log = common.train(model, batches, cfg["steps"], cfg["lr"], loss_fn, f"{task} {spec} seed {seed}",
                                   show_progress, memory_eps=cfg["memory_eps"])
                tokens, targets, mask = info["make"](torch.Generator().manual_seed(10_000 + seed), cfg["test_size"],
                                                     cfg)
                with torch.no_grad():
                    full = _accuracy(model(tokens), targets, mask)
                pruned = model.with_spec(cfg["pruned_spec"])
                by_budget = {}
                for budget in cfg["budgets"][task]:
                    by_budget[str(budget)] = _accuracy(pruned.decode_logits(tokens, budget), targets, mask)
                runs.append({"spec": spec, "task": task, "seed": seed, "accuracy_full": full,
                             "accuracy_by_budget": by_budget, "sequence_length": tokens.shape[1],
                             "train": log.as_dict()})
    summary = {}
    for spec in cfg["specs"]:
        for task in cfg["tasks"]:
            mine = [r for r in runs if r["spec"] == spec and r["task"] == task]
            summary[f"{task}/{spec}"] = {
                "full": common.mean_std([r["accuracy_full"] for r in mine]),
                "by_budget": {b: common.mean_std([r["accuracy_by_budget"][b] for r in mine])
                              for b in mine[0]["accuracy_by_budget"]},
                "sequence_length": mine[0]["sequence_length"]}
    return {"runs": runs, "summary": summary}


def plot(results: dict, folder) -> list[str]:
    plt = common.figure()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for key, per in results["summary"].items():
        budgets = [int(b) for b in per["by_budget"]]
        ax.errorbar(budgets, [100 * v["mean"] for v in per["by_budget"].values()],
                    yerr=[100 * v["std"] for v in per["by_budget"].values()], marker="o", capsize=3,
                    label=f"{key} (N={per['sequence_length']})")
    if "copy" in results["config"]["tasks"]:
        ax.axvline(results["config"]["copy_length"], color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget per layer (tokens; dotted: copy length)")
    ax.set_ylabel("per-token accuracy (%)")
    ax.set_title("Parity and Copy with selective pruning")
    ax.legend(fontsize=8)
    return common.save_figure(plt, fig, folder, "pruning.png")

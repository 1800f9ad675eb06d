"""Variable Assignment (selective attention paper, §"synthetic tasks"; the recipe is ours, docs/experiments.md).

A sequence ``BOS x 3 y 5 x 7 ... ? x`` assigns values to variables; the model answers the latest value of the
asked variable at the last token. Training draws 1 to ``train_assignments`` assignments per sequence (one count
per batch); the in-distribution test uses ``train_assignments``, the out-of-distribution tests use more, so the
asked variable has been overwritten more often and more stale values compete for attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from . import common

BOS, ASK = 0, 1


def vocab(variables: int, values: int) -> int:
    return 2 + variables + values


def batch(gen: torch.Generator, size: int, assignments: int, variables: int, values: int):
    """Tokens (B, 2·A + 3) and the answers (B,)."""
    var = torch.randint(0, variables, (size, assignments), generator=gen)
    val = torch.randint(0, values, (size, assignments), generator=gen)
    pick = torch.randint(0, assignments, (size,), generator=gen)
    asked = var[torch.arange(size), pick]
    later = var == asked[:, None]
    last = torch.where(later, torch.arange(assignments), -1).max(dim=1).values
    answer = val[torch.arange(size), last]
    body = torch.stack([2 + var, 2 + variables + val], dim=2).reshape(size, -1)
    tokens = torch.cat([torch.full((size, 1), BOS), body, torch.full((size, 1), ASK), (2 + asked)[:, None]], dim=1)
    return tokens, 2 + variables + answer


def accuracy(model, gen, size: int, assignments: int, variables: int, values: int, chunk: int = 256) -> float:
    correct = 0
    with torch.no_grad():
        for start in range(0, size, chunk):
            tokens, answer = batch(gen, min(chunk, size - start), assignments, variables, values)
            correct += int((model(tokens)[:, -1].argmax(-1) == answer).sum())
    return correct / size


DEFAULTS = dict(specs=["vanilla", "selective"], seeds=[0, 1, 2], steps=1500, batch=64, lr=1e-3, layers=3,
                heads=3, dim=192, variables=6, values=10, train_assignments=8, test_assignments=[8, 16, 24],
                test_size=1000)


def run(cfg: dict, show_progress: bool = True) -> dict:
    runs = []
    for spec in cfg["specs"]:
        for seed in cfg["seeds"]:
            gen = common.seed_everything(seed)
            model = common.TinyTransformer(spec, vocab(cfg["variables"], cfg["values"]), cfg["dim"], cfg["layers"],
                                           cfg["heads"])
            counts = torch.randint(1, cfg["train_assignments"] + 1, (cfg["steps"],), generator=gen)

            def batches(step, counts=counts, gen=gen):
                return batch(gen, cfg["batch"], int(counts[step]), cfg["variables"], cfg["values"])

            def loss_fn(model, b):
                tokens, answer = b
                return F_.cross_entropy(model(tokens)[:, -1], answer)

            log = common.train(model, batches, cfg["steps"], cfg["lr"], loss_fn, f"{spec} seed {seed}",
                               show_progress)
            test_gen = torch.Generator().manual_seed(10_000 + seed)
            acc = {str(a): accuracy(model, test_gen, cfg["test_size"], a, cfg["variables"], cfg["values"])
                   for a in cfg["test_assignments"]}
            runs.append({"spec": spec, "seed": seed, "accuracy": acc, "train": log.as_dict(),
                         "parameters": common.count_parameters(model)})
    summary = {}
    for spec in cfg["specs"]:
        mine = [r for r in runs if r["spec"] == spec]
        summary[spec] = {a: common.mean_std([r["accuracy"][a] for r in mine]) for a in mine[0]["accuracy"]}
    return {"runs": runs, "summary": summary}


def plot(results: dict, folder) -> list[str]:
    plt = common.figure()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for spec, per in results["summary"].items():
        xs = [int(a) for a in per]
        ax.errorbar(xs, [100 * per[a]["mean"] for a in per], yerr=[100 * per[a]["std"] for a in per],
                    marker="o", capsize=3, label=spec)
    ax.axvline(results["config"]["train_assignments"], color="grey", ls=":", lw=1)
    ax.set_xlabel("assignments per sequence (dotted: most seen in training)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Variable Assignment")
    ax.legend()
    fig.tight_layout()
    path = folder / "variable-assignment.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path.name]

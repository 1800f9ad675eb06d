"""Variable Assignment (selective attention paper, §"synthetic tasks"; the recipe is ours, docs/experiments.md).

A sequence ``BOS x 3 ? x 3 y 5 ? x 3 x 7 ? x 7 ...`` interleaves assignments (a variable, then its value) with
questions (``?``, a variable assigned before, then its latest value, which the model predicts). Training draws
``min_assignments`` to ``train_assignments`` assignments per sequence (one count per batch) and scores every
answer. Tests score the *last* answer of sequences with ``train_assignments`` assignments (in distribution) and
with more (out of distribution: longer sequences, where the asked variable has been overwritten more often and
more stale values compete for attention).
"""

from __future__ import annotations

import torch

from . import common

BOS, ASK = 0, 1


def vocab(variables: int, values: int) -> int:
    return 2 + variables + values


def batch(gen: torch.Generator, size: int, assignments: int, variables: int, values: int):
    """Tokens (B, 5·A + 1), the targets (B, N) (the answer at each asked variable) and the mask of answers."""
    var = torch.randint(0, variables, (size, assignments), generator=gen)
    val = torch.randint(0, values, (size, assignments), generator=gen)
    rows = torch.arange(size)
    # question t asks a variable assigned at or before step t: the one of a random earlier step
    pick = (torch.rand(size, assignments, generator=gen) * (torch.arange(assignments) + 1)).long()
    asked = var[rows[:, None], pick]
    steps = torch.arange(assignments)
    # the latest step s <= t with var[s] == asked[t]
    same = (var[:, None, :] == asked[:, :, None]) & (steps[None, None, :] <= steps[None, :, None])
    latest = torch.where(same, steps, -1).max(dim=2).values
    answer = val[rows[:, None], latest]
    ask = torch.full_like(var, ASK)
    body = torch.stack([2 + var, 2 + variables + val, ask, 2 + asked, 2 + variables + answer], dim=2)
    tokens = torch.cat([torch.full((size, 1), BOS), body.reshape(size, -1)], dim=1)
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 4::5] = True  # the asked variable: its next token is the answer
    return tokens, targets, mask


def accuracy(model, gen, size: int, assignments: int, variables: int, values: int, chunk: int = 250) -> float:
    """Accuracy of the last answer of sequences with ``assignments`` assignments."""
    correct = 0
    with torch.no_grad():
        for start in range(0, size, chunk):
            tokens, targets, _ = batch(gen, min(chunk, size - start), assignments, variables, values)
            correct += int((model(tokens[:, :-1])[:, -1].argmax(-1) == targets[:, -2]).sum())
    return correct / size


DEFAULTS = dict(specs=["vanilla", "selective"], seeds=[0, 1, 2], steps=1500, batch=32, lr=2e-3, layers=3,
                heads=3, dim=96, variables=6, values=10, min_assignments=4, train_assignments=8,
                test_assignments=[8, 16, 32], test_size=1000)


def run(cfg: dict, show_progress: bool = True) -> dict:
    runs = []
    for spec in cfg["specs"]:
        for seed in cfg["seeds"]:
            gen = common.seed_everything(seed)
            model = common.TinyTransformer(spec, vocab(cfg["variables"], cfg["values"]), cfg["dim"], cfg["layers"],
                                           cfg["heads"])
            counts = torch.randint(cfg["min_assignments"], cfg["train_assignments"] + 1, (cfg["steps"],),
                                   generator=gen)

            def batches(step, counts=counts, gen=gen):
                return batch(gen, cfg["batch"], int(counts[step]), cfg["variables"], cfg["values"])

            def loss_fn(model, b):
                tokens, targets, mask = b
                return common.masked_cross_entropy(model(tokens), targets, mask)

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
    for i, (spec, per) in enumerate(results["summary"].items()):
        xs = [int(a) for a in per]
        ax.errorbar(xs, [100 * per[a]["mean"] for a in per], yerr=[100 * per[a]["std"] for a in per],
                    marker="o", capsize=3, label=f"{spec} (mean ± std)", color=f"C{i}")
        for a in per:  # every seed
            ax.scatter([int(a)] * len(per[a]["runs"]), [100 * v for v in per[a]["runs"]], s=10, alpha=0.4,
                       color=f"C{i}")
    ax.axvline(results["config"]["train_assignments"], color="grey", ls=":", lw=1)
    ax.set_xlabel("assignments per sequence (dotted: most seen in training)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Variable Assignment")
    ax.legend()
    return common.save_figure(plt, fig, folder, "variable-assignment.png")

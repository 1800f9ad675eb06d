"""A small byte-level language model on real text (the recipe is ours, docs/experiments.md).

Corpus: the Python 3.11 documentation's prose (``data/python-docs.txt.gz``, 1.5 MB, PSF licence; origin and
changes in ``data/README.md``): the first 90% trains, the last 10% validates. Windows of ``context`` bytes, each
preceded by a BOS token (selective attention protects position 1). Every spec gets the same model, data order,
steps and learning rate. Reported: validation perplexity per byte; for specs with an accumulator, the perplexity
when decoding token by token through per-layer caches that keep ``budget`` tokens (the selective evictor), the
selective paper's memory-reduction curve at small scale.
"""

from __future__ import annotations

import gzip
import math
from importlib import resources

import torch
import torch.nn.functional as F_

from . import common

BOS = 256
VOCAB = 257


def corpus() -> bytes:
    with resources.files(__package__).joinpath("data/python-docs.txt.gz").open("rb") as f:
        return gzip.decompress(f.read())


def split(data: bytes, valid_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
    cut = int(len(ids) * (1 - valid_fraction))
    return ids[:cut], ids[cut:]


def windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, context): BOS then ``context - 1`` bytes; targets (B, context): the next byte at each."""
    idx = starts[:, None] + torch.arange(context)
    targets = ids[idx]
    inputs = torch.cat([torch.full((len(starts), 1), BOS), targets[:, :-1]], dim=1)
    return inputs, targets


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(float(F_.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))))


#: the control for the pruning curve: a spec without an accumulator decoded through a cache that keeps BOS and the
#: most recent tokens (StreamingLLM's rule with one sink), at the same budgets
WINDOW_SPEC = {"name": "window", "summary": "BOS + the most recent tokens", "transforms": [],
               "cache": {"evictor": "sink_window", "sink": 1}}

DEFAULTS = dict(specs=["vanilla", "ssa", "selective", "selective+memory"], seeds=[0], steps=600, batch=16,
                context=128, lr=2e-3, transform_lr=2e-2, layers=4, heads=4, dim=128, memory_eps=0.1,
                pruned_spec="selective-pruned", window_spec=WINDOW_SPEC, window_for=["vanilla"],
                budgets=[4, 8, 16, 32, 64, 128], valid_windows=64)

MEMORY_SUFFIX = "+memory"  # "<spec>+memory": the same spec trained with the memory loss (memory_eps)


def run(cfg: dict, show_progress: bool = True) -> dict:
    train_ids, valid_ids = split(corpus())
    context = cfg["context"]
    valid_starts = torch.linspace(0, len(valid_ids) - context - 1, cfg["valid_windows"]).to(torch.long)
    valid = windows(valid_ids, valid_starts, context)
    runs = []
    for seed in cfg["seeds"]:
        order = torch.randint(0, len(train_ids) - context - 1, (cfg["steps"], cfg["batch"]),
                              generator=torch.Generator().manual_seed(seed))
        for name in cfg["specs"]:
            spec, memory = (name[: -len(MEMORY_SUFFIX)], True) if name.endswith(MEMORY_SUFFIX) else (name, False)
            common.seed_everything(seed)
            model = common.TinyTransformer(spec, VOCAB, cfg["dim"], cfg["layers"], cfg["heads"])

            def batches(step, order=order):
                return windows(train_ids, order[step], context)

            def loss_fn(model, b):
                inputs, targets = b
                return F_.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))

            log = common.train(model, batches, cfg["steps"], cfg["lr"], loss_fn, f"{name} seed {seed}",
                               show_progress, transform_lr=cfg["transform_lr"],
                               memory_eps=cfg["memory_eps"] if memory else 0.0)
            with torch.no_grad():
                ppl = perplexity(model(valid[0]), valid[1])
            record = {"spec": name, "seed": seed, "valid_perplexity": ppl, "train": log.as_dict(),
                      "parameters": common.count_parameters(model)}
            pruned = None
            if model.blocks[0].attn.has_accumulator:
                pruned = model.with_spec(cfg["pruned_spec"])
            elif name in cfg["window_for"]:
                pruned = model.with_spec(cfg["window_spec"])
            if pruned is not None:
                curve = {}
                bar = common.progress(len(cfg["budgets"]), f"{name} budgets", show_progress)
                record["pruned_with"] = pruned.blocks[0].attn.spec.name
                for budget in cfg["budgets"]:
                    curve[str(budget)] = perplexity(pruned.decode_logits(valid[0], budget), valid[1])
                    bar.update(1)
                bar.close()
                record["perplexity_by_budget"] = curve
            runs.append(record)
    summary = {}
    for name in cfg["specs"]:
        mine = [r for r in runs if r["spec"] == name]
        summary[name] = {"valid_perplexity": common.mean_std([r["valid_perplexity"] for r in mine])}
        if "perplexity_by_budget" in mine[0]:
            summary[name]["pruned_with"] = mine[0]["pruned_with"]
            summary[name]["by_budget"] = {b: common.mean_std([r["perplexity_by_budget"][b] for r in mine])
                                          for b in mine[0]["perplexity_by_budget"]}
    baseline = summary.get("vanilla", {}).get("valid_perplexity", {}).get("mean")
    if baseline is not None:
        for per in summary.values():
            if "by_budget" in per:
                # the smallest budget from which every larger one stays at or below vanilla's perplexity
                smallest = None
                for budget in sorted(per["by_budget"], key=int, reverse=True):
                    if per["by_budget"][budget]["mean"] > baseline:
                        break
                    smallest = int(budget)
                per["smallest_budget_at_vanilla_perplexity"] = smallest
    return {"runs": runs, "summary": summary}


def plot(results: dict, folder) -> list[str]:
    plt = common.figure()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    common.plot_losses(axes[0], results["runs"], "training loss (nats/byte)", "training")
    summary = results["summary"]
    context = results["config"]["context"]
    for i, (name, per) in enumerate(summary.items()):
        color = f"C{i}"
        if "by_budget" in per:
            xs = [int(b) for b in per["by_budget"]]
            axes[1].plot(xs, [v["mean"] for v in per["by_budget"].values()], marker="o", color=color,
                         label=f"{name}, pruned ({per['pruned_with']})")
        axes[1].axhline(per["valid_perplexity"]["mean"], ls="--", lw=1, color=color,
                        label=f"{name} (full context)")
    axes[1].axvline(context / 4, color="grey", ls=":", lw=1)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel(f"KV budget per layer (tokens; context {context}, dotted: 1/4)")
    axes[1].set_ylabel("validation perplexity (per byte)")
    axes[1].legend(fontsize=7)
    axes[1].set_title("selective pruning")
    return common.save_figure(plt, fig, folder, "language-model.png")

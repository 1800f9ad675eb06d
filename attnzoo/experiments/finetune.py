"""Fine-tune a real pretrained model with a seed paper's spec, then prune it (issue 53; docs/finetune.md).

The model: SmolLM2-135M-Instruct (``attnzoo model smollm2``: float32, 30 layers, 9 query and 3 key/value heads), its
first ``layers`` layers kept (all by default; fewer is a slice, for tests). Each spec is applied with
``zt.apply``; a spec with an accumulator and no evictor (``selective``) gets selective attention's evictor in its
cache (the same model then decodes pruned; training computes the whole sequence, so the evictor does not act there).
Every spec gets the same data, order, steps and learning rates; ``vanilla`` is the control.

Data: the Python docs corpus the project ships, tokenized by the model's tokenizer; the first 90% of the tokens
train (windows of ``context`` tokens at seeded random starts, each preceded by the model's BOS), the last 10% are
held out: ``valid_windows`` windows of ``eval_context`` tokens, evenly spaced.

Training (:func:`common.train`): AdamW, warm-up and cosine decay; the transforms' parameters in their own group
(``transform_lr``, no weight decay); ``train``: ``attention`` (each layer's q/k/v/o projections and the transforms
train, the rest is frozen) or ``all``; ``<spec>+memory`` adds selective attention's memory loss (``memory_eps``).
With a results folder, each training checkpoints every ``checkpoint_every`` steps into ``<out>/finetune/<run>/``
(or ``<runs>/<run>/`` when the ``runs`` setting names a folder: another command's trainings are then loaded;
safetensors: the trained tensors and the optimizer's moments; JSON: the step and the losses), and running the same
command again resumes there (a finished training is loaded, not trained again); ``minutes`` bounds each training's
wall time (0: no bound; the run is then evaluated as it stands and says so). The trained model is saved with
``save_pretrained`` (and the tokenizer) in ``<out>/finetune/<run>/model``: ``zt.from_pretrained`` and vLLM load it.

Evaluation, on the held-out windows: the last quarter of each window is scored (teacher-forced) after the first
three quarters. "full": one forward over the window. "budget B": the first three quarters prefilled into an
``AttnzooCache`` of ``B`` tokens per layer and KV head (the spec's evictor compresses at prefill), then the last
quarter fed token by token through it with eviction on: every budget in ``budgets``. Fine-tuned runs with an evictor
are scored at each budget with their own; the original model (not fine-tuned) with each of ``baselines``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import time
import warnings
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F_

from . import common

DEFAULTS = dict(specs=["vanilla", "ssa", "selective+memory"], seeds=[0], steps=150, batch=4, context=256,
                lr=5e-5, transform_lr=1e-2, memory_eps=0.1, train="attention", layers=30, minutes=0.0,
                checkpoint_every=25, eval_context=1024, valid_windows=4, budgets=[64, 128, 256],
                baselines=["h2o", "tova", "streaming"], serve_budget=128, save=1, runs="")

MEMORY_SUFFIX = "+memory"
TRAINED = ("q_proj", "k_proj", "v_proj", "o_proj")  # train="attention": these modules of each layer (and the cores)


# -- model and data -----------------------------------------------------------------------------------------------
def load_model(layers: int):
    """(model, tokenizer): SmolLM2-135M-Instruct in float32, its first ``layers`` layers kept."""
    from ..integrations.transformers import smollm2

    model, tokenizer = smollm2(progress=False)
    total = model.config.num_hidden_layers
    if layers > total:
        raise ValueError(f"experiment 'finetune': layers={layers}: the model has {total}")
    if layers < total:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model, tokenizer


def load_tokenizer():
    """The model's tokenizer alone (from the same checked cache folder, nothing fetched)."""
    import transformers

    from ..integrations.transformers import models

    return transformers.AutoTokenizer.from_pretrained(models.ensure(models.SMOLLM2, progress=False).folder,
                                                      local_files_only=True)


def corpus_ids(tokenizer) -> torch.Tensor:
    """The shipped corpus as the model's token ids (1-D, long)."""
    with resources.files(__package__).joinpath("data/python-docs.txt.gz").open("rb") as f:
        text = gzip.decompress(f.read()).decode("utf-8")
    with warnings.catch_warnings():  # the tokenizer warns that the corpus is longer than the model's context
        warnings.simplefilter("ignore")
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


def split(ids: torch.Tensor, valid_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(ids) * (1 - valid_fraction))
    return ids[:cut], ids[cut:]


def training_batch(ids: torch.Tensor, starts: torch.Tensor, context: int, bos: int) -> torch.Tensor:
    """(B, context) token ids: BOS, then ``context - 1`` tokens of the corpus from each start."""
    idx = starts[:, None] + torch.arange(context - 1)
    return torch.cat([torch.full((len(starts), 1), bos, dtype=torch.long), ids[idx]], dim=1)


def held_out_windows(ids: torch.Tensor, count: int, length: int, bos: int) -> torch.Tensor:
    """(count, length) evenly spaced held-out windows, each BOS and ``length - 1`` tokens."""
    if len(ids) < length:
        raise ValueError(f"experiment 'finetune': eval_context={length}: the held-out text has {len(ids)} tokens")
    starts = torch.linspace(0, len(ids) - length, count).to(torch.long)
    return training_batch(ids, starts, length, bos)


def spec_for(name: str):
    """The spec a run trains: the registered spec, with selective attention's evictor added when it has an
    accumulator and no evictor (so the trained model decodes pruned)."""
    from .. import nn as zoo_nn
    from ..spec import load_spec

    spec = load_spec(name)
    has_evictor = spec.cache is not None and spec.cache.evictor is not None
    if zoo_nn.Attention(spec, num_heads=1, head_dim=2).has_accumulator and not has_evictor:
        data = spec.model_dump(exclude_defaults=True)
        data["name"] = f"{spec.name}-pruned"
        data["cache"] = {"evictor": "selective"}
        return load_spec(data)
    return spec


def freeze_for(model, train: str) -> None:
    """``train == "attention"``: only each layer's q/k/v/o projections and the attnzoo cores' tensors train."""
    if train == "all":
        return
    for name, p in model.named_parameters():
        p.requires_grad_(any(f".{m}." in name for m in TRAINED) or ".attnzoo." in name)


# -- evaluation -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def nll_full(model, window: torch.Tensor, prefix: int) -> float:
    """Summed NLL of ``window[prefix:]`` from one forward over the window."""
    logits = model(window[None], use_cache=False).logits[0, prefix - 1:-1]
    return float(F_.cross_entropy(logits.float(), window[prefix:], reduction="sum"))


@torch.no_grad()
def nll_through_cache(model, window: torch.Tensor, prefix: int, budget: int | None, evict: str = "always") -> float:
    """Summed NLL of ``window[prefix:]``: the prefix prefilled into an ``AttnzooCache(model, budget, evict=evict)``,
    the rest fed token by token through it (``always``: eviction on at every step; ``prefill``: the prefix
    compressed, every later token kept, as kvpress's presses score)."""
    from ..integrations.transformers import AttnzooCache

    cache = AttnzooCache(model, budget=budget, evict=evict)
    ids = window[None]
    logits = model(ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    nll = 0.0
    for t in range(prefix, ids.shape[1]):
        nll -= float(torch.log_softmax(logits.float(), -1)[ids[0, t]])
        if t + 1 < ids.shape[1]:
            logits = model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
    return nll


def perplexities(model, windows: torch.Tensor, budgets, bar, full: bool = True) -> dict:
    """{"full": ppl (unless ``full`` is False), "<budget>": ppl, ...} over the held-out windows (the last quarter of
    each scored)."""
    prefix = windows.shape[1] * 3 // 4
    scored = windows.shape[0] * (windows.shape[1] - prefix)
    out = {}
    if full:
        out["full"] = math.exp(sum(nll_full(model, w, prefix) for w in windows) / scored)
        bar.update(1)
    for budget in budgets:
        out[str(budget)] = math.exp(sum(nll_through_cache(model, w, prefix, budget) for w in windows) / scored)
        bar.update(1)
    return out


# -- checkpoints ----------------------------------------------------------------------------------------------------
def _fingerprint(cfg: dict, name: str, seed: int) -> str:
    keep = {k: cfg[k] for k in ("steps", "batch", "context", "lr", "transform_lr", "memory_eps", "train", "layers")}
    return hashlib.sha256(json.dumps([keep, name, seed], sort_keys=True).encode()).hexdigest()[:16]


class Checkpoints:
    """A training's folder ``<out>/finetune/<run>``: ``checkpoint.safetensors`` + ``checkpoint.json`` (the trained
    tensors, the optimizer's state, the step and losses so far) while it trains, ``model/`` once it is done."""

    def __init__(self, folder: Path, fingerprint: str) -> None:
        self.folder, self.fingerprint = folder, fingerprint
        self.tensors, self.meta = folder / "checkpoint.safetensors", folder / "checkpoint.json"
        self.model = folder / "model"

    def _read_meta(self) -> dict | None:
        if not self.meta.exists():
            return None
        meta = json.loads(self.meta.read_text())
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError(f"experiment 'finetune': {self.meta} was written with other settings (steps, batch, "
                             f"context, rates, train, layers): give another --out, or delete {self.folder}")
        return meta

    def done(self) -> dict | None:
        meta = self._read_meta()
        return meta if meta is not None and meta.get("done") and self.model.exists() else None

    def save(self, step: int, model, opt, log: dict, done: bool = False) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        names = {id(p): n for n, p in model.named_parameters()}
        tensors = {f"param.{n}": p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        state = opt.state_dict()
        order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        for index, entry in state["state"].items():
            for key, value in entry.items():
                tensors[f"opt.{order[index]}.{key}"] = value.detach().reshape(value.shape).contiguous()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        tmp = self.tensors.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(self.tensors)
        meta = {"fingerprint": self.fingerprint, "step": step, "log": log, "groups": groups, "order": order,
                "done": done}
        tmp = self.meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta) + "\n")
        tmp.replace(self.meta)

    def resume(self, model, opt) -> tuple[int, dict] | None:
        """Load the last checkpoint into ``model`` and ``opt``: (the step to go on from, the log so far)."""
        from safetensors.torch import load_file

        meta = self._read_meta()
        if meta is None or not self.tensors.exists():
            return None
        tensors = load_file(str(self.tensors))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, value in tensors.items():
                if key.startswith("param."):
                    params[key[len("param."):]].copy_(value)
        index = {n: i for i, n in enumerate(meta["order"])}
        state: dict = {}
        for key, value in tensors.items():
            if key.startswith("opt."):
                name, _, field = key[len("opt."):].rpartition(".")
                state.setdefault(index[name], {})[field] = value
        groups, start = [], 0
        for g, saved in zip(opt.param_groups, meta["groups"], strict=True):
            groups.append({**saved, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        opt.load_state_dict({"state": state, "param_groups": groups})
        return meta["step"], meta["log"]


# -- the experiment -------------------------------------------------------------------------------------------------
def _apply(model, spec, budget):
    from ..integrations import transformers as zt

    with warnings.catch_warnings():  # selective changes a pretrained model's function: that is why it is trained
        warnings.simplefilter("ignore", zt.FunctionWarning)
        return zt.apply(model, spec, budget=budget)


def train_one(cfg: dict, name: str, seed: int, train_ids, tokenizer, show_progress: bool, out: Path | None):
    """One fine-tune: (model, record)."""
    from ..integrations import transformers as zt

    spec_name, memory = (name[: -len(MEMORY_SUFFIX)], True) if name.endswith(MEMORY_SUFFIX) else (name, False)
    run = f"{name.replace('+', '-')}-seed{seed}"
    folder = Path(cfg["runs"]) if cfg["runs"] else None if out is None else Path(out) / "finetune"
    ckpt = None if folder is None else Checkpoints(folder / run, _fingerprint(cfg, name, seed))
    finished = None if ckpt is None else ckpt.done()
    if finished is not None:  # trained before: load it
        model = zt.from_pretrained(str(ckpt.model), torch_dtype=torch.float32).eval()
        return model, {"spec": name, "seed": seed, "train": finished["log"], "loaded": str(ckpt.model),
                       "model": str(ckpt.model)}
    common.seed_everything(seed)
    model, _ = load_model(cfg["layers"])
    spec = spec_for(spec_name)
    _apply(model, spec, cfg["serve_budget"] if spec.cache is not None and spec.cache.evictor else None)
    freeze_for(model, cfg["train"])
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    order = torch.randint(0, len(train_ids) - cfg["context"], (cfg["steps"], cfg["batch"]),
                          generator=torch.Generator().manual_seed(seed))

    def batches(step):
        return training_batch(train_ids, order[step], cfg["context"], bos)

    def loss_fn(model, ids):
        return model(ids, labels=ids, use_cache=False).loss

    deadline = None if not cfg["minutes"] else time.perf_counter() + 60 * cfg["minutes"]
    log = common.train(model, batches, cfg["steps"], cfg["lr"], loss_fn, f"{name} seed {seed}", show_progress,
                       transform_lr=cfg["transform_lr"], memory_eps=cfg["memory_eps"] if memory else 0.0,
                       warmup=min(50, max(1, cfg["steps"] // 10)), log_every=5, deadline=deadline,
                       checkpoints=ckpt, checkpoint_every=cfg["checkpoint_every"])
    tokens = log.done * cfg["batch"] * cfg["context"]
    record = {"spec": name, "applied": spec.name, "seed": seed, "train": log.as_dict(),
              "trained_parameters": common.count_parameters(model), "tokens": tokens,
              "tokens_per_second": round(tokens / log.seconds, 1) if log.seconds else None}
    if ckpt is not None and cfg["save"]:
        model.save_pretrained(str(ckpt.model))
        tokenizer.save_pretrained(str(ckpt.model))
        record["model"] = str(ckpt.model)
    return model, record


def run(cfg: dict, show_progress: bool = True, out: Path | None = None) -> dict:
    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    train_ids, valid_ids = split(corpus_ids(tokenizer))
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    windows = held_out_windows(valid_ids, cfg["valid_windows"], cfg["eval_context"], bos)
    budgets = cfg["budgets"]
    runs = []
    for seed in cfg["seeds"]:
        for name in cfg["specs"]:
            model, record = train_one(cfg, name, seed, train_ids, tokenizer, show_progress, out)
            spec = spec_for(name.removesuffix(MEMORY_SUFFIX))
            scored = budgets if spec.cache is not None and spec.cache.evictor else []
            bar = common.progress(1 + len(scored), f"{name} seed {seed}: held-out", show_progress)
            record["perplexity"] = perplexities(model, windows, scored, bar)
            bar.close()
            runs.append(record)
            del model
    base, _ = load_model(cfg["layers"])  # the original model: full, and each baseline evictor at each budget
    baselines = {}
    bar = common.progress(1 + len(cfg["baselines"]) * len(budgets), "original model: held-out", show_progress)
    baselines["original"] = perplexities(base, windows, [], bar)
    for evictor in cfg["baselines"]:
        _apply(base, evictor, budgets[0])
        baselines[evictor] = perplexities(base, windows, budgets, bar, full=False)  # "full": the original's
    bar.close()
    summary: dict = {"original": baselines["original"]["full"], "by_spec": {}}
    for name in cfg["specs"]:
        mine = [r for r in runs if r["spec"] == name]
        per = {key: common.mean_std([r["perplexity"][key] for r in mine]) for key in mine[0]["perplexity"]}
        summary["by_spec"][name] = per
    summary["baselines"] = {e: baselines[e] for e in cfg["baselines"]}
    return {"runs": runs, "baselines": baselines, "summary": summary,
            "held_out": {"windows": cfg["valid_windows"], "tokens": cfg["eval_context"],
                         "scored_per_window": cfg["eval_context"] - cfg["eval_context"] * 3 // 4,
                         "held_out_tokens": len(valid_ids), "train_tokens": len(train_ids)}}


def plot(results: dict, folder) -> list[str]:
    plt = common.figure()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    common.plot_losses(axes[0], results["runs"], "training loss (nats/token)", "fine-tuning SmolLM2-135M")
    budgets = [int(b) for b in results["config"]["budgets"]]
    summary = results["summary"]
    for i, (name, per) in enumerate(summary["by_spec"].items()):
        color = f"C{i}"
        if any(str(b) in per for b in budgets):
            axes[1].plot(budgets, [per[str(b)]["mean"] for b in budgets], marker="o", color=color,
                         label=f"{name}, pruned")
        axes[1].axhline(per["full"]["mean"], ls="--", lw=1, color=color, label=f"{name} (full cache)")
    for j, (evictor, per) in enumerate(summary["baselines"].items()):
        axes[1].plot(budgets, [per[str(b)] for b in budgets], marker="x", ls=":", color=f"C{5 + j}",
                     label=f"original + {evictor}")
    axes[1].axhline(summary["original"], ls="-.", lw=1, color="black", label="original (full cache)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel(f"KV budget per layer and head (tokens; context {results['config']['eval_context']})")
    axes[1].set_ylabel("held-out perplexity")
    axes[1].legend(fontsize=6)
    axes[1].set_title("pruned")
    return common.save_figure(plt, fig, folder, "finetune.png")

"""Denoising with value selectivity (SSA paper, §"synthetic tasks"; the recipe is ours, docs/experiments.md).

A target ``mu ~ N(0, I_d)``. A sequence holds ``n`` tokens in random order: ``k`` noisy copies
``mu + sigma_s · e`` and ``n - k`` pure-noise tokens ``sigma_n · e`` (sigma_n > 1 + sigma_s, so noise tokens are
larger, but the sign and direction of a token say nothing), then a query token. One attention layer (one head,
no MLP, no residual) reads the sequence at the query token and its output projection gives the estimate of mu.

Vanilla attention's weights come from logits linear in each token, which cannot tell a large token from a small
one, so it averages everything. SSA's value temperature ``t_tok = tanh(u · GELU(v_j))`` is a nonlinear function of
the token's own value, so it can scale noise tokens towards 0. Baselines computed exactly: naive averaging (the
best scalar multiple of the mean of all tokens, fitted on the training distribution) and the Bayes-optimal
estimator given which tokens carry the signal, ``k / (k + sigma_s²) · mean(signal tokens)`` (its MSE
``d · sigma_s² / (k + sigma_s²)`` is a lower bound on every estimator's). MSE is ``|estimate - mu|²`` summed over
the d coordinates, averaged over sequences.
"""

from __future__ import annotations

import torch

from .. import nn as zoo_nn
from . import common


def batch(gen: torch.Generator, size: int, n: int, k: int, d: int, sigma_s: float, sigma_n: float):
    """Tokens (B, n + 1, d + 1) (last coordinate: 1 on the query token), the targets mu (B, d) and the signal
    mask (B, n)."""
    mu = torch.randn(size, d, generator=gen)
    signal = torch.zeros(size, n, dtype=torch.bool)
    order = torch.rand(size, n, generator=gen).argsort(dim=1)[:, :k]
    signal[torch.arange(size)[:, None], order] = True
    noise = torch.randn(size, n, d, generator=gen)
    x = torch.where(signal[..., None], mu[:, None] + sigma_s * noise, sigma_n * noise)
    tokens = torch.zeros(size, n + 1, d + 1)
    tokens[:, :n, :d] = x
    tokens[:, n, d] = 1.0
    return tokens, mu, signal


class OneLayer(torch.nn.Module):
    """One attention layer read at the last token: q, k, v linear in the tokens, one head of width ``head_dim``,
    the spec's attention core, a linear read-out to d."""

    def __init__(self, spec, d: int, head_dim: int) -> None:
        super().__init__()
        self.q = torch.nn.Linear(d + 1, head_dim)
        self.k = torch.nn.Linear(d + 1, head_dim)
        self.v = torch.nn.Linear(d + 1, head_dim)
        self.attn = zoo_nn.Attention(spec, num_heads=1, head_dim=head_dim)
        self.read = torch.nn.Linear(head_dim, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(tokens)[:, None] for proj in (self.q, self.k, self.v))
        return self.read(self.attn(q, k, v)[:, 0, -1])


def mse(estimate: torch.Tensor, mu: torch.Tensor) -> float:
    return float(((estimate - mu) ** 2).sum(-1).mean())


def bayes_given_labels(tokens, signal, d: int, sigma_s: float) -> torch.Tensor:
    k = signal.sum(1, keepdim=True).to(tokens.dtype)
    total = (tokens[:, :-1, :d] * signal[..., None]).sum(1)
    return total / (k + sigma_s**2)


def naive_average(tokens, d: int, gain: float) -> torch.Tensor:
    return gain * tokens[:, :-1, :d].mean(1)


DEFAULTS = dict(specs=["vanilla", "ssa-value"], seeds=[0, 1, 2], steps=1500, batch=256, lr=3e-3, transform_lr=3e-2,
                n=32, k=8, d=8, head_dim=32, sigma_s=0.5, sigma_n=3.0, test_size=4096)


def run(cfg: dict, show_progress: bool = True) -> dict:
    keys = ("n", "k", "d", "sigma_s", "sigma_n")
    shape = {key: cfg[key] for key in keys}
    runs = []
    for seed in cfg["seeds"]:
        test = batch(torch.Generator().manual_seed(10_000 + seed), cfg["test_size"], **shape)
        tokens, mu, signal = test
        # the best gain for the mean of all tokens: E[mu·m] / E[|m|²] with m = mean of the tokens
        fit_tokens, fit_mu, _ = batch(torch.Generator().manual_seed(20_000 + seed), 16384, **shape)
        m = fit_tokens[:, :-1, : cfg["d"]].mean(1)
        gain = float((fit_mu * m).sum() / (m * m).sum())
        baselines = {"naive average": mse(naive_average(tokens, cfg["d"], gain), mu),
                     "Bayes given labels": mse(bayes_given_labels(tokens, signal, cfg["d"], cfg["sigma_s"]), mu),
                     "zero (the prior mean)": mse(torch.zeros_like(mu), mu)}
        for spec in cfg["specs"]:
            gen = common.seed_everything(seed)
            model = OneLayer(spec, cfg["d"], cfg["head_dim"])

            def batches(step, gen=gen):
                return batch(gen, cfg["batch"], **shape)

            def loss_fn(model, b):
                x, target, _ = b
                return ((model(x) - target) ** 2).sum(-1).mean()

            log = common.train(model, batches, cfg["steps"], cfg["lr"], loss_fn, f"{spec} seed {seed}",
                               show_progress, transform_lr=cfg["transform_lr"], weight_decay=0.0)
            with torch.no_grad():
                runs.append({"spec": spec, "seed": seed, "mse": mse(model(tokens), mu), "train": log.as_dict(),
                             "baselines": baselines})
    summary = {spec: common.mean_std([r["mse"] for r in runs if r["spec"] == spec]) for spec in cfg["specs"]}
    for name in runs[0]["baselines"]:
        by_seed = {r["seed"]: r["baselines"][name] for r in runs}
        summary[name] = common.mean_std(list(by_seed.values()))
    return {"runs": runs, "summary": summary}


def plot(results: dict, folder) -> list[str]:
    plt = common.figure()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    names = list(results["summary"])
    means = [results["summary"][n]["mean"] for n in names]
    stds = [results["summary"][n]["std"] for n in names]
    ax.bar(range(len(names)), means, yerr=stds, capsize=3, color=["C0" if n in results["config"]["specs"] else "C7"
                                                                 for n in names])
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("MSE of the estimate of mu")
    ax.set_yscale("log")
    ax.set_title("Denoising: value temperature vs vanilla")
    return common.save_figure(plt, fig, folder, "denoising.png")

"""Graph next-token prediction with query temperature (SSA paper, §"synthetic tasks"; the recipe is ours,
docs/experiments.md).

A random directed graph on K nodes; node i has out-degree ``deg(i)`` (drawn from ``degrees``) and its next token
is uniform over its out-neighbours, so the true transition matrix P has rows of very different spikiness. Each
sequence lists all K nodes once (a random order) and ends with a query node. One attention layer (one head) at the
query reads the listed nodes with values fixed to their one-hot codes, so its output *is* a distribution over the
K nodes: ``p(next | i) = sum_j softmax_j(t_i · l_ij) · onehot(node_j)``. Inputs are layer-normalised embeddings, so a
query cannot make its row spikier by growing its norm: vanilla attention has one temperature for every node, SSA
one per node (``t_i``). Trained with cross-entropy on sampled next nodes; reported: cross-entropy minus the true
rows' entropy (the KL to the truth, 0 at best), the L1 error ``|p(.|i) - P_i|_1``, and SSA's learned temperature
of each node against its degree.
"""

from __future__ import annotations

import torch

from .. import nn as zoo_nn
from ..transforms.base import RowScaleTransform, Slot
from . import common


def make_graph(gen: torch.Generator, nodes: int, degrees: list[int]) -> torch.Tensor:
    """The transition matrix P (K, K): row i uniform over ``deg(i)`` random other nodes."""
    deg = torch.tensor(degrees)[torch.randint(0, len(degrees), (nodes,), generator=gen)]
    p = torch.zeros(nodes, nodes)
    for i in range(nodes):
        others = torch.tensor([j for j in range(nodes) if j != i])
        chosen = others[torch.randperm(nodes - 1, generator=gen)[: int(deg[i])]]
        p[i, chosen] = 1.0 / int(deg[i])
    return p


def batch(gen: torch.Generator, p: torch.Tensor, size: int):
    """Tokens (B, K + 1): a random order of the K nodes then the query node; the query nodes (B,) and the next
    nodes sampled from P (B,)."""
    nodes = p.shape[0]
    order = torch.rand(size, nodes, generator=gen).argsort(dim=1)
    query = torch.randint(0, nodes, (size,), generator=gen)
    nxt = torch.multinomial(p[query], 1, generator=gen)[:, 0]
    return torch.cat([order, query[:, None]], dim=1), query, nxt


class OneHead(torch.nn.Module):
    """LayerNorm(embedding) → q, k (width ``head_dim``) → the spec's attention core with one-hot values."""

    def __init__(self, spec, nodes: int, width: int, head_dim: int) -> None:
        super().__init__()
        self.nodes = nodes
        self.embed = torch.nn.Embedding(nodes, width)
        self.norm = torch.nn.LayerNorm(width, elementwise_affine=False)
        self.q = torch.nn.Linear(width, head_dim, bias=False)
        self.k = torch.nn.Linear(width, head_dim, bias=False)
        self.attn = zoo_nn.Attention(spec, num_heads=1, head_dim=head_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The predicted next-node distribution at the query (B, K)."""
        x = self.norm(self.embed(tokens))
        q, k = self.q(x)[:, None], self.k(x)[:, None]
        values = torch.nn.functional.one_hot(tokens, self.nodes).to(x.dtype)
        values[:, -1] = 0.0  # the query's own value carries nothing: its weight is probability lost
        v = torch.nn.functional.pad(values, (0, q.shape[-1] - self.nodes))[:, None]
        return self.attn(q, k, v)[:, 0, -1, : self.nodes]

    def query_temperature(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The spec's query temperature t_i at the query token (B,), computed by the spec's own query-slot
        transform (docs/papers.md §1), or None for a spec without one."""
        transform = self.attn.variant.plan.one(Slot.QUERY)
        if not isinstance(transform, RowScaleTransform):
            return None
        prefix = transform.kind + "."
        group = {k[len(prefix):]: v for k, v in self.attn.params().items() if k.startswith(prefix)}
        q = self.q(self.norm(self.embed(tokens)))[:, None, -1:]  # (B, 1, 1, D): the query token's row
        position = torch.full((q.shape[0], 1, 1), tokens.shape[1], dtype=torch.long)
        return transform.scale(q, position, group)[:, 0, 0]


DEFAULTS = dict(specs=["vanilla", "ssa-query"], seeds=[0, 1, 2], steps=1000, batch=256, lr=3e-3, transform_lr=3e-2,
                nodes=32, degrees=[1, 2, 4, 8, 16], width=32, head_dim=32, test_size=8192)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def run(cfg: dict, show_progress: bool = True) -> dict:
    if cfg["head_dim"] < cfg["nodes"]:
        raise ValueError(f"graph: head_dim ({cfg['head_dim']}) must be at least nodes ({cfg['nodes']}): the values "
                         "are one-hot codes of the nodes")
    runs = []
    for seed in cfg["seeds"]:
        p = make_graph(torch.Generator().manual_seed(seed), cfg["nodes"], cfg["degrees"])
        degree = (p > 0).sum(1)
        tokens, query, nxt = batch(torch.Generator().manual_seed(10_000 + seed), p, cfg["test_size"])
        floor = float(_entropy(p[query]).mean())
        for spec in cfg["specs"]:
            gen = common.seed_everything(seed)
            model = OneHead(spec, cfg["nodes"], cfg["width"], cfg["head_dim"])

            def batches(step, gen=gen, p=p):
                return batch(gen, p, cfg["batch"])

            def loss_fn(model, b):
                x, _, target = b
                probs = model(x)
                return -torch.log(probs[torch.arange(len(target)), target].clamp_min(1e-12)).mean()

            log = common.train(model, batches, cfg["steps"], cfg["lr"], loss_fn, f"{spec} seed {seed}",
                               show_progress, transform_lr=cfg["transform_lr"], weight_decay=0.0)
            with torch.no_grad():
                probs = model(tokens)
                truth = p[query]
                cross = float(-(truth * torch.log(probs.clamp_min(1e-12))).sum(-1).mean())
                l1 = float((probs - truth).abs().sum(-1).mean())
                temp = model.query_temperature(tokens)
                by_degree = None
                if temp is not None:
                    qdeg = degree[query]
                    by_degree = {str(int(g)): {"mean": float(temp[qdeg == g].mean()),
                                               "std": float(temp[qdeg == g].std(correction=0))}
                                 for g in sorted(set(qdeg.tolist()))}
            runs.append({"spec": spec, "seed": seed, "cross_entropy": cross, "excess_cross_entropy": cross - floor,
                         "entropy_floor": floor, "l1": l1, "temperature_by_degree": by_degree,
                         "train": log.as_dict()})
    summary = {}
    for spec in cfg["specs"]:
        mine = [r for r in runs if r["spec"] == spec]
        summary[spec] = {key: common.mean_std([r[key] for r in mine])
                         for key in ("cross_entropy", "excess_cross_entropy", "l1")}
    return {"runs": runs, "summary": summary}


def plot(results: dict, folder) -> list[str]:
    plt = common.figure()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    specs = results["config"]["specs"]
    for i, key in enumerate(("excess_cross_entropy", "l1")):
        axes[0].bar([j + 0.4 * i for j in range(len(specs))], [results["summary"][s][key]["mean"] for s in specs],
                    width=0.4, yerr=[results["summary"][s][key]["std"] for s in specs], capsize=3,
                    label={"excess_cross_entropy": "cross-entropy - entropy (nats)", "l1": "L1 to the truth"}[key])
    axes[0].set_xticks([j + 0.2 for j in range(len(specs))], specs)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title("error against the true transition rows")
    for r in results["runs"]:
        if r["temperature_by_degree"]:
            degs = [int(g) for g in r["temperature_by_degree"]]
            axes[1].plot(degs, [v["mean"] for v in r["temperature_by_degree"].values()], marker="o",
                         label=f"{r['spec']} seed {r['seed']}")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("out-degree of the query node")
    axes[1].set_ylabel("learned query temperature t_i")
    axes[1].legend(fontsize=8)
    axes[1].set_title("SSA temperature by degree")
    return common.save_figure(plt, fig, folder, "graph.png")

"""What the experiments share: a small pre-norm transformer whose attention core is :class:`attnzoo.nn.Attention`,
seeding, a training loop with a progress bar, teacher-forced decoding through the KV caches (for budgets), and
the results folder (JSON + matplotlib plots). docs/experiments.md describes every recipe."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F_

from .. import nn as zoo_nn


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, torch (and numpy if present); returns a CPU generator for the data, seeded the same."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a core dependency
        pass
    return torch.Generator().manual_seed(seed)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x (B, H, N, D) at 0-based ``positions`` (N,) or (B, N) (rotate-half form)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    pos = positions.to(torch.float32)
    angles = pos[..., None] * inv  # (N, D/2) or (B, N, D/2)
    if angles.dim() == 3:
        angles = angles[:, None]
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(torch.nn.Module):
    """Pre-norm block: x + W_o attn(rope(W_q x), rope(W_k x), W_v x), then x + MLP(x) (4x, GELU)."""

    def __init__(self, spec, dim: int, heads: int, use_rope: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.heads, self.head_dim, self.use_rope = heads, dim // heads, use_rope
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.attn = zoo_nn.Attention(spec, num_heads=heads, head_dim=self.head_dim, backend=backend)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def _qkv(self, x, positions0):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.use_rope:
            q, k = rope(q, positions0), rope(k, positions0)
        return q, k, v

    def _finish(self, x, a):
        b, _, n, _ = a.shape
        x = x + self.out(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))

    def forward(self, x):
        n = x.shape[1]
        q, k, v = self._qkv(x, torch.arange(n, device=x.device))
        return self._finish(x, self.attn(q, k, v))

    def step(self, x_t, cache, position0: int):
        q, k, v = self._qkv(x_t, torch.tensor([position0], device=x_t.device))
        return self._finish(x_t, self.attn.decode(q, k, v, cache))


class TinyTransformer(torch.nn.Module):
    """A decoder-only language model: token embedding, ``layers`` blocks with the spec's attention, final norm,
    untied head. The selective paper's family is d layers, d heads, width 64·d (docs/papers.md)."""

    def __init__(self, spec, vocab: int, dim: int, layers: int, heads: int, use_rope: bool = True,
                 backend: str = "auto") -> None:
        super().__init__()
        self.config = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, use_rope=use_rope, backend=backend)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(spec, dim, heads, use_rope, backend) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        torch.nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def with_spec(self, spec) -> TinyTransformer:
        """The same model (a copy of every weight) with another spec's attention, e.g. the trained spec plus a
        cache evictor (``selective`` → ``selective-pruned``); the specs must have the same parameters."""
        other = TinyTransformer(spec, **self.config)
        other.load_state_dict(self.state_dict())
        return other.eval()

    @torch.no_grad()
    def decode_logits(self, tokens: torch.Tensor, budget: int | None = None) -> torch.Tensor:
        """Teacher-forced decoding of ``tokens`` (B, N) one token at a time through each layer's KV cache, with
        ``budget`` tokens per layer kept by the spec's evictor (None: keep all). Returns logits (B, N, V): with no
        eviction they equal :meth:`forward`'s (tested); with a budget they show what the pruned cache costs."""
        b, n = tokens.shape
        caches = [block.attn.new_cache(batch=b, budget=budget) for block in self.blocks]
        outs = []
        for t in range(n):
            x = self.embed(tokens[:, t: t + 1])
            for block, cache in zip(self.blocks, caches, strict=True):
                x = block.step(x, cache, t)
            outs.append(self.head(self.norm(x)))
        return torch.cat(outs, dim=1)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm progress bar on stderr (disabled: a no-op bar with the same interface)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, dynamic_ncols=True)


@dataclass
class Probe:
    """What :func:`probing` measured: the seconds per training step, past the first (None: no run got that far)."""

    steps: int
    seconds_per_step: float | None = None


class _ProbeDone(Exception):
    """Stops a probed run once its steps are timed."""


_PROBE: list[Probe] = []


@contextlib.contextmanager
def probing(steps: int = 3):
    """Within the block, the first :func:`train` stops after ``steps`` steps past its first and records their mean
    time in the yielded :class:`Probe`; the run that called it is abandoned (nothing evaluated or written)."""
    probe = Probe(steps)
    _PROBE.append(probe)
    try:
        yield probe
    except _ProbeDone:
        pass
    finally:
        _PROBE.remove(probe)


@dataclass
class TrainLog:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    #: the steps trained (fewer than asked when a deadline stopped it), and the step a resumed run went on from
    done: int = 0
    resumed_at: int | None = None
    stopped: str | None = None

    def as_dict(self) -> dict:
        return {"steps": self.steps, "losses": self.losses, "seconds": round(self.seconds, 2), "done": self.done,
                "resumed_at": self.resumed_at, "stopped": self.stopped}


def train(model, batches, steps: int, lr: float, loss_fn, desc: str, show_progress: bool = True,
          transform_lr: float | None = None, memory_eps: float = 0.0, log_every: int = 10, warmup: int = 50,
          weight_decay: float = 0.01, deadline: float | None = None, checkpoints=None,
          checkpoint_every: int = 0) -> TrainLog:
    """AdamW with warm-up and cosine decay; the attnzoo transforms in their own group (no weight decay,
    ``transform_lr``); ``memory_eps`` > 0 adds selective attention's memory loss (docs/papers.md §2) recorded
    with :func:`attnzoo.nn.recording_accumulated`. ``batches(step)`` gives one batch, ``loss_fn(model, batch)``
    its task loss. ``deadline`` (a ``time.perf_counter()`` value): stop before a step that would start after it
    (``log.stopped`` says so). ``checkpoints`` (an object with ``resume(model, opt)`` -> (step, log dict) or None
    and ``save(step, model, opt, log dict, done)``): resume from it, save every ``checkpoint_every`` steps and at
    the end (the batches of a step depend on the step alone, so a resumed run sees the data it would have)."""
    groups = zoo_nn.parameter_groups(model, lr=lr, transform_lr=transform_lr, weight_decay=weight_decay)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.98))
    base = [g["lr"] for g in opt.param_groups]
    log, start, first = TrainLog(), time.perf_counter(), 0
    if checkpoints is not None:
        resumed = checkpoints.resume(model, opt)
        if resumed is not None:
            first, saved = resumed
            log.steps, log.losses = list(saved["steps"]), list(saved["losses"])
            log.seconds, log.resumed_at = float(saved["seconds"]), first
            start -= log.seconds  # the seconds of the earlier runs count
    model.train()
    with progress(steps, desc, show_progress) as bar:
        bar.update(first)
        log.done = first
        for step in range(first, steps):
            if deadline is not None and time.perf_counter() >= deadline:
                log.stopped = f"the time limit stopped it after {step} of {steps} steps"
                break
            if _PROBE and step in (1, 1 + _PROBE[-1].steps):
                if step == 1:
                    probe_start = time.perf_counter()
                else:
                    _PROBE[-1].seconds_per_step = (time.perf_counter() - probe_start) / _PROBE[-1].steps
                    raise _ProbeDone
            factor = min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
            for g, lr0 in zip(opt.param_groups, base, strict=True):
                g["lr"] = lr0 * factor
            batch = batches(step)
            if memory_eps > 0:
                with zoo_nn.recording_accumulated(model) as record:
                    loss = loss_fn(model, batch)
                total = loss + record.memory_loss(eps=memory_eps)
            else:
                loss = loss_fn(model, batch)
                total = loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % log_every == 0 or step == steps - 1:
                log.steps.append(step)
                log.losses.append(loss.item())
                bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
            log.done = step + 1
            if checkpoints is not None and checkpoint_every and log.done % checkpoint_every == 0 \
                    and log.done < steps:
                log.seconds = time.perf_counter() - start
                checkpoints.save(log.done, model, opt, log.as_dict())
    log.seconds = time.perf_counter() - start
    if checkpoints is not None:
        checkpoints.save(log.done, model, opt, log.as_dict(), done=log.done == steps)
    model.eval()
    return log


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions where ``mask`` is True."""
    return F_.cross_entropy(logits[mask], targets[mask])


def mean_std(values: list[float]) -> dict:
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "std": float(t.std()) if len(values) > 1 else 0.0, "runs": list(values)}


def environment() -> dict:
    from ..bench import cpu_model

    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def write_results(folder: Path, name: str, results: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def figure():
    """A matplotlib figure on the Agg backend (no screen needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(ax, runs: list[dict], ylabel: str, title: str) -> None:
    """Each run's training loss against the step on ``ax`` (a run: ``spec``, ``seed`` and ``train``'s curve)."""
    for r in runs:
        ax.plot(r["train"]["steps"], r["train"]["losses"], lw=1, label=f"{r['spec']} seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.set_title(title)


def save_figure(plt, fig, folder: Path, filename: str) -> list[str]:
    """Lay out, write ``folder/filename`` (120 dpi), close the figure; returns ``[filename]`` for the results."""
    fig.tight_layout()
    fig.savefig(Path(folder) / filename, dpi=120)
    plt.close(fig)
    return [filename]

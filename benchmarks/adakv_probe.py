"""Does AdaKV pay here? A probe, not a feature (issue 52: "per-head budgets within a layer's total").

At a prompt's eviction under ``snapkv``, the layer's ``budget x H_kv`` slots go to the best-scoring (head, token)
pairs across the layer's key/value heads, each head keeping at least ``ADA_ALPHA x budget`` (AdaKV's safeguard, 0.2
by default; the newest ``window`` positions always kept), as kvpress's AdaKVPress selects. attnzoo's cache is dense
(every head holds the same number of slots), so each head holds the largest head's count and the slots past its own
count are masked out (its validity per head: the probe lifts ``KVCache.valid``'s refusal of that) and attended by
a per-head masked softmax written here (the backends mask held keys per batch row). The bytes a real per-head
layout would hold are the flat budget's; what this dense probe holds is reported as the mean width.

Run it as quality.py is run, with ``--evict prefill`` (a one-token step keeps every token, as kvpress does: the
padded widths would otherwise be evicted down to the budget at the first step)::

    ADAKV=1 ADA_ALPHA=0.2 .venv/bin/python benchmarks/adakv_probe.py --contexts 1024 2048 --run-contexts 2048 \
        --cases 7 --fractions 0.125 --specs snapkv --kv-bits 4u --evict prefill --ppl-docs 0 --threads 1

``ADAKV=0`` (or unset) runs quality.py unchanged (the flat baseline, the same cases). ``ADA_ALPHA=1.0`` gives every
head the flat budget: the same answers as the baseline, case for case (the probe's own check).
"""

import os
import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnzoo.decode.step as step
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.core.contract import HeldAttention
from attnzoo.decode.step import QueryRows
from attnzoo.evictors.base import rule_score

ALPHA = float(os.environ.get("ADA_ALPHA", "0.2"))
orig = step.evict_to_budget
STATS = []
CALLS = []

def ada(cache):
    excess = cache.num_tokens - cache.budget if cache.budget is not None else 0
    ev = cache.evictor
    if excess <= 1 or ev is None or ev.kind != "snapkv" or cache.valid is not None:
        return orig(cache)
    budget = cache.budget
    s = rule_score(ev, cache).float()
    prot = ev.protected(cache)
    s = torch.where(prot, torch.full_like(s, float("inf")), s)
    b, h, m = s.shape
    floor = max(int(prot.sum(-1).max()), int(ALPHA * budget))
    order = s.argsort(dim=-1, descending=True, stable=True)
    chosen = torch.zeros_like(prot)
    chosen.scatter_(-1, order[..., :floor], True)
    rest = budget * h - floor * h
    flat = s.masked_fill(chosen, float("-inf")).reshape(b, h * m)
    top = flat.topk(rest, dim=-1).indices
    chosen.reshape(b, h * m).scatter_(-1, top, True)
    counts = chosen.sum(-1)
    width = int(counts.max())
    STATS.append(counts.flatten().tolist())
    # keep chosen first then best others, up to width, in position order
    rank = torch.where(chosen, s, torch.full_like(s, float("-inf")))
    sel = rank.argsort(dim=-1, descending=True, stable=True)[..., :width]
    sel, _ = sel.sort(-1)
    valid = chosen.gather(-1, sel)
    cache.keep(sel)
    cache._valid = valid if not bool(valid.all()) else None  # per head: past the setter's refusal (prototype)
    cache.budget = width if os.environ.get("ADA_GROW") else cache.budget
    cache.compact()


_held = BlockedBackend.attend_held


def held_per_head(self, plan, stp, cache, params, *, want_probs=False):
    """The prototype's attention over a cache whose heads hold different valid slots: softmax(q k / sqrt(d)) v
    per head with each head's own mask (attnzoo's backends read one mask per row: valid[:, 0])."""
    valid = cache.valid
    qs = stp[0]
    if valid is None or qs.shape[2] != 1 or bool((valid == valid[:, :1]).all()):
        return _held(self, plan, stp, cache, params, want_probs=want_probs)
    CALLS.append(1)
    b, h, _, d = qs.shape
    ks, vs = cache.keys, cache.values
    g = h // ks.shape[1]
    kx, vx = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
    mask = valid.repeat_interleave(g, 1)[:, :, None, :]
    logits = (qs.float() @ kx.float().transpose(-1, -2)) * plan.logit_scale(d)
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    out = (probs @ vx.float()).to(qs.dtype)
    if isinstance(want_probs, QueryRows):
        probs = want_probs.pack(probs)
    elif not want_probs:
        probs = None
    return HeldAttention(out, None, probs)


def _set_valid(self, value):  # the prototype's per-head validity, past the setter's refusal
    self._valid = value
    if value is None:
        self._bias = None


if os.environ.get("ADAKV", "0") == "1":
    from attnzoo.decode.storage import KVCache
    KVCache.valid = property(KVCache.valid.fget, _set_valid)
    step.evict_to_budget = ada
    BlockedBackend.attend_held = held_per_head
sys.argv = ["quality.py", *sys.argv[1:]]
runpy.run_path(str(Path(__file__).resolve().parent / "quality.py"), run_name="__main__")
if STATS:
    widths = [max(c) for c in STATS]
    print("per-head attention calls", len(CALLS), file=sys.stderr)
    print("ada widths mean", sum(widths) / len(widths), "of layers", len(STATS), file=sys.stderr)

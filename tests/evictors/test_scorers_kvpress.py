"""The prompt scorers keep exactly kvpress's sets: SnapKVPress (window 16, avg kernel 5), KnormPress and
KeyDiffPress, each press's own ``score`` on the same keys and probabilities (float64), its top ``n_kept`` against
attnzoo's prefill at ``budget = n_kept``. kvpress runs in a fresh interpreter (importing it wraps transformers'
attention functions for the whole process); skipped where it is not importable (``ATTNZOO_KVPRESS_PATH``, as
tests/integrations/transformers/test_hf_peers.py)."""

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.subprocess

COMPARE = textwrap.dedent("""
    import math, os, sys, types
    sys.path.append(os.environ["ATTNZOO_KVPRESS_PATH"]) if os.environ.get("ATTNZOO_KVPRESS_PATH") else None
    import torch
    from kvpress import KeyDiffPress, KnormPress, SnapKVPress
    import attnzoo

    def probs_of(q, k):
        n = q.shape[2]
        kr = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        logits = q @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)

    b, h, hkv, n, d = 2, 6, 2, 200, 16
    config = types.SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv)
    module = types.SimpleNamespace(config=config, head_dim=d)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        q = 2 * torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
        k = 2 * torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
        v = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
        for ratio in (0.5, 0.75, 0.875):
            kept = max(1, int(n * (1 - ratio)))
            for press, cache in ((SnapKVPress(compression_ratio=ratio, window_size=16, kernel_size=5),
                                  {"evictor": "snapkv", "window": 16, "kernel": 5}),
                                 (KnormPress(compression_ratio=ratio), {"evictor": "knorm"}),
                                 (KeyDiffPress(compression_ratio=ratio), {"evictor": "keydiff"})):
                scores = press.score(module, torch.zeros(b, n, 8, dtype=torch.float64), k, v, probs_of(q, k), {})
                want = scores.topk(kept, dim=-1).indices.sort(-1).values + 1
                variant = attnzoo.compile({"name": "x", "cache": {**cache, "budget": kept}})
                held = variant.new_cache(batch=b, budget=kept)
                variant.prefill(q, k, v, held)
                got = held.positions.sort(-1).values
                assert torch.equal(got, want), (type(press).__name__, seed, ratio, int((got != want).sum()))
    print("same sets")
""")


def kvpress_reachable() -> bool:
    extra = os.environ.get("ATTNZOO_KVPRESS_PATH")
    if extra:
        return importlib.machinery.PathFinder.find_spec("kvpress", [*sys.path, extra]) is not None
    return importlib.util.find_spec("kvpress") is not None


def test_prefill_keeps_kvpress_sets():
    if not kvpress_reachable():
        pytest.skip("kvpress is not importable: install it beside attnzoo as docs/transformers.md says (pip install "
                    "--no-deps --target DIR kvpress ...; ATTNZOO_KVPRESS_PATH=DIR)")
    run = subprocess.run([sys.executable, "-c", COMPARE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "same sets" in run.stdout

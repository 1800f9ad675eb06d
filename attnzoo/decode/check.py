"""The fast decoding steps held to the Python rule (docs/decoding.md, "Who owns what"): each evictor's rule is
written once in Python (``attnzoo/evictors/builtin.py``), which the full decode path calls; the fused C step is its
second implementation. :func:`check_fast_step` decodes the same tokens through the fast step a backend offers and
through the full path, and says where they part: the outputs, the positions kept, the per-token scores.
"""

from __future__ import annotations

import torch

from .step import full_step

#: tolerance on the outputs and scores, by dtype (the fast and the full path round differently)
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def check_fast_step(variant, budget: int | None = 6, *, batch: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 8, steps: int = 40, prefill: int = 3, dtype: torch.dtype = torch.float64,
                    seed: int = 0) -> dict:
    """Decode ``steps`` tokens after a ``prefill`` into two caches of ``variant`` (``attnzoo.compile(spec,
    backend="blocked")``) at ``budget``: one through ``variant.decode`` (the fast step the backend offers, in C
    where it is available), one through the full path alone (every step checked, the evictor's Python ``update``
    and ``victim``). Raises AssertionError, with one line naming the step, at the first output, kept position or
    score that differs; the positions are compared every step as the slots hold them (without putting them back in
    order, which would hide what only a scrambled cache shows), the scores at the end. Returns ``{"spec", "steps",
    "fast_steps", "kinds"}``: how many steps took a fast step and which kinds; an AssertionError too when fewer
    than half did (a check of nothing). The variant is compiled by the caller: the decode step sits below dispatch
    (docs/architecture.md)."""
    gen = torch.Generator().manual_seed(seed)
    n = prefill + steps
    q = torch.randn(batch, heads, n, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(batch, kv_heads, n, head_dim, generator=gen, dtype=torch.float64).to(dtype)
            for _ in range(2))
    k[:, :, 1:3] = 0.0  # equal logits early on: ties in the scores
    fast, full = variant.new_cache(batch, budget=budget), variant.new_cache(batch, budget=budget)
    for cache in (fast, full):
        variant.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache)
    tol = _TOLERANCE.get(dtype, 5e-2)
    kinds = []
    name = variant.spec.name
    with torch.no_grad():
        for t in range(prefill, n):
            step = [x[:, :, t:t + 1] for x in (q, k, v)]
            kind = fast.lean_step_kind
            kinds.append(kind)
            got = variant.decode(*step, fast)
            want, _ = full_step(variant, *step, full, None, None, True)
            what = f"spec '{name}', step {t}, {'fast step ' + repr(kind) if kind else 'full path'}"
            if not torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True):
                gap = float((got - want).abs().nan_to_num(float("inf")).max())
                raise AssertionError(f"{what}: outputs differ from the full path's (Python rule) by {gap:.3g}")
            mine, theirs = fast.held_positions(), full.held_positions()
            if not torch.equal(mine, theirs):
                row = int((mine != theirs).reshape(mine.shape[0], -1).any(-1).nonzero()[0, 0])
                raise AssertionError(f"{what}: keeps positions {mine[row].tolist()} in row {row} where the full path "
                                     f"(Python rule) keeps {theirs[row].tolist()}")
    if not torch.equal(fast.positions, full.positions):
        raise AssertionError(f"spec '{name}': the positions held differ at the end")
    for key, held in full.state.items():
        if not torch.allclose(fast.state[key], held, rtol=tol, atol=tol, equal_nan=True):
            raise AssertionError(f"spec '{name}': score '{key}' differs from the full path's (Python rule) at the end")
    taken = sum(kind is not None for kind in kinds)
    if taken < steps // 2:
        raise AssertionError(f"spec '{name}': the fast step ran for {taken} of {steps} steps: nothing to check")
    return {"spec": name, "steps": steps, "fast_steps": taken, "kinds": sorted({k for k in kinds if k})}

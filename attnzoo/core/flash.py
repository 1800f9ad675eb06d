"""torch's private CPU flash-attention op, probed and guarded, in one place (the blocked backend's selective kernel
and the distributed pairs call it through here).

The op is private (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``). Whether it is usable is decided
once per dtype, by a probe on tiny inputs, with and without its causal flag, checked against the eager maths
(:func:`flash_available`): when the op is missing, its signature changed or its results differ, :func:`flash_block`
computes the same two results eagerly and warns once, saying why. An error from a real call (out of memory, say)
propagates: it never switches the process to the slow path. :func:`flash_pair` and :func:`flash_pair_grads` (the
distributed pairs, forward and backward) call the op only where :func:`flash_available` holds.
"""

from __future__ import annotations

import warnings

import torch

#: Probe verdicts per dtype: True (use the op) or False (eager). Tests reset it.
PROBED: dict[torch.dtype, bool] = {}


def flash_op(q, k, v, mask, scale, causal=False):
    """torch's private op: (out (B, H, Bq, D), lse (B, H, Bq)). A wrapper so the probe and tests can replace it.
    ``causal``: also hide key j > query i (top-left aligned: used on square blocks only)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)[:2]


def eager_block(q, k, v, mask, scale, causal=False):
    logits = (q @ k.transpose(-1, -2)) * scale + mask
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu_(1)
        logits = logits.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)) @ v, lse


def probe(dtype: torch.dtype) -> str | None:
    """Why the op cannot be used for ``dtype`` (missing, another signature, wrong results), or None if it can."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen).to(dtype) for _ in range(3))
    mask = torch.randn(1, 1, 3, 3, generator=gen).to(dtype)
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 5e-2
    for causal in (False, True):
        try:
            with torch.no_grad():
                out, lse = flash_op(q, k, v, mask, 0.5, causal)
        except (AttributeError, NotImplementedError, RuntimeError, TypeError) as exc:
            return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        want_out, want_lse = eager_block(q.double(), k.double(), v.double(), mask.double(), 0.5, causal)
        if (not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor)
                or out.shape != want_out.shape or lse.shape != want_lse.shape
                or not torch.allclose(out.double(), want_out, rtol=tol, atol=tol)
                or not torch.allclose(lse.double(), want_lse, rtol=tol, atol=tol)):
            return (f"its results on a probe {'with' if causal else 'without'} its causal flag differ from softmax "
                    f"attention (its contract changed)")
    return None


def flash_available(dtype: torch.dtype) -> bool:
    """Whether :func:`flash_block` uses torch's private op for ``dtype``: probed on the first call for each dtype,
    with a RuntimeWarning that says why when it cannot."""
    if dtype not in PROBED:
        why = probe(dtype)
        PROBED[dtype] = why is None
        if why is not None:
            warnings.warn(f"attnzoo: torch's private flash-attention CPU op is unusable for "
                          f"{str(dtype).removeprefix('torch.')} ({why}); using the eager equivalent (slower)",
                          RuntimeWarning, stacklevel=3)
    return PROBED[dtype]


def flash_block(q, k, v, mask, scale, causal=False):
    """(out, lse) of softmax(q k^T * scale + mask) v; q (B, H, Bq, D), k/v (B, H, Nk, D), mask (B, 1, Bq, Nk);
    ``causal``: key j > query i hidden too (for square blocks).

    Errors of the op itself propagate (the probe already showed it works for this dtype)."""
    if flash_available(q.dtype):
        return flash_op(q, k, v, mask, scale, causal)
    return eager_block(q, k, v, mask, scale, causal)


def flash_pair(q, k, v, diagonal: bool, scale: float):
    """Queries (B, H, nq, D) against keys and values (B, H_kv, nk, D) of an earlier chunk (every key visible) or of
    the same chunk (``diagonal``: causal by index) by the op, with no mask: (output, log-sum-exp (B, H, nq), ...)
    as the op returns them. Callers check :func:`flash_available` for the dtype first."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.contiguous(), k.contiguous(), v.contiguous(),
                                                                      0.0, diagonal, scale=scale)


def flash_pair_grads(d_out, q, k, v, out, lse, diagonal: bool, scale: float):
    """The gradients (dq, dk, dv) of a :func:`flash_pair`'s share of the attention, from the gradient of the
    final output ``d_out`` and the final output and log-sum-exp over every key (and the sink): the pair's
    probabilities are exp(logits - lse), so its share of every gradient is exact (ring attention's backward)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), 0.0,
        diagonal, scale=scale)

"""The numerics every fast path shares, written once (docs/backends.md, "The numerics contract").

- :func:`accumulator_dtype`: the wide dtype accumulated quantities (F, running sums, scores) are kept in.
- :data:`ACCUMULATED_STATE`: the name of the per-token state holding the running F in a decode cache.
- :func:`all_finite`: whether a fast path that masks by adding -inf (or drops NaN) may take a tensor.
"""

from __future__ import annotations

import torch

#: the per-token state of a decode cache that holds the accumulator's running F (B, H, M)
ACCUMULATED_STATE = "accumulated"


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype accumulated quantities are computed and stored in for inputs of ``dtype``: float32, or float64
    for float64 inputs (float16/bfloat16 sums lose the small increments once the running total is large)."""
    return torch.promote_types(dtype, torch.float32)


def f_from_s(selection: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
    """F from the selection S (B, 1, Nq, Nk): for each query, the sum of S over the strictly earlier queries of
    the block (a shifted cumulative sum along the query axis), plus ``carry`` (B, Nk), the sums of the queries
    before the block, when given. In :func:`accumulator_dtype` of S's dtype (the numerics contract)."""
    s = selection.to(accumulator_dtype(selection.dtype))
    # the cumulative sum taken along the last axis of the transpose: the same additions in the same order as along
    # the query axis (bitwise the same F), measured 4x faster on the CPU (256 x 512, one thread: 0.17 against
    # 0.75 ms); F comes back as a transposed view
    f = torch.nn.functional.pad(s[:, :, :-1].transpose(-1, -2).cumsum(-1), (1, 0)).transpose(-1, -2)
    return f if carry is None else f + carry[:, None, None, :]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, checked on its sum in :func:`accumulator_dtype`: a NaN or an
    infinity makes the sum non-finite; a sum that overflows from finite elements gives False, so a caller must only
    use it to choose an exact path over a fast one. Why the fast paths ask: SDPA with an additive mask adds -inf to
    q·k, so a NaN or infinite key would reach the queries the mask hides it from (NaN + -inf is NaN), where the
    reference (and SDPA's causal flag) masks the logit itself; FlexAttention's CPU kernel drops a NaN logit."""
    return bool(torch.isfinite(t.sum(dtype=accumulator_dtype(t.dtype))))


def subtract_f(logits: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``logits - f`` computed in F's (wider) dtype and rounded to the logits' dtype once."""
    return (logits.to(f.dtype) - f).to(logits.dtype)

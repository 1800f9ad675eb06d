"""The numerics every fast path shares, written once (docs/backends.md, "The numerics contract").

- :func:`accumulator_dtype`: the wide dtype accumulated quantities (F, running sums, scores) are kept in.
- :data:`ACCUMULATED_STATE`: the name of the per-token state holding the running F in a decode cache.
- :func:`all_finite`: whether a fast path that masks by adding -inf (or drops NaN) may take a tensor.
- :func:`weighted_rows`: weights times values where a masked pair contributes nothing, whatever its value;
  :func:`mark_reached`: the same after a kernel that weighs masked pairs by 0 ran over the finite values.
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


def weighted_rows(weights: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``weights @ rows`` where a pair the masks exclude contributes exactly nothing, whatever its row holds
    (select, not multiply: ``0 × NaN`` is NaN, and a padding token's value may be anything). ``weights`` (..., Nq,
    Nk) is 0 at every pair ``allowed`` (bool, broadcastable to ``weights``) excludes; ``rows`` (..., Nk, D).

    With finite rows (the usual case, one check of their sum) this is the product itself, exactly. Otherwise the
    product over the rows' finite elements (the non-finite ones as 0), and at each output element that an allowed
    pair with a non-finite row element reaches, what that sum of products gives in IEEE arithmetic: NaN for a NaN,
    for ``0 × ±inf`` (an allowed weight of exactly 0) or for +inf meeting -inf; else the infinity."""
    if all_finite(rows):
        return weights @ rows
    dtype = weights.dtype
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    finite = torch.isfinite(rows)
    out = weights @ torch.where(finite, rows, zero)
    allowed = (torch.ones((), dtype=torch.bool, device=weights.device) if allowed is None else allowed)
    allowed = allowed.expand(weights.shape)
    w = weights.detach()

    def reached(pairs: torch.Tensor, elements: torch.Tensor) -> torch.Tensor:
        """Whether some pair of ``pairs`` meets an element of ``elements`` (both bool)."""
        return (pairs.to(dtype) @ elements.to(dtype)) > 0

    pos, neg = rows == float("inf"), rows == float("-inf")
    up, down = allowed & (w > 0), allowed & (w < 0)
    plus = reached(up, pos) | reached(down, neg)
    minus = reached(up, neg) | reached(down, pos)
    nan = reached(allowed, torch.isnan(rows)) | reached(allowed & (w == 0), pos | neg) | (plus & minus)
    inf = torch.full((), float("inf"), dtype=out.dtype, device=out.device)
    return torch.where(nan, float("nan"), torch.where(plus, inf, torch.where(minus, -inf, out)))


def mark_reached(out: torch.Tensor, rows: torch.Tensor, allowed_blocks) -> torch.Tensor:
    """For a kernel that weighs every value of a block (a masked pair's by 0): ``out`` (B, H, Nq, D) computed with
    the non-finite elements of ``rows`` (B, H_kv, Nk, D) as 0, and each output element that an allowed pair brings
    one to set as that element makes it: NaN for a NaN or for +inf meeting -inf, else the infinity. ``allowed_blocks``
    yields (a slice of the queries, the allowed pairs of those queries, bool broadcastable to (B, H, Bq, Nk)).
    Softmax weights are positive at allowed pairs, so the sign of the weight is not needed here."""
    b, h = out.shape[:2]
    rows = rows.repeat_interleave(h // rows.shape[1], dim=1) if rows.shape[1] != h else rows
    dtype = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    kinds = [torch.isnan(rows), rows == float("inf"), rows == float("-inf")]
    kinds = [kind.to(dtype) for kind in kinds]
    inf = torch.full((), float("inf"), dtype=out.dtype, device=out.device)
    marked = out.clone()
    for queries, allowed in allowed_blocks:
        pairs = allowed.expand(b, h, *allowed.shape[2:]).to(dtype)
        nan, plus, minus = ((pairs @ kind) > 0 for kind in kinds)
        part = marked[:, :, queries]
        marked[:, :, queries] = torch.where(nan | (plus & minus), float("nan"),
                                            torch.where(plus, inf, torch.where(minus, -inf, part)))
    return marked

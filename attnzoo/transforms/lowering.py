"""Lowerings: how a transform is written inside a generated Triton kernel (see ``attnzoo/backends/triton``).

A lowering is Triton source text for one hook point of the kernel template, with ``{placeholders}`` the code
generator fills in. It needs no Triton import: the text is compiled only when a kernel is built.

Names a fragment may use (besides its placeholders): ``qp`` (BLOCK_M, 1) and ``kp`` (1, BLOCK_N) int64 absolute
1-based query and key positions, ``head`` the query head index (a scalar, or (BLOCK_M, 1) in the decode kernel),
``H`` the number of query heads, and ``tl`` (triton.language). Logits are float32. Rows past the last query and
columns past the last key of a block see ``qp = 1`` and ``kp = 1`` (so ``tl.log(qp)`` stays finite), and every
value computed there, and at pairs the masks forbid, is discarded with ``tl.where``, never multiplied by 0
(docs/triton.md).

Row-scale slots (query, key, value, output) need no lowering: the backend computes the per-token scale with the
transform's own torch maths (O(N·D), autograd gives its parameter gradients) and the kernel reads scaled rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TritonLogits:
    """``y = f(x)`` on a logits tile. ``forward`` is an expression in ``{x}``; ``derivative`` is dy/dx, an
    expression in ``{x}`` and ``{y}``. ``params`` names the per-head parameters (shape ``("H",)``) the fragment
    reads as ``{p_<name>}``; ``param_derivatives`` gives dy/d(param) for each, in ``{x}`` and ``{y}``."""

    forward: str
    derivative: str
    params: tuple[str, ...] = ()
    param_derivatives: tuple[str, ...] = ()


@dataclass(frozen=True)
class TritonMask:
    """``allowed``: a bool expression (broadcast to (BLOCK_M, BLOCK_N)) of which pairs may attend."""

    allowed: str


@dataclass(frozen=True)
class TritonSelection:
    """An accumulator whose selection is pointwise in one selector head's logits ``{x}``: ``S = value`` where
    the pair is allowed and ``keep`` holds (an empty ``keep``: wherever allowed), else 0; ``derivative`` is dS/dx
    there."""

    keep: str
    value: str
    derivative: str


def tanh(expr: str) -> str:
    """tanh through the sigmoid (Triton's libdevice tanh does not run in the interpreter)."""
    return f"(2.0 * tl.sigmoid(2.0 * ({expr})) - 1.0)"

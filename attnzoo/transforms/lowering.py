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


@dataclass(frozen=True)
class TritonProbability:
    """A probability map (slot ``probability``) in the generated kernels, the logits ``{x}`` being a row's logits
    after the logits slot and the accumulator's -F. Two modes:

    ``mode="pointwise"``: no row normalisation, ``w = f(x)`` (sigmoid attention). ``weight`` is f, an expression in
    ``{x}``; ``derivative`` is dw/dx in ``{x}`` and ``{y}`` (y = w); ``params`` names per-head parameters (shape
    ``("H",)``) read as ``{p_<name>}``, and ``param_derivatives`` gives dw/d(param) for each, in ``{x}`` and
    ``{y}``. The kernels add ``w @ v`` over the allowed pairs; the backward needs no row statistic.

    ``mode="ratio"``: ``w_j = N(x_j) / (sum_k D(x_k) + C)`` over the allowed keys, computed with a running shift
    ``{m}`` as flash attention computes the softmax: ``numerator`` N, ``denominator`` D (expressions in ``{x}`` and
    ``{m}``) and ``constant`` C (in ``{m}``) are the shifted forms, each ``e^{-m}`` times its unshifted value
    (``N(x, m') = N(x, m) e^{m - m'}``), so a row's sums merge over key blocks by rescaling with ``e^{m_old -
    m_new}``. The shift is ``m = max(shift_floor, the running maximum of the allowed logits)``: N and D must stay
    finite for x <= m (the softmax: N = D = ``tl.exp({x} - {m})``, C = ``0.0``, shift_floor -inf). A logit of -inf
    is a masked pair (it adds to neither sum). ``numerator_derivative`` and ``denominator_derivative`` are dN/dx and
    dD/dx in ``{x}`` and ``{m}``. The kernels keep two statistics per row, the final shift m and denominator
    Z = sum D + C, and the backward is ``dL/dx_k = (N'(x_k) dp_k - D'(x_k) delta) / Z`` with ``dp = dO·Vᵀ`` and
    ``delta = rowsum(dO·O)``, flash attention's delta. A ratio map reads no parameters (not lowered yet).

    Fragments may read ``qp``, ``kp``, ``head``, ``H`` and ``tl`` as logits fragments do; values computed at pairs
    that may not attend are discarded with ``tl.where``.
    """

    mode: str
    weight: str = ""
    derivative: str = ""
    params: tuple[str, ...] = ()
    param_derivatives: tuple[str, ...] = ()
    numerator: str = ""
    numerator_derivative: str = ""
    denominator: str = ""
    denominator_derivative: str = ""
    constant: str = "0.0"
    shift_floor: float = 0.0

    def fragments(self) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        """(field, text, its placeholders besides the parameters') for the mode's fragments."""
        if self.mode == "pointwise":
            return (("weight", self.weight, ("x",)), ("derivative", self.derivative, ("x", "y")),
                    *((f"param_derivatives[{i}]", e, ("x", "y")) for i, e in enumerate(self.param_derivatives)))
        return (("numerator", self.numerator, ("x", "m")), ("numerator_derivative", self.numerator_derivative,
                                                             ("x", "m")),
                ("denominator", self.denominator, ("x", "m")),
                ("denominator_derivative", self.denominator_derivative, ("x", "m")),
                ("constant", self.constant, ("m",)))

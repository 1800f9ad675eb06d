"""Probability maps other than the softmax (slot ``probability``, docs/specs.md "The probability slot").

- ``sigmoid``: sigmoid attention (Ramapuram et al., "Theory, Analysis, and Best Practices for Sigmoid
  Self-Attention", ICLR 2025): ``w_ij = sigmoid(l_ij + b)``, no row normalisation. The paper's bias is
  ``b = -log n`` with n the sequence length; here n is the query's position (a causal row's length), so that at
  initialisation every row's weights sum to about 1 as in the paper (i * sigmoid(-log i) = i / (i + 1)).
- ``softpick``: the rectified softmax (Zuhri et al., "Softpick: No Attention Sink, No Massive Activations with
  Rectified Softmax", 2025): ``w_j = relu(e^{l_j} - 1) / (sum_k |e^{l_k} - 1| + eps)`` over the allowed keys.
- ``stick_breaking``: stick-breaking attention (Tan et al., "Scaling Stick-Breaking Attention", ICLR 2025):
  ``w_ij = sigmoid(l_ij) * prod over allowed keys k after j (by position) of (1 - sigmoid(l_ik))``, the nearest key
  breaking its share of the stick first; computed in log space.

Each map has its reference form (``weights``) and its blocked form (``start``/``update``/``finish``), which merges
key blocks online: sigmoid's blocks simply add, softpick's merge with a running maximum as flash attention's softmax
does, stick-breaking's are visited from the nearest back carrying the running sum of log(1 - sigmoid). Every sum is
kept in at least float32 (the numerics contract) and the weights come back in the logits' dtype.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from .base import ParamSpec, PointwiseMap, ProbabilityTransform, Slot, TransformOptions
from .lowering import TritonProbability


def wide(like: torch.Tensor) -> torch.dtype:
    """The dtype sums are kept in: the input's, at least float32."""
    return torch.promote_types(like.dtype, torch.float32)


def safe_logits(logits: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logits in ``dtype`` with 0 at the pairs that are not allowed (whatever they held there: -inf, NaN), so
    that nothing non-finite reaches a map's maths or its gradient."""
    return torch.where(allowed, logits.to(dtype), torch.zeros((), dtype=dtype, device=logits.device))


def later_sum(a: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """``out[..., j] = sum of a[..., k] over the keys k at a later position than key j`` (kpos_k > kpos_j), by
    position, whatever the keys' order along the last axis. ``a`` (B, H, Nq, Nk); ``kpos`` broadcastable to it,
    (B, 1 or H, 1, Nk). Keys at equal positions (only padding ties with a real key, and padding adds 0) are taken
    in slot order."""
    if kpos.shape[-1] < 2 or bool((kpos[..., 1:] >= kpos[..., :-1]).all()):  # in position order already
        return F.pad(a.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
    order = torch.argsort(kpos, dim=-1, stable=True).expand(a.shape)
    ranked = a.gather(-1, order)
    after = F.pad(ranked.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))  # the sum over the keys after each one
    return after.gather(-1, torch.argsort(order, dim=-1))


# -- sigmoid attention ------------------------------------------------------------------------------------------------
class SigmoidOptions(TransformOptions):
    bias: float | Literal["-log n"] = Field("-log n", description="the bias b in sigmoid(l + b): a number, or "
                                            "'-log n' with n the query's position (a causal row's length)")
    learnable: bool = Field(False, description="add a learnable per-head offset to the bias, starting at 0")

    @field_validator("bias", mode="before")
    @classmethod
    def _number_or_log_n(cls, value):
        if value == "-log n" or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value
        raise ValueError("must be a number or '-log n'")


class Sigmoid(ProbabilityTransform):
    """``w_ij = sigmoid(l_ij + b_{h,i})`` on the allowed pairs, no normalisation; ``b = bias`` (or ``-log qpos``),
    plus a learnable per-head offset when ``learnable``."""

    kind = "sigmoid"
    slot = Slot.PROBABILITY
    Options = SigmoidOptions
    summary = "sigmoid attention (Ramapuram et al.): w = sigmoid(l + b), b = -log n, no row normalisation"

    def check_spec(self, spec):
        if self.options.bias == "-log n" and not spec.attention.causal:
            return ("sigmoid: bias '-log n' takes n from the query's position, a causal row's length: a non-causal "
                    "spec gives bias a number (e.g. -log of its sequence length)")
        return None

    def parameters(self):
        return [ParamSpec("bias", ("H",), 0.0)] if self.options.learnable else []

    def row_bias(self, qpos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """b at the query positions ``qpos`` (any shape, the same shape back) in ``dtype``, without the learnable
        per-head offset: ``-log qpos`` or the number."""
        if self.options.bias == "-log n":
            return -torch.log(qpos.to(dtype))
        return torch.full(qpos.shape, float(self.options.bias), dtype=dtype, device=qpos.device)

    def pointwise(self):
        """The map's declaration, ``w = sigmoid(l + b)`` with ``b`` from :meth:`row_bias` plus the learnable
        per-head ``bias``: ``weights()`` (the base class's default) and ``blocked``'s fused node compute it."""
        return PointwiseMap("sigmoid", self.row_bias, "bias" if self.options.learnable else None)

    def triton(self):
        """Pointwise: ``w = sigmoid(x + b)``, ``b`` from the query's 1-based position ``qp`` (``-log n``) or a number,
        plus the per-head parameter when learnable; dw/dx = dw/db = w (1 - w)."""
        bias = "-tl.log(qp.to(tl.float32))" if self.options.bias == "-log n" else repr(float(self.options.bias))
        params: tuple[str, ...] = ()
        if self.options.learnable:
            bias, params = f"{bias} + {{p_bias}}", ("bias",)
        slope = "{y} * (1.0 - {y})"
        return TritonProbability(mode="pointwise", weight=f"tl.sigmoid({{x}} + ({bias}))", derivative=slope,
                                 params=params, param_derivatives=(slope,) * len(params))

    def start(self, out_shape, like):
        return {"out": torch.zeros(out_shape, dtype=wide(like), device=like.device)}

    def update(self, state, logits, allowed, values, ctx, params):
        w = self.weights(logits, allowed, ctx, params)  # pointwise: the blocks just add
        out = state["out"]
        return {"out": out + w.to(out.dtype) @ values.to(out.dtype)}

    def finish(self, state, params):
        return state["out"]


# -- softpick ---------------------------------------------------------------------------------------------------------
class SoftpickOptions(TransformOptions):
    eps: float = Field(1e-8, gt=0, description="added to the denominator sum_k |e^{l_k} - 1| (the paper's code: 1e-8)")


class Softpick(ProbabilityTransform):
    """``w_j = relu(e^{l_j} - 1) / (sum_k |e^{l_k} - 1| + eps)`` over the allowed keys: rows need not sum to 1, a
    key with a negative logit gets exactly 0, a row whose allowed logits are all <= 0 gets all zeros.

    Computed with a shift m = max(0, the row's largest allowed logit): ``relu(e^{l-m} - e^{-m}) / (sum |e^{l-m} -
    e^{-m}| + eps e^{-m})`` is the same function with every exponent <= 0 (the paper's code shifts by the row max
    alone, whose e^{-m} overflows for a row of very negative logits). The shift is a constant of the gradient (the
    result does not depend on it). Keys that are not allowed add nothing to either sum, nor does a logit of -inf
    (a logits transform's way to mask a pair; the paper's code skips non-finite logits alike, where the formula's
    limit would add |0 - 1| = 1 to the denominator)."""

    kind = "softpick"
    slot = Slot.PROBABILITY
    Options = SoftpickOptions
    summary = "softpick (Zuhri et al.): relu(e^l - 1) / (sum |e^l - 1| + eps), the rectified softmax"

    def weights(self, logits, allowed, ctx, params):
        dtype = wide(logits)
        allowed = allowed & ~torch.isneginf(logits)  # -inf masks a pair (as the paper's code takes it)
        x = safe_logits(logits, allowed, dtype)
        m = x.amax(-1, keepdim=True).clamp_min(0.0).detach()  # 0 stands in for the pairs not allowed: max(0, ...)
        e = torch.exp(x - m) - torch.exp(-m)
        zero = torch.zeros((), dtype=dtype, device=x.device)
        numerator = torch.where(allowed, torch.relu(e), zero)
        denominator = torch.where(allowed, e.abs(), zero).sum(-1, keepdim=True) + self.options.eps * torch.exp(-m)
        return (numerator / denominator).to(logits.dtype)

    def triton(self):
        """A ratio map with the shifted form above: N = relu(e), D = |e|, C = eps e^{-m}, e = e^{x-m} - e^{-m}, the
        shift at least 0; dN/dx and dD/dx are relu'(e) and sign(e) times e^{x-m} (torch's subgradients at 0)."""
        e = "(tl.exp({x} - {m}) - tl.exp(-{m}))"
        grow = "tl.exp({x} - {m})"
        return TritonProbability(
            mode="ratio", numerator=f"tl.maximum({e}, 0.0)", numerator_derivative=f"tl.where({e} > 0.0, {grow}, 0.0)",
            denominator=f"tl.abs({e})",
            denominator_derivative=f"tl.where({e} > 0.0, 1.0, tl.where({e} < 0.0, -1.0, 0.0)) * {grow}",
            constant=f"{float(self.options.eps)!r} * tl.exp(-{{m}})", shift_floor=0.0)

    def start(self, out_shape, like):
        dtype = wide(like)
        rows = (*out_shape[:-1], 1)
        return {"m": torch.zeros(rows, dtype=dtype, device=like.device),
                "num": torch.zeros(out_shape, dtype=dtype, device=like.device),
                "den": torch.zeros(rows, dtype=dtype, device=like.device)}

    def update(self, state, logits, allowed, values, ctx, params):
        m = state["m"]
        allowed = allowed & ~torch.isneginf(logits)
        x = safe_logits(logits, allowed, m.dtype)
        new = torch.maximum(m, x.amax(-1, keepdim=True)).detach()  # the running shift, >= 0 (it starts at 0)
        rescale = torch.exp(m - new)
        e = torch.exp(x - new) - torch.exp(-new)
        zero = torch.zeros((), dtype=m.dtype, device=m.device)
        num = torch.where(allowed, torch.relu(e), zero) @ values.to(m.dtype)
        den = torch.where(allowed, e.abs(), zero).sum(-1, keepdim=True)
        return {"m": new, "num": state["num"] * rescale + num, "den": state["den"] * rescale + den}

    def finish(self, state, params):
        return state["num"] / (state["den"] + self.options.eps * torch.exp(-state["m"]))


# -- stick-breaking ---------------------------------------------------------------------------------------------------
class StickBreakingOptions(TransformOptions):
    attend_current: bool = Field(False, description="a query's own key takes the first share of the stick (the "
                                 "paper's default, false: a query weighs only earlier keys)")


class StickBreaking(ProbabilityTransform):
    """``w_ij = sigmoid(l_ij) * prod_{k in S_i, kpos_j < kpos_k} (1 - sigmoid(l_ik))`` for j in S_i, the keys the
    query weighs: the allowed keys strictly before it (with ``attend_current``, up to and including its own). In
    log space: ``log w_ij = logsigmoid(l_ij) + sum_{k in S_i after j} logsigmoid(-l_ik)``. The order is the keys'
    positions (``ctx.kpos``), never their slots. A row's weights sum to 1 - prod_{k in S_i} (1 - sigmoid(l_ik)) <= 1:
    what is left of the stick is attended by nobody (the authors' code can add it to the query's own value; attnzoo
    does not). Needs a causal spec."""

    kind = "stick_breaking"
    slot = Slot.PROBABILITY
    Options = StickBreakingOptions
    order = "reverse"
    summary = "stick-breaking attention (Tan et al.): w_ij = sigmoid(l_ij) * prod_{j<k<i} (1 - sigmoid(l_ik))"

    def check_spec(self, spec):
        if not spec.attention.causal:
            return "stick_breaking needs attention.causal: true (the stick is broken from the query back)"
        return None

    def weighed(self, allowed, ctx) -> torch.Tensor:
        """S: the allowed pairs the stick is broken over (the query's own key only with ``attend_current``)."""
        return allowed if self.options.attend_current else allowed & (ctx.kpos < ctx.qpos)

    def _terms(self, logits, allowed, ctx, dtype):
        """(S, log sigmoid(l) and log(1 - sigmoid(l)) at the pairs of S, 0 elsewhere)."""
        weighed = self.weighed(allowed, ctx)
        x = safe_logits(logits, weighed, dtype)
        zero = torch.zeros((), dtype=dtype, device=x.device)
        return weighed, F.logsigmoid(x), torch.where(weighed, F.logsigmoid(-x), zero)

    def weights(self, logits, allowed, ctx, params):
        weighed, log_beta, log_rest = self._terms(logits, allowed, ctx, wide(logits))
        w = torch.exp(log_beta + later_sum(log_rest, ctx.kpos))
        return torch.where(weighed, w, torch.zeros((), dtype=w.dtype, device=w.device)).to(logits.dtype)

    def start(self, out_shape, like):
        dtype = wide(like)
        return {"out": torch.zeros(out_shape, dtype=dtype, device=like.device),
                "rest": torch.zeros((*out_shape[:-1], 1), dtype=dtype, device=like.device)}

    def update(self, state, logits, allowed, values, ctx, params):
        """One key block, every later key already merged: ``rest`` is the sum of log(1 - sigmoid) over them."""
        rest = state["rest"]
        weighed, log_beta, log_rest = self._terms(logits, allowed, ctx, rest.dtype)
        w = torch.exp(log_beta + later_sum(log_rest, ctx.kpos) + rest)
        w = torch.where(weighed, w, torch.zeros((), dtype=w.dtype, device=w.device))
        return {"out": state["out"] + w @ values.to(w.dtype), "rest": rest + log_rest.sum(-1, keepdim=True)}

    def finish(self, state, params):
        return state["out"]


# -- the softmax, online (for maps built on it: differential attention) ---------------------------------------------
class OnlineSoftmax:
    """The masked softmax, in its reference form and merged online over key blocks with a running maximum (flash
    attention's merge): a mixin for probability maps whose map is the softmax itself and whose work is in
    ``values``/``combine`` (differential attention). A row with no allowed key gives 0."""

    order = "any"
    softmax_map = True

    def weights(self, logits, allowed, ctx, params):
        dtype = logits.dtype
        x = torch.where(allowed, logits, torch.full((), float("-inf"), dtype=dtype, device=logits.device))
        has_key = allowed.expand_as(logits).any(-1, keepdim=True)
        x = torch.where(has_key, x, torch.zeros((), dtype=dtype, device=logits.device))
        return torch.where(allowed, torch.softmax(x, dim=-1), torch.zeros((), dtype=dtype, device=logits.device))

    def start(self, out_shape, like):
        dtype = wide(like)
        rows = (*out_shape[:-1], 1)
        return {"m": torch.full(rows, float("-inf"), dtype=dtype, device=like.device),
                "l": torch.zeros(rows, dtype=dtype, device=like.device),
                "acc": torch.zeros(out_shape, dtype=dtype, device=like.device)}

    def update(self, state, logits, allowed, values, ctx, params):
        m = state["m"]
        x = torch.where(allowed, logits.to(m.dtype), torch.full((), float("-inf"), dtype=m.dtype, device=m.device))
        new = torch.maximum(m, x.amax(-1, keepdim=True)).detach()
        shift = torch.where(torch.isinf(new), torch.zeros((), dtype=m.dtype, device=m.device), new)  # empty so far
        rescale = torch.exp(m - shift)
        p = torch.exp(x - shift)
        return {"m": new, "l": state["l"] * rescale + p.sum(-1, keepdim=True),
                "acc": state["acc"] * rescale + p @ values.to(m.dtype)}

    def finish(self, state, params):
        total = state["l"]
        some = total > 0
        return torch.where(some, state["acc"] / torch.where(some, total, torch.ones_like(total)),
                           torch.zeros((), dtype=total.dtype, device=total.device))

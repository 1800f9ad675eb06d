"""SSA temperatures (Zhang et al., NeurIPS 2024): a per-token, per-head inverse temperature on queries, keys or
values, ``t = t_pos(i) + t_tok(x)`` with ``t_pos(i) = 1 + c * log(i)`` and ``t_tok(x) = tanh(u_h · GELU(x))``.

Certain (docs/papers.md §1): the decomposition, weight sharing (x is the head's own query/key/value row), absolute
1-based positions. Options for the [open] choices: ``position_coefficient`` (``gompertz`` c = exp(-exp(b)), the
authors' code and the default; ``sigmoid`` c = sigmoid(b); ``linear`` c = b) and ``token_weight`` (``per_head``
default, or one ``shared`` vector). Initial values: u = 0 (token term exactly 0) and b = 2.0 for gompertz
(c = exp(-e²) ≈ 6e-4), the same c for sigmoid (b = logit(6e-4)), and b = 1e-5 for linear (the variant's own start).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import model_validator

from .base import ParamSpec, RowScaleTransform, Slot, TransformOptions, gelu_dot_tanh

_GOMPERTZ_INIT = 2.0
_START_COEFFICIENT = math.exp(-math.exp(_GOMPERTZ_INIT))
POSITION_INIT = {
    "gompertz": _GOMPERTZ_INIT,
    "sigmoid": math.log(_START_COEFFICIENT / (1.0 - _START_COEFFICIENT)),
    "linear": 1e-5,
}


class TemperatureOptions(TransformOptions):
    token_aware: bool = True
    position_aware: bool = True
    position_coefficient: Literal["gompertz", "sigmoid", "linear"] = "gompertz"
    token_weight: Literal["per_head", "shared"] = "per_head"

    @model_validator(mode="after")
    def _one_term(self):
        if not (self.token_aware or self.position_aware):
            raise ValueError("at least one of token_aware and position_aware must be true")
        return self


def position_coefficient(kind: str, b: torch.Tensor) -> torch.Tensor:
    if kind == "gompertz":
        return torch.exp(-torch.exp(b))
    if kind == "sigmoid":
        return torch.sigmoid(b)
    return b


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (itself when it is already: ``Tensor.to``'s own call costs a microsecond)."""
    return t if t.dtype == dtype else t.to(dtype)


class _Temperature(RowScaleTransform):
    Options = TemperatureOptions
    heads_symbol = "H"

    def parameters(self):
        o = self.options
        out = []
        if o.token_aware:
            shape = ("D",) if o.token_weight == "shared" else (self.heads_symbol, "D")
            out.append(ParamSpec("token_weight", shape, 0.0))
        if o.position_aware:
            out.append(ParamSpec("position_logit", (), POSITION_INIT[o.position_coefficient]))
        return out

    def scale(self, rows, positions, params):
        """rows (B, Hx, N, D), positions (B, 1 or Hx, N) → t (B, Hx, N) in at least float32 (the numerics
        contract, docs/backends.md): in float16 a position from 65,520 on rounds to inf (and so does its log),
        and the terms are summed before rounding. :meth:`attnzoo.plan.Plan.row_scale` multiplies and rounds
        back to the rows' dtype once."""
        o = self.options
        wide = torch.promote_types(rows.dtype, torch.float32)
        t = None  # 1 + each term, summed in order (a decode step maps a few rows: every op counts)
        if o.position_aware:
            c = position_coefficient(o.position_coefficient, _as(params["position_logit"], wide))
            t = 1 + c * torch.log(positions.to(wide))
        if o.token_aware:
            g = gelu_dot_tanh(_as(rows, wide), _as(params["token_weight"], wide))
            t = 1 + g if t is None else t + g
        if t is None:
            t = torch.ones((), dtype=wide, device=rows.device)
        return t.expand(rows.shape[:-1])


class QueryTemperature(_Temperature):
    """SSA query temperature: scales query row i (equivalently logit row i) by ``t_q(q_i, i)``."""

    kind = "query_temperature"
    slot = Slot.QUERY
    summary = "SSA: q_i *= 1 + c log(i) + tanh(u_h · GELU(q_i))"


class KeyTemperature(_Temperature):
    """SSA key temperature (an ablation in the paper: it hurt). Weights are per key/value head."""

    kind = "key_temperature"
    slot = Slot.KEY
    heads_symbol = "H_kv"
    summary = "SSA ablation: k_j *= 1 + c log(j) + tanh(u_h · GELU(k_j))"


class ValueTemperature(_Temperature):
    """SSA value temperature: scales value row j by ``t_v(v_j, j)``. Weights are per key/value head."""

    kind = "value_temperature"
    slot = Slot.VALUE
    heads_symbol = "H_kv"
    summary = "SSA: v_j *= 1 + c log(j) + tanh(u_h · GELU(v_j))"

"""Pointwise logits transforms, and the SSA paper's constant-temperature and YaRN baselines."""

from __future__ import annotations

import math

import torch
from pydantic import Field

from .base import Context, LogitsTransform, ParamSpec, Slot, TransformOptions
from .lowering import TritonLogits, tanh


class SoftcapOptions(TransformOptions):
    cap: float = Field(gt=0)


class Softcap(LogitsTransform):
    """``l' = cap * tanh(l / cap)`` (Gemma-2 style logit soft-capping)."""

    kind = "softcap"
    slot = Slot.LOGITS
    Options = SoftcapOptions
    summary = "l' = cap * tanh(l / cap)"

    def apply(self, logits, ctx, params):
        cap = self.options.cap
        return cap * torch.tanh(logits / cap)

    def triton(self):
        cap = float(self.options.cap)
        return TritonLogits(forward=f"{cap!r} * {tanh(f'{{x}} / {cap!r}')}",
                            derivative=f"1.0 - ({{y}} / {cap!r}) * ({{y}} / {cap!r})")


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> list[float]:
    """The ALiBi head slopes (Press et al.): ``2^(-max_bias * h / n)`` for n a power of two; otherwise the slopes
    of the nearest lower power of two followed by every other slope of the next power of two."""

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_two(num_heads)
    lower = 2 ** int(math.floor(math.log2(num_heads)))
    return power_of_two(lower) + power_of_two(2 * lower)[0::2][: num_heads - lower]


class AlibiOptions(TransformOptions):
    max_bias: float = Field(8.0, gt=0)


class Alibi(LogitsTransform):
    """``l' = l - slope_h * |i - j|`` with the standard per-head ALiBi slopes."""

    kind = "alibi"
    slot = Slot.LOGITS
    Options = AlibiOptions
    summary = "l' = l - slope_h * |i - j| (per-head geometric slopes)"

    def apply(self, logits: torch.Tensor, ctx: Context, params):
        return logits + self.bias(ctx, params, logits.dtype)

    def bias(self, ctx: Context, params, dtype: torch.dtype) -> torch.Tensor:
        distance = (ctx.qpos - ctx.kpos).abs().to(dtype)
        head = ctx.heads.to(dtype)
        return -head_slope(head, ctx.dims.num_heads, self.options.max_bias) * distance

    def separable(self, ctx: Context, params, dtype: torch.dtype):
        slope = head_slope(ctx.heads.to(dtype), ctx.dims.num_heads, self.options.max_bias)
        return -slope * ctx.qpos.to(dtype), slope * ctx.kpos.to(dtype)  # -slope (i - j) where j <= i

    def triton(self):
        # head_slope in Triton; the largest power of two <= H is exp2(floor(log2(H)))
        mb = float(self.options.max_bias)
        lower = "tl.exp2(tl.floor(tl.log2(H + 0.0)))"
        first = f"tl.exp2(-{mb!r} * (head + 1.0) / {lower})"
        interleaved = f"tl.exp2(-{mb!r} * (2.0 * (head - {lower}) + 1.0) / (2.0 * {lower}))"
        forward = (f"{{x}} - tl.where(head < {lower}, {first}, {interleaved}) "
                   f"* tl.abs(qp - kp).to(tl.float32)")
        return TritonLogits(forward=forward, derivative="1.0")


class LearnableAlibiOptions(TransformOptions):
    max_bias: float = Field(8.0, gt=0, description="the initial slopes are ALiBi's for this max_bias")


class LearnableAlibi(LogitsTransform):
    """ALiBi with a learnable slope per head: ``l' = l - slope_h * |i - j|``, the slopes starting at ALiBi's
    geometric ones (:func:`alibi_slopes`) and trained like any parameter (parameter ``slope``, shape (H,))."""

    kind = "alibi_learnable"
    slot = Slot.LOGITS
    Options = LearnableAlibiOptions
    summary = "l' = l - slope_h * |i - j|, slope_h learnable (starts at ALiBi's slopes)"

    def parameters(self):
        max_bias = self.options.max_bias
        return [ParamSpec("slope", ("H",), lambda dims: alibi_slopes(dims.num_heads, max_bias))]

    def apply(self, logits: torch.Tensor, ctx: Context, params):
        return logits + self.bias(ctx, params, logits.dtype)

    def bias(self, ctx: Context, params, dtype: torch.dtype) -> torch.Tensor:
        distance = (ctx.qpos - ctx.kpos).abs().to(dtype)
        return -params["slope"][ctx.heads].to(dtype) * distance

    # not separable(): the slope's gradient would become sum_j dcol_j * j over absolute positions, where the
    # row/column split cancels terms of size N; summed over distances (i - j) it keeps float32's precision

    def triton(self):
        distance = "tl.abs(qp - kp).to(tl.float32)"
        return TritonLogits(forward=f"{{x}} - {{p_slope}} * {distance}", derivative="1.0",
                            params=("slope",), param_derivatives=(f"-{distance}",))


def head_slope(head: torch.Tensor, num_heads: int, max_bias: float) -> torch.Tensor:
    """:func:`alibi_slopes` as a pointwise function of the head index, a float tensor (so that it also lowers to a
    FlexAttention score_mod, and keeps the precision of the logits)."""
    lower = 2 ** int(math.floor(math.log2(num_heads)))
    first = torch.exp2(-max_bias * (head + 1) / lower)
    if lower == num_heads:
        return first
    interleaved = torch.exp2(-max_bias * (2 * (head - lower) + 1) / (2 * lower))
    return torch.where(head < lower, first, interleaved)


class ConstantTemperatureOptions(TransformOptions):
    value: float = Field(1.0, gt=0, description="initial inverse temperature")
    learnable: bool = True


class ConstantTemperature(LogitsTransform):
    """SSA's baseline: one inverse temperature per head, ``l' = tau_h * l`` (learnable by default, starting at
    ``value``; fixed at ``value`` when ``learnable: false``)."""

    kind = "constant_temperature"
    slot = Slot.LOGITS
    Options = ConstantTemperatureOptions
    summary = "l' = tau_h * l, one (learnable) inverse temperature per head"

    def parameters(self):
        return [ParamSpec("temperature", ("H",), self.options.value)] if self.options.learnable else []

    def apply(self, logits, ctx, params):
        if not self.options.learnable:
            return logits * self.options.value
        return logits * params["temperature"][ctx.heads]

    def triton(self):
        if not self.options.learnable:
            value = float(self.options.value)
            return TritonLogits(forward=f"{{x}} * {value!r}", derivative=f"{value!r}")
        return TritonLogits(forward="{x} * {p_temperature}", derivative="{p_temperature}",
                            params=("temperature",), param_derivatives=("{x}",))


class YarnScaleOptions(TransformOptions):
    factor: float = Field(ge=1, description="context extension factor s")


class YarnScale(LogitsTransform):
    """YaRN's attention scaling, SSA's baseline: ``l' = (0.1 * ln(s) + 1) * l`` for extension factor s."""

    kind = "yarn_scale"
    slot = Slot.LOGITS
    Options = YarnScaleOptions
    summary = "l' = (0.1 ln s + 1) * l"

    def apply(self, logits, ctx, params):
        return logits * (0.1 * math.log(self.options.factor) + 1.0)

    def triton(self):
        c = 0.1 * math.log(self.options.factor) + 1.0
        return TritonLogits(forward=f"{{x}} * {c!r}", derivative=f"{c!r}")

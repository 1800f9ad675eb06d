"""The tolerance rule of the conformance suite, declared in one place (docs/conformance.md).

Element by element, a backend's error against the float64 truth may be at most a few times the error of the
reference itself run in the same precision, plus a floor relative to the expected value:

    |got - truth| <= FACTOR * max(|low - truth|, q99|low - truth|)
                     + FLOOR[dtype] * max(|truth|, median|truth|, SCALE_MIN)

``low`` is the reference run in the tested dtype (None: no allowance but the floor); ``q99`` is the 99th
percentile over the tensor. Every quantity that sets an element's allowance is that element's own, a percentile or
a median, so one large entry cannot widen the allowance of the small ones (a gradient ``[200, 0.01 x 9]`` whose
small entries have the wrong sign fails), and a non-finite entry of ``low`` adds nothing (it cannot make the
allowance infinite). The percentile keeps an element whose reference error is zero by chance from demanding more
than the precision gives; SCALE_MIN keeps a tensor of exact zeros from demanding exact zeros. Non-finite values of
``got`` where the truth is finite always fail.
"""

from __future__ import annotations

import torch

FACTOR = 4.0
QUANTILE = 0.99
FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 5e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 4e-2,
}
SCALE_MIN = 1e-2  # the smallest magnitude the floor is taken relative to (inputs are O(1))


def allowance(truth: torch.Tensor, low: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The per-element allowance of the rule (float64, the shape of ``truth``)."""
    magnitude = truth.abs()
    typical = magnitude.median().clamp_min(SCALE_MIN) if magnitude.numel() else SCALE_MIN
    floor = FLOOR[dtype] * torch.maximum(magnitude, torch.as_tensor(typical, dtype=torch.float64))
    if low is None or not low.numel():
        return floor
    ref_err = (low.detach().to(torch.float64) - truth).abs()
    ref_err = torch.where(torch.isfinite(ref_err), ref_err, torch.zeros((), dtype=torch.float64))
    return FACTOR * torch.maximum(ref_err, torch.quantile(ref_err.flatten(), QUANTILE)) + floor


def _at(where: tuple[int, ...], axes: tuple[str, ...] | None) -> str:
    """``(0, 1, 3, 2)``, followed by the axes' names when ``axes`` names each (``batch row 0, head 1, ...``)."""
    if axes is None or len(axes) != len(where):
        return str(where)
    return f"{where} ({', '.join(f'{axis} {i}' for axis, i in zip(axes, where, strict=True))})"


def check_close(name: str, got: torch.Tensor, truth: torch.Tensor, reference_in_dtype: torch.Tensor | None,
                dtype: torch.dtype, axes: tuple[str, ...] | None = None) -> None:
    """Raise AssertionError (one line) unless ``got`` meets the rule against the float64 ``truth``. ``axes``: the
    names of the tensor's axes (``("batch row", "head", "token", "dim")``), which the failure line spells out at
    the element it names."""
    if got.shape != truth.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}")
    got64 = got.detach().cpu().to(torch.float64)
    truth = truth.detach().cpu().to(torch.float64)
    low = reference_in_dtype.detach().cpu() if reference_in_dtype is not None else None
    finite = torch.isfinite(truth)
    bad = ~torch.isfinite(got64) & finite
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise AssertionError(f"{name}: non-finite value at {_at(where, axes)} ({int(bad.sum())} elements) where the "
                             f"reference is finite (an unwritten or overflowing element)")
    if not bool(finite.all()):
        where = tuple(int(i) for i in (~finite).nonzero()[0].tolist())
        raise AssertionError(f"{name}: the float64 reference itself is non-finite at {where} "
                             f"({int((~finite).sum())} elements)")
    if not got64.numel():
        return
    err = (got64 - truth).abs()
    allowed = allowance(truth, low, dtype)
    over = err > allowed
    if bool(over.any()):
        ratio = err / allowed.clamp_min(torch.finfo(torch.float64).tiny)
        worst = int(ratio.flatten().argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), truth.shape))
        raise AssertionError(
            f"{name}: error {float(err.flatten()[worst]):.3g} > allowed {float(allowed.flatten()[worst]):.3g} at "
            f"{_at(where, axes)} (got {float(got64.flatten()[worst]):.6g}, expected "
            f"{float(truth.flatten()[worst]):.6g}; "
            f"{int(over.sum())} of {over.numel()} elements over; rule: {FACTOR:g} x reference "
            f"{str(dtype).removeprefix('torch.')} error + floor, element-wise)")

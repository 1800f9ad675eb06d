"""The tolerance rule of the conformance suite, declared in one place.

A backend's error against the float64 reference may be at most twice the error of the reference itself run in the
same precision, plus a floor that scales with the magnitude of the expected values:

    max|got - truth| <= 2 * max|reference_in_dtype - truth| + FLOOR[dtype] * max(1, max|truth|)
"""

from __future__ import annotations

import torch

FACTOR = 2.0
FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}


def check_close(name: str, got: torch.Tensor, truth: torch.Tensor, reference_in_dtype: torch.Tensor | None,
                dtype: torch.dtype) -> None:
    """Raise AssertionError (one line) unless ``got`` meets the rule against the float64 ``truth``."""
    if got.shape != truth.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}")
    got64 = got.detach().to(torch.float64)
    truth = truth.detach().to(torch.float64)
    bad = ~torch.isfinite(got64) & torch.isfinite(truth)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise AssertionError(f"{name}: non-finite value at {where} ({int(bad.sum())} elements) where the "
                             f"reference is finite (an unwritten or overflowing element)")
    err = float((got64 - truth).abs().max()) if got64.numel() else 0.0
    ref_err = 0.0
    if reference_in_dtype is not None and reference_in_dtype.numel():
        ref_err = float((reference_in_dtype.detach().to(torch.float64) - truth).abs().max())
    scale = max(1.0, float(truth.abs().max())) if truth.numel() else 1.0
    allowed = FACTOR * ref_err + FLOOR[dtype] * scale
    if not err <= allowed:
        raise AssertionError(f"{name}: max error {err:.3g} > allowed {allowed:.3g} "
                             f"(2 x reference {str(dtype).removeprefix('torch.')} error {ref_err:.3g} + floor)")

"""Checks of a call's inputs (q, k, v, positions, key mask): one clear error line each, before any backend runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .transforms.base import Dims


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool = True) -> Dims:
    """Validate shapes and dtypes of q (B, H, N, D), k and v (B, H_kv, N, D); return the dims."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (B and D must agree)")
    if same_length and k.shape[2] != n:
        raise ValueError(f"k/v have {k.shape[2]} tokens but q has {n}")
    if k.shape[1] < 1 or h % k.shape[1] != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    if n < 1 or d < 1:
        raise ValueError(f"q has an empty dimension: shape {tuple(q.shape)}")
    return Dims(num_heads=h, head_dim=d, num_kv_heads=k.shape[1])


def positions_tensor(positions: Any, batch: int, n: int, device) -> torch.Tensor:
    """Given positions as (B, N) int64 on ``device``: an integer tensor of shape (N,) or (B, N), else one line."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError("positions must be an integer tensor of 1-based positions")
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(batch, -1)
    if positions.shape != (batch, n):
        raise ValueError(f"positions must have shape ({n},) or ({batch}, {n}), got {tuple(positions.shape)}")
    return positions.to(device=device, dtype=torch.int64)


def check_positions(positions: Any, batch: int, n: int, device, key_mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Default 1..N; accept (N,) or (B, N) integer tensors of 1-based positions that increase strictly along each
    row (offsets and gaps are fine). Returns (B, N) int64.

    The positions contract (docs/backends.md): no backend infers structure from order, and a row whose positions
    repeat or go back (packed documents) is refused here with one line rather than computed wrongly.

    Padding (``key_mask`` False): the positions given for padding tokens are ignored, and only the real tokens
    must increase strictly. Each padding token takes the position of the next real token of its row (one past
    the last real token at the end of a row), so a row stays non-decreasing and its first real token keeps its
    position (1 in a left-padded row): backends see ties only at padding tokens, which are never attended."""
    if positions is None:
        return torch.arange(1, n + 1, device=device).expand(batch, n)
    positions = positions_tensor(positions, batch, n, device)
    real = key_mask.to(device) if key_mask is not None else None
    if bool(((positions < 1) if real is None else ((positions < 1) & real)).any()):
        raise ValueError("positions are 1-based: every position must be >= 1")
    if n > 1:
        if real is None:
            bad = F.pad(positions[:, 1:] <= positions[:, :-1], (1, 0))
        else:
            seen = torch.cummax(torch.where(real, positions, 0), dim=-1).values
            bad = real & (positions <= F.pad(seen[:, :-1], (1, 0)))
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0].tolist())
            earlier = positions[row, :col] if real is None else positions[row, :col][real[row, :col]]
            before = int(earlier[-1])
            raise ValueError(f"positions must increase strictly along each row (offsets and gaps are fine): row "
                             f"{row} goes from {before} to {int(positions[row, col])} at index {col}; pass documents= "
                             f"for packed documents")
    if real is not None and not bool(real.all()):
        big = torch.iinfo(torch.int64).max
        following = torch.where(real, positions, big).flip(-1).cummin(-1).values.flip(-1)
        last = torch.cummax(torch.where(real, positions, 0), dim=-1).values[:, -1:] + 1
        following = torch.where(following == big, last, following)
        positions = torch.where(real, positions, following)
    return positions


def check_key_mask(key_mask: Any, batch: int, n: int, device) -> torch.Tensor | None:
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or key_mask.shape != (batch, n):
        got = tuple(key_mask.shape) if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
        raise ValueError(f"key_mask must be a bool tensor of shape ({batch}, {n}) (True = may attend), got {got}")
    return key_mask.to(device)

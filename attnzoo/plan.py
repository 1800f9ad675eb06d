"""A spec resolved against the registry: transform instances by slot, parameter declarations, input checks.

Backends consume a :class:`Plan`; it holds no backend-specific state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .transforms.base import (
    Context,
    Dims,
    LogitsTransform,
    ParamSpec,
    RowScaleTransform,
    Slot,
    TokenRows,
    Transform,
    restrict_heads,
)


class DecodeStep(NamedTuple):
    """What :meth:`Plan.admit` hands a decoding backend: the new queries after the query slot (B, H, T, D), their
    positions (B, T) and their per-token features ``{"<kind>.<name>": (B, H, T)}`` (the keys' are in
    ``cache.key_features()``)."""

    queries: torch.Tensor
    positions: torch.Tensor
    features: dict[str, torch.Tensor]


@dataclass
class Plan:
    spec: Any
    transforms: list[Transform]
    causal: bool
    scale: float | None
    by_slot: dict[Slot, list[Transform]] = field(default_factory=dict)
    evictor_cls: type | None = None

    @classmethod
    def from_spec(cls, spec, registry) -> Plan:
        transforms = [registry.transforms[entry.kind](entry) for entry in spec.transforms]
        by_slot: dict[Slot, list[Transform]] = {}
        for t in transforms:
            by_slot.setdefault(t.slot, []).append(t)
        evictor_cls = registry.evictors[spec.cache.evictor] if spec.cache is not None else None
        return cls(spec, transforms, spec.attention.causal, spec.attention.scale, by_slot, evictor_cls)

    def one(self, slot: Slot) -> Transform | None:
        items = self.by_slot.get(slot, [])
        return items[0] if items else None

    def many(self, slot: Slot) -> list[Transform]:
        return self.by_slot.get(slot, [])

    # -- parameters ---------------------------------------------------------------------------------------------
    def param_specs(self) -> dict[str, tuple[Transform, ParamSpec]]:
        return {f"{t.kind}.{p.name}": (t, p) for t in self.transforms for p in t.parameters()}

    def init_params(self, dims: Dims, dtype=torch.float32, device=None) -> dict[str, torch.Tensor]:
        return {key: p.initial(dims, dtype=dtype, device=device) for key, (_, p) in self.param_specs().items()}

    def split_params(self, params: dict[str, torch.Tensor] | None, dims: Dims, like: torch.Tensor
                     ) -> dict[str, dict[str, torch.Tensor]]:
        """Check ``params`` against the declarations and group them per transform kind (short names)."""
        specs = self.param_specs()
        if params is None:
            params = self.init_params(dims, dtype=like.dtype, device=like.device)
        unknown = sorted(set(params) - set(specs))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} for spec '{self.spec.name}' "
                             f"(expected: {', '.join(sorted(specs)) or 'none'})")
        out: dict[str, dict[str, torch.Tensor]] = {t.kind: {} for t in self.transforms}
        for key, (t, p) in specs.items():
            if key not in params:
                raise ValueError(f"missing parameter {key!r} for spec '{self.spec.name}'")
            value = params[key]
            want = dims.resolve(p.shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"parameter {key!r} must have shape {want}, got {got}")
            out[t.kind][p.name] = value.to(like.dtype) if value.dtype != like.dtype else value
        return out

    def check_dims(self, dims: Dims) -> None:
        """Raise ValueError if a transform's options do not fit the sizes of a call."""
        for t in self.transforms:
            t.check_dims(dims)

    # -- the pieces every backend computes the same way ----------------------------------------------------------
    def row_scale(self, slot: Slot, rows: torch.Tensor, positions: torch.Tensor, params,
                  widen: bool = False) -> torch.Tensor:
        """rows (B, Hx, N, D) through the slot's row maps in spec order (unchanged when the slot is empty); same
        dtype as rows.

        A row scale (SSA temperatures) multiplies in the wider of the rows' and the scale's dtypes and rounds to
        the rows' dtype once: the built-in scales come in at least float32 (the numerics contract,
        docs/backends.md), so half-precision rows are scaled in float32 and rounded once. Any other row map
        gets the rows as they are, and its result is rounded to the rows' dtype.

        ``widen``: for float16/bfloat16 rows, hand every transform float32 rows and parameters (fast backends use
        it: the gradient of a per-token scale reduces over D and over every position, which loses too much in
        half precision; it matters for transforms that compute in the dtype they are given)."""
        transforms = self.many(slot)
        if not transforms:
            return rows
        out = rows
        for t in transforms:
            group = params[t.kind]
            if widen and out.dtype in (torch.float16, torch.bfloat16):
                x, group = out.float(), {name: p.float() for name, p in group.items()}
            else:
                x = out
            if isinstance(t, RowScaleTransform):
                scale = t.scale(x, positions, group)
                x = x.to(torch.promote_types(x.dtype, scale.dtype)) * scale.unsqueeze(-1)
            else:
                x = t.map(x, positions, group)
                if tuple(x.shape) != tuple(rows.shape):
                    raise ValueError(f"transform '{t.kind}' ({slot.value}) returned rows of shape {tuple(x.shape)} "
                                     f"for rows of shape {tuple(rows.shape)}: a row map must keep the shape")
            out = x.to(rows.dtype)
        return out

    def admit(self, cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params, *, evict_first: bool,
              key_mask: torch.Tensor | None = None, widen: bool = False) -> DecodeStep:
        """The decoding sequence every backend shares: the new tokens' positions, their rows through the query,
        key and value slots (once per token), their per-token features (cumulative ones continuing the cache's
        running sums), then the append to ``cache`` (which evicts first when its evictor says so). ``q`` (B, H,
        T, D) and ``k``, ``v`` (B, H_kv, T, D) are raw; ``widen``: see :meth:`row_scale`."""
        count = k.shape[2]
        features: dict[str, torch.Tensor] = {}
        featured = bool(self.feature_transforms())
        if self.many(Slot.KEY) or self.many(Slot.VALUE) or featured:
            positions = cache.upcoming_positions(count, key_mask, k.device)
            k = self.row_scale(Slot.KEY, k, positions.unsqueeze(1), params, widen=widen)
            v = self.row_scale(Slot.VALUE, v, positions.unsqueeze(1), params, widen=widen)
        if featured:
            qs = self.row_scale(Slot.QUERY, q, positions.unsqueeze(1), params, widen=widen)
            features = self._features(TokenRows(qs, k, v, positions, key_mask, Dims(q.shape[1], q.shape[3],
                                                                                      k.shape[1])),
                                      params, cache.feature_totals)
        positions = cache.admit(k, v, evict_first, key_mask, features)
        if not featured:
            qs = self.row_scale(Slot.QUERY, q, positions.unsqueeze(1), params, widen=widen)
        return DecodeStep(qs, positions, features)

    def context(self, qpos: torch.Tensor, kpos: torch.Tensor, dims: Dims,
                key_mask: torch.Tensor | None = None, query_features: dict[str, torch.Tensor] | None = None,
                key_features: dict[str, torch.Tensor] | None = None) -> Context:
        """The broadcastable context of queries at qpos (B, Nq) against keys at kpos (B, 1 or H_kv, Nk), with the
        key mask (B, Nk) or None and the per-token features of the queries (B, H, Nq) and keys (B, H, Nk)."""
        group = dims.num_heads // dims.num_kv_heads
        kpos_h = kpos.repeat_interleave(group, dim=1) if kpos.shape[1] > 1 else kpos
        heads = torch.arange(dims.num_heads, device=qpos.device).view(1, -1, 1, 1)
        return Context(qpos=qpos[:, None, :, None], kpos=kpos_h[:, :, None, :], heads=heads, dims=dims,
                       key_mask=key_mask[:, None, None, :] if key_mask is not None else None,
                       query_features={n: t[..., None] for n, t in (query_features or {}).items()},
                       key_features={n: t[:, :, None, :] for n, t in (key_features or {}).items()})

    def feature_transforms(self) -> list[Transform]:
        """The logits transforms that compute per-token features."""
        return [t for t in self.many(Slot.LOGITS) if type(t).features is not LogitsTransform.features]

    def token_features(self, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, positions: torch.Tensor,
                       key_mask: torch.Tensor | None, params) -> dict[str, torch.Tensor]:
        """Every per-token feature of the spec for the N tokens of the batch form (rows after the row maps,
        positions (B, N)), keyed ``"<kind>.<name>"``, each (B, H, N) in at least float32; cumulative ones summed
        along each row in position order (padding adds 0: the numerics contract keeps such sums in float32+)."""
        return self._features(TokenRows(qs, ks, vs, positions, key_mask, Dims(qs.shape[1], qs.shape[3],
                                                                              ks.shape[1])), params)

    def _features(self, rows: TokenRows, params, totals: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
        """The features of ``rows``' tokens; cumulative ones summed along the row, after the running ``totals``
        {name: (B, H)} of earlier tokens when given (decoding), which are then updated in place."""
        out: dict[str, torch.Tensor] = {}
        want = (rows.q.shape[0], rows.q.shape[1], rows.q.shape[2])
        for t in self.feature_transforms():
            for name, value in (t.features(rows, params[t.kind]) or {}).items():
                if tuple(value.shape) != want:
                    raise ValueError(f"transform '{t.kind}': feature '{name}' has shape {tuple(value.shape)}, "
                                     f"expected (B, H, N) = {want}")
                value = value.to(torch.promote_types(value.dtype, torch.float32))
                key = f"{t.kind}.{name}"
                if name in t.cumulative:
                    if rows.key_mask is not None:
                        value = value * rows.key_mask[:, None, :].to(value.dtype)
                    value = value.cumsum(dim=-1)
                    if totals is not None:
                        if key in totals:
                            value = value + totals[key].to(value.dtype)[..., None]
                        totals[key] = value[..., -1].detach()
                out[key] = value
        return out

    def allowed(self, ctx: Context, key_mask: torch.Tensor | None) -> torch.Tensor:
        """Which (query, key) pairs may attend: the spec's causal flag, every mask transform, the key mask."""
        allowed = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=ctx.qpos.device)
        if self.causal:
            allowed = allowed & (ctx.kpos <= ctx.qpos)
        for t in self.many(Slot.MASK):
            allowed = allowed & t.allowed(ctx)
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :]
        return allowed

    def selector_view(self, acc, allowed: torch.Tensor, ctx: Context):
        """The accumulator's heads as an index tensor, with ``allowed`` and ``ctx`` narrowed to them."""
        heads = acc.heads()
        index = torch.tensor(heads, device=ctx.qpos.device)
        narrowed = allowed.index_select(1, index) if allowed.shape[1] > 1 else allowed
        return index, narrowed, restrict_heads(ctx, heads)

    def selection(self, acc, qs: torch.Tensor, ks: torch.Tensor, allowed: torch.Tensor, ctx: Context, params,
                  scale: float) -> torch.Tensor:
        """The accumulator's selection S (B, 1, Nq, Nk) from the scaled rows qs (B, H, Nq, D) and ks (B, H_kv,
        Nk, D): the logits of its heads alone, through the logits slot."""
        index, sel_allowed, sel_ctx = self.selector_view(acc, allowed, ctx)
        kv_index = torch.div(index, ctx.dims.num_heads // ctx.dims.num_kv_heads, rounding_mode="floor")
        logits = (qs.index_select(1, index) @ ks.index_select(1, kv_index).transpose(-1, -2)) * scale
        for t in self.many(Slot.LOGITS):
            logits = t.apply(logits, sel_ctx, params[t.kind])
        return acc.selection(logits, sel_allowed, sel_ctx, params[acc.kind])

    def sink(self, heads: torch.Tensor, params, like: torch.Tensor) -> torch.Tensor | None:
        """The normaliser's sink logit of the query heads ``heads`` (1, H', 1, 1) in ``like``'s dtype, or None
        when the spec has no normaliser."""
        t = self.one(Slot.NORMALISER)
        return None if t is None else t.sink(heads, params[t.kind]).to(like.dtype)

    def earliest_key(self, query_position: int) -> int | None:
        """The smallest key position that queries at ``query_position`` or later may see under every mask (keys
        before it can be skipped), or None when no mask bounds it."""
        bounds = [b for t in self.many(Slot.MASK) if (b := t.earliest_key(query_position)) is not None]
        return max(bounds) if bounds else None

    def logit_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


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
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError("positions must be an integer tensor of 1-based positions")
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(batch, -1)
    if positions.shape != (batch, n):
        raise ValueError(f"positions must have shape ({n},) or ({batch}, {n}), got {tuple(positions.shape)}")
    positions = positions.to(device=device, dtype=torch.int64)
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
                             f"{row} goes from {before} to {int(positions[row, col])} at index {col}; restarting "
                             f"positions (packed documents) are not supported yet")
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

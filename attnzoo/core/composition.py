"""The pieces of the attention computation every fast backend computes the same way, on a
:class:`~attnzoo.plan.Plan`: the row maps of a slot, the transforms' context, per-token features, the allowed pairs,
the accumulator's selection, the sink, the masks' key bounds and the logit scale.

A ``Plan`` holds one (``plan.composition.row_scale(...)``); this module holds the numerics, ``attnzoo/plan.py`` the spec
resolved against the registry (the decoding sequence is :mod:`attnzoo.decode.step`'s),
``attnzoo/inputs.py`` the checks of a call's inputs. Part of :mod:`attnzoo.core`: it imports only the transforms'
types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..transforms.base import (
    Context,
    Dims,
    LogitsTransform,
    RowScaleTransform,
    Slot,
    TokenRows,
    Transform,
    restrict_heads,
)


@dataclass(frozen=True)
class Composition:
    """The backends' shared steps over a spec's transform instances: ``plan.composition`` of a
    :class:`~attnzoo.plan.Plan` (which builds it from the same transforms)."""

    transforms: list[Transform]
    by_slot: dict[Slot, list[Transform]]
    causal: bool
    scale: float | None

    def one(self, slot: Slot) -> Transform | None:
        items = self.by_slot.get(slot, [])
        return items[0] if items else None

    def many(self, slot: Slot) -> list[Transform]:
        return self.by_slot.get(slot, [])

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
                _check_scale(t, slot, scale, x)
                wide = torch.promote_types(x.dtype, scale.dtype)
                x = (x if x.dtype == wide else x.to(wide)) * scale.unsqueeze(-1)
            else:
                x = t.map(x, positions, group)
                if tuple(x.shape) != tuple(rows.shape):
                    raise ValueError(f"transform '{t.kind}' ({slot.value}) returned rows of shape {tuple(x.shape)} "
                                     f"for rows of shape {tuple(rows.shape)}: a row map must keep the shape")
            out = x if x.dtype == rows.dtype else x.to(rows.dtype)
        return out

    def context(self, qpos: torch.Tensor, kpos: torch.Tensor, dims: Dims,
                key_mask: torch.Tensor | None = None, query_features: dict[str, torch.Tensor] | None = None,
                key_features: dict[str, torch.Tensor] | None = None, heads: torch.Tensor | None = None) -> Context:
        """The broadcastable context of queries at qpos (B, Nq) against keys at kpos (B, 1 or H_kv, Nk), with the
        key mask (B, Nk) or None and the per-token features of the queries (B, H, Nq) and keys (B, H, Nk).
        ``heads`` is the (1, H, 1, 1) head index, for a caller that keeps one (a decode step)."""
        group = dims.num_heads // dims.num_kv_heads
        kpos_h = kpos.repeat_interleave(group, dim=1) if kpos.shape[1] > 1 else kpos
        if heads is None:
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
        return self.features_of(TokenRows(qs, ks, vs, positions, key_mask, Dims(qs.shape[1], qs.shape[3],
                                                                              ks.shape[1])), params)

    def features_of(self, rows: TokenRows, params, totals: dict[str, torch.Tensor] | None = None
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
                        # select, not multiply: a padding token's feature may be NaN (0 × NaN is NaN)
                        value = torch.where(rows.key_mask[:, None, :], value, torch.zeros((), dtype=value.dtype,
                                                                                          device=value.device))
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
            logits = checked_logits(t, t.apply(logits, sel_ctx, params[t.kind]), logits)
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


def _check_scale(t, slot, scale, rows) -> None:
    """A row scale is one number per row, (B, Hx, N) or broadcastable to it: anything else names the transform."""
    want = tuple(rows.shape[:-1])
    # each dimension of the scale, from the right, 1 or the rows' (torch.broadcast_shapes is a third of a decode
    # step's row maps on the CPU: its symbolic-shape guards)
    ok = (isinstance(scale, torch.Tensor) and scale.dim() <= len(want)
          and all(s == 1 or s == w for s, w in zip(reversed(scale.shape), reversed(want), strict=False)))
    if not ok:
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"transform '{t.kind}' ({slot.value}) returned a scale of shape {got} for rows of shape "
                         f"{tuple(rows.shape)}: a row scale is one number per row, shape {want} (or broadcastable)")


def checked_rows(t, what: str, out, want: tuple[int, ...]):
    """``out`` if probability transform ``t``'s ``what`` (weights, values, outputs) has shape ``want``, else one line
    naming it."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"transform '{t.kind}' ({t.slot.value}) returned {what} of shape {got}, expected "
                         f"{tuple(want)}")
    return out


def checked_logits(t, out, logits):
    """``out`` if transform ``t`` kept the logits' shape, else one line naming it."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(logits.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"transform '{t.kind}' ({t.slot.value}) returned logits of shape {got} for logits of shape "
                         f"{tuple(logits.shape)}: a logits transform must keep the shape")
    return out


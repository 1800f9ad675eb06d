"""Trace a non-finite result to the transform whose own maths produced it.

When a check meets NaN or inf, the suite replays the spec's transforms one slot at a time, with the reference's
torch maths, on the same inputs in the same dtype, and names the first transform that turns finite inputs into
non-finite values. That separates "the plugin's formula overflows (its own bug)" from "the backend disagrees".

What counts as non-finite: NaN and +/-inf anywhere in rows (query, key, value, output slots), features and the
accumulator's selection. In the logits, -inf is how a transform masks a pair, so a logits transform is named when it
gives NaN or +inf, or when it leaves a row whose allowed pairs (the spec's masks, causality and the key mask:
``plan.composition.allowed``) are all -inf although one of them was finite before it. Such a row is 0/0 in the
softmax (NaN), unless the spec has a normaliser (a sink), whose extra logit keeps every row finite, or another
probability map than the softmax. A -inf at some allowed pairs of a row, or at pairs the masks exclude anyway, is
never blamed. A probability map is named when its weights are non-finite on finite logits.
"""

from __future__ import annotations

import torch

from ..transforms.base import Dims, Slot


def _bad(t: torch.Tensor, allow_neg_inf: bool = False) -> bool:
    if allow_neg_inf:
        return bool((torch.isnan(t) | torch.isposinf(t)).any())
    return not bool(torch.isfinite(t).all())


def _emptied_row(before: torch.Tensor, after: torch.Tensor, allowed: torch.Tensor) -> tuple | None:
    """The (b, h, i) of the first row whose allowed logits are all -inf in ``after`` but not in ``before``, or None
    (a row with no allowed pair is a masked row: it gives zeros, whatever its logits)."""
    allowed = allowed.expand_as(after)
    dead = lambda x: (torch.isneginf(x) | ~allowed).all(-1)  # noqa: E731
    hits = (dead(after) & ~dead(before)).nonzero()
    return tuple(int(i) for i in hits[0].tolist()) if len(hits) else None


def culprit(plan, q, k, v, params, positions, key_mask=None) -> str | None:
    """The first transform whose own maths gives non-finite values on these inputs, as one phrase, or None.

    q (B, H, N, D); k, v (B, H_kv, N, D), all of one dtype; params grouped per transform kind (as backends get
    them); positions (B, N) int64; key_mask (B, N) bool or None. Logits may be -inf (a mask), never NaN or +inf.
    """
    dtype = str(q.dtype).removeprefix("torch.")
    pos = positions.unsqueeze(1)
    rows = {}
    with torch.no_grad():
        for slot, x in ((Slot.QUERY, q), (Slot.KEY, k), (Slot.VALUE, v)):
            scaled = plan.composition.row_scale(slot, x, pos, params)
            t = plan.one(slot)
            if t is not None and not _bad(x) and _bad(scaled):
                return f"transform '{t.kind}' ({slot.value} slot) gives non-finite values in {dtype}"
            rows[slot] = scaled
        qs, ks = rows[Slot.QUERY], rows[Slot.KEY]
        dims = Dims(q.shape[1], q.shape[3], k.shape[1])
        features = plan.composition.token_features(qs, ks, rows[Slot.VALUE], positions, key_mask, params)
        bad = next((name for name, f in features.items() if _bad(f)), None)
        if bad is not None:
            return f"transform '{bad.split('.')[0]}' gives a non-finite feature '{bad.split('.', 1)[1]}' in {dtype}"
        ctx = plan.composition.context(positions, pos, dims, key_mask, features, features)
        group = dims.num_heads // dims.num_kv_heads
        logits = (qs @ ks.repeat_interleave(group, dim=1).transpose(-1, -2)) * plan.logit_scale(dims.head_dim)
        allowed = plan.composition.allowed(ctx, key_mask)
        # a sink keeps every row finite; a probability map other than the softmax has no 0/0 to fear
        sink = plan.one(Slot.NORMALISER) is not None or plan.one(Slot.PROBABILITY) is not None
        for t in plan.many(Slot.LOGITS):
            before = _bad(logits, allow_neg_inf=True)
            previous, logits = logits, t.apply(logits, ctx, params[t.kind])
            if not before and _bad(logits, allow_neg_inf=True):
                return f"transform '{t.kind}' (logits slot) gives non-finite logits in {dtype}"
            row = None if before or sink else _emptied_row(previous, logits, allowed)
            if row is not None:
                b, h, i = row
                return (f"transform '{t.kind}' (logits slot) gives -inf at every pair of a row the spec's masks "
                        f"allow (query position {int(positions[b, i])}, batch row {b}, head {h}), so the row's "
                        f"softmax is 0/0, in {dtype}")
        acc = plan.one(Slot.ACCUMULATOR)
        if acc is not None and not _bad(logits, allow_neg_inf=True):
            index, sel_allowed, sel_ctx = plan.composition.selector_view(acc, allowed, ctx)
            selection = acc.selection(logits.index_select(1, index), sel_allowed, sel_ctx, params[acc.kind])
            if _bad(selection):
                return f"transform '{acc.kind}' (accumulator slot) gives a non-finite selection in {dtype}"
        mapped = plan.one(Slot.PROBABILITY)
        if mapped is not None and not _bad(logits, allow_neg_inf=True):
            if _bad(mapped.weights(logits, allowed, ctx, params[mapped.kind])):
                return f"transform '{mapped.kind}' (probability slot) gives non-finite weights in {dtype}"
        t = plan.one(Slot.OUTPUT)
        if t is not None:
            probe = torch.ones_like(q)
            if _bad(plan.composition.row_scale(Slot.OUTPUT, probe, pos, params)):
                return f"transform '{t.kind}' (output slot) gives non-finite values in {dtype}"
    return None

"""The reference backend: plain eager torch that materialises everything. It defines the truth.

Small and obviously correct on purpose; it imports nothing from the fast backends. float64, float32, float16 and
bfloat16 (the dtypes torch computes matmul and softmax in; others are declined with a reason), any device, autograd
through everything (q, k, v and every transform parameter).
"""

from __future__ import annotations

import torch

from ..core.composition import checked_logits, checked_rows
from ..transforms.base import Dims, Slot
from .base import Backend, HeldAttention, Mode, eager_dtype_reasons


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; a row with no allowed entry gives zeros (not NaN).

    ``sink`` (broadcastable to (B, H, Nq, 1)): one more logit in every row's denominator, attending to nothing
    (the normaliser slot); the weights of the real keys then sum to less than 1."""
    allowed = allowed.expand_as(logits)
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    safe = torch.where(allowed, logits, neg_inf)
    if sink is not None:  # the sink's column is always finite: no row is empty
        column = sink.to(logits.dtype).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([safe, column], dim=-1), dim=-1)[..., :-1]
        return torch.where(allowed, probs, zero)
    has_any = allowed.any(-1, keepdim=True)
    safe = torch.where(has_any, safe, zero)
    probs = torch.softmax(safe, dim=-1)
    return torch.where(allowed, probs, zero)


def weigh(weights: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[..., i, j] * rows[..., j, :]`` over the pairs ``allowed`` lets attend, and nothing from the
    others whatever their rows hold (a padding token's value may be NaN: a masked pair is selected out, never
    multiplied by 0). With finite rows, ``weights @ rows`` (``weights`` is 0 at every excluded pair, and 0 times a
    finite number is 0); else the products taken pair by pair, a few keys at a time."""
    if bool(torch.isfinite(rows).all()):
        return weights @ rows
    allowed = allowed.expand(weights.shape)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    out = None
    for first in range(0, weights.shape[-1], 8):
        keys = slice(first, first + 8)
        terms = weights[..., keys, None] * rows[..., None, keys, :]  # (..., Nq, keys, D)
        part = torch.where(allowed[..., keys, None], terms, zero).sum(-2)
        out = part if out is None else out + part
    return out


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    summary = "eager torch, materialises H·N² logits; the truth every backend is checked against"
    modes = frozenset(Mode)

    def supports(self, plan, device, dtype, mode):
        return eager_dtype_reasons(dtype)

    # The pieces below are methods so that tests can build deliberately broken backends by overriding one.
    def accumulate(self, selection: torch.Tensor) -> torch.Tensor:
        """F[i] = sum of S over strictly earlier queries: a shifted cumulative sum along the QUERY axis (dim 2).

        selection S (B, 1, Nq, Nk) in the input dtype → F of the same shape in the accumulator's dtype (at least
        float32: the numerics contract, docs/backends.md)."""
        wide = selection.to(torch.promote_types(selection.dtype, torch.float32))  # written here: the oracle
        return torch.nn.functional.pad(wide[:, :, :-1].cumsum(dim=2), (0, 0, 1, 0))

    def query_positions(self, cache, count: int, batch: int) -> torch.Tensor:
        """Absolute positions of the ``count`` tokens just appended to ``cache``: (B, count)."""
        return cache.query_positions(count, batch)

    def carry(self, cache) -> torch.Tensor | None:
        """The running F of every cached token (B, M), or None without an accumulator."""
        return cache.accumulated()

    def attend(self, plan, q, k, v, qpos, kpos, params, key_mask=None, carry=None, held=False,
               features=None, query_mask=None):
        """The whole composition for queries at ``qpos`` against keys at ``kpos``.

        q (B, H, Nq, D); k, v (B, H_kv, Nk, D); qpos (B, Nq); kpos (B, 1 or H_kv, Nk); key_mask (B, Nk) or None;
        carry (B, Nk): the accumulator's F from queries before this call (decoding, chunks), or None;
        ``held``: a decoding step's rows (``attend_held``): q, k and v already went through the query, key and
        value slots (the step admitted them, the cache stores them so) and the output slot is the step's;
        ``features``: (the queries', the keys') per-token features {name: (B, H, N)} when the queries are not the
        keys (decoding; the batch form computes them here); ``query_mask`` (B, Nq) or None: False for a padding
        query, which selects nothing (its selection would reach the real queries after it through F).
        Returns (out (B, H, Nq, D), probs (B, H, Nq, Nk), S (B, 1, Nq, Nk) or None, F (B, 1, Nq, Nk) or None);
        with a probability transform, ``probs`` are its weights (``ProbabilityTransform.weights``) and the output is
        ``combine(weights @ values(v'))``.
        """
        b, h, nq, d = q.shape
        hkv = k.shape[1]
        dims = Dims(num_heads=h, head_dim=d, num_kv_heads=hkv)

        qs = q if held else plan.composition.row_scale(Slot.QUERY, q, qpos.unsqueeze(1), params)
        ks = k if held else plan.composition.row_scale(Slot.KEY, k, kpos, params)
        vs = v if held else plan.composition.row_scale(Slot.VALUE, v, kpos, params)
        # the batch form: queries and keys are the same tokens
        if features is None and plan.composition.feature_transforms():
            features = (plan.composition.token_features(qs, ks, vs, qpos, key_mask, params),) * 2
        group = h // hkv
        ks = ks.repeat_interleave(group, dim=1)
        vs = vs.repeat_interleave(group, dim=1)
        ctx = plan.composition.context(qpos, kpos, dims, key_mask, *(features or ({}, {})))

        logits = (qs @ ks.transpose(-1, -2)) * plan.logit_scale(d)
        for t in plan.many(Slot.LOGITS):
            logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
        allowed = plan.composition.allowed(ctx, key_mask)

        selection = accumulated = None
        acc = plan.one(Slot.ACCUMULATOR)
        if acc is not None:
            selecting = allowed if query_mask is None else allowed & query_mask[:, None, :, None]
            index, sel_allowed, sel_ctx = plan.composition.selector_view(acc, selecting, ctx)
            selection = acc.selection(logits.index_select(1, index), sel_allowed, sel_ctx, params[acc.kind])
            accumulated = self.accumulate(selection)
            if carry is not None:
                accumulated = accumulated + carry[:, None, None, :]
            # subtract in F's (wider) dtype, round the logits once
            logits = (logits.to(accumulated.dtype) - accumulated).to(logits.dtype)

        mapped = plan.one(Slot.PROBABILITY)
        if mapped is None:
            probs = masked_softmax(logits, allowed, plan.composition.sink(ctx.heads, params, logits))
            out = weigh(probs, vs, allowed)
        else:  # another row map in place of the softmax (docs/specs.md, "The probability slot")
            own = params[mapped.kind]
            probs = checked_rows(mapped, "weights", mapped.weights(logits, allowed, ctx, own), logits.shape)
            read = mapped.values(vs, own)
            checked_rows(mapped, "values", read, (*vs.shape[:-1], read.shape[-1]))
            out = mapped.combine(weigh(probs, read.to(probs.dtype), allowed), own)
            out = checked_rows(mapped, "outputs", out, qs.shape)
            out = out.to(qs.dtype)
        if not held:
            out = plan.composition.row_scale(Slot.OUTPUT, out, qpos.unsqueeze(1), params)
        return out, probs, selection, accumulated

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        out, _, _, accumulated = self.attend(plan, q, k, v, positions, positions.unsqueeze(1), params, key_mask,
                                             **_selecting(plan, key_mask))
        if return_accumulated:
            return out, (accumulated[:, 0] if accumulated is not None else None)
        return out

    def attend_held(self, plan, step, cache, params, *, want_probs=False):
        count, batch = step.queries.shape[2], step.queries.shape[0]
        qpos = self.query_positions(cache, count, batch)
        out, probs, selection, _ = self.attend(plan, step.queries, cache.keys, cache.values, qpos, cache.positions,
                                               params, key_mask=cache.key_mask(), carry=self.carry(cache),
                                               held=True, features=(step.features, cache.key_features()),
                                               **_selecting(plan, cache.query_mask()))
        # the new queries' selections are summed in the cache's (at least float32) dtype, never in the input's
        total = None
        if selection is not None:
            carry = cache.accumulated()
            total = carry + selection.to(carry.dtype).sum(dim=2)[:, 0]
        # the oracle hands every row's probabilities, whatever ``want_probs`` asks: the step gives the evictor its
        # real rows, of which it reads the last ``probability_rows`` (a fast backend computes only those:
        # tests/decode/test_prefill_rows.py)
        return HeldAttention(out, total, probs if want_probs is not False else None)


def _selecting(plan, query_mask) -> dict:
    """``attend``'s ``query_mask`` where it matters (an accumulator, some padding query), else nothing: a subclass
    that overrides ``attend`` with the older signature keeps working for every other spec."""
    if query_mask is None or plan.one(Slot.ACCUMULATOR) is None:
        return {}
    return {"query_mask": query_mask}

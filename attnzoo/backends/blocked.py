"""The blocked backend: portable, memory-efficient torch for CPU and GPU, with autograd.

Queries are processed in blocks of ``block_size``; keys beyond the last causally visible one are skipped; no
N×N tensor per head is ever held. The accumulator (selective attention) keeps a running carry: the column sums
of the selection over earlier query blocks, O(N) per batch row, plus the within-block cumulative sum. With
gradients, each block is checkpointed (recomputed in the backward pass), so training memory stays
O(H · block · N); the carry chain carries the gradient back into earlier blocks' selector logits.

Fast paths: a spec with only row scales (SSA temperatures) and a causal mask is one call to
``torch.nn.functional.scaled_dot_product_attention`` on the scaled rows; an accumulator whose selection is
pointwise in one selector head's logits (``AccumulatorTransform.pointwise``: ``selective_mask``, or a plugin's)
under a plain causal mask runs the fused kernel of ``selective_kernel.py`` (CPU, float32 and float64); logits
transforms that are all separable (a query term plus a key term: ALiBi, the forgetting gate) fold their key terms
into the keys as one more dimension and stay one causal SDPA call (``_key_bias_sdpa``); other blocks without
logits transforms hand their mask (−F and −inf) to SDPA as an additive float mask; the rest runs eager per block.

A probability transform (another row map in place of the softmax: ``ProbabilityTransform``) whose map is the softmax
itself (``softmax_map``: ``diff``) takes the softmax's paths above over the rows ``values(v)`` gives (wider values
go through SDPA a slice of D at a time), then ``combine``. A causal map declared sigmoid (``ProbabilityTransform.
pointwise``, ``declared_map``: ``sigmoid``, or a plugin's, whatever its class) with nothing but row scales, at
consecutive positions, in float32/float64, is one autograd node (``sigmoid_blocks.py``: no row statistics, so each
query block is two products and an in-place sigmoid, and its backward recomputes the block). Every other map takes
none of the fast paths: each query block runs :meth:`BlockedBackend.mapped_block`, a generic loop over key blocks of
``block_size`` that hands each block's logits (after the logits slot and the accumulator's -F), allowed pairs and
values (through the map's ``values``) to the map's blocked form (``start``, ``update``, ``finish``), then its
``combine``; each of the three that declares a parameter ``step`` also gets the query block's ``MapStep`` (the number
of keys each query sees over all the key blocks, counted once per query block), so that a map scaled by that count
(SSMax) merges its blocks in one pass. How the built-in maps merge blocks: ``sigmoid`` needs no normalisation, its
blocks' weighted values just add; ``softpick`` keeps a running shift m = max(0, the largest logit so far) and rescales
its numerator and denominator sums by e^(m_old - m_new) as flash attention does for the softmax; ``stick_breaking``
visits the key blocks from the nearest back (``order = "reverse"``) and carries the running sum of log(1 - sigmoid) of
the later keys, which every earlier key's weight is multiplied by (exact: the same sums, grouped by block); ``diff``'s
blocked form (per-head softmaxes merged with a running maximum) is not taken here: its softmaxes take the paths above.
The query blocks are checkpointed as usual, so training memory stays O(H · block · N). Decoding takes the same blocks (a
map never takes the one-query softmax step, nor a fast step).

This module never imports the reference backend (it computes the same function independently).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.composition import checked_logits, checked_rows
from ..core.numerics import accumulator_dtype, all_finite, f_from_s, subtract_f, weighted_rows
from ..decode import fast
from ..decode.fast import plain_one
from ..decode.step import QueryRows
from ..transforms.base import Context, Dims, MapStep, Slot, declared_map, declared_pointwise
from .base import Backend, HeldAttention, Mode, eager_dtype_reasons
from .selective_kernel import PREFILL_BLOCK, SelectiveCausal, selective_prefill
from .sigmoid_blocks import SigmoidCausal
from .softmax_maps import joined, other_map, softmax_map_combine, softmax_map_rows, value_slices

#: the largest key term (after centring) folded into the keys: the logit's rounding grows with it (float32 rounds
#: a term of 256 to about 1.5e-5, below the conformance floor); past it the blocks take the additive mask instead
_FOLDED_RANGE = {torch.float32: 256.0, torch.float64: 1e9}
#: the dtypes the fused CPU selective kernel (selective_kernel.py) runs in: its forward fails on float16 and bfloat16
#: (``torch.neg`` into its float32 -F buffer), so those take the blocks below
_FUSED_DTYPES = (torch.float32, torch.float64)
#: sigmoid_blocks.py's query block: 128 measured faster than 256 and 512 (forward, float32, B1 H8 D64, N = 4096, 2
#: threads, one ad-hoc run: about 1.15x, 1.25x and 1.6x SDPA's time; less of the diagonal block computed and
#: discarded, the N-wide tile in cache); make bench-probability then measured the node at 128
_SIGMOID_BLOCK = 128


def fusable_pointwise(acc):
    """The accumulator's pointwise selection when the fused CPU kernel can take it (one selector head, no
    parameters, a declaration that describes its class's selection: ``declared_pointwise``), else None."""
    return declared_pointwise(acc)


def sdpa(q, k, v, **kwargs):
    """``scaled_dot_product_attention`` for values as wide as the queries or wider (a softmax map's ``values``):
    wider values go through in slices of the queries' width (``softmax_maps.value_slices``), each a call of the fused
    kernel (CPU SDPA takes its slow path when the value width differs from the key width)."""
    if v.shape[-1] == q.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    outs = [F.scaled_dot_product_attention(q, k, piece, **kwargs) for piece in value_slices(v, q.shape[-1])]
    return joined(outs, v.shape[-1])


def _step_for(mapped, method: str, step: MapStep | None) -> dict:
    """The keyword ``step`` for a probability map's blocked-form ``method`` when it declares it (``takes_step``)."""
    return {"step": step} if method in mapped.takes_step else {}


def consecutive_positions(positions: torch.Tensor) -> bool:
    """Positions p0, p0 + 1, ... with the same p0 in every batch row (index causality == position causality)."""
    n = positions.shape[-1]
    steps = torch.arange(n, device=positions.device)
    return bool((positions == positions[:1, :1] + steps).all())


class BlockedBackend(Backend):
    name = "blocked"
    priority = 10  # measured (benchmarks/, CPU): 1.0-1.6x SDPA forward on the shipped specs, the fastest here
    summary = "query blocks, causal block skipping, O(N) accumulator carry, checkpointed backward"

    def __init__(self, block_size: int = 256, name: str = "blocked") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.name = name
        self._decode_consts: dict = {}

    modes = frozenset(Mode)

    def supports(self, plan, device, dtype, mode):
        reasons = eager_dtype_reasons(dtype)
        mapped = plan.one(Slot.PROBABILITY)
        if mapped is not None and not mapped.has_blocked_form():
            reasons.append(f"transform '{mapped.kind}' (probability) has no blocked form (start, update, finish): "
                           "the reference computes it")
        return reasons

    # -- batch form ---------------------------------------------------------------------------------------------
    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        d = q.shape[-1]
        qs = plan.composition.row_scale(Slot.QUERY, q, positions.unsqueeze(1), params)
        ks = plan.composition.row_scale(Slot.KEY, k, positions.unsqueeze(1), params)
        vs = plan.composition.row_scale(Slot.VALUE, v, positions.unsqueeze(1), params)
        raw = (ks, vs)  # the per-token features read the keys and values as the value slot leaves them
        ks, vs, _ = softmax_map_rows(plan, ks, vs, None, q.shape[1], params)
        mapped = other_map(plan)
        # a NaN or infinite value must reach only the queries allowed to see it: the kernels below weigh every
        # value of a block, masked pairs by 0 (0 × NaN is NaN), so such values take the eager blocks (weighted_rows)
        finite = all_finite(vs)
        plain = (finite and key_mask is None and not plan.many(Slot.LOGITS) and not plan.many(Slot.MASK)
                 and plan.one(Slot.NORMALISER) is None and plan.causal and consecutive_positions(positions)
                 and not return_accumulated)
        simple = plain and mapped is None
        acc = plan.one(Slot.ACCUMULATOR)
        if simple and acc is None:
            out = sdpa(qs, ks, vs, is_causal=True, scale=plan.logit_scale(d), enable_gqa=q.shape[1] != k.shape[1])
            accumulated = None
        elif (plain and acc is None and qs.dtype in _FUSED_DTYPES and (declared := declared_map(mapped)) is not None
              and declared.function == "sigmoid"):
            # a map declared sigmoid (any class), causal, nothing but row scales: one autograd node (sigmoid_blocks.py)
            bias = declared.row_bias(positions[0], qs.dtype)
            offset = params[mapped.kind][declared.offset] if declared.offset is not None else None
            block = min(self.block_size, _SIGMOID_BLOCK)
            out = SigmoidCausal.apply(qs, ks, vs, bias, offset, plan.logit_scale(d), block)
            accumulated = None
        elif (simple and qs.device.type == "cpu" and qs.dtype in _FUSED_DTYPES and vs.shape[-1] == d
              and (pointwise := fusable_pointwise(acc)) is not None):
            out = SelectiveCausal.apply(qs, ks, vs, plan.logit_scale(d), acc.heads()[0], pointwise,
                                        int(positions[0, 0]), self.block_size)
            accumulated = None
        else:
            features = plan.composition.token_features(qs, *raw, positions, key_mask, params)  # once, for either path
            out = (self._key_bias_sdpa(plan, qs, ks, vs, positions, key_mask, params, return_accumulated, features)
                   if finite else None)
            accumulated = None
        if out is None:
            out, accumulated, _, _ = self.blocks(plan, qs, ks, vs, positions, positions.unsqueeze(1), params,
                                               key_mask, None, return_accumulated, features=features,
                                               query_mask=key_mask)
        out = softmax_map_combine(plan, out, q.shape, params)
        out = plan.composition.row_scale(Slot.OUTPUT, out, positions.unsqueeze(1), params)
        return (out, accumulated) if return_accumulated else out

    def _key_bias_sdpa(self, plan, qs, ks, vs, positions, key_mask, params, return_accumulated, features):
        """Every logits transform separable (``LogitsTransform.separable``), nothing else but row maps, a causal
        spec at consecutive positions, float32/64: the key terms ``col`` summed are folded into the keys as one
        more dimension, ``q'' = [q, 1]``, ``k'' = [k, col / scale]``, ``v'' = [v, 0]``, and the whole call is one
        causal SDPA (the query terms are per-row constants: they cancel in the softmax, and in its gradient).
        ``col`` is centred per head first; where it still spans more than ``_FOLDED_RANGE`` (the logits' rounding
        would grow with it) this returns None and the blocks run instead."""
        transforms = plan.many(Slot.LOGITS)
        if (not transforms or key_mask is not None or return_accumulated or plan.many(Slot.MASK)
                or plan.one(Slot.ACCUMULATOR) is not None or plan.one(Slot.NORMALISER) is not None
                or other_map(plan) is not None or not plan.causal or qs.dtype not in _FOLDED_RANGE
                or not consecutive_positions(positions)):
            return None
        b, h, n, d = qs.shape
        ctx = plan.composition.context(positions, positions.unsqueeze(1), Dims(h, d, ks.shape[1]), None, features,
                                       features)
        col = torch.zeros((), dtype=qs.dtype, device=qs.device)
        for t in transforms:
            terms = t.separable(ctx, params[t.kind], qs.dtype)
            if terms is None:
                return None
            col = col + terms[1]
        col = col.expand(b, h, 1, n)[:, :, 0]
        centre = ((col.amax(-1, keepdim=True) + col.amin(-1, keepdim=True)) / 2).detach()
        col = col - centre
        if float(col.detach().abs().max()) > _FOLDED_RANGE[qs.dtype]:
            return None
        scale = plan.logit_scale(d)
        if ks.shape[1] != h:  # the key column is per query head
            ks, vs = ks.repeat_interleave(h // ks.shape[1], dim=1), vs.repeat_interleave(h // vs.shape[1], dim=1)
        q2 = torch.cat([qs, qs.new_ones(b, h, n, 1)], dim=-1)
        k2 = torch.cat([ks, (col / scale).unsqueeze(-1)], dim=-1)
        v2 = F.pad(vs, (0, 1))
        return sdpa(q2, k2, v2, is_causal=True, scale=scale)[..., :vs.shape[-1]]

    def attend_rows(self, plan, qs, ks, vs, qpos, kpos, params, key_mask=None):
        """The contract's :meth:`~attnzoo.core.contract.Backend.attend_rows`: :meth:`blocks` with no carry."""
        return self.blocks(plan, qs, ks, vs, qpos, kpos, params, key_mask, None)[0]

    def blocks(self, plan, qs, ks, vs, qpos, kpos, params, key_mask, carry, return_accumulated=False,
               want_probs=False, use_sdpa=True, features=None, key_features=None, query_mask=None):
        """Attention of scaled rows in query blocks. qs (B, H, Nq, D); ks, vs (B, H_kv, Nk, D); qpos (B, Nq);
        kpos (B, 1 or H_kv, Nk) ascending; carry (B, Nk) or None; features: the queries' per-token features
        (B, H, Nq) by name, or None; key_features: the keys' (B, H, Nk), or None for the batch form's (queries
        and keys are the same tokens); query_mask (B, Nq): False for a padding query, which selects nothing, or
        None. Returns (out, F or None, carry, probs or None).

        The carry and F are in ``accumulator_dtype(qs.dtype)`` (at least float32: the numerics contract). SDPA takes
        a block's additive mask only over finite keys and values (``all_finite``), for every caller: a masked pair
        must add nothing, whatever its key or value holds."""
        b, h, nq, d = qs.shape
        nk = ks.shape[2]
        acc = plan.one(Slot.ACCUMULATOR)
        wide = accumulator_dtype(qs.dtype)
        if acc is not None and carry is None:
            carry = torch.zeros(b, nk, dtype=wide, device=qs.device)
        # every element must be written: a missed one stays NaN; as wide as the values (a softmax map's may be wider),
        # laid out as the queries where the widths agree (a host that views the output may rely on it)
        out = (torch.full_like(qs, float("nan")) if vs.shape[-1] == d
               else qs.new_full((*qs.shape[:-1], vs.shape[-1]), float("nan")))
        accumulated = (torch.zeros(b, nq, nk, dtype=wide, device=qs.device)
                       if return_accumulated and acc is not None else None)
        probs = qs.new_zeros(b, h, nq, nk) if want_probs else None
        grad = _wants_grad(qs, ks, vs, params)
        finite_values = all_finite(vs)  # once per call: a block's eager path weighs non-finite values by selection
        use_sdpa = use_sdpa and finite_values and all_finite(ks)
        step = self.block_size
        for start in range(0, nq, step):
            stop = min(start + step, nq)
            qpos_blk = qpos[:, start:stop]
            # keys after the last position this block can see, and before the first one any mask lets it see,
            # are skipped (kpos ascending along Nk)
            visible = int((kpos <= qpos_blk.max()).sum(-1).max()) if plan.causal else nk
            visible = max(visible, 1)
            earliest = plan.composition.earliest_key(int(qpos_blk.min()))
            first = min(int((kpos < earliest).sum(-1).min()), visible - 1) if earliest is not None else 0
            keys = slice(first, visible)
            args = (qs[:, :, start:stop], ks[:, :, keys], vs[:, :, keys], qpos_blk,
                    kpos[..., keys], key_mask[:, keys] if key_mask is not None else None,
                    carry[:, keys] if carry is not None else None,
                    {n: t[:, :, start:stop] for n, t in (features or {}).items()},
                    {n: t[:, :, keys] for n, t in (key_features if key_features is not None else features or {}
                                                   ).items()})

            def block(*a, _plan=plan, _params=params,
                      _queries=query_mask[:, start:stop] if query_mask is not None and acc is not None else None):
                if other_map(_plan) is not None:
                    return self.mapped_block(_plan, _params, *a, want_probs=want_probs, query_mask=_queries,
                                             finite_values=finite_values)
                return self.block(_plan, _params, *a, want_probs=want_probs, use_sdpa=use_sdpa, query_mask=_queries,
                                  finite_values=finite_values)

            if grad:
                o, f_blk, colsum, p = checkpoint(block, *args, use_reentrant=False)
            else:
                o, f_blk, colsum, p = block(*args)
            out[:, :, start:stop] = o
            if carry is not None:
                carry = torch.cat([carry[:, :first], carry[:, keys] + colsum, carry[:, visible:]], dim=1)
            if accumulated is not None:
                accumulated[:, start:stop, keys] = f_blk
            if probs is not None:
                probs[:, :, start:stop, keys] = p
        return out, accumulated, carry, probs

    def block(self, plan, params, q, k, v, qpos, kpos, key_mask, carry, query_features=None, key_features=None,
              want_probs=False, use_sdpa=True, query_mask=None, finite_values=None):
        """One query block against its visible keys (with the features of its queries and keys, (B, H, Bq) and
        (B, H, Bk) by name). ``finite_values``: whether every value is finite, when the caller knows (else checked
        here). Returns (out, F, column sums of S, probs or None); F and the column sums in
        ``accumulator_dtype(q.dtype)``, like the carry."""
        b, h, nq, d = q.shape
        hkv = k.shape[1]
        group = h // hkv
        scale = plan.logit_scale(d)
        ctx = plan.composition.context(qpos, kpos, Dims(h, d, hkv), key_mask, query_features, key_features)
        allowed = plan.composition.allowed(ctx, key_mask)

        f_blk = colsum = None
        acc = plan.one(Slot.ACCUMULATOR)
        if acc is not None:
            selecting = allowed if query_mask is None else allowed & query_mask[:, None, :, None]  # padding: none
            s = plan.composition.selection(acc, q, k, selecting, ctx, params, scale)  # (B, 1, Bq, Nk)
            f_blk = f_from_s(s, carry)[:, 0]  # sums over queries in at least float32 (numerics contract)
            colsum = s.to(f_blk.dtype).sum(dim=2)[:, 0]

        allowed = allowed.expand(b, allowed.shape[1], nq, allowed.shape[-1])
        has_key = allowed.any(-1, keepdim=True)
        sink = plan.composition.sink(ctx.heads, params, q)  # (1, H, 1, 1) or None
        biases = [t.bias(ctx, params[t.kind], q.dtype) for t in plan.many(Slot.LOGITS)]
        if use_sdpa and not want_probs and all(bias is not None for bias in biases):
            # every logits transform is additive: the whole block is SDPA with a float mask
            zero = torch.zeros((), dtype=q.dtype, device=q.device)
            total = sum(biases, zero) if f_blk is None else sum(biases, -f_blk[:, None])
            mask = torch.where(allowed, total.to(q.dtype), float("-inf"))
            if sink is not None:
                # the sink is one more key: its key row gives logit 0 and its value row is 0, the mask adds the
                # sink logit (no row is then empty)
                mask = torch.cat([mask.expand(b, h, nq, mask.shape[-1]), sink.expand(b, h, nq, 1)], dim=-1)
                k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
                out = sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
                return out, f_blk, colsum, None
            every = bool(has_key.all())  # the usual case (a causal prompt: each row sees its own key)
            if not every:
                mask = torch.where(has_key, mask, zero)  # a row with no key: any finite row, zeroed below
            out = sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            return (out if every else torch.where(has_key, out, zero)), f_blk, colsum, None

        # eager: logits of all heads, grouped so that each key/value head is read once
        logits = (q.reshape(b, hkv, group * nq, d) @ k.transpose(-1, -2)).reshape(b, h, nq, -1) * scale
        for t in plan.many(Slot.LOGITS):
            logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
        if f_blk is not None:  # subtract in F's (wider) dtype, round the logits once
            logits = subtract_f(logits, f_blk[:, None])
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sink is not None:
            column = sink.expand(b, h, nq, 1)
            p = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1].masked_fill(~allowed, 0.0)
        else:
            p = torch.softmax(logits.masked_fill(~has_key, 0.0), dim=-1).masked_fill(~allowed, 0.0)
        weights = p.reshape(b, hkv, group * nq, -1)
        if finite_values if finite_values is not None else all_finite(v):
            out = weights @ v
        else:  # a masked pair adds nothing, whatever its value (0 × NaN is NaN)
            out = weighted_rows(weights, v, allowed.expand(b, h, nq, -1).reshape(b, hkv, group * nq, -1))
        return out.reshape(b, h, nq, v.shape[-1]), f_blk, colsum, (p if want_probs else None)

    def mapped_block(self, plan, params, q, k, v, qpos, kpos, key_mask, carry, query_features=None,
                     key_features=None, want_probs=False, query_mask=None, finite_values=None):
        """One query block against its visible keys under a probability transform: the keys in blocks of
        ``block_size`` (from the nearest back for a map of ``order = "reverse"``), each block's logits through the
        logits slot and -F, merged by the map's blocked form, then ``combine``. Returns what :meth:`block` does."""
        mapped = plan.one(Slot.PROBABILITY)
        own = params[mapped.kind]
        if want_probs:  # spec validation refuses evictors that read probabilities with a probability map
            raise ValueError(f"transform '{mapped.kind}' (probability) has no attention probabilities to hand to an "
                             "evictor")
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        group = h // hkv
        scale = plan.logit_scale(d)
        dims = Dims(h, d, hkv)
        query_features, key_features = query_features or {}, key_features or {}
        if mapped.order == "reverse" and nk > 1 and not bool((kpos[..., 1:] >= kpos[..., :-1]).all()):
            raise ValueError(f"transform '{mapped.kind}' visits key blocks by position, and the keys are not in "
                             "position order")
        f_blk = colsum = step = whole = None
        acc = plan.one(Slot.ACCUMULATOR)
        if acc is not None or mapped.takes_step:  # the context over every visible key at once
            ctx = plan.composition.context(qpos, kpos, dims, key_mask, query_features, key_features)
            everywhere = plan.composition.allowed(ctx, key_mask)
            whole = (ctx, everywhere)  # the one key block's, when there is one
        if mapped.takes_step:  # the step's context, for the blocked-form methods that declare ``step``
            counts = everywhere.expand(b, everywhere.shape[1], nq, nk).sum(-1, keepdim=True)
            step = MapStep(visible=counts.to(accumulator_dtype(q.dtype)).expand(b, h, nq, 1), qpos=ctx.qpos,
                           dims=dims)
        if acc is not None:  # the selection over every visible key at once, as block() computes it
            selecting = everywhere
            if query_mask is not None:  # a padding query selects nothing
                selecting = selecting & query_mask[:, None, :, None]
            s = plan.composition.selection(acc, q, k, selecting, ctx, params, scale)
            f_blk = f_from_s(s, carry)[:, 0]
            colsum = s.to(f_blk.dtype).sum(dim=2)[:, 0]
        vs = v.repeat_interleave(group, dim=1) if group > 1 else v
        if nk <= self.block_size or not (finite_values if finite_values is not None else all_finite(vs)):
            # the map's weights over every visible key at once (its reference form, which its blocked form equals:
            # the conformance suite checks that): for one key block, where the blocked form's start/update/finish
            # would only add their own cost (issue 54: SSMax at N = 256 took 1.26x the reference's time), and for a
            # NaN or infinite value, each masked pair selected out (a map's blocked form weighs a block's values by
            # 0 there: 0 × NaN is NaN)
            ctx = plan.composition.context(qpos, kpos, dims, key_mask, query_features, key_features)
            logits = (q.reshape(b, hkv, group * nq, d) @ k.transpose(-1, -2)).reshape(b, h, nq, -1) * scale
            for t in plan.many(Slot.LOGITS):
                logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
            if f_blk is not None:
                logits = subtract_f(logits, f_blk[:, None])
            allowed = plan.composition.allowed(ctx, key_mask)
            weights = checked_rows(mapped, "weights", mapped.weights(logits, allowed, ctx, own), logits.shape)
            read = mapped.values(vs, own)
            out = mapped.combine(weighted_rows(weights, read.to(weights.dtype), allowed), own)
            return checked_rows(mapped, "outputs", out, q.shape).to(q.dtype), f_blk, colsum, None
        width = mapped.values(vs[:, :, :0], own).shape[-1]
        state = mapped.start((b, h, nq, width), q, **_step_for(mapped, "start", step))
        starts = range(0, nk, self.block_size)
        for first in (reversed(starts) if mapped.order == "reverse" else starts):
            keys = slice(first, min(first + self.block_size, nk))
            mask = key_mask[:, keys] if key_mask is not None else None
            if whole is not None and len(starts) == 1:
                ctx, allowed = whole
            else:
                ctx = plan.composition.context(qpos, kpos[..., keys], dims, mask, query_features,
                                               {n: t[:, :, keys] for n, t in key_features.items()})
                allowed = plan.composition.allowed(ctx, mask)
            logits = (q.reshape(b, hkv, group * nq, d) @ k[:, :, keys].transpose(-1, -2)).reshape(b, h, nq, -1)
            logits = logits * scale
            for t in plan.many(Slot.LOGITS):
                logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
            if f_blk is not None:  # subtract in F's (wider) dtype, round the logits once
                logits = subtract_f(logits, f_blk[:, None, :, keys])
            read = mapped.values(vs[:, :, keys], own)
            state = mapped.update(state, logits, allowed, read, ctx, own, **_step_for(mapped, "update", step))
        out = mapped.finish(state, own, **_step_for(mapped, "finish", step))
        out = checked_rows(mapped, "outputs", mapped.combine(out, own), q.shape)
        return out.to(q.dtype), f_blk, colsum, None

    # -- decoding -------------------------------------------------------------------------------------------------
    def decode_one(self, plan, qs, ks, vs, qpos, kpos, params, carry, query_features=None, key_features=None):
        """One query (B, H, 1, D) at the newest position against every cached key, with no mask: the lean
        decoding step (a handful of tensor operations). kpos (B, 1 or H_kv, M); the per-token features of the
        query (B, H, 1) and of the keys (B, H, M) by name, or None. Returns (out, the new carry or None)."""
        b, h, _, d = qs.shape
        hkv, m = ks.shape[1], ks.shape[2]
        acc, logits_transforms = plan.one(Slot.ACCUMULATOR), plan.many(Slot.LOGITS)
        normaliser = plan.one(Slot.NORMALISER)
        scale = plan.logit_scale(d)
        if acc is None and not logits_transforms and normaliser is None:
            return plain_one(qs, ks, vs, scale), None
        group = h // hkv
        logits = (qs.reshape(b, hkv, group, d) @ ks.transpose(-1, -2)).reshape(b, h, 1, m) * scale
        dims = Dims(h, d, hkv)
        selector = tuple(acc.heads()) if acc is not None else ()
        key = (h, qs.device, selector)
        if key not in self._decode_consts:  # made once: indexing with a list costs more than the step's maths
            heads = torch.arange(h, device=qs.device).view(1, -1, 1, 1)
            index = torch.tensor(selector, dtype=torch.int64, device=qs.device)
            contiguous = bool(selector) and list(selector) == list(range(selector[0], selector[0] + len(selector)))
            self._decode_consts[key] = (heads, torch.ones((1, 1, 1, 1), dtype=torch.bool, device=qs.device),
                                        index.view(1, -1, 1, 1),
                                        slice(selector[0], selector[0] + len(selector)) if contiguous else index)
        heads, every, index_heads, pick = self._decode_consts[key]
        ctx = plan.composition.context(qpos, kpos, dims, query_features=query_features, key_features=key_features,
                                       heads=heads)
        for t in logits_transforms:
            logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
        if acc is not None:
            sel_ctx = Context(qpos=ctx.qpos, kpos=ctx.kpos if ctx.kpos.shape[1] == 1 else ctx.kpos[:, pick],
                              heads=index_heads, dims=dims)
            s = acc.selection(logits[:, pick], every, sel_ctx, params[acc.kind])
            wide = accumulator_dtype(qs.dtype)  # subtract in F's (wider) dtype, round the logits once
            if wide == logits.dtype:
                logits = logits - carry[:, None, None, :]
                carry = carry + s[:, 0, 0]
            else:
                logits = (logits.to(wide) - carry[:, None, None, :]).to(logits.dtype)
                carry = carry + s.to(wide)[:, 0, 0]
        if normaliser is not None:
            sink = plan.composition.sink(heads, params, logits).expand(b, h, 1, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out = (probs.reshape(b, hkv, group, m) @ vs).reshape(b, h, 1, d)
        return out, carry

    def decode_step(self, plan, cache, params):
        """The fast step for later steps of this cache (``Backend.decode_step``; :mod:`attnzoo.decode.fast`): the
        plain step (no transforms, or only windows and chunks, no evictor), and selective attention, sink + window,
        H2O and TOVA at their budget (in C on the CPU in float32/float64, :mod:`attnzoo.decode.fused`)."""
        return fast.offer(plan, cache, params, self.decode_one)

    def attend_held(self, plan, step, cache, params, *, want_probs=False):
        qs, qpos, query_features = step
        key_features = cache.key_features()
        ks, vs, mask = cache.keys, cache.values, cache.key_mask()
        per_head = cache.evictor is not None and cache.evictor.per_head
        kpos = cache.positions if per_head else cache.positions[:, :1]  # the same in every head otherwise
        count = qs.shape[2]
        mapped = plan.one(Slot.PROBABILITY) is not None  # another map than the softmax: the blocks below
        acc = plan.one(Slot.ACCUMULATOR)
        # an evictor that reads only the step's last rows (``probability_rows``, the step's ``want_probs``): the
        # output by the path a spec without it takes, then those rows' probabilities alone (the step asks for
        # every row's under an accumulator, whose F ties a row's probabilities to the step's earlier queries)
        rows = want_probs if isinstance(want_probs, QueryRows) and acc is None and not mapped else None
        want_probs = want_probs is not False and rows is None
        bare = (mask is None and not want_probs and plan.causal and not plan.many(Slot.MASK)
                and not plan.many(Slot.LOGITS) and plan.one(Slot.NORMALISER) is None and not mapped)
        # a NaN or infinite value takes the blocks: the prompt's kernels weigh masked pairs' values by 0
        prompt = (bare and count > 1 and cache.num_tokens == count and consecutive_positions(qpos)
                  and all_finite(vs))
        probs = None
        if prompt and acc is None:
            # a prompt into an empty cache, nothing but row scales: one causal SDPA call, as in the batch form
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=plan.logit_scale(qs.shape[-1]),
                                                 enable_gqa=qs.shape[1] != ks.shape[1])
            carry = None
        elif (prompt and qs.dtype in _FUSED_DTYPES and vs.shape[-1] == qs.shape[-1]
              and (pointwise := fusable_pointwise(acc)) is not None
              and not _wants_grad(qs, ks, vs, params) and all_finite(ks)):
            # a prompt into an empty cache under a pointwise selection, no gradient wanted: the selective kernel's
            # forward by small query blocks, and the carry its keys start decoding with
            out, carry = selective_prefill(qs, ks, vs, plan.logit_scale(qs.shape[-1]), acc.heads()[0], pointwise,
                                           int(qpos[0, 0]), min(self.block_size, PREFILL_BLOCK))
        elif (count == 1 and mask is None and not want_probs and plan.causal and not plan.many(Slot.MASK)
              and not mapped):
            # one query at the newest position: every cached key is visible and no mask applies
            out, carry = self.decode_one(plan, qs, ks, vs, qpos, kpos, params, cache.accumulated(),
                                         query_features, key_features)
        else:
            ks, vs, kpos = softmax_map_rows(plan, ks, vs, kpos, qs.shape[1], params)
            out, _, carry, probs = self.blocks(plan, qs, ks, vs, qpos, kpos, params, mask, cache.accumulated(),
                                               want_probs=want_probs, use_sdpa=kpos.shape[1] == 1,
                                               features=query_features, key_features=key_features,
                                               query_mask=cache.query_mask() if acc is not None else None)
            out = softmax_map_combine(plan, out, qs.shape, params)
        if rows is not None:  # the evictor's rows alone
            probs = rows.pack(self.row_probabilities(plan, rows.queries(qs), ks, vs,
                                                     qpos.gather(1, rows.index.to(qpos.device)), kpos, params, mask,
                                                     {n: rows.queries(t) for n, t in query_features.items()},
                                                     key_features))
        return HeldAttention(out, carry, probs)

    def row_probabilities(self, plan, qs, ks, vs, qpos, kpos, params, mask, query_features, key_features):
        """The softmax probabilities (B, H, R, M) of some of a step's queries (an evictor's rows:
        ``attnzoo.decode.step.evictor_query_rows``), scaled rows qs (B, H, R, D) at qpos (B, R), over the cache's
        keys at kpos (B, 1 or H_kv, M) ascending, as :meth:`blocks` computes them for the whole step (no
        accumulator: the rows' probabilities do not depend on the step's other queries).

        With nothing but row scales under a causal mask and no key mask (a prompt's usual case): one product of
        the rows and the keys, -inf at the keys newer than a row (only the newest slots can be), one softmax; a
        row with no visible key, or any other spec, takes :meth:`blocks` (its probabilities kept, its output not
        used)."""
        b, h, r, d = qs.shape
        hkv, m = ks.shape[1], ks.shape[2]
        if (mask is None and plan.causal and not plan.many(Slot.MASK) and not plan.many(Slot.LOGITS)
                and plan.one(Slot.NORMALISER) is None and m > 0
                and bool((kpos[..., 0] <= qpos.amin(-1)[:, None]).all())):  # each row sees at least its oldest key
            group = h // hkv
            logits = torch.baddbmm(qs.new_empty(b * hkv, group * r, m), qs.reshape(b * hkv, group * r, d),
                                   ks.reshape(b * hkv, m, d).transpose(-1, -2), beta=0, alpha=plan.logit_scale(d))
            logits = logits.view(b, hkv, group, r, m)  # the scaled product in one call (beta 0: nothing added)
            first = int((kpos <= qpos.amin()).sum(-1).min())  # keys before `first`: visible from every row
            if first < m:
                hidden = kpos[..., None, None, first:] > qpos[:, None, None, :, None]  # (B, 1 or H_kv, 1, R, M')
                logits[..., first:].masked_fill_(hidden, float("-inf"))
            return torch.softmax(logits, dim=-1).view(b, h, r, m)
        return self.blocks(plan, qs, ks, vs, qpos, kpos, params, mask, None, want_probs=True, use_sdpa=False,
                           features=query_features, key_features=key_features)[3]


def _flat(params):
    return [t for group in params.values() for t in group.values()]


def _wants_grad(qs, ks, vs, params) -> bool:
    """Whether autograd wants a gradient of the rows or of a transform parameter."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (qs, ks, vs, *_flat(params)))

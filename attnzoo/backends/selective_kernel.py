"""A fused CPU path for selective attention under a plain causal mask: forward and backward by query blocks.

The forward hands each block to torch's flash-attention CPU op with the additive mask ``-F`` (and ``-inf`` above
the diagonal) and keeps its log-sum-exp; only the selector head's logits are computed besides. The backward walks
the blocks in reverse, recomputes each block's probabilities from the saved log-sum-exp, and carries the gradient
of the running column sums (the "reverse carry") back into earlier blocks' selector logits. Extra state: the
carry before each block, O(N · N / block) per batch row, and the log-sum-exp, O(H · N).

The flash op is private (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``). Whether it is usable is
decided once per dtype, by a probe on tiny inputs checked against the eager maths (:func:`flash_available`): when
the op is missing, its signature changed or its results differ, :func:`flash_block` computes the same two results
eagerly and warns once, saying why. An error from a real call (out of memory, say) propagates: it never switches
the process to the slow path.

Numerics: the carry and F are summed in at least float32 (``accumulator_dtype``, docs/backends.md), the log-sum-exp
is kept in that dtype too; -F is rounded to the input dtype once, where it enters the logits as the additive mask.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..cache import accumulator_dtype

#: Probe verdicts per dtype: True (use the op) or False (eager). Tests reset it.
_PROBED: dict[torch.dtype, bool] = {}


def _flash_op(q, k, v, mask, scale):
    """torch's private op: (out (B, H, Bq, D), lse (B, H, Bq)). A wrapper so the probe and tests can replace it."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)[:2]


def _eager_block(q, k, v, mask, scale):
    logits = (q @ k.transpose(-1, -2)) * scale + mask
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)) @ v, lse


def _probe(dtype: torch.dtype) -> str | None:
    """Why the op cannot be used for ``dtype`` (missing, another signature, wrong results), or None if it can."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen).to(dtype) for _ in range(3))
    mask = torch.randn(1, 1, 3, 3, generator=gen).to(dtype)
    try:
        with torch.no_grad():
            out, lse = _flash_op(q, k, v, mask, 0.5)
    except (AttributeError, NotImplementedError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    want_out, want_lse = _eager_block(q.double(), k.double(), v.double(), mask.double(), 0.5)
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 5e-2
    if (not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor)
            or out.shape != want_out.shape or lse.shape != want_lse.shape
            or not torch.allclose(out.double(), want_out, rtol=tol, atol=tol)
            or not torch.allclose(lse.double(), want_lse, rtol=tol, atol=tol)):
        return "its results on a probe differ from softmax attention (its contract changed)"
    return None


def flash_available(dtype: torch.dtype) -> bool:
    """Whether :func:`flash_block` uses torch's private op for ``dtype``: probed on the first call for each dtype,
    with a RuntimeWarning that says why when it cannot."""
    if dtype not in _PROBED:
        why = _probe(dtype)
        _PROBED[dtype] = why is None
        if why is not None:
            warnings.warn(f"attnzoo blocked backend: torch's private flash-attention CPU op is unusable for "
                          f"{str(dtype).removeprefix('torch.')} ({why}); using the eager equivalent (slower)",
                          RuntimeWarning, stacklevel=3)
    return _PROBED[dtype]


def flash_block(q, k, v, mask, scale):
    """(out, lse) of softmax(q k^T * scale + mask) v; q (B, H, Bq, D), k/v (B, H, Nk, D), mask (B, 1, Bq, Nk).

    Errors of the op itself propagate (the probe already showed it works for this dtype)."""
    if flash_available(q.dtype):
        return _flash_op(q, k, v, mask, scale)
    return _eager_block(q, k, v, mask, scale)


class SelectiveCausal(torch.autograd.Function):
    """out = softmax(q k^T * scale - F, causal) v with F from selector head ``sel``: the accumulator's selection
    given as a pointwise function of that head's logits (``AccumulatorTransform.pointwise``, e.g. selective
    attention's ReLU).

    Inputs are the already row-scaled q (B, H, N, D) and k, v (B, H_kv, N, D); positions are 1..N shifted by
    ``first_position - 1`` (BOS is column 0 only when ``first_position == 1``).
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, sel, pointwise, first_position, block):
        b, h, n, d = q.shape
        group = h // k.shape[1]
        ke = k.repeat_interleave(group, dim=1) if group > 1 else k
        ve = v.repeat_interleave(group, dim=1) if group > 1 else v
        bos = pointwise.exclude_first and first_position == 1
        out = torch.full_like(q, float("nan"))
        wide = accumulator_dtype(q.dtype)  # the carry (a running sum) and lse in at least float32
        lse = torch.empty(b, h, n, dtype=wide, device=q.device)
        carry = torch.zeros(b, n, dtype=wide, device=q.device)
        carries = []
        for start in range(0, n, block):
            stop = min(start + block, n)
            carries.append(carry[:, :stop].clone())
            s = _selection(q, ke, sel, start, stop, scale, pointwise, bos)[0]
            mask = _mask(s, carry[:, :stop], start)
            out[:, :, start:stop], lse[:, :, start:stop] = flash_block(q[:, :, start:stop], ke[:, :, :stop],
                                                                       ve[:, :, :stop], mask, scale)
            carry[:, :stop] += s.sum(dim=2, dtype=wide)
        ctx.save_for_backward(q, ke, ve, out, lse, *carries)
        ctx.meta = (scale, sel, pointwise, bos, block, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, ke, ve, out, lse, *carries = ctx.saved_tensors
        scale, sel, pointwise, bos, block, group = ctx.meta
        dtype = q.dtype
        if dtype in (torch.float16, torch.bfloat16):  # recompute and accumulate in float32
            q, ke, ve, out, lse, grad_out = (t.float() for t in (q, ke, ve, out, lse, grad_out))
            carries = [c.float() for c in carries]
        b, h, n, d = q.shape
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
        dcarry = q.new_zeros(b, n)
        starts = list(range(0, n, block))
        floor = math.log(torch.finfo(q.dtype).tiny) + 7.0  # keeps exp away from its slow subnormal range
        for index in reversed(range(len(starts))):
            start = starts[index]
            stop = min(start + block, n)
            carry = carries[index]
            q_blk, g_blk = q[:, :, start:stop], grad_out[:, :, start:stop]
            past = torch.ones(stop - start, stop - start, dtype=q.dtype, device=q.device).tril_()
            k_vis, v_vis = ke[:, :, :stop], ve[:, :, :stop]
            s, l_sel = _selection(q, ke, sel, start, stop, scale, pointwise, bos)
            mask = _mask(s, carry, start)
            # probabilities from the saved log-sum-exp, then the usual softmax backward
            p = (q_blk * scale) @ k_vis.transpose(-1, -2)
            p.add_(mask).sub_(lse[:, :, start:stop, None])
            # clamp before exp: a large F makes exp underflow through denormals, which is slow on CPU
            p.clamp_min_(floor).exp_()
            p[..., start:].mul_(past)  # exactly 0 above the diagonal
            dv[:, :, :stop] += p.transpose(-1, -2) @ g_blk
            dp = g_blk @ v_vis.transpose(-1, -2)
            delta = (g_blk * out[:, :, start:stop]).sum(-1, keepdim=True)
            dl = p.mul_(dp.sub_(delta))  # dL/dlogits, in place: p and dp are not needed afterwards
            dq[:, :, start:stop] += (dl @ k_vis) * scale
            dk[:, :, :stop] += (dl.transpose(-1, -2) @ q_blk) * scale
            # F enters every head's logits with a minus sign; work transposed, (B, Nk, Bq), like the forward
            d_f = dl.sum(dim=1).transpose(1, 2).neg()
            # F = carry + exclusive cumsum over queries of S; the next carry = carry + sums over queries of S
            total = d_f.sum(dim=2, keepdim=True)
            d_s = total - torch.cumsum(d_f, dim=2) + dcarry[:, :stop, None]
            dcarry = torch.cat([dcarry[:, :stop] + total[:, :, 0], dcarry[:, stop:]], dim=1)
            d_sel = d_s.mul_(_exclude(pointwise.derivative(l_sel), start, stop, pointwise, bos))
            dk[:, sel, :stop] += (d_sel @ q_blk[:, sel]) * scale
            dq[:, sel, start:stop] += (d_sel.transpose(-1, -2) @ ke[:, sel, :stop]) * scale
        if group > 1:
            dk = dk.view(b, h // group, group, n, d).sum(2)
            dv = dv.view(b, h // group, group, n, d).sum(2)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None


def _selection(q, ke, sel, start, stop, scale, pointwise, bos):
    """The block's selection, transposed: S^T (B, Nk, Bq) = the pointwise selection of the selector logits where
    a query may select a key (strictly earlier, or itself unless ``exclude_self``; never BOS when ``bos``), and
    those logits l^T.

    Keys run along rows so that the cumulative sum over queries is along the contiguous last dim (much faster
    on CPU than a cumulative sum across rows)."""
    l_sel = (ke[:, sel, :stop] @ q[:, sel, start:stop].transpose(-1, -2)) * scale
    return _exclude(pointwise.value(l_sel), start, stop, pointwise, bos), l_sel


def _exclude(t, start, stop, pointwise, bos):
    """Zero, in place, the pairs no query may select: on the diagonal block key j needs j < i (j <= i unless
    ``exclude_self``), and BOS (column 0) when ``bos``."""
    t[:, start:stop].triu_(1 if pointwise.exclude_self else 0)
    if bos:
        t[:, 0] = 0
    return t


def _mask(s, carry, start):
    """The additive mask (B, 1, Bq, Nk) in S's dtype: -F (carry + exclusive cumsum of S over the block's queries,
    summed in the carry's dtype, at least float32) and -inf above the diagonal."""
    wide = s.to(carry.dtype)
    f = torch.cumsum(wide, dim=2).sub_(wide).add_(carry[:, :, None])  # F^T (B, Nk, Bq)
    mask = f.transpose(1, 2).neg().to(s.dtype)
    bq = s.shape[2]
    future = torch.ones(bq, bq, dtype=torch.bool, device=s.device).triu_(1)
    mask[:, :, start:start + bq].masked_fill_(future, float("-inf"))
    return mask.unsqueeze(1)

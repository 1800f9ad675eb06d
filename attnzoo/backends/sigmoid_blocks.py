"""Sigmoid attention's causal batch form as one autograd node (the ``blocked`` backend's fast path for ``sigmoid``).

``w_ij = sigmoid(scale · q_i·k_j + b_i)`` for keys j <= i, no row normalisation (:class:`attnzoo.transforms.
probability.Sigmoid`): the rows need no running statistic, so each block of queries is one matrix product with
every key up to its last query, the bias added in the same call (``baddbmm``), the sigmoid in place, the causal
triangle zeroed on the diagonal block only, and one product with the values. The backward pass recomputes each
block's weights (nothing N×N is kept between the passes) and takes the sigmoid's derivative in one fused call
(``sigmoid_backward``): ``dS = dW · w (1 - w)``, zeroed where the mask forbids a pair (so a non-finite key or value
after the query never reaches its gradients), then ``dQ = dS K``, ``dK += dSᵀ Q``, ``dV += Wᵀ dO`` and the
per-head learnable offset's gradient ``Σ dS``. Grouped keys (GQA) are read once per key/value head: the query heads
of a group are stacked as rows.

Taken by :meth:`attnzoo.backends.blocked.BlockedBackend.forward` for a causal spec at consecutive positions whose
only slots besides the map are row scales, in float32 and float64; everything else takes the generic blocks.
"""

from __future__ import annotations

import torch


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, Bq, D) → (B·H_kv, G·Bq, D): the query heads of each key/value group stacked as rows."""
    b, h, n, d = x.shape
    return x.reshape(b * hkv, (h // hkv) * n, d)


def _ungrouped(x: torch.Tensor, b: int, h: int) -> torch.Tensor:
    return x.reshape(b, h, -1, x.shape[-1])


class SigmoidCausal(torch.autograd.Function):
    """q (B, H, N, D); k, v (B, H_kv, N, D); bias (N,) the bias of each query row (b = -log n or a number);
    offset (H,) a learnable per-head offset or None; scale the logits' scale; block the query block size.

    The bias rides in the product: each block's rows are ``[scale · q_i, b_i (+ offset_h)]`` against keys
    ``[k_j, 1]``, so one product gives the biased logits, and in the backward pass the same product's last column
    gives each row's ``Σ_j dS_ij`` (the offset's gradient). Every N-wide tile is written into one buffer made per
    call: a fresh large tensor per block costs more in first-touch page faults than the product that fills it."""

    @staticmethod
    def _setup(q, k, v, bias, offset, scale, block):
        b, h, n, d = q.shape
        hkv = k.shape[1]
        k1 = torch.cat([k, k.new_ones(b, hkv, n, 1)], dim=-1).reshape(b * hkv, n, d + 1)
        v2 = v.reshape(b * hkv, n, v.shape[-1])
        rows = bias.to(q.dtype).view(1, 1, n).expand(b, h, n)
        if offset is not None:
            rows = rows + offset.to(q.dtype).view(1, h, 1)
        q1 = torch.cat([q * scale, rows.unsqueeze(-1)], dim=-1)  # (B, H, N, D + 1)
        rows_per_block = (h // hkv) * min(block, n)
        work = q.new_empty(b * hkv * rows_per_block * n)
        return q1, k1, v2, work

    @staticmethod
    def _weights(work, q1b, k1, start, stop, group):
        """The weights of one query block against keys [0, stop) in ``work``: (B·H_kv, G·Bq, stop), 0 above the
        diagonal."""
        nq = stop - start
        w = work[:q1b.shape[0] * q1b.shape[1] * stop].view(q1b.shape[0], q1b.shape[1], stop)
        torch.bmm(q1b, k1[:, :stop].transpose(1, 2), out=w)
        torch.sigmoid_(w)
        upper = torch.ones(nq, nq, dtype=torch.bool, device=w.device).triu_(1)
        w.view(w.shape[0], group, nq, stop)[..., start:stop].masked_fill_(upper, 0.0)
        return w, upper

    @staticmethod
    def forward(ctx, q, k, v, bias, offset, scale, block):
        b, h, n, d = q.shape
        hkv = k.shape[1]
        group = h // hkv
        q1, k1, v2, work = SigmoidCausal._setup(q, k, v, bias, offset, scale, block)
        out = q.new_empty(b, h, n, v.shape[-1])
        for start in range(0, n, block):
            stop = min(start + block, n)
            w, _ = SigmoidCausal._weights(work, _grouped(q1[:, :, start:stop], hkv), k1, start, stop, group)
            out[:, :, start:stop] = _ungrouped(torch.bmm(w, v2[:, :stop]), b, h)
        ctx.save_for_backward(q, k, v, bias, offset)
        ctx.scale, ctx.block = scale, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, offset = ctx.saved_tensors
        scale, block = ctx.scale, ctx.block
        b, h, n, d = q.shape
        hkv = k.shape[1]
        group = h // hkv
        q1, k1, v2, work = SigmoidCausal._setup(q, k, v, bias, offset, scale, block)
        grads = torch.empty_like(work)
        dq1 = q.new_empty(b, h, n, d + 1)
        dk1 = torch.zeros_like(k1)
        dv2 = torch.zeros_like(v2)
        dout = dout.contiguous()
        for start in range(0, n, block):
            stop = min(start + block, n)
            nq = stop - start
            q1b = _grouped(q1[:, :, start:stop], hkv)
            dob = _grouped(dout[:, :, start:stop], hkv)
            w, upper = SigmoidCausal._weights(work, q1b, k1, start, stop, group)
            dv2[:, :stop].baddbmm_(w.transpose(1, 2), dob)
            ds = grads[:w.numel()].view(w.shape)
            torch.bmm(dob, v2[:, :stop].transpose(1, 2), out=ds)
            torch.ops.aten.sigmoid_backward.grad_input(ds, w, grad_input=ds)  # dS = dW · w (1 - w)
            ds.view(ds.shape[0], group, nq, stop)[..., start:stop].masked_fill_(upper, 0.0)
            dq1[:, :, start:stop] = _ungrouped(torch.bmm(ds, k1[:, :stop]), b, h)
            dk1[:, :stop].baddbmm_(ds.transpose(1, 2), q1b)
        dq = dq1[..., :d] * scale
        dk = dk1[..., :d].reshape(k.shape)
        dv = dv2.reshape(v.shape)
        grad_offset = dq1[..., d].sum(dim=(0, 2)).to(offset.dtype) if offset is not None else None
        return dq, dk, dv, None, grad_offset, None, None

"""The parts of the fused selective kernel (``selective_kernel.py``) below a pair: torch's private CPU
flash-attention op and its probe, the keys a block of queries visits (:class:`Keys`, leaving out the negligible
ones), the selector's selection and -F of one block, a span's attention by flash calls merged by log-sum-exp, and
the backward's tiles.

The flash op is private: its probe and guard are in :mod:`attnzoo.core.flash` (one home; the distributed pairs use
it too), re-exported here as :func:`flash_available` and :func:`flash_block`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.flash import flash_available, flash_block  # noqa: F401 - the kernel's names for them

#: names the phases for torch's profiler (benchmarks/selective_phases.py); next to nothing when it is off
phase = torch.profiler.record_function

class Keys:
    """The keys a block of queries [start, stop) visits: every key < stop, or (:meth:`live`) only the earlier
    keys whose F is under the negligible bound in some batch row, then the block's own keys. A key's F only grows
    with the query, so a key left out is negligible for every later query too (exp(-104) of the row's largest,
    :func:`negligible_f`): leaving it out changes no float32 result, and it is what selective attention's
    pruning does. Its carry then stops growing (it stays past the bound), in the forward and backward alike."""

    def __init__(self, start: int, stop: int, index: torch.Tensor | None = None, before: int | None = None):
        self.start, self.stop, self.index = start, stop, index
        self.before = start if index is None else before  # how many of the keys come before ``start``
        self.count = stop if index is None else index.numel()

    @classmethod
    def live(cls, carry, start: int, stop: int, limit: float, keep: float = 0.8) -> Keys:
        """Left out only when at most ``keep`` of the earlier keys are live (otherwise gathering costs more than
        it saves)."""
        if start == 0 or limit == math.inf:
            return cls(start, stop)
        alive = (carry[:, :start] < limit).any(dim=0).nonzero().squeeze(1)
        if alive.numel() > keep * start:
            return cls(start, stop)
        index = torch.cat([alive, torch.arange(start, stop, device=carry.device)])
        return cls(start, stop, index, alive.numel())

    @property
    def has_first(self) -> bool:
        """Whether key 0 (BOS) is the first of these keys."""
        return self.index is None or (self.index.numel() > 0 and int(self.index[0]) == 0)

    def upto(self, hi: int) -> Keys:
        """The keys before ``hi`` (a block inside a span: the earlier live keys, then the span's keys up to hi)."""
        if self.index is None:
            return Keys(self.start, hi)
        return Keys(self.start, hi, self.index[:self.before + hi - self.start], self.before)

    def earlier(self) -> Keys:
        """The keys before ``start``."""
        if self.index is None:
            return Keys(0, self.start)
        return Keys(0, self.start, self.index[:self.before], self.before)

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.index is None:
            return t.narrow(dim, 0, self.stop)
        return t.index_select(dim, self.index)

    def grad_buffer(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Where gradients for these keys accumulate: a view of ``t`` or a zero buffer (see :meth:`add_into`)."""
        if self.index is None:
            return t.narrow(dim, 0, self.stop)
        shape = list(t.shape)
        shape[dim] = self.count
        return t.new_zeros(shape)

    def add_into(self, t: torch.Tensor, values: torch.Tensor, dim: int, buffer: bool = False) -> None:
        """t[keys] += values along ``dim`` (nothing to do for a :meth:`grad_buffer` view)."""
        if self.index is None:
            if not buffer:
                t.narrow(dim, 0, self.stop).add_(values)
            return
        t.index_add_(dim, self.index, values)


#: heads and keys per tile of the backward pass: a tile's probabilities (4 × 256 × 1024 float32, 4 MiB) stay
#: in cache between the products that make and use them, which made the backward pass 1.4-1.5x faster than one
#: (B, H, block, N) tensor per block (AMD EPYC, 2 threads, N = 4096)
TILE_HEADS = 4
TILE_KEYS = 1024


def tiles_backward(q, k, v, grad_out, lse, neg_delta, neg_f, scale, dq, dk, dv, diagonal=True):
    """The softmax backward of a block of queries (q, grad_out, lse, neg_delta, dq: (B, H, Bq, ·)) against its
    keys (k, v, dk, dv: (B, H, Nk, ·), the block's own keys last), in tiles of heads and keys: adds into dq, dk,
    dv and returns -sum over heads of dL/dlogits, i.e. dL/dF (B, Bq, Nk).

    ``neg_f`` is -F (B, Bq, Nk). The tile's probabilities are exp(logits - F - lse), with the exponent clamped
    above the subnormal range (exp of a large F would otherwise run through subnormals, slow on CPU; such
    probabilities are below 1e-34 either way) and exactly 0 for future keys. Off the ``diagonal`` every key
    precedes every query (no own keys)."""
    b, h, bq, d = q.shape
    nk = k.shape[2]
    diagonal = nk - bq if diagonal else nk  # where the block's own keys start
    floor = math.log(torch.finfo(q.dtype).tiny) + 7.0
    # key tiles: the last one holds the whole diagonal block
    firsts = list(range(0, max(diagonal, 1), TILE_KEYS))
    bounds = list(zip(firsts, [*firsts[1:], nk], strict=True))
    future = torch.ones(bq, bq, dtype=torch.bool, device=q.device).triu_(1)
    d_f = torch.empty(b, bq, nk, dtype=q.dtype, device=q.device)
    for h0 in range(0, h, TILE_HEADS):
        h1 = min(h0 + TILE_HEADS, h)
        heads, m = slice(h0, h1), (h1 - h0) * b

        def rows(t, lo=0, hi=None, _heads=heads, _m=m):
            t = t[:, _heads, lo:hi]
            return t.reshape(_m, t.shape[2], t.shape[3])

        q_blk, g_blk, nd_blk = rows(q), rows(grad_out), rows(neg_delta)
        lse_blk = lse[:, heads, :, None]
        dq_blk = torch.zeros(m, bq, d, dtype=q.dtype, device=q.device)
        for c0, c1 in bounds:
            k_t, v_t = rows(k, c0, c1), rows(v, c0, c1)
            bias = (neg_f[:, None, :, c0:c1] - lse_blk).reshape(m, bq, c1 - c0)
            p = torch.baddbmm(bias, q_blk, k_t.transpose(1, 2), alpha=scale)  # logits - F - lse
            p.clamp_min_(floor).exp_()
            if c1 > diagonal:  # the diagonal block: exactly 0 above the diagonal
                p[..., diagonal - c0:].masked_fill_(future, 0.0)
            dv[:, heads, c0:c1] += (p.transpose(1, 2) @ g_blk).view(b, h1 - h0, c1 - c0, d)
            dl = p.mul_(torch.baddbmm(nd_blk, g_blk, v_t.transpose(1, 2)))  # dL/dlogits = p (dp - delta)
            dq_blk.baddbmm_(dl, k_t, alpha=scale)
            dk[:, heads, c0:c1] += (dl.transpose(1, 2) @ q_blk).view(b, h1 - h0, c1 - c0, d) * scale
            summed = dl.view(b, h1 - h0, bq, c1 - c0).sum(1)
            if h0 == 0:
                torch.neg(summed, out=d_f[:, :, c0:c1])
            else:
                d_f[:, :, c0:c1].sub_(summed)
        dq[:, heads] += dq_blk.view(b, h1 - h0, bq, d)
    return d_f


def block_selection(q_sel, k_sel, bq, scale, pointwise, bos, diagonal=True):
    """A block's selection, transposed: S^T (B, Nk, Bq) = the pointwise selection of the selector logits where
    a query may select a key (strictly earlier, or itself unless ``exclude_self``; never BOS, the first key,
    when ``bos``), and those logits l^T. ``q_sel`` (B, Bq, D) are the block's selector queries, ``k_sel``
    (B, Nk, D) its keys, the block's own keys last (none off the ``diagonal``).

    Keys run along rows so that the cumulative sum over queries is along the contiguous last dim (much faster
    on CPU than a cumulative sum across rows)."""
    l_sel = (k_sel @ q_sel.transpose(-1, -2)) * scale
    return exclude_unselectable(pointwise.value(l_sel), bq, pointwise, bos, diagonal), l_sel


def exclude_unselectable(t, bq, pointwise, bos, diagonal=True):
    """Zero, in place, the pairs no query may select: on the diagonal block (the last ``bq`` keys, when
    ``diagonal``) key j needs j < i (j <= i unless ``exclude_self``), and BOS (the first key) when ``bos``."""
    if diagonal:
        t[:, t.shape[1] - bq:].triu_(1 if pointwise.exclude_self else 0)
    if bos:
        t[:, 0] = 0
    return t


def forward_span(block: int, batch: int, n: int) -> int:
    """How many queries one forward step hands to the flash op: up to 4 blocks (the op runs 256-row tiles from
    768 queries up, and the span's keys before it need no causal mask), while the span's mask, (B, span, N),
    stays under 16M elements."""
    blocks = max(1, min(4, (1 << 24) // max(1, batch * n * block)))
    return block * blocks


#: what -F becomes past :func:`negligible_f` (finite: a row of the keys before a span that is all negligible then
#: gets weight exp(-1e30) = 0 in the merge, where -inf would give the flash op's fully masked row, out 0, lse 0)
NEGLIGIBLE = -1e30


def negligible_f(q, k, scale) -> float:
    """An F past which a key's probability is below e^-104 of its row's largest, for every query: with
    L = scale · max|q| · max|k|, a row's largest exponent is at least its own key's logit (F = 0 there), so
    logit_ij - F_ij - max_i <= 2L - F_ij. In float32 exp(-104) is 0, so replacing such an F by
    :data:`NEGLIGIBLE` changes nothing; in float64 it changes a probability by less than 1e-45. It keeps exp away
    from its subnormal range, which is slow on CPU. ``inf`` when an input is not finite."""
    bound = 2.0 * scale * float(q.norm(dim=-1).amax()) * float(k.norm(dim=-1).amax()) + 104.0
    return bound if math.isfinite(bound) else math.inf


def neg_f_into(out, s, carry, limit=math.inf):
    """Write -F (queries × keys, the rows of ``out`` (B, Bq, Nk_out)) of one block: ``s`` is its S^T (B, Nk, Bq),
    ``carry`` (B, Nk) the carry before it; an F of ``limit`` or more (:func:`negligible_f`) becomes
    :data:`NEGLIGIBLE`. Keys from Nk on are future keys for every query of the block: they get 0 (the causal flag
    hides them). -F is rounded to ``out``'s dtype once; a half-precision -F that would
    overflow is clamped to the dtype's lowest finite value (such a key gets probability 0 either way)."""
    nk = s.shape[1]
    # -F^T (B, Nk, Bq) = the cumulative sum over queries of [-carry, -S(query 0), ..., -S(query Bq - 2)]
    neg_t = torch.empty(s.shape, dtype=carry.dtype, device=s.device)
    torch.neg(carry, out=neg_t[:, :, 0])
    torch.neg(s[:, :, :-1], out=neg_t[:, :, 1:])
    neg_t.cumsum_(dim=2)
    if limit != math.inf:
        F.threshold(neg_t, -limit, NEGLIGIBLE, inplace=True)
    if out.dtype != neg_t.dtype:
        neg_t = neg_t.clamp_min_(torch.finfo(out.dtype).min).to(out.dtype)
    for row in range(out.shape[0]):  # the 2-D transposing copy is a fast kernel; the batched one is not
        out[row, :, :nk].copy_(neg_t[row].t())
    out[:, :, nk:] = 0


def span_attention(q, ke, ve, keys, mask, scale, start, stop, out, lse, diagonal=True):
    """Attention of queries [start, stop) against ``keys`` with the additive mask (B, 1, Bq, keys.count): the
    keys before the span in one call without a causal mask, the span's own keys (a square, the last columns) in
    one call with the op's causal flag (which skips the tiles above the diagonal), merged by their
    log-sum-exps. Off the ``diagonal`` there are no own keys: the earlier ones only (output 0 and log-sum-exp
    -inf when none is live)."""
    q_blk = q[:, :, start:stop]
    before = keys.before
    if not diagonal:
        if before == 0:
            out[:, :, start:stop] = 0.0
            lse[:, :, start:stop] = float("-inf")
            return
        with phase("forward: flash, earlier keys"):
            out[:, :, start:stop], lse[:, :, start:stop] = flash_block(
                q_blk, keys.take(ke, 2), keys.take(ve, 2), mask, scale)
        return
    own = slice(keys.start, keys.stop)
    with phase("forward: flash, the span's keys"):
        out_d, lse_d = flash_block(q_blk, ke[:, :, own], ve[:, :, own], mask[..., before:], scale, causal=True)
    if before == 0:
        out[:, :, start:stop], lse[:, :, start:stop] = out_d, lse_d
        return
    earlier = keys.earlier()
    with phase("forward: flash, earlier keys"):
        out_a, lse_a = flash_block(q_blk, earlier.take(ke, 2), earlier.take(ve, 2), mask[..., :before], scale)
    with phase("forward: merge"):
        _merge(out_a, lse_a, out_d, lse_d, out[:, :, start:stop], lse[:, :, start:stop])


def _merge(out_a, lse_a, out_d, lse_d, out, lse):
    """Write into ``out`` and ``lse`` the attention over both key sets from each one's output and lse."""
    # lse_d is finite (every query sees itself, with F = 0); lse_a is about -1e30 for a query whose earlier keys
    # are all negligible (their weight is then 0)
    diff = lse_a.to(lse.dtype) - lse_d.to(lse.dtype)
    # out = (e^lse_a out_a + e^lse_d out_d) / (e^lse_a + e^lse_d) = out_d + sigmoid(lse_a - lse_d) (out_a - out_d)
    weight = torch.sigmoid(diff).unsqueeze(-1)
    out.copy_(torch.lerp(out_d, out_a, weight.to(out_d.dtype)))
    lse.copy_(lse_d.to(lse.dtype) + F.softplus(diff))

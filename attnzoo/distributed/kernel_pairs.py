"""Pairs on the triton backend's generated kernels (CUDA; on the CPU only in Triton's interpreter, a checking
mode): each (query chunk, key chunk) pair is one launch of the spec's own forward kernels, queries and keys at
their true positions (causality, masks and the logits transforms come from the positions), F starting from the
chunk's carry (``init_carry``); its backward is one launch of the backward kernels from the final output and
log-sum-exp (ring attention's backward), which also hand back the gradient of that carry (the reverse carry over
every query of the pair, ``_Run.want_dcarry``). What is distributed stays here, as for the fused CPU pairs
(``fused.py``): the selector pass (the kernels' pre-pass per pair on a ring of the selector's key rows) and the
scans of the carries, the merge by log-sum-exp, and the gradient of each pair's column sums of S through later
chunks' F, a selector-only ring once the reverse scan is done."""

from __future__ import annotations

import torch

from ..backends.base import Mode
from ..backends.triton import codegen
from ..core.numerics import accumulator_dtype
from ..transforms.base import Dims, Slot
from .carry import scan_chunks
from .exchange import KeyBlocks
from .layout import ShardConfig
from .pairs import PairWalk, key_block, merge_lse, pair_queries, pair_selection, selector_kv_heads, unpack_rest


def triton_reasons(backend, cfg: ShardConfig, qs: torch.Tensor, keep: bool) -> list[str]:
    """Why the triton backend's kernels cannot compute this call's pairs (empty: they can): the backend's own
    reasons for the spec, device and dtype, and per-token features, which cross the shards as cumulative sums
    (the eager pairs compute them)."""
    if backend is None:
        return ["the triton backend is not registered"]
    plan = cfg.plan
    reasons = list(backend.supports(plan, qs.device, qs.dtype, Mode.BACKWARD if keep else Mode.FORWARD))
    if cfg.feature_keys or (not reasons and codegen.layout(plan).terms):
        reasons.append("per-token features cross the shards as running sums: the eager pairs compute them")
    return reasons


class _Launch:
    """One call's fixed parts: the backend, the packed per-head parameters of the kernels (with autograd to the
    pair slots' parameters when asked) and the accumulator."""

    def __init__(self, cfg: ShardConfig, backend, qs, params) -> None:
        self.cfg, self.backend, self.plan = cfg, backend, cfg.plan
        self.acc = cfg.plan.one(Slot.ACCUMULATOR)
        self.heads = qs.shape[1]
        self.prm = backend.packed_params(cfg.plan, params, self.heads, qs).detach().contiguous()

    def run(self, c: int, cb: int, q_rows, pos_rows, kpos, carry):
        """The launch configuration of the pair of query chunk ``c`` (rows at ``pos_rows``) and key chunk ``cb``
        (at ``kpos``), F starting from ``carry`` (B, nk) (None without an accumulator). On the diagonal the keys
        are the queries' own tokens, so the kernels skip the tiles past the diagonal."""
        return self.backend.prepare_run(self.plan, q_rows, pos_rows.contiguous(), kpos.unsqueeze(1).contiguous(), None,
                                 carry, self.plan.causal and c == cb)


def _selector_pass(cfg: ShardConfig, launch: _Launch, qs, ks, pos) -> dict[int, torch.Tensor]:
    """The column sums of S of every local query chunk over the whole sequence's keys, (B, N) float32 per chunk:
    the kernels' pre-pass (``_Run.select``, no carry) on each pair, over a ring of the selector head's key rows
    alone (one key head: the kernels then read it for the selector)."""
    b, h, n, d = qs.shape
    index = selector_kv_heads(cfg.plan, launch.acc, Dims(h, d, ks.shape[1]), ks.device)
    table = {c: torch.zeros(b, cfg.layout.seq_len, dtype=torch.float32, device=qs.device)
             for c in cfg.layout.owned(cfg.rank)}
    walk = PairWalk(cfg, pos)
    for src, blk in KeyBlocks(cfg, "selector")({"k": ks.index_select(1, index).contiguous(), "pos": pos}):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            rows = pair_queries(blocks)
            run = launch.run(c, cb, qs[:, :, rows], pos[:, rows], blk["pos"][:, chunk], None)
            total = run.select(qs[:, :, rows].contiguous(), blk["k"][:, :, chunk].contiguous(), launch.prm)
            table[c][:, gstart:gstart + chunk.stop - chunk.start] += total
    return table


def triton_forward(cfg: ShardConfig, backend, qs, ks, vs, pos, params):
    """(out, lse (float32), the carries into each local chunk); the sink is joined by the caller."""
    launch = _Launch(cfg, backend, qs, params)
    b, h, n, d = qs.shape
    carries = (scan_chunks(cfg, _selector_pass(cfg, launch, qs, ks, pos), reverse=False)
               if launch.acc is not None else {})
    out = torch.zeros(b, h, n, d, dtype=accumulator_dtype(qs.dtype), device=qs.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=out.dtype, device=qs.device)
    walk = PairWalk(cfg, pos)
    piece = None if cfg.keep else cfg.piece
    for src, blk, start in KeyBlocks(cfg, "kv").pieces(key_block(ks, vs, pos, {}), piece):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"], start):
            rows = pair_queries(blocks)
            width = chunk.stop - chunk.start
            carry = carries[c][:, gstart:gstart + width] if launch.acc is not None else None
            run = launch.run(c, cb, qs[:, :, rows], pos[:, rows], blk["pos"][:, chunk], carry)
            o, l, _, _ = run.forward(qs[:, :, rows].contiguous(), blk["k"][:, :, chunk].contiguous(),
                                     blk["v"][:, :, chunk].contiguous(), launch.prm)
            l = l.masked_fill(l == float("inf"), float("-inf"))  # the kernels' mark of a row with no key here
            merge_lse(out[:, :, rows], lse[:, :, rows], o.to(out.dtype), l)
    return out.to(qs.dtype), lse, carries


def triton_backward(cfg: ShardConfig, backend, qs, ks, vs, pos, out, lse, carries, d_out, flat, wanted):
    """(dq, dk, dv, the gradient of each pair-slot parameter (None where not ``wanted``)): every pair's share from
    the final output and log-sum-exp (the sink included), with the gradient of its incoming carry; the reverse
    scan; then the selector-only ring that carries each chunk's share into the earlier chunks' S. ``flat``: the
    pair slots' parameters in ``cfg.param_keys`` order (no features: the triton pairs take none)."""
    plan = cfg.plan
    launch = _Launch(cfg, backend, qs, unpack_rest(cfg, flat)[1])
    acc = launch.acc
    walk = PairWalk(cfg, pos)
    d_out = d_out.contiguous()
    lse32 = lse.float()
    d_q = torch.zeros_like(qs, dtype=torch.float32)
    d_prm = torch.zeros_like(launch.prm)
    reach = {c: torch.zeros_like(t, dtype=torch.float32) for c, t in carries.items()}
    kv = KeyBlocks(cfg, "kv")
    for src, blk, g_blk in kv.with_grads(key_block(ks, vs, pos, {}), ["k", "v"]):
        for c, cb, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            rows = pair_queries(blocks)
            width = chunk.stop - chunk.start
            carry = carries[c][:, gstart:gstart + width] if acc is not None else None
            run = launch.run(c, cb, qs[:, :, rows], pos[:, rows], blk["pos"][:, chunk], carry)
            run.want_dcarry = acc is not None
            q_rows, k_c, v_c = (t.contiguous() for t in (qs[:, :, rows], blk["k"][:, :, chunk], blk["v"][:, :, chunk]))
            run.select(q_rows, k_c, launch.prm)
            dq, dk, dv, dprm, _, _ = run.backward(q_rows, k_c, v_c, launch.prm, out[:, :, rows],
                                                  lse32[:, :, rows].contiguous(), d_out[:, :, rows])
            d_q[:, :, rows] += dq
            g_blk["k"][:, :, chunk] += dk.to(g_blk["k"].dtype)
            g_blk["v"][:, :, chunk] += dv.to(g_blk["v"].dtype)
            if dprm is not None:
                d_prm += dprm
            if acc is not None:
                reach[c][:, gstart:gstart + width] += run.dcarry
    d_k, d_v = kv.returned["k"], kv.returned["v"]
    leaves = [p.detach().requires_grad_(w) for p, w in zip(flat, wanted, strict=True)]
    d_params = [torch.zeros_like(p) for p in leaves]
    if any(wanted) and codegen.layout(plan).params:
        with torch.enable_grad():
            packed = backend.packed_params(plan, unpack_rest(cfg, leaves)[1], launch.heads, qs)
            _add_grads(d_params, leaves, wanted, packed, d_prm)
    if acc is not None:
        later = scan_chunks(cfg, reach, reverse=True)
        _later_ring(cfg, qs, ks, pos, later, leaves, wanted, d_q, d_k, d_params)
    return (d_q.to(qs.dtype), d_k, d_v, [g if w else None for g, w in zip(d_params, wanted, strict=True)])


def _later_ring(cfg: ShardConfig, qs, ks, pos, later, leaves, wanted, d_q, d_k, d_params) -> None:
    """The gradient of each pair's column sums of S through later chunks' F (``later[c]``, (B, N), dL/d the
    column sums of chunk c's queries): a ring of the selector's key rows, the selection recomputed with autograd
    in query blocks of ``cfg.block_size`` (one head), skipping keys no later F sees."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    dims = Dims(h, d, ks.shape[1])
    index = selector_kv_heads(plan, acc, dims, ks.device)
    walk = PairWalk(cfg, pos)
    selector = KeyBlocks(cfg, "selector")
    for src, blk, g_blk in selector.with_grads({"k": ks.index_select(1, index), "pos": pos}, ["k"]):
        for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            width = chunk.stop - chunk.start
            g = later[c][:, gstart:gstart + width]
            if not bool(g.any()):
                continue
            k_c, p_c = blk["k"][:, :, chunk], blk["pos"][:, chunk]
            for qb, keys in blocks:
                q_l = qs[:, :, qb].detach().requires_grad_()
                k_l = k_c[:, :, keys].detach().requires_grad_()
                with torch.enable_grad():
                    s = pair_selection(plan, acc, q_l, k_l, pos[:, qb], p_c[:, keys], dims, {}, {},
                                       unpack_rest(cfg, leaves)[1], cfg.scale)
                    weights = g[:, keys].to(s.dtype)[:, None, None, :].expand_as(s)
                    wrt = [q_l, k_l, *(p for p, w in zip(leaves, wanted, strict=True) if w)]
                    got = torch.autograd.grad(s, wrt, weights, allow_unused=True)
                if got[0] is not None:
                    d_q[:, :, qb] += got[0]
                if got[1] is not None:
                    g_blk["k"][:, :, chunk][:, :, keys] += got[1]
                it = iter(got[2:])
                for i, w in enumerate(wanted):
                    if w and (gi := next(it)) is not None:
                        d_params[i] += gi
    d_k.index_add_(1, index, selector.returned["k"].to(d_k.dtype))


def _add_grads(d_params, leaves, wanted, packed, d_packed) -> None:
    wrt = [p for p, w in zip(leaves, wanted, strict=True) if w]
    got = iter(torch.autograd.grad(packed, wrt, d_packed, allow_unused=True))
    for i, w in enumerate(wanted):
        if w and (gi := next(got)) is not None:
            d_params[i] += gi

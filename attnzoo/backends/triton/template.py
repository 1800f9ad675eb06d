"""The kernel template every spec is generated from (see ``codegen.py``).

One flash-attention template (online softmax, causal block skipping, GQA) whose per-slot work is done by helper
functions the generator writes from the spec's transforms: ``_allowed`` (mask slot and ``attention.causal``),
``_logits`` / ``_logits_bwd`` (logits slot, with the chain rule and per-head parameter gradients) and ``_select``
/ ``_select_grad`` (accumulator slot). Row-scale slots arrive pre-applied (the backend's torch prologue).

Kernels:
- ``_sel_carry``: accumulator pre-pass. Per key block, walks the query blocks in order and stores the exclusive
  scan of the selection's column sums (the carry each query block starts from), and the total.
- ``_fwd``: forward; the accumulator's F tile is ``carry + (within-block exclusive cumsum of S)``.
- ``_bwd_dkdv`` / ``_bwd_dq``: backward without atomics; logits-parameter gradients as per-program partial sums.
- ``_sel_bwd_dk`` / ``_sel_bwd_dq``: the selector head's extra gradient through F. ``dL/dS[k, j] = -sum_{i > k}
  sum_h dS_h[i, j]``: the first walks the query blocks in reverse (the reverse carry), the second reuses it.
  With ``HAS_RTOTAL`` the first also stores the reverse carry over every query (``RTOTAL``, (B, NK)): minus the
  gradient of the carry F starts from (``INIT``), what a sharded pair hands back (``attnzoo.distributed``).
- ``_decode``: one query per batch row against a cache with per-token F; one program per key/value head, its
  query heads as the rows.

A normaliser (attention sink) needs no generated code: its per-head sink logits (SINK, float32 (H,), computed by
the host with the transform's torch maths) start each row's online softmax (``m = sink``, ``l = 1``), so LSE
includes the sink and the backward kernels need no change; the sink's gradient is a host-side sum over LSE and
DELTA.

Fragments at out-of-range rows and columns: a tile's rows past NQ and columns past NK load position 1 (the
smallest valid 1-based position), so fragments see ``qp = 1`` and ``kp = 1`` there, and in ``_decode`` the rows
past a KV group see ``head`` = the group's last head. Every value a fragment computes at a pair outside
``_allowed`` (out-of-range pairs included) is discarded with ``tl.where`` before it enters an accumulation (the
softmax's row statistics, dq, dk, dv, the selection and F, the parameters' and per-token terms' gradients), never
multiplied by 0, so a fragment that is non-finite only there leaks no NaN into any result.

A spec gives two sources: the forward kernels (``_sel_carry``, ``_fwd``, ``_decode``) and the backward ones, loaded
on the first backward pass; each carries the helpers it calls. Tensors are contiguous: q/o/dq (B, H, NQ, D), k/v
(B, HKV, NK, D), positions int64 (B, NQ) and (B, KPH, NK), lse/delta float32 (B, H, NQ), carry float32 (B, NMB,
NK), packed per-head parameters float32 (NP, H), per-token terms float32 QT (NT, B, H, NQ) and KT (NT, B, H, NK)
(TQS = B·H·NQ and TKS = B·H·NK apart), the host-computed separable form ``row_i + col_j`` of each logits transform
with per-token features (``LogitsTransform.separable``), their gradients DQT/DKT (row and column sums of the
logits' gradient at that transform). """

COMMON = '''
# Out-of-range rows and columns (past NQ / NK in a tile) load position 1, the smallest valid (1-based) position:
# fragments see qp = 1 and kp = 1 there, so tl.log(qp) and 1 / qp stay finite. What a fragment computes at a pair
# outside _allowed (out of range included) is then discarded with tl.where, never multiplied by 0.
@triton.jit
def _load_rows(PTR, base, rows, nrows, D, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < nrows) & (d[None, :] < D)
    return tl.load(PTR + (base + rows[:, None]) * D + d[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(PTR, base, rows, nrows, D, value, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < nrows) & (d[None, :] < D)
    tl.store(PTR + (base + rows[:, None]) * D + d[None, :], value.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def _kv_tile(K, V, KPOS, b, kvh, cols, HKV, NK, D, KPB, KPHS, BLOCK_D: tl.constexpr):
    k = _load_rows(K, (b * HKV + kvh) * NK, cols, NK, D, BLOCK_D)
    v = _load_rows(V, (b * HKV + kvh) * NK, cols, NK, D, BLOCK_D)
    kp = tl.load(KPOS + b * KPB + kvh * KPHS + cols, mask=cols < NK, other=1)[None, :]
    return k, v, kp


# _key_range: the key blocks query block m visits: none after the causal diagonal (CAUSAL_SKIP), none before a
# mask's earliest visible key (BOUNDS, e.g. a sliding window).
@triton.jit
def _key_range(m, NK, BOUNDS, BLOCK_M: tl.constexpr, CAUSAL_SKIP: tl.constexpr, HAS_BOUNDS: tl.constexpr):
    lo = 0
    hi = NK
    if CAUSAL_SKIP:
        hi = tl.minimum(NK, (m + 1) * BLOCK_M)
    if HAS_BOUNDS:
        lo = tl.load(BOUNDS + m)
    return lo, hi


@triton.jit
def _key_valid(KMASK, b, cols, NK, HAS_KMASK: tl.constexpr):
    valid = cols < NK
    if HAS_KMASK:
        valid = valid & (tl.load(KMASK + b * NK + cols, mask=cols < NK, other=0) != 0)
    return valid[None, :]
'''

ACC_SHARED = '''
# _sel_tile: The selector head's selection S on one tile, with what its gradient needs.
@triton.jit
def _sel_tile(qs, K, KPOS, PRM, b, skvh, cols, qp, valid, H, HKV, NK, D, KPB, KPHS, scale, SEL,
              BLOCK_D: tl.constexpr):
    ks = _load_rows(K, (b * HKV + skvh) * NK, cols, NK, D, BLOCK_D)
    kps = tl.load(KPOS + b * KPB + skvh * KPHS + cols, mask=cols < NK, other=1)[None, :]
    oks = _allowed(qp, kps, SEL, valid)
    x0 = tl.dot(qs, tl.trans(ks)) * scale
    x = _logits(x0, qp, kps, SEL, H, PRM, PRM, PRM, 0, 0, False, False, 0, 0)  # no per-token terms with an accumulator
    return _select(x, oks, qp, kps), x, x0, oks, kps, ks


# _f_tile: F on one tile: the carry of the earlier query blocks plus the within-block exclusive cumsum of S, with
# what the selector's gradient needs.
@triton.jit
def _f_tile(qs, K, KPOS, CARRY, PRM, b, m, cols, qp, valid, H, HKV, NK, D, KPB, KPHS, NMB, scale, SEL,
            BLOCK_D: tl.constexpr):
    sel, x, x0, oks, kps, ks = _sel_tile(qs, K, KPOS, PRM, b, SEL // (H // HKV), cols, qp, valid, H, HKV, NK, D,
                                         KPB, KPHS, scale, SEL, BLOCK_D)
    carry = tl.load(CARRY + (b * NMB + m) * NK + cols, mask=cols < NK, other=0.0)
    return carry[None, :] + tl.cumsum(sel, 0) - sel, x, x0, oks, kps, ks
'''

ACC_FORWARD = '''
@triton.jit(do_not_specialize=SIZES)
def _sel_carry(Q, K, QPOS, KPOS, KMASK, INIT, CARRY, TOTAL, PRM,
               H, HKV, NQ, NK, D, KPB, KPHS, NMB, scale, SEL,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               CAUSAL_SKIP: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_INIT: tl.constexpr):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    skvh = SEL // (H // HKV)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    cv = cols < NK
    kvalid = _key_valid(KMASK, b, cols, NK, HAS_KMASK)
    running = tl.zeros([BLOCK_N], tl.float32)
    if HAS_INIT:
        running = tl.load(INIT + b * NK + cols, mask=cv, other=0.0)
    m0 = 0
    if CAUSAL_SKIP:
        m0 = (n * BLOCK_N) // BLOCK_M
    for m in range(0, NMB):
        tl.store(CARRY + (b * NMB + m) * NK + cols, running, mask=cv)
        if m >= m0:
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            qs = _load_rows(Q, (b * H + SEL) * NQ, rows, NQ, D, BLOCK_D)
            qp = tl.load(QPOS + b * NQ + rows, mask=rows < NQ, other=1)[:, None]
            valid = (rows < NQ)[:, None] & kvalid
            sel, x, x0, oks, kps, ks = _sel_tile(qs, K, KPOS, PRM, b, skvh, cols, qp, valid, H, HKV, NK, D,
                                                 KPB, KPHS, scale, SEL, BLOCK_D)
            running += tl.sum(sel, 0)
    tl.store(TOTAL + b * NK + cols, running, mask=cv)
'''

ACC_BACKWARD = '''
# _ds_sum: sum over every head h of dL/dl_h on one tile (l_h: head h's logits after F): -dL/dF.
@triton.jit
def _ds_sum(Q, K, V, DO, LSE, DELTA, KPOS, PRM, b, rows, cols, qp, valid, ftile, H, HKV, NQ, NK, D, KPB, KPHS,
            scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    group = H // HKV
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for h in range(0, H):
        kvh = h // group
        k, v, kp = _kv_tile(K, V, KPOS, b, kvh, cols, HKV, NK, D, KPB, KPHS, BLOCK_D)
        q = _load_rows(Q, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
        do = _load_rows(DO, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
        lse = tl.load(LSE + (b * H + h) * NQ + rows, mask=rows < NQ, other=0.0)
        delta = tl.load(DELTA + (b * H + h) * NQ + rows, mask=rows < NQ, other=0.0)
        ok = _allowed(qp, kp, h, valid)
        s = _logits(tl.dot(q, tl.trans(k)) * scale, qp, kp, h, H, PRM, PRM, PRM, 0, 0, False, False, 0, 0) - ftile
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        total += p * (dp - delta[:, None])
    return total


@triton.jit(do_not_specialize=SIZES)
def _sel_bwd_dk(Q, K, V, DO, LSE, DELTA, DKS, PGS, RCARRY, RTOTAL, QPOS, KPOS, KMASK, CARRY, PRM,
                H, HKV, NQ, NK, D, KPB, KPHS, NMB, NNB, scale, SEL,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NPP: tl.constexpr,
                CAUSAL_SKIP: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_RTOTAL: tl.constexpr):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    cv = cols < NK
    kvalid = _key_valid(KMASK, b, cols, NK, HAS_KMASK)
    running = tl.zeros([BLOCK_N], tl.float32)
    dks = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dpv = tl.zeros([NPP], tl.float32)
    m0 = 0
    if CAUSAL_SKIP:
        m0 = (n * BLOCK_N) // BLOCK_M
    for mm in range(0, NMB - m0):
        m = NMB - 1 - mm  # query blocks in reverse: the reverse carry sums later queries
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        rv = rows < NQ
        qp = tl.load(QPOS + b * NQ + rows, mask=rv, other=1)[:, None]
        qs = _load_rows(Q, (b * H + SEL) * NQ, rows, NQ, D, BLOCK_D)
        valid = rv[:, None] & kvalid
        ftile, x, x0, oks, kps, ks = _f_tile(qs, K, KPOS, CARRY, PRM, b, m, cols, qp, valid, H, HKV, NK, D,
                                             KPB, KPHS, NMB, scale, SEL, BLOCK_D)
        e = _ds_sum(Q, K, V, DO, LSE, DELTA, KPOS, PRM, b, rows, cols, qp, valid, ftile, H, HKV, NQ, NK, D,
                    KPB, KPHS, scale, BLOCK_M, BLOCK_N, BLOCK_D)
        col = tl.sum(e, 0)
        tl.store(RCARRY + (b * NMB + m) * NK + cols, running, mask=cv)
        dsel = -(running[None, :] + col[None, :] - tl.cumsum(e, 0)) * _select_grad(x, oks, qp, kps)
        running += col
        g0, dpc, gq, gk = _logits_bwd(dsel, oks, x0, qp, kps, SEL, H, PRM, NPP, PRM, PRM, 0, 0, False, False, 0, 0, 1)
        dpv += dpc
        dks += tl.dot(tl.trans(g0.to(qs.dtype)), qs).to(tl.float32)
    _store_rows(DKS, b * NK, cols, NK, D, dks * scale, BLOCK_D)
    tl.store(PGS + (b * NNB + n) * NPP + tl.arange(0, NPP), dpv)
    if HAS_RTOTAL:  # the reverse carry over every query: -dL/d(the carry F starts from), for sharded pairs
        tl.store(RTOTAL + b * NK + cols, running, mask=cv)


@triton.jit(do_not_specialize=SIZES)
def _sel_bwd_dq(Q, K, V, DO, LSE, DELTA, DQS, RCARRY, QPOS, KPOS, KMASK, CARRY, PRM,
                H, HKV, NQ, NK, D, KPB, KPHS, NMB, scale, SEL,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NPP: tl.constexpr,
                CAUSAL_SKIP: tl.constexpr, HAS_KMASK: tl.constexpr):
    m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    rv = rows < NQ
    qp = tl.load(QPOS + b * NQ + rows, mask=rv, other=1)[:, None]
    qs = _load_rows(Q, (b * H + SEL) * NQ, rows, NQ, D, BLOCK_D)
    dqs = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(m, NK, Q, BLOCK_M, CAUSAL_SKIP, False)  # every key block up to the diagonal
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cv = cols < NK
        valid = rv[:, None] & _key_valid(KMASK, b, cols, NK, HAS_KMASK)
        ftile, x, x0, oks, kps, ks = _f_tile(qs, K, KPOS, CARRY, PRM, b, m, cols, qp, valid, H, HKV, NK, D,
                                             KPB, KPHS, NMB, scale, SEL, BLOCK_D)
        e = _ds_sum(Q, K, V, DO, LSE, DELTA, KPOS, PRM, b, rows, cols, qp, valid, ftile, H, HKV, NQ, NK, D,
                    KPB, KPHS, scale, BLOCK_M, BLOCK_N, BLOCK_D)
        rcarry = tl.load(RCARRY + (b * NMB + m) * NK + cols, mask=cv, other=0.0)
        dsel = -(rcarry[None, :] + tl.sum(e, 0)[None, :] - tl.cumsum(e, 0)) * _select_grad(x, oks, qp, kps)
        g0, dpc, gq, gk = _logits_bwd(dsel, oks, x0, qp, kps, SEL, H, PRM, NPP, PRM, PRM, 0, 0, False, False, 0, 0, 1)
        dqs += tl.dot(g0.to(ks.dtype), ks).to(tl.float32)
    _store_rows(DQS, b * NQ, rows, NQ, D, dqs * scale, BLOCK_D)
'''

FORWARD = '''
@triton.jit(do_not_specialize=SIZES)
def _fwd(Q, K, V, O, LSE, QPOS, KPOS, KMASK, CARRY, LOGITS, PRM, BOUNDS, SINK, QT, KT,
         H, HKV, NQ, NK, D, KPB, KPHS, NMB, TQS, TKS, scale, SEL,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
         CAUSAL_SKIP: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_ACC: tl.constexpr, WRITE_LOGITS: tl.constexpr,
         HAS_BOUNDS: tl.constexpr, HAS_SINK: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    group = H // HKV
    kvh = h // group
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    rv = rows < NQ
    q = _load_rows(Q, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
    qp = tl.load(QPOS + b * NQ + rows, mask=rv, other=1)[:, None]
    qoff = ((b * H + h) * NQ + rows)[:, None]  # per-token terms (QT/KT) of this head
    qs = q
    if HAS_ACC:
        qs = _load_rows(Q, (b * H + SEL) * NQ, rows, NQ, D, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINK:  # the normaliser's sink: one more logit in the denominator, with a zero value row
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINK + h)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(m, NK, BOUNDS, BLOCK_M, CAUSAL_SKIP, HAS_BOUNDS)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        valid = rv[:, None] & _key_valid(KMASK, b, cols, NK, HAS_KMASK)
        k, v, kp = _kv_tile(K, V, KPOS, b, kvh, cols, HKV, NK, D, KPB, KPHS, BLOCK_D)
        ok = _allowed(qp, kp, h, valid)
        koff = ((b * H + h) * NK + cols)[None, :]
        s = _logits(tl.dot(q, tl.trans(k)) * scale, qp, kp, h, H, PRM, QT, KT, qoff, koff, rv[:, None],
                    (cols < NK)[None, :], TQS, TKS)
        if HAS_ACC:
            ftile, x, x0, oks, kps, ks = _f_tile(qs, K, KPOS, CARRY, PRM, b, m, cols, qp, valid, H, HKV, NK,
                                                 D, KPB, KPHS, NMB, scale, SEL, BLOCK_D)
            s = s - ftile
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
        if WRITE_LOGITS:
            tl.store(LOGITS + ((b * H + h) * NQ + rows[:, None]) * NK + cols[None, :], s,
                     mask=rv[:, None] & (cols < NK)[None, :])
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    _store_rows(O, (b * H + h) * NQ, rows, NQ, D, acc / l_safe[:, None], BLOCK_D)
    lse = tl.where(l_i == 0.0, float("inf"), m_fin + tl.log(l_safe))
    tl.store(LSE + (b * H + h) * NQ + rows, lse, mask=rv)


@triton.jit(do_not_specialize=SIZES)
def _decode(Q, K, V, O, LSE, QPOS, KPOS, CARRYV, SROW, LOGITS, PRM, SINK, QT, KT,
            H, HKV, NK, D, KPB, KPHS, TQS, TKS, scale, SEL,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            HAS_ACC: tl.constexpr, WRITE_LOGITS: tl.constexpr, HAS_SINK: tl.constexpr):
    bk = tl.program_id(0)
    b = (bk // HKV).to(tl.int64)
    kvh = bk % HKV
    group = H // HKV
    r = tl.arange(0, BLOCK_M)
    rv = r < group
    head = (kvh * group + tl.minimum(r, group - 1))[:, None]  # rows past the group: its last head (discarded)
    q = _load_rows(Q, b * H + kvh * group, r, group, D, BLOCK_D)
    qp = tl.zeros([BLOCK_M, 1], tl.int64) + tl.load(QPOS + b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINK:
        m_i = tl.load(SINK + kvh * group + r, mask=rv, other=0.0)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, NK, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cv = cols < NK
        valid = rv[:, None] & cv[None, :]
        k, v, kp = _kv_tile(K, V, KPOS, b, kvh, cols, HKV, NK, D, KPB, KPHS, BLOCK_D)
        ok = _allowed(qp, kp, head, valid)
        s = _logits(tl.dot(q, tl.trans(k)) * scale, qp, kp, head, H, PRM, QT, KT, b * H + head,
                    (b * H + head) * NK + cols[None, :], rv[:, None], valid, TQS, TKS)
        if HAS_ACC:
            if kvh == SEL // group:
                sel = tl.where(head == SEL, _select(s, ok, qp, kp), 0.0)
                tl.store(SROW + b * NK + cols, tl.sum(sel, 0), mask=cv)
            s = s - tl.load(CARRYV + b * NK + cols, mask=cv, other=0.0)[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
        if WRITE_LOGITS:
            tl.store(LOGITS + (b * H + head) * NK + cols[None, :], s, mask=valid)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    _store_rows(O, b * H + kvh * group, r, group, D, acc / l_safe[:, None], BLOCK_D)
    lse = tl.where(l_i == 0.0, float("inf"), m_fin + tl.log(l_safe))
    tl.store(LSE + b * H + kvh * group + r, lse, mask=rv)
'''

BACKWARD = '''
@triton.jit(do_not_specialize=SIZES)
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, PG, QPOS, KPOS, KMASK, CARRY, PRM, BOUNDS, QT, KT, DKT,
              H, HKV, NQ, NK, D, KPB, KPHS, NMB, NNB, TQS, TKS, NT, scale, SEL,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NPP: tl.constexpr,
              NTP: tl.constexpr,
              CAUSAL_SKIP: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_ACC: tl.constexpr, HAS_BOUNDS: tl.constexpr):
    n = tl.program_id(0)
    bk = tl.program_id(1)
    b = (bk // HKV).to(tl.int64)
    kvh = bk % HKV
    group = H // HKV
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    kvalid = _key_valid(KMASK, b, cols, NK, HAS_KMASK)
    k, v, kp = _kv_tile(K, V, KPOS, b, kvh, cols, HKV, NK, D, KPB, KPHS, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m0 = 0
    if CAUSAL_SKIP:
        m0 = (n * BLOCK_N) // BLOCK_M
    m_end = NMB
    if HAS_BOUNDS:  # the query blocks after m_end see no key of this block (a sliding window)
        m_end = tl.load(BOUNDS + NMB + n)
    for g in range(0, group):
        h = kvh * group + g
        dpv = tl.zeros([NPP], tl.float32)
        dkt = tl.zeros([BLOCK_N, NTP], tl.float32)
        koff = ((b * H + h) * NK + cols)[None, :]
        for m in range(m0, m_end):
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            rv = rows < NQ
            q = _load_rows(Q, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
            do = _load_rows(DO, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
            lse = tl.load(LSE + (b * H + h) * NQ + rows, mask=rv, other=0.0)
            delta = tl.load(DELTA + (b * H + h) * NQ + rows, mask=rv, other=0.0)
            qp = tl.load(QPOS + b * NQ + rows, mask=rv, other=1)[:, None]
            valid = rv[:, None] & kvalid
            ok = _allowed(qp, kp, h, valid)
            x0 = tl.dot(q, tl.trans(k)) * scale
            qoff = ((b * H + h) * NQ + rows)[:, None]
            s = _logits(x0, qp, kp, h, H, PRM, QT, KT, qoff, koff, rv[:, None], (cols < NK)[None, :], TQS, TKS)
            if HAS_ACC:
                qs = _load_rows(Q, (b * H + SEL) * NQ, rows, NQ, D, BLOCK_D)
                ftile, x, xs0, oks, kps, ks = _f_tile(qs, K, KPOS, CARRY, PRM, b, m, cols, qp, valid, H, HKV, NK,
                                                      D, KPB, KPHS, NMB, scale, SEL, BLOCK_D)
                s = s - ftile
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            ds = p * (dp - delta[:, None])
            g0, dpc, gq, gk = _logits_bwd(ds, ok, x0, qp, kp, h, H, PRM, NPP, QT, KT, qoff, koff, rv[:, None],
                                          (cols < NK)[None, :], TQS, TKS, NTP)
            dpv += dpc
            dkt += gk
            dk += tl.dot(tl.trans(g0.to(q.dtype)), q).to(tl.float32)
        tl.store(PG + ((b * H + h) * NNB + n) * NPP + tl.arange(0, NPP), dpv)
        t = tl.arange(0, NTP)[None, :]
        tl.store(DKT + t * TKS + ((b * H + h) * NK + cols)[:, None], dkt, mask=(t < NT) & (cols < NK)[:, None])
    _store_rows(DK, (b * HKV + kvh) * NK, cols, NK, D, dk * scale, BLOCK_D)
    _store_rows(DV, (b * HKV + kvh) * NK, cols, NK, D, dv, BLOCK_D)


@triton.jit(do_not_specialize=SIZES)
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, KMASK, CARRY, PRM, BOUNDS, QT, KT, DQT,
            H, HKV, NQ, NK, D, KPB, KPHS, NMB, TQS, TKS, NT, scale, SEL,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NPP: tl.constexpr,
            NTP: tl.constexpr,
            CAUSAL_SKIP: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_ACC: tl.constexpr, HAS_BOUNDS: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    group = H // HKV
    kvh = h // group
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    rv = rows < NQ
    q = _load_rows(Q, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
    do = _load_rows(DO, (b * H + h) * NQ, rows, NQ, D, BLOCK_D)
    lse = tl.load(LSE + (b * H + h) * NQ + rows, mask=rv, other=0.0)
    delta = tl.load(DELTA + (b * H + h) * NQ + rows, mask=rv, other=0.0)
    qp = tl.load(QPOS + b * NQ + rows, mask=rv, other=1)[:, None]
    qs = q
    if HAS_ACC:
        qs = _load_rows(Q, (b * H + SEL) * NQ, rows, NQ, D, BLOCK_D)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dqt = tl.zeros([BLOCK_M, NTP], tl.float32)
    qoff = ((b * H + h) * NQ + rows)[:, None]
    lo, hi = _key_range(m, NK, BOUNDS, BLOCK_M, CAUSAL_SKIP, HAS_BOUNDS)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        valid = rv[:, None] & _key_valid(KMASK, b, cols, NK, HAS_KMASK)
        k, v, kp = _kv_tile(K, V, KPOS, b, kvh, cols, HKV, NK, D, KPB, KPHS, BLOCK_D)
        ok = _allowed(qp, kp, h, valid)
        x0 = tl.dot(q, tl.trans(k)) * scale
        koff = ((b * H + h) * NK + cols)[None, :]
        s = _logits(x0, qp, kp, h, H, PRM, QT, KT, qoff, koff, rv[:, None], (cols < NK)[None, :], TQS, TKS)
        if HAS_ACC:
            ftile, x, xs0, oks, kps, ks = _f_tile(qs, K, KPOS, CARRY, PRM, b, m, cols, qp, valid, H, HKV, NK,
                                                  D, KPB, KPHS, NMB, scale, SEL, BLOCK_D)
            s = s - ftile
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        ds = p * (dp - delta[:, None])
        g0, dpc, gq, gk = _logits_bwd(ds, ok, x0, qp, kp, h, H, PRM, NPP, QT, KT, qoff, koff, rv[:, None],
                                      (cols < NK)[None, :], TQS, TKS, NTP)
        dqt += gq
        dq += tl.dot(g0.to(k.dtype), k).to(tl.float32)
    _store_rows(DQ, (b * H + h) * NQ, rows, NQ, D, dq * scale, BLOCK_D)
    t = tl.arange(0, NTP)[None, :]
    tl.store(DQT + t * TQS + qoff, dqt, mask=(t < NT) & rv[:, None])
'''


# -- probability maps (docs/triton.md, "Probability maps") ---------------------------------------------------------
# A spec with a probability map gets the kernels above with the softmax's row statistics swapped for calls to the
# generated _map_* helpers (codegen.py writes them from the map's TritonProbability lowering). The swaps are made
# here, on the text above, so that the block skipping, GQA, key masks, per-token terms and the accumulator stay one
# template; a spec without a map gets the text above unchanged. With a map, LSE holds two float32 statistics per
# row, interleaved (B, H, NQ, 2): the final shift m and the denominator Z (a pointwise map: 0 and 1).
MAP_COMMON = '''
# _map_store / _map_stats: a row's two statistics (the map's final shift and denominator), interleaved in LSE.
@triton.jit
def _map_store(LSE, index, mask, shift, total):
    tl.store(LSE + 2 * index, shift, mask=mask)
    tl.store(LSE + 2 * index + 1, total, mask=mask)


@triton.jit
def _map_stats(LSE, index, mask):
    return tl.load(LSE + 2 * index, mask=mask, other=0.0), tl.load(LSE + 2 * index + 1, mask=mask, other=1.0)
'''


def _swap(text: str, old: str, new: str, count: int = 1) -> str:
    """``text`` with the ``count`` occurrences of ``old`` replaced by ``new`` (a list: one replacement each, in
    order); the template must hold ``old`` exactly ``count`` times (a change above that moves it fails here, at
    import, not in a generated kernel)."""
    found = text.count(old)
    if found != count:
        raise AssertionError(f"template: expected {count} occurrence(s) of {old.strip()[:60]!r}, found {found}")
    for each in new if isinstance(new, list) else [new] * count:
        text = text.replace(old, each, 1)
    return text


def _map_forward(text: str) -> str:
    text = _swap(text, '    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)\n',
                 "    m_i = _map_start(BLOCK_M)  # the map's shift floor\n", count=2)
    sink = ("    if HAS_SINK:  # the normaliser's sink: one more logit in the denominator, with a zero value row\n"
            "        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINK + h)\n"
            "        l_i = tl.full([BLOCK_M], 1.0, tl.float32)\n")
    text = _swap(text, sink, "    # no normaliser: spec validation refuses one beside a probability map\n")
    text = _swap(text, '''    if HAS_SINK:
        m_i = tl.load(SINK + kvh * group + r, mask=rv, other=0.0)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
''', "")
    step = '''        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
'''
    mapped = '''        m_new, alpha, p, dsum = _map_step(s, ok, m_i, qp, kp, {head}, H, PRM)
        l_i = l_i * alpha + dsum
'''
    text = _swap(text, step, [mapped.format(head="h"), mapped.format(head="head")], count=2)
    finish = '''    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    _store_rows(O, {base}, {rows}, {nrows}, D, acc / l_safe[:, None], BLOCK_D)
    lse = tl.where(l_i == 0.0, float("inf"), m_fin + tl.log(l_safe))
    tl.store(LSE + {index}, lse, mask=rv)
'''
    mapped = '''    m_fin, z = _map_total(m_i, l_i, qp, {head}, H, PRM, BLOCK_M)
    _store_rows(O, {base}, {rows}, {nrows}, D, acc / tl.where(z == 0.0, 1.0, z)[:, None], BLOCK_D)
    _map_store(LSE, {index}, rv, m_fin, z)
'''
    for where in (dict(head="h", base="(b * H + h) * NQ", rows="rows", nrows="NQ", index="(b * H + h) * NQ + rows"),
                  dict(head="head", base="b * H + kvh * group", rows="r", nrows="group",
                       index="b * H + kvh * group + r")):
        text = _swap(text, finish.format(**where), mapped.format(**where))
    return text


def _map_backward(text: str, accumulator: bool = False) -> str:
    if accumulator:  # _ds_sum: dL/ds of every head through the map
        text = _swap(text, "        lse = tl.load(LSE + (b * H + h) * NQ + rows, mask=rows < NQ, other=0.0)\n",
                     "        mst, zst = _map_stats(LSE, (b * H + h) * NQ + rows, rows < NQ)\n")
        return _swap(text, '''        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        total += p * (dp - delta[:, None])
''', '''        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        p, ds = _map_bwd(s, ok, dp, mst, zst, delta, qp, kp, h, H, PRM)
        total += ds
''')
    for pad in ("            ", "    "):  # _bwd_dkdv, _bwd_dq
        text = _swap(text, f"\n{pad}lse = tl.load(LSE + (b * H + h) * NQ + rows, mask=rv, other=0.0)\n",
                     f"\n{pad}mst, zst = _map_stats(LSE, (b * H + h) * NQ + rows, rv)\n")
    text = _swap(text, '''            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            ds = p * (dp - delta[:, None])
''', '''            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            p, ds = _map_bwd(s, ok, dp, mst, zst, delta, qp, kp, h, H, PRM)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
''')
    text = _swap(text, "            dpv += dpc\n            dkt += gk\n",
                 "            dpv += dpc + _map_pgrad(s, ok, dp, mst, zst, delta, qp, kp, h, H, PRM, NPP)\n"
                 "            dkt += gk\n")
    return _swap(text, '''        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        ds = p * (dp - delta[:, None])
''', '''        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        p, ds = _map_bwd(s, ok, dp, mst, zst, delta, qp, kp, h, H, PRM)
''')


MAP_FORWARD = _map_forward(FORWARD)
MAP_BACKWARD = _map_backward(BACKWARD)
MAP_ACC_BACKWARD = _map_backward(ACC_BACKWARD, accumulator=True)

/* The fused decoding steps for one dtype T (included by fused_decode.c with T, EXP and NAME defined).
 *
 * Every step takes the layout block, the new token's query q (B, H, 1, D), key k and value v (B, H_kv, 1, D)
 * (any batch and head strides, rows contiguous), writes the output (B, H, 1, D) contiguous into out, and the
 * position the new token takes: `next` in every row, or, when `nexts` is given, nexts[b] in row b (ragged rows),
 * each then moved on by one. Query head h reads key/value head h / G. The victim follows the reference
 * evictor's rule (Evictor.victim: argmax/argmin over the scores in position order, protected slots filled with
 * -inf/+inf): a NaN score among the eligible slots outranks every number, largest or smallest alike (torch's
 * argmax/argmin return the first NaN), so the eligible NaN-scored slot with the oldest position leaves; else the
 * largest (smallest) score, ties to the oldest position. docs/decoding.md, "Non-finite scores".
 */

static inline T NAME(dot)(const T *restrict a, const T *restrict b, i64 d) {
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (i64 i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

static inline void NAME(copy_row)(T *restrict dst, const T *restrict src, i64 d) {
    for (i64 i = 0; i < d; i++) dst[i] = src[i];
}

/* w[0..m) holds one query's logits. They become its softmax probabilities, as torch.softmax computes them: the
 * row's maximum, exp, the sum, a division. A NaN or +inf logit makes the whole row NaN. */
static void NAME(softmax)(T *restrict w, i64 m) {
    T mx = -INFINITY;
    for (i64 j = 0; j < m; j++)
        if (w[j] > mx) mx = w[j];
    T sum = 0;
    for (i64 j = 0; j < m; j++) {
        T e = EXP(w[j] - mx);
        w[j] = e;
        sum += e;
    }
    for (i64 j = 0; j < m; j++) w[j] = w[j] / sum;
}

/* The logits of the G query heads of one key/value head over m keys, scaled: w[g * m + j]. Four keys at a time,
 * so that four independent sums are in flight (one sum at a time waits on each multiply-add). */
static void NAME(group_logits)(T *restrict w, const T *restrict q0, i64 qsh, i64 g_count, const T *restrict K, i64 m,
                               i64 d, T scale) {
    for (i64 g = 0; g < g_count; g++) {
        const T *restrict qg = q0 + g * qsh;
        T *restrict wg = w + g * m;
        i64 j = 0;
        for (; j + 4 <= m; j += 4) {
            const T *restrict k0 = K + j * d, *restrict k1 = k0 + d, *restrict k2 = k1 + d, *restrict k3 = k2 + d;
            T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (i64 i = 0; i < d; i++) {
                const T x = qg[i];
                a0 += x * k0[i];
                a1 += x * k1[i];
                a2 += x * k2[i];
                a3 += x * k3[i];
            }
            wg[j] = a0 * scale;
            wg[j + 1] = a1 * scale;
            wg[j + 2] = a2 * scale;
            wg[j + 3] = a3 * scale;
        }
        for (; j < m; j++) wg[j] = NAME(dot)(qg, K + j * d, d) * scale;
    }
}

/* The outputs of the G query heads of one key/value head: o[g * d + i] = sum_j p[g * m + j] V[j, i]. Each value
 * row is read once for the G heads. */
static void NAME(group_values)(T *restrict o, const T *restrict p, i64 g_count, const T *restrict V, i64 m, i64 d) {
    for (i64 i = 0; i < g_count * d; i++) o[i] = 0;
    for (i64 j = 0; j < m; j++) {
        const T *restrict vj = V + j * d;
        for (i64 g = 0; g < g_count; g++) {
            const T pj = p[g * m + j];
            T *restrict og = o + g * d;
#pragma omp simd
            for (i64 i = 0; i < d; i++) og[i] += pj * vj[i];
        }
    }
}

/* The new token (row b) into slot `slot` of every key/value head, at position `next`, with score 0. */
static inline void NAME(write_slot)(const i64 *lay, i64 b, i64 slot, const T *k, i64 ksb, i64 ksh, const T *v,
                                    i64 vsb, i64 vsh, i64 next) {
    const i64 hkv = lay[LAY_HKV], d = lay[LAY_D];
    T *K = (T *)(intptr_t)lay[LAY_K], *V = (T *)(intptr_t)lay[LAY_V], *S = (T *)(intptr_t)lay[LAY_S];
    i64 *P = (i64 *)(intptr_t)lay[LAY_P];
    for (i64 hk = 0; hk < hkv; hk++) {
        NAME(copy_row)(K + b * lay[LAY_KSB] + hk * lay[LAY_KSH] + slot * d, k + b * ksb + hk * ksh, d);
        NAME(copy_row)(V + b * lay[LAY_VSB] + hk * lay[LAY_VSH] + slot * d, v + b * vsb + hk * vsh, d);
        P[b * lay[LAY_PSB] + hk * lay[LAY_PSH] + slot] = next;
        if (S) S[b * lay[LAY_SSB] + hk * lay[LAY_SSH] + slot] = 0;
    }
}

static void NAME(fill_nan)(T *out, i64 n) {
    for (i64 i = 0; i < n; i++) out[i] = (T)NAN;
}

/* Selective attention at its budget (selective_mask with the selective evictor). Options: OPT0 1: position 1
 * (BOS) is never the victim (the evictor's rule; decided per row, by each slot's position, so rows at other
 * offsets are ruled on their own), OPT1 the selector's key/value head, OPT2 its index in that head's group, OPT3
 * bit 0: S = 0 at position 1 (protect_bos), bit 1: S = 0 at the query's own key (no self_mask). The victim is the
 * largest F of an eligible slot (a NaN first, ties to the oldest position); the new token takes its slot with
 * F = 0; every head's logits minus F, softmax, values; S = ReLU of the selector head's logits, then F += S in
 * every key/value head (F is the same in all of them). */
int NAME(attnzoo_selective)(const i64 *lay, const T *q, i64 qsb, i64 qsh, const T *k, i64 ksb, i64 ksh,
                            const T *v, i64 vsb, i64 vsh, T *out, i64 next, i64 *nexts, double scale) {
    const i64 B = lay[LAY_B], HKV = lay[LAY_HKV], G = lay[LAY_G], D = lay[LAY_D], M = lay[LAY_M];
    const T *K = (const T *)(intptr_t)lay[LAY_K], *V = (const T *)(intptr_t)lay[LAY_V];
    const i64 *P = (const i64 *)(intptr_t)lay[LAY_P];
    T *S = (T *)(intptr_t)lay[LAY_S], *w = (T *)(intptr_t)lay[LAY_W], *s = w + G * (M + 1);
    const int protect = (int)(lay[LAY_OPT0] & 1);
    const i64 sel_kv = lay[LAY_OPT1], sel_g = lay[LAY_OPT2];
    const int bos_zero = (int)(lay[LAY_OPT3] & 1), self_zero = (int)((lay[LAY_OPT3] >> 1) & 1);
    const T sc = (T)scale;
    NAME(fill_nan)(out, B * HKV * G * D);
    for (i64 b = 0; b < B; b++) {
        const i64 nb = nexts ? nexts[b] : next;
        const i64 *p0 = P + b * lay[LAY_PSB];
        T *f0 = S + b * lay[LAY_SSB];
        i64 victim = -1, oldest = 0, nan_victim = -1, nan_oldest = 0;
        T best = 0;
        for (i64 j = 0; j < M; j++) {
            if (protect && p0[j] == 1) continue;
            const T f = f0[j];
            if (f != f) {
                if (nan_victim < 0 || p0[j] < nan_oldest) { nan_victim = j; nan_oldest = p0[j]; }
            } else if (victim < 0 || f > best || (f == best && p0[j] < oldest)) {
                best = f; victim = j; oldest = p0[j];
            }
        }
        if (nan_victim >= 0) victim = nan_victim;
        if (victim < 0) victim = 0;  /* no eligible slot: a budget >= 2 holds one position 1 at most, never here */
        NAME(write_slot)(lay, b, victim, k, ksb, ksh, v, vsb, vsh, nb);
        for (i64 hk = 0; hk < HKV; hk++) {
            const T *Kh = K + b * lay[LAY_KSB] + hk * lay[LAY_KSH], *Vh = V + b * lay[LAY_VSB] + hk * lay[LAY_VSH];
            NAME(group_logits)(w, q + b * qsb + hk * G * qsh, qsh, G, Kh, M, D, sc);
            if (hk == sel_kv)
                for (i64 j = 0; j < M; j++) {
                    const T l = w[sel_g * M + j];
                    s[j] = l < 0 ? (T)0 : l;  /* ReLU; NaN stays NaN */
                }
            for (i64 g = 0; g < G; g++) {
                T *wg = w + g * M;
                for (i64 j = 0; j < M; j++) wg[j] -= f0[j];
                NAME(softmax)(wg, M);
            }
            NAME(group_values)(out + (b * HKV + hk) * G * D, w, G, Vh, M, D);
        }
        if (bos_zero)
            for (i64 j = 0; j < M; j++)
                if (p0[j] == 1) s[j] = 0;
        if (self_zero) s[victim] = 0;
        for (i64 hk = 0; hk < HKV; hk++) {
            T *fh = S + b * lay[LAY_SSB] + hk * lay[LAY_SSH];
            for (i64 j = 0; j < M; j++) fh[j] += s[j];
        }
        if (nexts) nexts[b] += 1;
    }
    return 0;
}

/* Sink + window at its budget (no transforms): the smallest position after the first OPT0 positions (the
 * sinks) leaves, the new token takes its slot, then plain softmax attention over the held tokens. Positions are
 * distinct, so there are no ties; if no position is past the sinks, slot 0 (as the torch step's argmin). */
int NAME(attnzoo_sink_window)(const i64 *lay, const T *q, i64 qsb, i64 qsh, const T *k, i64 ksb, i64 ksh,
                              const T *v, i64 vsb, i64 vsh, T *out, i64 next, i64 *nexts, double scale) {
    const i64 B = lay[LAY_B], HKV = lay[LAY_HKV], G = lay[LAY_G], D = lay[LAY_D], M = lay[LAY_M];
    const T *K = (const T *)(intptr_t)lay[LAY_K], *V = (const T *)(intptr_t)lay[LAY_V];
    const i64 *P = (const i64 *)(intptr_t)lay[LAY_P];
    T *w = (T *)(intptr_t)lay[LAY_W];
    const i64 sink = lay[LAY_OPT0];
    const T sc = (T)scale;
    NAME(fill_nan)(out, B * HKV * G * D);
    for (i64 b = 0; b < B; b++) {
        const i64 nb = nexts ? nexts[b] : next;
        const i64 *p0 = P + b * lay[LAY_PSB];
        i64 victim = 0, oldest = INT64_MAX;
        for (i64 j = 0; j < M; j++)
            if (p0[j] > sink && p0[j] < oldest) { oldest = p0[j]; victim = j; }
        NAME(write_slot)(lay, b, victim, k, ksb, ksh, v, vsb, vsh, nb);
        for (i64 hk = 0; hk < HKV; hk++) {
            const T *Kh = K + b * lay[LAY_KSB] + hk * lay[LAY_KSH], *Vh = V + b * lay[LAY_VSB] + hk * lay[LAY_VSH];
            NAME(group_logits)(w, q + b * qsb + hk * G * qsh, qsh, G, Kh, M, D, sc);
            for (i64 g = 0; g < G; g++) NAME(softmax)(w + g * M, M);
            NAME(group_values)(out + (b * HKV + hk) * G * D, w, G, Vh, M, D);
        }
        if (nexts) nexts[b] += 1;
    }
    return 0;
}

/* H2O (OPT0 = 0) or TOVA (OPT0 = 1) at the budget, evicting after attention: the new token goes into the spare
 * slot M (the buffers hold M + 1 slots), the query attends over M + 1 tokens, the scores are updated as the
 * evictor's update() does (H2O: each key/value head adds the sum of its query heads' probabilities; TOVA: the
 * mean over all query heads replaces the score, the same in every head), and in each key/value head the smallest
 * score leaves (H2O: never one of the positions > next - OPT1, its recent window; ties to the oldest position),
 * the spare slot's token moving into its slot (nothing moves when the new token is the victim). */
int NAME(attnzoo_scoring)(const i64 *lay, const T *q, i64 qsb, i64 qsh, const T *k, i64 ksb, i64 ksh,
                          const T *v, i64 vsb, i64 vsh, T *out, i64 next, i64 *nexts, double scale) {
    const i64 B = lay[LAY_B], HKV = lay[LAY_HKV], G = lay[LAY_G], D = lay[LAY_D], M = lay[LAY_M];
    T *K = (T *)(intptr_t)lay[LAY_K], *V = (T *)(intptr_t)lay[LAY_V], *S = (T *)(intptr_t)lay[LAY_S];
    i64 *P = (i64 *)(intptr_t)lay[LAY_P];
    T *w = (T *)(intptr_t)lay[LAY_W], *t = w + G * (M + 1);
    const int tova = lay[LAY_OPT0] == 1;
    const i64 n = M + 1;
    const T sc = (T)scale;
    NAME(fill_nan)(out, B * HKV * G * D);
    for (i64 b = 0; b < B; b++) {
        const i64 nb = nexts ? nexts[b] : next, newest_unprotected = nb - lay[LAY_OPT1];
        NAME(write_slot)(lay, b, M, k, ksb, ksh, v, vsb, vsh, nb);
        if (tova)
            for (i64 j = 0; j < n; j++) t[j] = 0;
        for (i64 hk = 0; hk < HKV; hk++) {
            const T *Kh = K + b * lay[LAY_KSB] + hk * lay[LAY_KSH], *Vh = V + b * lay[LAY_VSB] + hk * lay[LAY_VSH];
            if (!tova)
                for (i64 j = 0; j < n; j++) t[j] = 0;
            NAME(group_logits)(w, q + b * qsb + hk * G * qsh, qsh, G, Kh, n, D, sc);
            for (i64 g = 0; g < G; g++) {
                NAME(softmax)(w + g * n, n);
                for (i64 j = 0; j < n; j++) t[j] += w[g * n + j];
            }
            NAME(group_values)(out + (b * HKV + hk) * G * D, w, G, Vh, n, D);
            if (!tova) {
                T *sh = S + b * lay[LAY_SSB] + hk * lay[LAY_SSH];
                for (i64 j = 0; j < n; j++) sh[j] += t[j];
            }
        }
        if (tova) {
            const T heads = (T)(HKV * G);
            for (i64 j = 0; j < n; j++) t[j] /= heads;
            for (i64 hk = 0; hk < HKV; hk++) {
                T *sh = S + b * lay[LAY_SSB] + hk * lay[LAY_SSH];
                for (i64 j = 0; j < n; j++) sh[j] = t[j];
            }
        }
        for (i64 hk = 0; hk < HKV; hk++) {
            T *sh = S + b * lay[LAY_SSB] + hk * lay[LAY_SSH];
            i64 *ph = P + b * lay[LAY_PSB] + hk * lay[LAY_PSH];
            i64 victim = -1, oldest = 0, nan_victim = -1, nan_oldest = 0;
            T best = 0;
            for (i64 j = 0; j < n; j++) {
                const T x = (!tova && ph[j] > newest_unprotected) ? (T)INFINITY : sh[j];  /* protected: +inf */
                if (x != x) {
                    if (nan_victim < 0 || ph[j] < nan_oldest) { nan_victim = j; nan_oldest = ph[j]; }
                } else if (victim < 0 || x < best || (x == best && ph[j] < oldest)) {
                    best = x; victim = j; oldest = ph[j];
                }
            }
            if (nan_victim >= 0) victim = nan_victim;
            if (victim != M) {
                T *Kh = K + b * lay[LAY_KSB] + hk * lay[LAY_KSH], *Vh = V + b * lay[LAY_VSB] + hk * lay[LAY_VSH];
                NAME(copy_row)(Kh + victim * D, Kh + M * D, D);
                NAME(copy_row)(Vh + victim * D, Vh + M * D, D);
                ph[victim] = ph[M];
                sh[victim] = sh[M];
            }
        }
        if (nexts) nexts[b] += 1;
    }
    return 0;
}

/* The plain lean step's append (no evictor): the new token into slot `slot` (< the buffers' slots) of every
 * key/value head at its row's next position, each moved on when `nexts` is given; attention is torch's. */
int NAME(attnzoo_append)(const i64 *lay, i64 slot, const T *k, i64 ksb, i64 ksh, const T *v, i64 vsb, i64 vsh,
                         i64 next, i64 *nexts) {
    const i64 B = lay[LAY_B];
    for (i64 b = 0; b < B; b++) {
        NAME(write_slot)(lay, b, slot, k, ksb, ksh, v, vsb, vsh, nexts ? nexts[b] : next);
        if (nexts) nexts[b] += 1;
    }
    return 0;
}

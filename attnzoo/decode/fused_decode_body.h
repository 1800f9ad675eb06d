/* The fused decoding steps, one batch row at a time, for one dtype T (float or double; included by
 * fused_decode.cpp, which checks every tensor and runs the rows in parallel).
 *
 * A row function takes the cache's buffers (Rows: addresses and strides, named), the new token's query q (H, 1, D)
 * of its row, key k and value v (H_kv, 1, D) (head strides qsh, ksh, vsh; rows contiguous), writes the row's output
 * (H, 1, D) contiguous into out, and the position the new token takes, nb. Query head h reads key/value head h / G.
 * `w` is the row's scratch: (G + 1) * (M + 1) elements. The victim follows the reference evictor's rule
 * (Evictor.victim: argmax/argmin over the scores in position order, protected slots filled with -inf/+inf): a NaN
 * score among the eligible slots outranks every number, largest or smallest alike (torch's argmax/argmin return the
 * first NaN), so the eligible NaN-scored slot with the oldest position leaves; else the largest (smallest) score,
 * ties to the oldest position. docs/decoding.md, "Non-finite scores".
 *
 * What fused_decode.cpp has checked before a row runs, and the arithmetic here relies on (no int64 from the caller
 * is added to or multiplied without it): every slot index below the buffers' slots (M, or M + 1 with the spare
 * slot), every stride and size within the storage, the position nb >= 1 (so nb - recent, recent >= 0, cannot wrap),
 * the selector head among the heads. Positions read from the buffers are only compared and copied.
 */
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

namespace attnzoo_fused {

typedef int64_t i64;

/* The cache's buffers: keys and values (B, H_kv, slots, D), positions and scores (B, H_kv, slots), each with its
 * batch and head strides in elements (slots contiguous); hkv, g (query heads per key/value head), d, m (held). */
template <typename T>
struct Rows {
    T *K; i64 ksb, ksh;
    T *V; i64 vsb, vsh;
    i64 *P; i64 psb, psh;
    T *S; i64 ssb, ssh;  /* nullptr when the step keeps no scores */
    i64 hkv, g, d, m;
};

template <typename T>
static inline T dot(const T *__restrict__ a, const T *__restrict__ b, i64 d) {
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (i64 i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

template <typename T>
static inline void copy_row(T *__restrict__ dst, const T *__restrict__ src, i64 d) {
    for (i64 i = 0; i < d; i++) dst[i] = src[i];
}

/* w[0..m) holds one query's logits. They become its softmax probabilities, as torch.softmax computes them: the
 * row's maximum, exp, the sum, a division. A NaN or +inf logit makes the whole row NaN. */
template <typename T>
static void softmax(T *__restrict__ w, i64 m) {
    T mx = -std::numeric_limits<T>::infinity();
    for (i64 j = 0; j < m; j++)
        if (w[j] > mx) mx = w[j];
    T sum = 0;
    for (i64 j = 0; j < m; j++) {
        T e = std::exp(w[j] - mx);
        w[j] = e;
        sum += e;
    }
    for (i64 j = 0; j < m; j++) w[j] = w[j] / sum;
}

/* The logits of the G query heads of one key/value head over m keys, scaled: w[g * m + j]. Four keys at a time,
 * so that four independent sums are in flight (one sum at a time waits on each multiply-add). */
template <typename T>
static void group_logits(T *__restrict__ w, const T *__restrict__ q0, i64 qsh, i64 g_count, const T *__restrict__ K,
                         i64 m, i64 d, T scale) {
    for (i64 g = 0; g < g_count; g++) {
        const T *__restrict__ qg = q0 + g * qsh;
        T *__restrict__ wg = w + g * m;
        i64 j = 0;
        for (; j + 4 <= m; j += 4) {
            const T *__restrict__ k0 = K + j * d;
            const T *__restrict__ k1 = k0 + d;
            const T *__restrict__ k2 = k1 + d;
            const T *__restrict__ k3 = k2 + d;
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
        for (; j < m; j++) wg[j] = dot(qg, K + j * d, d) * scale;
    }
}

/* The outputs of the G query heads of one key/value head: o[g * d + i] = sum_j p[g * m + j] V[j, i]. Each value
 * row is read once for the G heads. */
template <typename T>
static void group_values(T *__restrict__ o, const T *__restrict__ p, i64 g_count, const T *__restrict__ V, i64 m,
                         i64 d) {
    for (i64 i = 0; i < g_count * d; i++) o[i] = 0;
    for (i64 j = 0; j < m; j++) {
        const T *__restrict__ vj = V + j * d;
        for (i64 g = 0; g < g_count; g++) {
            const T pj = p[g * m + j];
            T *__restrict__ og = o + g * d;
#pragma omp simd
            for (i64 i = 0; i < d; i++) og[i] += pj * vj[i];
        }
    }
}

/* The new token (row b) into slot `slot` of every key/value head, at position `next`, with score 0. */
template <typename T>
static inline void write_slot(const Rows<T> &r, i64 b, i64 slot, const T *k, i64 ksh, const T *v, i64 vsh,
                              i64 next) {
    for (i64 hk = 0; hk < r.hkv; hk++) {
        copy_row(r.K + b * r.ksb + hk * r.ksh + slot * r.d, k + hk * ksh, r.d);
        copy_row(r.V + b * r.vsb + hk * r.vsh + slot * r.d, v + hk * vsh, r.d);
        r.P[b * r.psb + hk * r.psh + slot] = next;
        if (r.S) r.S[b * r.ssb + hk * r.ssh + slot] = 0;
    }
}

template <typename T>
static void fill_nan(T *out, i64 n) {
    for (i64 i = 0; i < n; i++) out[i] = std::numeric_limits<T>::quiet_NaN();
}

/* The selection rules by number (attnzoo/decode/layout.py SELECTION_RULES, named by a transform's declared
 * PointwiseSelection.rule in attnzoo/transforms/base.py SELECTION_RULES, whose torch function each is written
 * again here): 1 relu. Any other number is refused by the op before anything is read. */
static inline bool known_selection(i64 rule) { return rule == 1; }

template <typename T>
static inline T select_value(i64 rule, T l) {
    (void)rule;                   /* 1 (relu), the only rule known_selection() lets through */
    return l < 0 ? (T)0 : l;      /* ReLU; NaN stays NaN */
}

/* Selective attention at its budget (an accumulator declaring a pointwise selection with a named rule, with the
 * selective evictor), row b. protect_first: position 1 (BOS) is never the victim (the evictor's rule; decided per
 * row, by each slot's position, so rows at other offsets are ruled on their own); sel_kv, sel_g: the selector
 * head's key/value head and its index in that head's group; rule: the selection (select_value); zero_first: S = 0
 * at position 1 (exclude_first); zero_own: S = 0 at the query's own key (exclude_self). The victim is the largest
 * F of an eligible slot (a NaN first, ties to the oldest position); the new token takes its slot with F = 0; every
 * head's logits minus F, softmax, values; S = the rule of the selector head's logits, then F += S in every
 * key/value head (F is the same in all of them). */
template <typename T>
static void selective_row(const Rows<T> &r, i64 b, const T *q, i64 qsh, const T *k, i64 ksh, const T *v, i64 vsh,
                          T *out, i64 nb, T *w, T sc, bool protect, i64 sel_kv, i64 sel_g, i64 rule,
                          bool zero_first, bool zero_own) {
    const i64 HKV = r.hkv, G = r.g, D = r.d, M = r.m;
    T *s = w + G * (M + 1);
    fill_nan(out, HKV * G * D);
    const i64 *p0 = r.P + b * r.psb;
    T *f0 = r.S + b * r.ssb;
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
    write_slot(r, b, victim, k, ksh, v, vsh, nb);
    for (i64 hk = 0; hk < HKV; hk++) {
        const T *Kh = r.K + b * r.ksb + hk * r.ksh, *Vh = r.V + b * r.vsb + hk * r.vsh;
        group_logits(w, q + hk * G * qsh, qsh, G, Kh, M, D, sc);
        if (hk == sel_kv)
            for (i64 j = 0; j < M; j++) s[j] = select_value(rule, w[sel_g * M + j]);
        for (i64 g = 0; g < G; g++) {
            T *wg = w + g * M;
            for (i64 j = 0; j < M; j++) wg[j] -= f0[j];
            softmax(wg, M);
        }
        group_values(out + hk * G * D, w, G, Vh, M, D);
    }
    if (zero_first)
        for (i64 j = 0; j < M; j++)
            if (p0[j] == 1) s[j] = 0;
    if (zero_own) s[victim] = 0;
    for (i64 hk = 0; hk < HKV; hk++) {
        T *fh = r.S + b * r.ssb + hk * r.ssh;
        for (i64 j = 0; j < M; j++) fh[j] += s[j];
    }
}

/* Sink + window at its budget (no transforms), row b: the smallest position after the first `sinks` positions
 * leaves, the new token takes its slot, then plain softmax attention over the held tokens. Positions are distinct,
 * so there are no ties; if no position is past the sinks, slot 0 (as the torch step's argmin). */
template <typename T>
static void sink_window_row(const Rows<T> &r, i64 b, const T *q, i64 qsh, const T *k, i64 ksh, const T *v, i64 vsh,
                            T *out, i64 nb, T *w, T sc, i64 sinks) {
    const i64 HKV = r.hkv, G = r.g, D = r.d, M = r.m;
    fill_nan(out, HKV * G * D);
    const i64 *p0 = r.P + b * r.psb;
    i64 victim = 0, oldest = INT64_MAX;
    for (i64 j = 0; j < M; j++)
        if (p0[j] > sinks && p0[j] < oldest) { oldest = p0[j]; victim = j; }
    write_slot(r, b, victim, k, ksh, v, vsh, nb);
    for (i64 hk = 0; hk < HKV; hk++) {
        const T *Kh = r.K + b * r.ksb + hk * r.ksh, *Vh = r.V + b * r.vsb + hk * r.vsh;
        group_logits(w, q + hk * G * qsh, qsh, G, Kh, M, D, sc);
        for (i64 g = 0; g < G; g++) softmax(w + g * M, M);
        group_values(out + hk * G * D, w, G, Vh, M, D);
    }
}

/* H2O (tova false) or TOVA (tova true) at the budget, evicting after attention, row b: the new token goes into the
 * spare slot M (the buffers hold M + 1 slots), the query attends over M + 1 tokens, the scores are updated as the
 * evictor's update() does (H2O: each key/value head adds the sum of its query heads' probabilities; TOVA: the mean
 * over all query heads replaces the score, the same in every head), and in each key/value head the smallest score
 * leaves (H2O: never one of the positions > next - recent, its recent window; ties to the oldest position), the
 * spare slot's token moving into its slot (nothing moves when the new token is the victim). */
template <typename T>
static void scoring_row(const Rows<T> &r, i64 b, const T *q, i64 qsh, const T *k, i64 ksh, const T *v, i64 vsh,
                        T *out, i64 nb, T *w, T sc, bool tova, i64 recent) {
    const i64 HKV = r.hkv, G = r.g, D = r.d, M = r.m;
    T *t = w + G * (M + 1);
    const i64 n = M + 1, newest_unprotected = nb - recent;  /* M < the slots; nb >= 1, recent >= 0 */
    fill_nan(out, HKV * G * D);
    write_slot(r, b, M, k, ksh, v, vsh, nb);
    if (tova)
        for (i64 j = 0; j < n; j++) t[j] = 0;
    for (i64 hk = 0; hk < HKV; hk++) {
        const T *Kh = r.K + b * r.ksb + hk * r.ksh, *Vh = r.V + b * r.vsb + hk * r.vsh;
        if (!tova)
            for (i64 j = 0; j < n; j++) t[j] = 0;
        group_logits(w, q + hk * G * qsh, qsh, G, Kh, n, D, sc);
        for (i64 g = 0; g < G; g++) {
            softmax(w + g * n, n);
            for (i64 j = 0; j < n; j++) t[j] += w[g * n + j];
        }
        group_values(out + hk * G * D, w, G, Vh, n, D);
        if (!tova) {
            T *sh = r.S + b * r.ssb + hk * r.ssh;
            for (i64 j = 0; j < n; j++) sh[j] += t[j];
        }
    }
    if (tova) {
        const T heads = (T)(HKV * G);
        for (i64 j = 0; j < n; j++) t[j] /= heads;
        for (i64 hk = 0; hk < HKV; hk++) {
            T *sh = r.S + b * r.ssb + hk * r.ssh;
            for (i64 j = 0; j < n; j++) sh[j] = t[j];
        }
    }
    for (i64 hk = 0; hk < HKV; hk++) {
        T *sh = r.S + b * r.ssb + hk * r.ssh;
        i64 *ph = r.P + b * r.psb + hk * r.psh;
        i64 victim = -1, oldest = 0, nan_victim = -1, nan_oldest = 0;
        T best = 0;
        for (i64 j = 0; j < n; j++) {
            const T x = (!tova && ph[j] > newest_unprotected) ? std::numeric_limits<T>::infinity() : sh[j];  /* protected: +inf */
            if (x != x) {
                if (nan_victim < 0 || ph[j] < nan_oldest) { nan_victim = j; nan_oldest = ph[j]; }
            } else if (victim < 0 || x < best || (x == best && ph[j] < oldest)) {
                best = x; victim = j; oldest = ph[j];
            }
        }
        if (nan_victim >= 0) victim = nan_victim;
        if (victim != M) {
            T *Kh = r.K + b * r.ksb + hk * r.ksh, *Vh = r.V + b * r.vsb + hk * r.vsh;
            copy_row(Kh + victim * D, Kh + M * D, D);
            copy_row(Vh + victim * D, Vh + M * D, D);
            ph[victim] = ph[M];
            sh[victim] = sh[M];
        }
    }
}

}  // namespace attnzoo_fused

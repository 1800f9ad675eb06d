/* attnzoo's fused decoding steps on the CPU as torch ops (docs/decoding.md, "Fused in C on the CPU").
 *
 * One call does a whole lean step of one attention layer for a batch of single-token queries: the evictor's
 * victim, the new token written into its slot, attention over the held tokens and the per-token scores updated
 * in place (fused_decode_body.h, one row at a time; the rows run in parallel on torch's intra-op threads). The ops'
 * schemas and these kernels' parameter lists come from one definition, attnzoo/decode/layout.py, through the
 * generated fused_decode_ops.h; every argument is named, and the mutated ones are the schema's Tensor(x!).
 *
 * Every tensor is checked here before any element is read or written (the ops are callable by anyone through
 * torch.ops): plain strided CPU tensors of the step's dtype (float32 or float64; positions and nexts int64), no
 * negative or conjugate bit, the shapes and strides the rows assume, a storage that covers every element, and no
 * two elements of a written buffer in one place. attnzoo/decode/fused.py checks the same in Python first and takes
 * the torch step when a check fails; a failure here is a ValueError of one line.
 */
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "fused_decode_ops.h"
#include "fused_decode_body.h"

using attnzoo_fused::i64;
using attnzoo_fused::Rows;

namespace {

/* Work (multiply-adds) a chunk of rows should hold before a thread is worth its start. */
constexpr i64 kGrainWork = 1 << 15;

bool covered(const at::Tensor &t) {
    if (!t.has_storage()) return false;
    if (t.numel() == 0) return true;
    i64 last = t.storage_offset();
    for (i64 i = 0; i < t.dim(); i++) last += (t.size(i) - 1) * t.stride(i);
    return (last + 1) * (i64)t.element_size() <= (i64)t.storage().nbytes();
}

/* No two elements share memory (strides sorted ascending, each past the span of the smaller ones: sufficient). */
bool disjoint(const at::Tensor &t) {
    std::vector<std::pair<i64, i64>> dims;
    for (i64 i = 0; i < t.dim(); i++)
        if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
    std::sort(dims.begin(), dims.end());
    i64 span = 0;
    for (auto &[st, n] : dims) {
        if (st <= span) return false;
        span += st * (n - 1);
    }
    return true;
}

void plain(const char *op, const char *name, const at::Tensor &t, at::ScalarType dtype, i64 dim, bool written) {
    TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided, op, ": ", name,
                      " must be a strided CPU tensor");
    TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", at::toString(dtype), ", got ",
                      at::toString(t.scalar_type()));
    TORCH_CHECK_VALUE(!t.is_neg() && !t.is_conj(), op, ": ", name, " has the negative or conjugate bit set");
    TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got ", t.dim());
    TORCH_CHECK_VALUE(covered(t), op, ": ", name, " of shape ", t.sizes(),
                      " reaches past its storage (freed or resized after it was made?)");
    TORCH_CHECK_VALUE(!written || disjoint(t), op, ": ", name, " has elements that share memory (an expanded view?)");
}

struct Geometry {
    i64 b, h, hkv, g, d;
};

/* Checks every argument of a step; q may be undefined (the append). */
Geometry check_step(const char *op, const at::Tensor *q, const at::Tensor &k, const at::Tensor &v,
                    const std::optional<at::Tensor> &nexts, const at::Tensor &keys, const at::Tensor &values,
                    const at::Tensor &positions, const at::Tensor *scores, i64 need) {
    const at::ScalarType dtype = keys.scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble, op, ": keys must be float32 or float64, got ",
                      at::toString(dtype));
    plain(op, "keys", keys, dtype, 4, true);
    const i64 B = keys.size(0), HKV = keys.size(1), D = keys.size(3);
    TORCH_CHECK_VALUE(HKV >= 1 && D >= 1, op, ": keys of shape ", keys.sizes(), " hold no heads or no head size");
    plain(op, "values", values, dtype, 4, true);
    plain(op, "positions", positions, at::kLong, 3, true);
    for (auto [name, t] : {std::pair<const char *, const at::Tensor *>{"keys", &keys}, {"values", &values}}) {
        TORCH_CHECK_VALUE(t->size(0) == B && t->size(1) == HKV && t->size(3) == D && t->size(2) >= need, op, ": ",
                          name, " of shape ", t->sizes(), " must be (", B, ", ", HKV, ", >= ", need, ", ", D, ")");
        TORCH_CHECK_VALUE(t->stride(3) == 1 && t->stride(2) == D, op, ": ", name,
                          " must hold each slot's row contiguous, got strides ", t->strides());
    }
    std::vector<std::pair<const char *, const at::Tensor *>> per_token{{"positions", &positions}};
    if (scores) {
        plain(op, "scores", *scores, dtype, 3, true);
        per_token.emplace_back("scores", scores);
    }
    for (auto [name, t] : per_token) {
        TORCH_CHECK_VALUE(t->size(0) == B && t->size(1) == HKV && t->size(2) >= need, op, ": ", name, " of shape ",
                          t->sizes(), " must be (", B, ", ", HKV, ", >= ", need, ")");
        TORCH_CHECK_VALUE(t->stride(2) == 1, op, ": ", name, " must hold its slots contiguous, got strides ",
                          t->strides());
    }
    for (auto [name, t] : {std::pair<const char *, const at::Tensor *>{"k", &k}, {"v", &v}}) {
        plain(op, name, *t, dtype, 4, false);
        TORCH_CHECK_VALUE(t->size(0) == B && t->size(1) == HKV && t->size(2) == 1 && t->size(3) == D, op, ": ", name,
                          " of shape ", t->sizes(), " must be (", B, ", ", HKV, ", 1, ", D, ")");
        TORCH_CHECK_VALUE(t->stride(3) == 1, op, ": ", name, " must hold its rows contiguous");
    }
    i64 H = HKV;
    if (q) {
        plain(op, "q", *q, dtype, 4, false);
        H = q->size(1);
        TORCH_CHECK_VALUE(q->size(0) == B && H >= HKV && H % HKV == 0 && q->size(2) == 1 && q->size(3) == D, op,
                          ": q of shape ", q->sizes(), " must be (", B, ", a multiple of ", HKV, ", 1, ", D, ")");
        TORCH_CHECK_VALUE(q->stride(3) == 1, op, ": q must hold its rows contiguous");
    }
    if (nexts.has_value()) {
        plain(op, "nexts", *nexts, at::kLong, 1, true);
        TORCH_CHECK_VALUE(nexts->size(0) == B && nexts->is_contiguous(), op, ": nexts must be (", B,
                          ",) and contiguous, got ", nexts->sizes());
    }
    return {B, H, HKV, H / HKV, D};
}

template <typename T>
Rows<T> rows_of(const at::Tensor &keys, const at::Tensor &values, const at::Tensor &positions,
                const at::Tensor *scores, const Geometry &g, i64 held) {
    Rows<T> r;
    r.K = keys.data_ptr<T>(), r.ksb = keys.stride(0), r.ksh = keys.stride(1);
    r.V = values.data_ptr<T>(), r.vsb = values.stride(0), r.vsh = values.stride(1);
    r.P = positions.data_ptr<int64_t>(), r.psb = positions.stride(0), r.psh = positions.stride(1);
    if (scores) {
        r.S = scores->data_ptr<T>(), r.ssb = scores->stride(0), r.ssh = scores->stride(1);
    } else {
        r.S = nullptr, r.ssb = r.ssh = 0;
    }
    r.hkv = g.hkv, r.g = g.g, r.d = g.d, r.m = held;
    return r;
}

/* Runs row(rows, b, q_b, k_b, v_b, out_b, next_b, scratch) for every batch row, in parallel, each row's next
 * position then moved on when nexts is given; returns the output (B, H, 1, D). */
template <typename T, typename Row>
at::Tensor run_rows(const Rows<T> &r, const Geometry &g, const at::Tensor &q, const at::Tensor &k,
                    const at::Tensor &v, i64 next, const std::optional<at::Tensor> &nexts, i64 slots_read, Row row) {
    at::Tensor out = at::empty({g.b, g.h, 1, g.d}, q.options().memory_format(at::MemoryFormat::Contiguous));
    T *o = out.data_ptr<T>();
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const i64 qsb = q.stride(0), qsh = q.stride(1), ksb = k.stride(0), ksh = k.stride(1), vsb = v.stride(0),
              vsh = v.stride(1);
    int64_t *nx = nexts.has_value() ? nexts->data_ptr<int64_t>() : nullptr;
    const i64 work = std::max<i64>(1, 2 * g.h * slots_read * g.d);
    const i64 grain = std::max<i64>(1, kGrainWork / work);
    const i64 scratch = (g.g + 1) * (r.m + 1);
    at::parallel_for(0, g.b, grain, [&](int64_t begin, int64_t end) {
        std::vector<T> w(scratch);
        for (i64 b = begin; b < end; b++) {
            row(b, qp + b * qsb, qsh, kp + b * ksb, ksh, vp + b * vsb, vsh, o + b * g.h * g.d, nx ? nx[b] : next,
                w.data());
            if (nx) nx[b] += 1;
        }
    });
    return out;
}

ATTNZOO_SELECTIVE_STEP_RETURNS selective_step(ATTNZOO_SELECTIVE_STEP_PARAMS) {
    const char *op = "attnzoo selective_step";
    const Geometry g = check_step(op, &q, k, v, nexts, keys, values, positions, &scores, held);
    TORCH_CHECK_VALUE(held >= 1, op, ": held must be >= 1, got ", held);
    TORCH_CHECK_VALUE(selector_kv_head >= 0 && selector_kv_head < g.hkv && selector_in_group >= 0 &&
                          selector_in_group < g.g,
                      op, ": the selector head (", selector_kv_head, ", ", selector_in_group, ") is not one of ",
                      g.hkv, " key/value heads of ", g.g, " query heads");
    return AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "selective_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, &scores, g, held);
        const scalar_t sc = (scalar_t)scale;
        return run_rows<scalar_t>(r, g, q, k, v, next, nexts, held,
                                  [&](i64 b, const scalar_t *qb, i64 qsh, const scalar_t *kb, i64 ksh,
                                      const scalar_t *vb, i64 vsh, scalar_t *ob, i64 nb, scalar_t *w) {
                                      attnzoo_fused::selective_row(r, b, qb, qsh, kb, ksh, vb, vsh, ob, nb, w, sc,
                                                                   protect_first, selector_kv_head,
                                                                   selector_in_group, zero_first_score,
                                                                   zero_own_score);
                                  });
    });
}

ATTNZOO_SINK_WINDOW_STEP_RETURNS sink_window_step(ATTNZOO_SINK_WINDOW_STEP_PARAMS) {
    const char *op = "attnzoo sink_window_step";
    const Geometry g = check_step(op, &q, k, v, nexts, keys, values, positions, nullptr, held);
    TORCH_CHECK_VALUE(held >= 1, op, ": held must be >= 1, got ", held);
    return AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "sink_window_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, nullptr, g, held);
        const scalar_t sc = (scalar_t)scale;
        return run_rows<scalar_t>(r, g, q, k, v, next, nexts, held,
                                  [&](i64 b, const scalar_t *qb, i64 qsh, const scalar_t *kb, i64 ksh,
                                      const scalar_t *vb, i64 vsh, scalar_t *ob, i64 nb, scalar_t *w) {
                                      attnzoo_fused::sink_window_row(r, b, qb, qsh, kb, ksh, vb, vsh, ob, nb, w, sc,
                                                                     sinks);
                                  });
    });
}

ATTNZOO_SCORING_STEP_RETURNS scoring_step(ATTNZOO_SCORING_STEP_PARAMS) {
    const char *op = "attnzoo scoring_step";
    const Geometry g = check_step(op, &q, k, v, nexts, keys, values, positions, &scores, held + 1);
    TORCH_CHECK_VALUE(held >= 1, op, ": held must be >= 1, got ", held);
    return AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "scoring_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, &scores, g, held);
        const scalar_t sc = (scalar_t)scale;
        return run_rows<scalar_t>(r, g, q, k, v, next, nexts, held + 1,
                                  [&](i64 b, const scalar_t *qb, i64 qsh, const scalar_t *kb, i64 ksh,
                                      const scalar_t *vb, i64 vsh, scalar_t *ob, i64 nb, scalar_t *w) {
                                      attnzoo_fused::scoring_row(r, b, qb, qsh, kb, ksh, vb, vsh, ob, nb, w, sc, tova,
                                                                 recent);
                                  });
    });
}

/* The plain lean step's append (no evictor): the new token into slot `slot` of every key/value head at its row's
 * next position, each moved on when nexts is given; attention is torch's. */
ATTNZOO_APPEND_STEP_RETURNS append_step(ATTNZOO_APPEND_STEP_PARAMS) {
    const char *op = "attnzoo append_step";
    TORCH_CHECK_VALUE(slot >= 0, op, ": slot must be >= 0, got ", slot);
    const Geometry g = check_step(op, nullptr, k, v, nexts, keys, values, positions, nullptr, slot + 1);
    int64_t *nx = nexts.has_value() ? nexts->data_ptr<int64_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "append_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, nullptr, g, slot);
        const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
        for (i64 b = 0; b < g.b; b++) {  /* a copy per row: no thread is worth its start */
            attnzoo_fused::write_slot(r, b, slot, kp + b * k.stride(0), k.stride(1), vp + b * v.stride(0),
                                      v.stride(1), nx ? nx[b] : next);
            if (nx) nx[b] += 1;
        }
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ATTNZOO_OP_NAMESPACE, m) {
    m.def(ATTNZOO_SELECTIVE_STEP_SCHEMA);
    m.def(ATTNZOO_SINK_WINDOW_STEP_SCHEMA);
    m.def(ATTNZOO_SCORING_STEP_SCHEMA);
    m.def(ATTNZOO_APPEND_STEP_SCHEMA);
}

TORCH_LIBRARY_IMPL(ATTNZOO_OP_NAMESPACE, CPU, m) {
    m.impl("selective_step", &selective_step);
    m.impl("sink_window_step", &sink_window_step);
    m.impl("scoring_step", &scoring_step);
    m.impl("append_step", &append_step);
}

/* attnzoo's fused decoding steps on the CPU as torch ops (docs/decoding.md, "Fused in C on the CPU").
 *
 * One call does a whole lean step of one attention layer for a batch of single-token queries: the evictor's
 * victim, the new token written into its slot, attention over the held tokens and the per-token scores updated
 * in place (fused_decode_body.h, one row at a time; the rows run in parallel on torch's intra-op threads). The ops'
 * schemas and these kernels' parameter lists come from one definition, attnzoo/decode/layout.py, through the
 * generated fused_decode_ops.h; every argument is named, and the mutated ones are the schema's Tensor(x!).
 *
 * Every argument is checked here before any element is read or written (the ops are callable by anyone through
 * torch.ops), and the ops keep the rules torch's own in-place ops keep:
 * - plain strided CPU tensors of the step's dtype (float32 or float64; positions and nexts int64), no negative or
 *   conjugate bit, the shapes and strides the rows assume, a storage that covers every element, and no two
 *   elements of a written buffer in one place;
 * - sizes, slots and held counts compared, never added to (an int64 from the caller plus one can wrap): the
 *   buffers need more than `held` slots when the step uses the spare slot, `slot` must be below their slots;
 *   every position the op writes is >= 1 and each row's next position can move on;
 * - no tensor the op writes requires grad while grad mode is on (the op has no backward; torch refuses an in-place
 *   write to a leaf that requires grad), and none is an inference tensor outside inference mode; q, k and v do not
 *   require grad either;
 * - no argument the op writes shares memory with any other argument: disjoint address ranges pass at once, others
 *   (strided views of one storage, as vLLM's ring pages interleave keys, values, positions and scores page by
 *   page) are compared exactly, contiguous run by contiguous run;
 * and after writing, the version counter of every tensor written is bumped, so that autograd refuses a backward
 * through a value the op overwrote. attnzoo/decode/fused.py checks the buffers in Python first and takes the torch
 * step when a check fails; a failure here is a ValueError of one line naming the argument.
 */
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
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
/* The most contiguous runs one tensor is split into for the overlap check (16 bytes each). */
constexpr i64 kMaxRuns = i64(1) << 20;
/* The most dimensions a step's tensor has. */
constexpr int kMaxDims = 4;

/* The storage holds every element of t (overflow-safe: a size or stride that does not fit is not covered). */
bool covered(const at::Tensor &t) {
    if (!t.has_storage()) return false;
    if (t.numel() == 0) return true;
    i64 last = t.storage_offset(), step = 0, end = 0;
    if (last < 0) return false;
    for (i64 i = 0; i < t.dim(); i++) {
        if (t.stride(i) < 0 || c10::mul_overflows(t.size(i) - 1, t.stride(i), &step) ||
            c10::add_overflows(last, step, &last))
            return false;
    }
    if (c10::add_overflows(last, i64(1), &end) || c10::mul_overflows(end, i64(t.element_size()), &end)) return false;
    return (uint64_t)end <= (uint64_t)t.storage().nbytes();
}

/* No two elements share memory (strides sorted ascending, each past the span of the smaller ones: sufficient). */
bool disjoint(const at::Tensor &t) {
    std::pair<i64, i64> dims[kMaxDims];
    int n = 0;
    for (i64 i = 0; i < t.dim() && n < kMaxDims; i++)
        if (t.size(i) > 1) dims[n++] = {t.stride(i), t.size(i)};
    std::sort(dims, dims + n);
    i64 span = 0, step = 0;
    for (int i = 0; i < n; i++) {
        if (dims[i].first <= span || c10::mul_overflows(dims[i].first, dims[i].second - 1, &step) ||
            c10::add_overflows(span, step, &span))
            return false;
    }
    return true;
}

void plain(const char *op, const char *name, const at::Tensor &t, at::ScalarType dtype, i64 dim, bool written) {
    TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided, op, ": ", name,
                      " must be a strided CPU tensor (every argument on the CPU)");
    TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", at::toString(dtype), ", got ",
                      at::toString(t.scalar_type()));
    TORCH_CHECK_VALUE(!t.is_neg() && !t.is_conj(), op, ": ", name, " has the negative or conjugate bit set");
    TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got ", t.dim());
    TORCH_CHECK_VALUE(covered(t), op, ": ", name, " of shape ", t.sizes(),
                      " reaches past its storage (freed or resized after it was made?)");
    TORCH_CHECK_VALUE(!written || disjoint(t), op, ": ", name, " has elements that share memory (an expanded view?)");
}

/* One argument of a step for the rules every argument keeps (autograd, inference mode, overlap): its name, the
 * tensor (nullptr when not given), whether the op writes it, the bytes it spans [lo, hi) (lo == hi: none) and,
 * made only when another argument's span meets its own, its contiguous runs of bytes, sorted and merged. */
struct Arg {
    const char *name;
    const at::Tensor *t;
    bool written;
    uintptr_t lo = 0, hi = 0;
    bool split = false;
    std::vector<std::pair<uintptr_t, uintptr_t>> runs;
    Arg(const char *name_, const at::Tensor *t_, bool written_) : name(name_), t(t_), written(written_) {}
};

/* a's contiguous runs: the dimensions (stride > 0, size > 1) by stride, those whose stride is the run so far
 * coalesced into it, the others enumerated. At most kMaxRuns, else a refusal naming a and the other argument. */
void split_runs(const char *op, Arg &a, const Arg &other) {
    if (a.split) return;
    a.split = true;
    const at::Tensor &t = *a.t;
    std::pair<i64, i64> dims[kMaxDims];  // (stride, size)
    int n = 0;
    for (i64 i = 0; i < t.dim() && n < kMaxDims; i++)
        if (t.size(i) > 1 && t.stride(i) > 0) dims[n++] = {t.stride(i), t.size(i)};
    std::sort(dims, dims + n);
    i64 run = 1;  // elements; a product of sizes of t: at most its numel
    int k = 0;
    while (k < n && dims[k].first == run) run *= dims[k++].second;
    i64 count = 1;
    for (int i = k; i < n; i++) {
        TORCH_CHECK_VALUE(dims[i].second <= kMaxRuns / count, op, ": ", a.name, " and ", other.name,
                          " lie in one range of memory and ", a.name, " is in more than ", kMaxRuns,
                          " separate pieces there: too many to check that they do not overlap");
        count *= dims[i].second;
    }
    const uintptr_t es = (uintptr_t)t.element_size();
    a.runs.reserve((size_t)count);
    i64 index[kMaxDims] = {0, 0, 0, 0}, off = 0;  // elements from the first; within the span (covered)
    for (i64 c = 0; c < count; c++) {
        a.runs.emplace_back(a.lo + (uintptr_t)off * es, a.lo + (uintptr_t)(off + run) * es);
        for (int i = k; i < n; i++) {  // the next run: the smallest stride moves fastest
            if (++index[i] < dims[i].second) {
                off += dims[i].first;
                break;
            }
            off -= (dims[i].second - 1) * dims[i].first;
            index[i] = 0;
        }
    }
    std::sort(a.runs.begin(), a.runs.end());
    size_t kept = 0;  // merged: a read tensor's runs may overlap each other
    for (size_t i = 0; i < a.runs.size(); i++) {
        if (kept && a.runs[i].first <= a.runs[kept - 1].second)
            a.runs[kept - 1].second = std::max(a.runs[kept - 1].second, a.runs[i].second);
        else
            a.runs[kept++] = a.runs[i];
    }
    a.runs.resize(kept);
}

/* Whether a and b share a byte. */
bool overlap(const char *op, Arg &a, Arg &b) {
    if (a.lo == a.hi || b.lo == b.hi || a.hi <= b.lo || b.hi <= a.lo) return false;
    split_runs(op, a, b);
    split_runs(op, b, a);
    size_t i = 0, j = 0;
    while (i < a.runs.size() && j < b.runs.size()) {
        if (a.runs[i].second <= b.runs[j].first)
            i++;
        else if (b.runs[j].second <= a.runs[i].first)
            j++;
        else
            return true;
    }
    return false;
}

/* The rules torch's in-place ops keep, over every argument (each already checked by plain()). */
void check_rules(const char *op, Arg *args, int count) {
    const bool grad = c10::GradMode::is_enabled(), inference = c10::InferenceMode::is_enabled();
    for (int i = 0; i < count; i++) {
        Arg &a = args[i];
        if (!a.t) continue;
        const at::Tensor &t = *a.t;
        if (a.written) {
            TORCH_CHECK_VALUE(!(grad && t.requires_grad()), op, ": ", a.name,
                              " requires grad: the op writes it in place and has no backward (call it under "
                              "torch.no_grad(), or pass a tensor that does not require grad)");
            TORCH_CHECK_VALUE(inference || !t.is_inference(), op, ": ", a.name,
                              " is an inference tensor: it can be written in place only inside "
                              "torch.inference_mode()");
        } else {
            TORCH_CHECK_VALUE(!(grad && t.requires_grad()), op, ": ", a.name,
                              " requires grad, and the op has no backward (call it under torch.no_grad(), or pass ",
                              a.name, ".detach())");
        }
        if (t.numel() > 0) {  // covered: the sums below fit
            i64 last = 0;
            for (i64 d = 0; d < t.dim(); d++) last += (t.size(d) - 1) * t.stride(d);
            a.lo = (uintptr_t)t.data_ptr();
            a.hi = a.lo + (uintptr_t)(last + 1) * (uintptr_t)t.element_size();
        }
    }
    for (int i = 0; i < count; i++)
        for (int j = i + 1; j < count; j++) {
            Arg &a = args[i], &b = args[j];
            if (!a.t || !b.t || !(a.written || b.written) || !overlap(op, a, b)) continue;
            const Arg &w = a.written ? a : b, &o = a.written ? b : a;
            TORCH_CHECK_VALUE(false, op, ": ", w.name, " and ", o.name, " share memory: the op writes ", w.name,
                              ", which no other argument may overlap");
        }
}

/* After writing: every written tensor's version counter moves on, as torch's in-place ops move it (a no-op for
 * an inference tensor inside inference mode). */
void bump(Arg *args, int count) {
    for (int i = 0; i < count; i++)
        if (args[i].t && args[i].written) args[i].t->unsafeGetTensorImpl()->bump_version();
}

/* The position the step writes: `next` for every row, or nexts[b] in row b, each moved on by one afterwards (so
 * below the largest int64). Positions are 1-based. */
void check_next(const char *op, i64 next, const std::optional<at::Tensor> &nexts) {
    if (!nexts.has_value()) {
        TORCH_CHECK_VALUE(next >= 1, op, ": next must be a position >= 1, got ", next);
        return;
    }
    const int64_t *nx = nexts->data_ptr<int64_t>();
    for (i64 b = 0; b < nexts->size(0); b++)
        TORCH_CHECK_VALUE(nx[b] >= 1 && nx[b] < std::numeric_limits<int64_t>::max(), op, ": nexts[", b, "] = ",
                          nx[b], " is not a position the op can write and move on (1 <= nexts[b] < 2**63 - 1)");
}

struct Geometry {
    i64 b, h, hkv, g, d;
};

/* The arguments of a step, for check_rules and bump: q (absent for the append), k, v, nexts, keys, values,
 * positions, scores (absent without scores). */
struct Args {
    Arg a[8];
    Args(const at::Tensor *q, const at::Tensor &k, const at::Tensor &v, const std::optional<at::Tensor> &nexts,
         const at::Tensor &keys, const at::Tensor &values, const at::Tensor &positions, const at::Tensor *scores)
        : a{{"q", q, false},
            {"k", &k, false},
            {"v", &v, false},
            {"nexts", nexts.has_value() ? &*nexts : nullptr, true},
            {"keys", &keys, true},
            {"values", &values, true},
            {"positions", &positions, true},
            {"scores", scores, true}} {}
};

/* Checks every argument of a step (`args`: the same tensors, for the rules every argument keeps); q may be
 * undefined (the append). The buffers hold at least `held` slots, more than `held` when `spare` (the step writes
 * slot `held`: the spare slot, or the append's slot). */
Geometry check_step(const char *op, const at::Tensor *q, const at::Tensor &k, const at::Tensor &v,
                    const std::optional<at::Tensor> &nexts, const at::Tensor &keys, const at::Tensor &values,
                    const at::Tensor &positions, const at::Tensor *scores, i64 held, bool spare, i64 next,
                    Args &args) {
    const at::ScalarType dtype = keys.scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble, op, ": keys must be float32 or float64, got ",
                      at::toString(dtype));
    plain(op, "keys", keys, dtype, 4, true);
    const i64 B = keys.size(0), HKV = keys.size(1), D = keys.size(3);
    TORCH_CHECK_VALUE(HKV >= 1 && D >= 1, op, ": keys of shape ", keys.sizes(), " hold no heads or no head size");
    plain(op, "values", values, dtype, 4, true);
    plain(op, "positions", positions, at::kLong, 3, true);
    const char *room = spare ? ", > " : ", >= ";  // compared, not held + 1: an int64 from the caller may be the largest
    auto fits = [&](const at::Tensor &t) { return spare ? t.size(2) > held : t.size(2) >= held; };
    for (auto [name, t] : {std::pair<const char *, const at::Tensor *>{"keys", &keys}, {"values", &values}}) {
        TORCH_CHECK_VALUE(t->size(0) == B && t->size(1) == HKV && t->size(3) == D && fits(*t), op, ": ", name,
                          " of shape ", t->sizes(), " must be (", B, ", ", HKV, room, held, ", ", D, ")");
        TORCH_CHECK_VALUE(t->stride(3) == 1 && t->stride(2) == D, op, ": ", name,
                          " must hold each slot's row contiguous, got strides ", t->strides());
    }
    std::vector<std::pair<const char *, const at::Tensor *>> per_token{{"positions", &positions}};
    if (scores) {
        plain(op, "scores", *scores, dtype, 3, true);
        per_token.emplace_back("scores", scores);
    }
    for (auto [name, t] : per_token) {
        TORCH_CHECK_VALUE(t->size(0) == B && t->size(1) == HKV && fits(*t), op, ": ", name, " of shape ",
                          t->sizes(), " must be (", B, ", ", HKV, room, held, ")");
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
    check_rules(op, args.a, 8);
    check_next(op, next, nexts);
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

/* A row's scratch, (G + 1) * (M + 1) elements (checked: q expanded over many heads has no storage to bound it). */
i64 scratch_of(const Geometry &g, i64 m, const at::Tensor &q) {
    i64 g1 = 0, m1 = 0, scratch = 0;
    TORCH_CHECK_VALUE(!c10::add_overflows(g.g, i64(1), &g1) && !c10::add_overflows(m, i64(1), &m1) &&
                          !c10::mul_overflows(g1, m1, &scratch),
                      "attnzoo: q of shape ", q.sizes(), " has too many query heads per key/value head for ", m,
                      " held tokens");
    return scratch;
}

/* A row's multiply-adds, 2 H slots D (at least 1; the largest int64 where the product does not fit). */
i64 work_of(const Geometry &g, i64 slots_read) {
    i64 work = 2;
    if (c10::mul_overflows(work, g.h, &work) || c10::mul_overflows(work, slots_read, &work) ||
        c10::mul_overflows(work, g.d, &work))
        return std::numeric_limits<i64>::max();
    return std::max<i64>(1, work);
}

/* Runs row(rows, b, q_b, k_b, v_b, out_b, next_b, scratch) for every batch row, in parallel, each row's next
 * position then moved on when nexts is given; returns the output (B, H, 1, D). */
template <typename T, typename Row>
at::Tensor run_rows(const Rows<T> &r, const Geometry &g, const at::Tensor &q, const at::Tensor &k,
                    const at::Tensor &v, i64 next, const std::optional<at::Tensor> &nexts, i64 slots_read, Row row) {
    const i64 scratch = scratch_of(g, r.m, q), grain = std::max<i64>(1, kGrainWork / work_of(g, slots_read));
    at::Tensor out = at::empty({g.b, g.h, 1, g.d}, q.options().memory_format(at::MemoryFormat::Contiguous));
    T *o = out.data_ptr<T>();
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const i64 qsb = q.stride(0), qsh = q.stride(1), ksb = k.stride(0), ksh = k.stride(1), vsb = v.stride(0),
              vsh = v.stride(1);
    int64_t *nx = nexts.has_value() ? nexts->data_ptr<int64_t>() : nullptr;
    at::parallel_for(0, g.b, grain, [&](int64_t begin, int64_t end) {
        std::vector<T> w(scratch);
        for (i64 b = begin; b < end; b++) {
            row(b, qp + b * qsb, qsh, kp + b * ksb, ksh, vp + b * vsb, vsh, o + b * g.h * g.d, nx ? nx[b] : next,
                w.data());
            if (nx) nx[b] += 1;  /* checked below the largest int64 */
        }
    });
    return out;
}

ATTNZOO_SELECTIVE_STEP_RETURNS selective_step(ATTNZOO_SELECTIVE_STEP_PARAMS) {
    const char *op = "attnzoo selective_step";
    TORCH_CHECK_VALUE(held >= 1, op, ": held must be >= 1, got ", held);
    Args args(&q, k, v, nexts, keys, values, positions, &scores);
    const Geometry g = check_step(op, &q, k, v, nexts, keys, values, positions, &scores, held, false, next, args);
    TORCH_CHECK_VALUE(selector_kv_head >= 0 && selector_kv_head < g.hkv && selector_in_group >= 0 &&
                          selector_in_group < g.g,
                      op, ": the selector head (", selector_kv_head, ", ", selector_in_group, ") is not one of ",
                      g.hkv, " key/value heads of ", g.g, " query heads");
    TORCH_CHECK_VALUE(attnzoo_fused::known_selection(selection_rule), op, ": selection_rule ", selection_rule,
                      " is not a rule this step computes (1: relu)");
    at::Tensor out = AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "selective_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, &scores, g, held);
        const scalar_t sc = (scalar_t)scale;
        return run_rows<scalar_t>(r, g, q, k, v, next, nexts, held,
                                  [&](i64 b, const scalar_t *qb, i64 qsh, const scalar_t *kb, i64 ksh,
                                      const scalar_t *vb, i64 vsh, scalar_t *ob, i64 nb, scalar_t *w) {
                                      attnzoo_fused::selective_row(r, b, qb, qsh, kb, ksh, vb, vsh, ob, nb, w, sc,
                                                                   protect_first, selector_kv_head,
                                                                   selector_in_group, selection_rule,
                                                                   zero_first_score, zero_own_score);
                                  });
    });
    bump(args.a, 8);
    return out;
}

ATTNZOO_SINK_WINDOW_STEP_RETURNS sink_window_step(ATTNZOO_SINK_WINDOW_STEP_PARAMS) {
    const char *op = "attnzoo sink_window_step";
    TORCH_CHECK_VALUE(held >= 1, op, ": held must be >= 1, got ", held);
    Args args(&q, k, v, nexts, keys, values, positions, nullptr);
    const Geometry g = check_step(op, &q, k, v, nexts, keys, values, positions, nullptr, held, false, next, args);
    at::Tensor out = AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "sink_window_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, nullptr, g, held);
        const scalar_t sc = (scalar_t)scale;
        return run_rows<scalar_t>(r, g, q, k, v, next, nexts, held,
                                  [&](i64 b, const scalar_t *qb, i64 qsh, const scalar_t *kb, i64 ksh,
                                      const scalar_t *vb, i64 vsh, scalar_t *ob, i64 nb, scalar_t *w) {
                                      attnzoo_fused::sink_window_row(r, b, qb, qsh, kb, ksh, vb, vsh, ob, nb, w, sc,
                                                                     sinks);
                                  });
    });
    bump(args.a, 8);
    return out;
}

ATTNZOO_SCORING_STEP_RETURNS scoring_step(ATTNZOO_SCORING_STEP_PARAMS) {
    const char *op = "attnzoo scoring_step";
    TORCH_CHECK_VALUE(held >= 1, op, ": held must be >= 1, got ", held);
    TORCH_CHECK_VALUE(recent >= 0, op, ": recent must be >= 0, got ", recent);  /* next - recent: no overflow */
    Args args(&q, k, v, nexts, keys, values, positions, &scores);
    const Geometry g = check_step(op, &q, k, v, nexts, keys, values, positions, &scores, held, true, next, args);
    at::Tensor out = AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "scoring_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, &scores, g, held);
        const scalar_t sc = (scalar_t)scale;
        return run_rows<scalar_t>(r, g, q, k, v, next, nexts, held + 1,  /* held < the slots: no overflow */
                                  [&](i64 b, const scalar_t *qb, i64 qsh, const scalar_t *kb, i64 ksh,
                                      const scalar_t *vb, i64 vsh, scalar_t *ob, i64 nb, scalar_t *w) {
                                      attnzoo_fused::scoring_row(r, b, qb, qsh, kb, ksh, vb, vsh, ob, nb, w, sc, tova,
                                                                 recent);
                                  });
    });
    bump(args.a, 8);
    return out;
}

/* The plain lean step's append (no evictor): the new token into slot `slot` of every key/value head at its row's
 * next position, each moved on when nexts is given; attention is torch's. */
ATTNZOO_APPEND_STEP_RETURNS append_step(ATTNZOO_APPEND_STEP_PARAMS) {
    const char *op = "attnzoo append_step";
    TORCH_CHECK_VALUE(slot >= 0, op, ": slot must be >= 0, got ", slot);
    Args args(nullptr, k, v, nexts, keys, values, positions, nullptr);
    const Geometry g = check_step(op, nullptr, k, v, nexts, keys, values, positions, nullptr, slot, true, next, args);
    int64_t *nx = nexts.has_value() ? nexts->data_ptr<int64_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "append_step", [&] {
        const Rows<scalar_t> r = rows_of<scalar_t>(keys, values, positions, nullptr, g, slot);
        const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
        for (i64 b = 0; b < g.b; b++) {  /* a copy per row: no thread is worth its start */
            attnzoo_fused::write_slot(r, b, slot, kp + b * k.stride(0), k.stride(1), vp + b * v.stride(0),
                                      v.stride(1), nx ? nx[b] : next);
            if (nx) nx[b] += 1;  /* checked below the largest int64 */
        }
    });
    bump(args.a, 8);
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

/* attnzoo's fused decoding steps on the CPU (docs/decoding.md, "A step validated once").
 *
 * One call does a whole lean step of one attention layer for a batch of single-token queries: the evictor's
 * victim, the new token written into its slot, attention over the held tokens and the per-token scores updated
 * in place. What a step may assume (shapes, dtypes, contiguity, a cache at its budget, the evictor's options) is
 * checked once in Python (attnzoo/backends/fused_decode.py) when the step is offered and whenever the buffers
 * change; the C code trusts the layout it is given.
 *
 * The maths is that of BlockedBackend's torch lean steps (attnzoo/backends/blocked.py), which are tested against
 * the float64 reference; this file is compiled once per process with the system's C compiler and its steps are
 * tested against the same reference (tests/test_decode.py). The steps for one dtype live in
 * fused_decode_body.h, included twice below: float (keys in float32, scores in float32) and double.
 *
 * Layout block: an int64 array (the LAY_* indices below), filled by the Python side. Buffers are (B, H_kv, slots)
 * with any batch and head strides, slots contiguous (keys and values: a slot is a contiguous row of D elements).
 */
#include <math.h>
#include <stdint.h>

typedef int64_t i64;

enum {
    LAY_B, LAY_HKV, LAY_G, LAY_D, LAY_M,      /* batch, key/value heads, query heads per kv head, head size, held */
    LAY_K, LAY_KSB, LAY_KSH,                  /* key buffer address, batch and head strides (elements) */
    LAY_V, LAY_VSB, LAY_VSH,                  /* value buffer */
    LAY_P, LAY_PSB, LAY_PSH,                  /* positions (int64) */
    LAY_S, LAY_SSB, LAY_SSH,                  /* per-token scores: F, H2O's or TOVA's (0 when there are none) */
    LAY_W,                                    /* scratch: (G + 1) * (M + 1) elements */
    LAY_OPT0, LAY_OPT1, LAY_OPT2, LAY_OPT3,   /* the step's options (see each step) */
    LAY_SIZE
};

i64 attnzoo_fused_layout_size(void) { return LAY_SIZE; }

#define T float
#define EXP expf
#define NAME(x) x##_f32
#include "fused_decode_body.h"
#undef T
#undef EXP
#undef NAME

#define T double
#define EXP exp
#define NAME(x) x##_f64
#include "fused_decode_body.h"
#undef T
#undef EXP
#undef NAME

"""Tiny hand-written attention in plain Python floats, independent of torch and of attnzoo."""

import math


def softmax_out(logit_rows, values):
    """logit_rows: one list per query, None where masked; values: one float per key (D = 1)."""
    out = []
    for row in logit_rows:
        allowed = [(l, v) for l, v in zip(row, values, strict=True) if l is not None]
        if not allowed:
            out.append(0.0)
            continue
        m = max(l for l, _ in allowed)
        weights = [math.exp(l - m) for l, _ in allowed]
        out.append(sum(w * v for w, (_, v) in zip(weights, allowed, strict=True)) / sum(weights))
    return out


def causal(rows):
    return [[x if j <= i else None for j, x in enumerate(r)] for i, r in enumerate(rows)]


def gelu(x):
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))

"""Spec → Triton source: the template of ``template.py`` plus helper functions written from the spec's transforms.

The output depends only on the spec (its canonical form) and :data:`GENERATOR_VERSION`: the same spec gives
byte-identical source. Every fragment is marked with the transform it came from.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ...transforms.base import LogitsTransform, NormaliserTransform, ProbabilityTransform, RowMapTransform, Slot
from ...transforms.lowering import TritonLogits, TritonMask, TritonProbability, TritonSelection
from .template import (
    ACC_BACKWARD,
    ACC_FORWARD,
    ACC_SHARED,
    BACKWARD,
    COMMON,
    FORWARD,
    MAP_ACC_BACKWARD,
    MAP_BACKWARD,
    MAP_COMMON,
    MAP_FORWARD,
)

#: Bump when the template or the generated helpers change meaning: it is part of every artifact's key.
GENERATOR_VERSION = "5"

#: the integer kernel arguments Triton must not specialise on their values (every one but the head dim D)
SIZES = ("H", "HKV", "NQ", "NK", "KPB", "KPHS", "NMB", "NNB", "TQS", "TKS", "NT", "SEL")


@dataclass(frozen=True)
class Layout:
    """What the host side needs to know about a generated kernel: the packed per-head parameters (their
    params keys, in the order of the ``PRM`` rows), the selector head (None without an accumulator), the
    transforms whose per-token terms the host computes (``LogitsTransform.separable``: rows of ``QT``/``KT``) and
    how the probability map runs: None (the softmax), ``"pointwise"`` or ``"ratio"`` (in the kernels, with two
    statistics per row in LSE), or ``"softmax"`` (a ``softmax_map`` transform: the softmax kernels over its
    ``values``, then its ``combine``, on the host)."""

    params: tuple[str, ...]
    selector: int | None
    terms: tuple[str, ...] = ()
    probability: str | None = None


def host_termed(plan, t) -> bool:
    """A logits transform the kernels add as host-computed per-token terms ``row_i + col_j`` (its separable form):
    one with per-token features (a fragment cannot compute them), or one without a Triton lowering."""
    if t.slot is not Slot.LOGITS or type(t).separable is LogitsTransform.separable:
        return False
    return t in plan.composition.feature_transforms() or t.triton() is None


def problems(plan) -> list[str]:
    """Why this spec cannot be lowered to Triton (empty: it can)."""
    reasons = []
    for t in plan.transforms:
        if isinstance(t, (RowMapTransform, NormaliserTransform)):
            continue  # computed by the host with the transform's torch maths
        if isinstance(t, ProbabilityTransform):
            reasons += _probability_problems(t)
            continue
        if host_termed(plan, t):
            if plan.one(Slot.ACCUMULATOR) is not None:
                reasons.append(f"transform '{t.kind}': per-token terms with an accumulator are not lowered (the "
                               "selector's kernels do not load them)")
            continue
        if t in plan.composition.feature_transforms():
            reasons.append(f"transform '{t.kind}' computes per-token features but is not separable (the kernels "
                           "load per-token terms row_i + col_j: LogitsTransform.separable)")
            continue
        lowering = t.triton()
        want = {Slot.LOGITS: TritonLogits, Slot.MASK: TritonMask, Slot.ACCUMULATOR: TritonSelection}[t.slot]
        if lowering is None:
            reasons.append(f"transform '{t.kind}' ({t.slot.value}) has no Triton lowering")
            continue
        if not isinstance(lowering, want):
            reasons.append(f"transform '{t.kind}': its Triton lowering must be a {want.__name__}")
            continue
        if t.slot is Slot.ACCUMULATOR and len(t.heads()) != 1:
            reasons.append(f"transform '{t.kind}': the Triton accumulator reads exactly one selector head")
        if t.slot is Slot.LOGITS:
            reasons += _parameter_problems(t, lowering)
        reasons += _fragment_problems(t, lowering)
    return reasons


def _parameter_problems(t, lowering) -> list[str]:
    """A lowering's per-head parameters against the transform's declared ones (logits and probability maps)."""
    reasons = []
    declared = {p.name: p for p in t.parameters()}
    if len(lowering.param_derivatives) != len(lowering.params):
        reasons.append(f"transform '{t.kind}': Triton lowering needs one derivative per parameter")
    for name in lowering.params:
        if name not in declared or tuple(declared[name].shape) != ("H",):
            reasons.append(f"transform '{t.kind}': Triton lowerings read per-head parameters of shape (H,) only, "
                           f"not '{name}'")
    if set(declared) - set(lowering.params):
        reasons.append(f"transform '{t.kind}': its Triton lowering ignores a learnable parameter")
    return reasons


def _probability_problems(t) -> list[str]:
    """Why probability transform ``t`` cannot be lowered (empty: it can). A ``softmax_map`` needs no fragment (the
    softmax kernels run over its values, the host combines); any other map needs a :class:`TritonProbability`."""
    if type(t).softmax_map:
        return []
    if t.order != "any":
        return [f"transform '{t.kind}' (probability) takes key blocks in order '{t.order}' (its blocked form visits "
                "them from the nearest back, carrying what the later keys left): the generated kernels merge key "
                "blocks in any order, so it is not lowered"]
    lowering = t.triton()
    if lowering is None:
        return [f"transform '{t.kind}' (probability) has no Triton lowering"]
    if not isinstance(lowering, TritonProbability):
        return [f"transform '{t.kind}': its Triton lowering must be a TritonProbability"]
    if lowering.mode not in ("pointwise", "ratio"):
        return [f"transform '{t.kind}': its Triton lowering's mode must be 'pointwise' or 'ratio', not "
                f"{lowering.mode!r}"]
    reasons = []
    if lowering.mode == "ratio" and (lowering.params or lowering.param_derivatives):
        reasons.append(f"transform '{t.kind}': a ratio map's Triton lowering reads no parameters (not lowered yet)")
    return reasons + _parameter_problems(t, lowering) + _fragment_problems(t, lowering)


def _fragment_problems(t, lowering) -> list[str]:
    """Each fragment of a lowering filled in as the generator fills it, and parsed as a Python expression: a
    misspelt placeholder or a syntax error is named here, with the transform and the fragment, rather than as a
    KeyError or a SyntaxError in the generated kernels."""
    if isinstance(lowering, TritonLogits):
        names = {f"p_{name}": f"p{i}" for i, name in enumerate(lowering.params)}
        fragments = [("forward", lowering.forward, {"x": "x", **names}),
                     ("derivative", lowering.derivative, {"x": "x", "y": "y", **names}),
                     *((f"param_derivatives[{i}]", expr, {"x": "x", "y": "y", **names})
                       for i, expr in enumerate(lowering.param_derivatives))]
    elif isinstance(lowering, TritonMask):
        fragments = [("allowed", lowering.allowed, None)]  # inserted as written (no placeholders)
    elif isinstance(lowering, TritonProbability):
        names = {f"p_{name}": f"p{i}" for i, name in enumerate(lowering.params)}
        fragments = [(field, text, {**{n: n for n in fill}, **names}) for field, text, fill in lowering.fragments()]
    else:
        fragments = [("keep", lowering.keep or "True", None), ("value", lowering.value, {"x": "x"}),
                     ("derivative", lowering.derivative, {"x": "x"})]
    reasons = []
    for field, text, fill in fragments:
        where = f"transform '{t.kind}': Triton fragment {field} {text!r}"
        try:
            expr = text if fill is None else text.format(**fill)
        except KeyError as exc:
            known = ", ".join("{" + k + "}" for k in fill) or "none (it takes no placeholders)"
            reasons.append(f"{where} uses the placeholder {{{exc.args[0]}}}, which is not one of {known}")
            continue
        except (IndexError, ValueError) as exc:
            reasons.append(f"{where} is not a valid template ({exc}; write {{{{ and }}}} for literal braces)")
            continue
        try:
            ast.parse(expr, mode="eval")
        except SyntaxError as exc:
            reasons.append(f"{where} is not a Python expression ({exc.msg})")
    return reasons


@functools.cache
def _generator_digest() -> str:
    """The template and this module (read once per process)."""
    text = "\n".join([COMMON, ACC_SHARED, ACC_FORWARD, ACC_BACKWARD, FORWARD, BACKWARD, MAP_COMMON, MAP_FORWARD,
                      MAP_BACKWARD, MAP_ACC_BACKWARD, Path(__file__).read_text()])
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(plan) -> str:
    """A digest of everything besides the spec that shapes the generated source: the template, this module, and
    each transform's lowering as it is now (so a plugin that changes a fragment never reuses a stale artifact)."""
    parts = [_generator_digest()] + [f"{t.kind}:{t.slot.value}:{None if host_termed(plan, t) else t.triton()!r}"
                                     for t in plan.transforms]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _map_lowering(plan):
    """(the probability transform, its TritonProbability), or (the transform, None) for a ``softmax_map`` (no
    fragment), or (None, None) without a probability transform. Called once :func:`problems` is empty."""
    mapped = plan.one(Slot.PROBABILITY)
    if mapped is None or type(mapped).softmax_map:
        return mapped, None
    low = mapped.triton()
    if not isinstance(low, TritonProbability):
        raise ValueError(f"transform '{mapped.kind}' (probability) has no Triton lowering")
    return mapped, low


def layout(plan) -> Layout:
    lowered = [t for t in plan.many(Slot.LOGITS) if not host_termed(plan, t)]
    params = tuple(f"{t.kind}.{name}" for t in lowered for name in t.triton().params)
    mapped, low = _map_lowering(plan)
    if low is not None:  # the map's per-head parameters follow the logits' in PRM
        params += tuple(f"{mapped.kind}.{name}" for name in low.params)
    acc = plan.one(Slot.ACCUMULATOR)
    return Layout(params=params, selector=acc.heads()[0] if acc is not None else None,
                  terms=tuple(t.kind for t in plan.many(Slot.LOGITS) if host_termed(plan, t)),
                  probability=None if mapped is None else (low.mode if low is not None else "softmax"))


def _param_names(t, index0: int) -> dict[str, str]:
    return {f"p_{name}": f"p{index0 + i}" for i, name in enumerate(t.triton().params)}


#: what fragments see at a tile's rows past the last query and columns past the last key (template.py's docstring)
_OUT_OF_RANGE = ["    Fragments see qp = 1 at rows past the last query and kp = 1 at columns past the last key (in",
                 "    decoding, rows past the KV group see head = the group's last head); what they compute there,",
                 "    and at every pair outside _allowed, is discarded by tl.where(ok, ...), never multiplied by 0."]


def _mask_helper(plan) -> list[str]:
    lines = ["@triton.jit", "def _allowed(qp, kp, head, valid):",
             '    """Which pairs may attend: attention.causal and every mask transform, intersected with valid',
             '    (in range, and the key mask).', *_OUT_OF_RANGE[:-1], _OUT_OF_RANGE[-1] + '"""',
             "    ok = valid"]
    if plan.causal:
        lines += ["    # --- attention.causal ---", "    ok = ok & (kp <= qp)"]
    for t in plan.many(Slot.MASK):
        lines += [f"    # --- from transform '{t.kind}' (mask) ---", f"    ok = ok & ({t.triton().allowed})"]
    return lines + ["    return ok"]


_TERMS = "QT, KT, qoff, koff, qm, km, TQS, TKS"


def _logits_helpers(plan) -> list[str]:
    fwd = ["@triton.jit", f"def _logits(x, qp, kp, head, H, PRM, {_TERMS}):",
           '    """The logits slot: each transform in spec order, on float32 tiles. Host-computed per-token terms',
           '    (QT/KT row t, at qoff/koff where qm/km) are added where their transform stands.',
           *_OUT_OF_RANGE[:-1], _OUT_OF_RANGE[-1] + '"""']
    bwd = ["@triton.jit",
           f"def _logits_bwd(g, ok, x, qp, kp, head, H, PRM, NPP: tl.constexpr, {_TERMS}, NTP: tl.constexpr):",
           '    """Chain rule back through the logits slot: g (dL/d output) -> dL/d input, the summed gradients of',
           '    the per-head parameters as a vector (entry i: packed parameter i), and the gradients of the',
           '    per-token terms: row sums gq (BLOCK_M, NTP) and column sums gk (BLOCK_N, NTP), column t for term t.',
           *_OUT_OF_RANGE,
           '    ok: the pairs _allowed lets attend; g and its product with every fragment are 0.0 outside it."""',
           "    g = tl.where(ok, g, 0.0)", "    dpv = tl.zeros([NPP], tl.float32)", "    x0 = x",
           "    gq = tl.zeros([x.shape[0], NTP], tl.float32)", "    gk = tl.zeros([x.shape[1], NTP], tl.float32)"]
    steps = []
    index = 0
    term = 0
    for i, t in enumerate(plan.many(Slot.LOGITS)):
        if host_termed(plan, t):
            add = (f"(tl.load(QT + {term} * TQS + qoff, mask=qm, other=0.0) "
                   f"+ tl.load(KT + {term} * TKS + koff, mask=km, other=0.0))")
            mark = f"    # --- from transform '{t.kind}' (logits, per-token terms: QT/KT row {term}) ---"
            fwd += [mark, f"    x = x + {add}"]
            bwd += [mark, f"    x{i + 1} = x{i} + {add}"]
            steps.append((i, t, None, term, None))
            term += 1
            continue
        low = t.triton()
        names = _param_names(t, index)
        loads = [f"    {var} = tl.load(PRM + {index + j} * H + head)" for j, var in enumerate(names.values())]
        fwd += [f"    # --- from transform '{t.kind}' (logits) ---", *loads,
                f"    x = {low.forward.format(x='x', **names)}"]
        bwd += [f"    # --- from transform '{t.kind}' (logits) ---", *loads,
                f"    x{i + 1} = {low.forward.format(x=f'x{i}', **names)}"]
        steps.append((i, t, low, names, index))
        index += len(low.params)
    for i, t, low, names, first in reversed(steps):
        if low is None:  # a per-token term: d/d(row_i) and d/d(col_j) are 1, g passes unchanged
            bwd += [f"    # --- back through '{t.kind}' (per-token terms) ---",
                    f"    gq += tl.where(tl.arange(0, NTP)[None, :] == {names}, tl.sum(g, 1)[:, None], 0.0)",
                    f"    gk += tl.where(tl.arange(0, NTP)[None, :] == {names}, tl.sum(g, 0)[:, None], 0.0)"]
            continue
        fmt = dict(x=f"x{i}", y=f"x{i + 1}", **names)
        bwd.append(f"    # --- back through '{t.kind}' ---")
        for j, expr in enumerate(low.param_derivatives):
            bwd.append(f"    dpv += tl.where(tl.arange(0, NPP) == {first + j}, "
                       f"tl.sum(tl.sum(tl.where(ok, g * ({expr.format(**fmt)}), 0.0), 1), 0), 0.0)")
        bwd.append(f"    g = tl.where(ok, g * ({low.derivative.format(**fmt)}), 0.0)")
    return fwd + ["    return x"], bwd + ["    return g, dpv, gq, gk"]


def _selection_helpers(plan):
    acc = plan.one(Slot.ACCUMULATOR)
    low = acc.triton()
    keep = f"ok & ({low.keep})" if low.keep else "ok"
    mark = f"    # --- from transform '{acc.kind}' (accumulator, selector head {acc.heads()[0]}) ---"
    return (["@triton.jit", "def _select(x, ok, qp, kp):", mark,
             f"    return tl.where({keep}, {low.value.format(x='x')}, 0.0)"],
            ["@triton.jit", "def _select_grad(x, ok, qp, kp):", mark,
             f"    return tl.where({keep}, {low.derivative.format(x='x')}, 0.0)"])


def _map_helpers(plan) -> tuple[list[list[str]], list[list[str]]]:
    """The probability map's helpers (forward, backward), from its TritonProbability: ``_map_start`` (a row's shift
    before any key), ``_map_step`` (one key tile merged into a row), ``_map_total`` (the final shift and
    denominator); ``_map_bwd`` (the weights and dL/ds on a tile) and ``_map_pgrad`` (the map's per-head parameter
    gradients on a tile)."""
    mapped, low = _map_lowering(plan)
    first = len(layout(plan).params) - len(low.params)  # the map's rows of PRM follow the logits'
    names = {f"p_{name}": f"p{first + i}" for i, name in enumerate(low.params)}
    loads = [f"    p{first + j} = tl.load(PRM + {first + j} * H + head)" for j in range(len(low.params))]
    mark = f"    # --- from transform '{mapped.kind}' (probability, {low.mode}) ---"
    ratio = low.mode == "ratio"
    floor = 'float("-inf")' if low.shift_floor == float("-inf") else repr(float(low.shift_floor))
    discard = ['    Values computed outside ok (pairs _allowed rejects, out-of-range rows and columns) are discarded',
               '    by tl.where, never multiplied by 0."""']
    start = ["@triton.jit", "def _map_start(BLOCK_M: tl.constexpr):",
             f'    """A row\'s running shift before any key: the shift floor ({low.mode} map)."""',
             f"    return tl.full([BLOCK_M], {'0.0' if not ratio else floor}, tl.float32)"]
    step = ["@triton.jit", "def _map_step(s, ok, m_i, qp, kp, head, H, PRM):",
            '    """The probability slot on one key tile: (the new running shift, the factor e^(m_old - m_new) that',
            '    rescales the running sums, the numerator weights (BLOCK_M, BLOCK_N), the tile\'s denominator terms',
            '    summed per row). s: the logits after the logits slot and -F, -inf outside ok.', *discard, mark, *loads]
    total = ["@triton.jit", "def _map_total(m_i, l_i, qp, head, H, PRM, BLOCK_M: tl.constexpr):",
             '    """After the last key tile: (the final shift, the denominator Z = sum D + C); outputs: acc / Z."""',
             mark, *loads]
    bwd = ["@triton.jit", "def _map_bwd(s, ok, dp, mst, zst, delta, qp, kp, head, H, PRM):",
           '    """The probability slot backward on one tile: (the weights, dL/ds) from dp = dO V^T, the row\'s',
           '    statistics (mst: shift, zst: denominator) and delta = rowsum(dO O).', *discard, mark, *loads,
           "    x = s"]
    pgrad = ["@triton.jit", "def _map_pgrad(s, ok, dp, mst, zst, delta, qp, kp, head, H, PRM, NPP: tl.constexpr):",
             '    """The summed gradients of the map\'s per-head parameters on one tile, as a vector (entry i: packed',
             '    parameter i).', *discard, "    dpv = tl.zeros([NPP], tl.float32)"]
    if not ratio:
        weight = low.weight.format(x="x", **names)
        fill = dict(x="x", y="y", **names)
        step += ["    x = s", f"    w = tl.where(ok, {weight}, 0.0)",
                 "    return m_i, m_i * 0.0 + 1.0, w, m_i * 0.0  # no normalisation: shift 0, nothing to rescale"]
        total += ["    return m_i, m_i * 0.0 + 1.0  # no normalisation: Z = 1"]
        bwd += [f"    y = {weight}",
                f"    return tl.where(ok, y, 0.0), tl.where(ok, dp * ({low.derivative.format(**fill)}), 0.0)"]
        if low.params:
            pgrad += [mark, *loads, "    x = s", f"    y = {weight}"]
        for j, expr in enumerate(low.param_derivatives):
            pgrad.append(f"    dpv += tl.where(tl.arange(0, NPP) == {first + j}, "
                         f"tl.sum(tl.sum(tl.where(ok, dp * ({expr.format(**fill)}), 0.0), 1), 0), 0.0)")
    else:
        fill = dict(x="x", m="m")
        masked = "    ok = ok & (s != float(\"-inf\"))  # a logit of -inf is a masked pair: it adds to neither sum"
        step += [masked, '    m_new = tl.maximum(m_i, tl.max(tl.where(ok, s, float("-inf")), 1))',
                 '    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)',
                 "    alpha = tl.exp(m_i - m_safe)", "    x = s", "    m = m_safe[:, None]",
                 f"    num = tl.where(ok, {low.numerator.format(**fill)}, 0.0)",
                 f"    den = tl.sum(tl.where(ok, {low.denominator.format(**fill)}, 0.0), 1)",
                 "    return m_new, alpha, num, den"]
        total += ['    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)', "    m = m_fin[:, None]",
                  f"    c = ({low.constant.format(m='m')}) + tl.zeros([BLOCK_M, 1], tl.float32)",
                  "    return m_fin, l_i + tl.sum(c, 1)"]
        bwd += [masked, "    m = mst[:, None]", "    z = tl.where(zst == 0.0, 1.0, zst)[:, None]",
                "    # dL/dx_k = (N'(x_k) dp_k - D'(x_k) delta) / Z, delta = sum_j w_j dp_j = rowsum(dO O)",
                f"    w = tl.where(ok, ({low.numerator.format(**fill)}) / z, 0.0)",
                f"    ds = tl.where(ok, (({low.numerator_derivative.format(**fill)}) * dp "
                f"- ({low.denominator_derivative.format(**fill)}) * delta[:, None]) / z, 0.0)",
                "    return w, ds"]
    return [start, step, total], [bwd, pgrad + ["    return dpv"]]


def _function_json(spec) -> str:
    return json.dumps(spec.model_dump(mode="json", exclude={"summary"}), sort_keys=True, separators=(",", ":"))


def generate(plan) -> dict[str, str]:
    """The Triton sources of ``plan``'s spec: ``{"forward": ..., "backward": ...}`` (the backward kernels load
    only when a backward pass runs). Raises ValueError when the spec cannot be lowered."""
    reasons = problems(plan)
    if reasons:
        raise ValueError("; ".join(reasons))
    spec = plan.spec
    rows = [t for t in plan.transforms if isinstance(t, RowMapTransform)]
    logits, logits_bwd = _logits_helpers(plan)
    has_acc = plan.one(Slot.ACCUMULATOR) is not None
    select, select_grad = _selection_helpers(plan) if has_acc else ([], [])
    mapped, low = _map_lowering(plan)
    map_forward, map_backward = _map_helpers(plan) if low is not None else ([], [])
    # new text only for a spec with a probability map: every other spec's source is as before, byte for byte
    if low is not None:
        described = [f"probability map (the _map_* helpers; LSE holds each row's shift and denominator): "
                     f"{mapped.kind} ({low.mode})"]
    elif mapped is not None:
        described = [f"probability map on the host around these softmax kernels (its values before, its combine "
                     f"after): {mapped.kind}"]
    else:
        described = []
    sources = {}
    for part in ("forward", "backward"):
        header = [
            f'"""Triton {part} kernels for attnzoo spec \'{spec.name}\' (generated; do not edit).',
            "",
            f"spec hash: {spec.hash}",
            f"generator: {GENERATOR_VERSION}",
            f"spec (canonical, summary left out): {_function_json(spec)}",
            "row scales applied outside the kernels (torch): "
            + (", ".join(f"{t.kind} ({t.slot.value})" for t in rows) or "none"),
            f"packed per-head parameters (PRM rows): {', '.join(layout(plan).params) or 'none'}",
            f"per-token terms computed by the host (QT/KT rows): {', '.join(layout(plan).terms) or 'none'}",
            "normaliser (per-head sink logits, SINK): "
            + (f"{plan.one(Slot.NORMALISER).kind}" if plan.one(Slot.NORMALISER) is not None else "none"),
            *described,
            '"""',
            "",
            "import triton",
            "import triton.language as tl",
            "",
            "# sizes and indices are not specialised on their values (only D is: its divisibility keeps loads",
            "# vectorised), so a kernel compiled at build time (attnzoo build --compile-for) serves every sequence",
            "# length, batch and head count",
            f"SIZES = {list(SIZES)!r}",
        ]
        helpers = [header, _mask_helper(plan), logits]
        # with a map in the kernels: its helpers, and the kernels with the softmax's statistics swapped for them
        kernels = [MAP_COMMON, MAP_FORWARD if part == "forward" else MAP_BACKWARD] if low is not None else [
            FORWARD if part == "forward" else BACKWARD]
        if part == "forward":
            helpers += map_forward
            tail = ([select, ACC_SHARED, ACC_FORWARD] if has_acc else []) + [COMMON, *kernels]
        else:
            helpers += [logits_bwd, *map_backward]
            acc_backward = MAP_ACC_BACKWARD if low is not None else ACC_BACKWARD
            tail = ([select, select_grad, ACC_SHARED, acc_backward] if has_acc else []) + [COMMON, *kernels]
        blocks = ["\n".join(lines) for lines in helpers] + ["\n".join(t) if isinstance(t, list) else t.strip("\n")
                                                         for t in tail]
        sources[part] = "\n\n\n".join(blocks) + "\n"
    return sources

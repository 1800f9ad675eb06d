"""Spec → Triton source: the template of ``template.py`` plus helper functions written from the spec's transforms.

The output depends only on the spec (its canonical form) and :data:`GENERATOR_VERSION`: the same spec gives
byte-identical source. Every fragment is marked with the transform it came from.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ...transforms.base import NormaliserTransform, RowMapTransform, Slot
from ...transforms.lowering import TritonLogits, TritonMask, TritonSelection
from .template import ACC_BACKWARD, ACC_FORWARD, ACC_SHARED, BACKWARD, COMMON, FORWARD

#: Bump when the template or the generated helpers change meaning: it is part of every artifact's key.
GENERATOR_VERSION = "2"


@dataclass(frozen=True)
class Layout:
    """What the host side needs to know about a generated kernel: the packed per-head parameters (their
    params keys, in the order of the ``PRM`` rows) and the selector head (None without an accumulator)."""

    params: tuple[str, ...]
    selector: int | None


def problems(plan) -> list[str]:
    """Why this spec cannot be lowered to Triton (empty: it can)."""
    reasons = []
    for t in plan.transforms:
        if isinstance(t, (RowMapTransform, NormaliserTransform)):
            continue  # computed by the host with the transform's torch maths
        if t in plan.feature_transforms():
            reasons.append(f"transform '{t.kind}' computes per-token features, which the Triton kernels do not load "
                           "yet")
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
            declared = {p.name: p for p in t.parameters()}
            if len(lowering.param_derivatives) != len(lowering.params):
                reasons.append(f"transform '{t.kind}': Triton lowering needs one derivative per parameter")
            for name in lowering.params:
                if name not in declared or tuple(declared[name].shape) != ("H",):
                    reasons.append(f"transform '{t.kind}': Triton lowerings read per-head parameters of shape "
                                   f"(H,) only, not '{name}'")
            if set(declared) - set(lowering.params):
                reasons.append(f"transform '{t.kind}': its Triton lowering ignores a learnable parameter")
    return reasons


@functools.cache
def _generator_digest() -> str:
    """The template and this module (read once per process)."""
    text = "\n".join([COMMON, ACC_SHARED, ACC_FORWARD, ACC_BACKWARD, FORWARD, BACKWARD, Path(__file__).read_text()])
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(plan) -> str:
    """A digest of everything besides the spec that shapes the generated source: the template, this module, and
    each transform's lowering as it is now (so a plugin that changes a fragment never reuses a stale artifact)."""
    parts = [_generator_digest()] + [f"{t.kind}:{t.slot.value}:{t.triton()!r}" for t in plan.transforms]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def layout(plan) -> Layout:
    params = tuple(f"{t.kind}.{name}" for t in plan.many(Slot.LOGITS) for name in t.triton().params)
    acc = plan.one(Slot.ACCUMULATOR)
    return Layout(params=params, selector=acc.heads()[0] if acc is not None else None)


def _param_names(t, index0: int) -> dict[str, str]:
    return {f"p_{name}": f"p{index0 + i}" for i, name in enumerate(t.triton().params)}


def _mask_helper(plan) -> list[str]:
    lines = ["@triton.jit", "def _allowed(qp, kp, head, valid):",
             '    """Which pairs may attend: attention.causal and every mask transform, intersected."""',
             "    ok = valid"]
    if plan.causal:
        lines += ["    # --- attention.causal ---", "    ok = ok & (kp <= qp)"]
    for t in plan.many(Slot.MASK):
        lines += [f"    # --- from transform '{t.kind}' (mask) ---", f"    ok = ok & ({t.triton().allowed})"]
    return lines + ["    return ok"]


def _logits_helpers(plan) -> list[str]:
    fwd = ["@triton.jit", "def _logits(x, qp, kp, head, H, PRM):",
           '    """The logits slot: each transform in spec order, on float32 tiles."""']
    bwd = ["@triton.jit", "def _logits_bwd(g, x, qp, kp, head, H, PRM, NPP: tl.constexpr):",
           '    """Chain rule back through the logits slot: g (dL/d output) -> dL/d input, and the summed',
           '    gradients of the per-head parameters as a vector (entry i: packed parameter i)."""',
           "    dpv = tl.zeros([NPP], tl.float32)", "    x0 = x"]
    steps = []
    index = 0
    for i, t in enumerate(plan.many(Slot.LOGITS)):
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
        fmt = dict(x=f"x{i}", y=f"x{i + 1}", **names)
        bwd.append(f"    # --- back through '{t.kind}' ---")
        for j, expr in enumerate(low.param_derivatives):
            bwd.append(f"    dpv += tl.where(tl.arange(0, NPP) == {first + j}, "
                       f"tl.sum(tl.sum(g * ({expr.format(**fmt)}), 1), 0), 0.0)")
        bwd.append(f"    g = g * ({low.derivative.format(**fmt)})")
    return fwd + ["    return x"], bwd + ["    return g, dpv"]


def _selection_helpers(plan):
    acc = plan.one(Slot.ACCUMULATOR)
    low = acc.triton()
    keep = f"ok & ({low.keep})" if low.keep else "ok"
    mark = f"    # --- from transform '{acc.kind}' (accumulator, selector head {acc.heads()[0]}) ---"
    return (["@triton.jit", "def _select(x, ok, qp, kp):", mark,
             f"    return tl.where({keep}, {low.value.format(x='x')}, 0.0)"],
            ["@triton.jit", "def _select_grad(x, ok, qp, kp):", mark,
             f"    return tl.where({keep}, {low.derivative.format(x='x')}, 0.0)"])


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
            "normaliser (per-head sink logits, SINK): "
            + (f"{plan.one(Slot.NORMALISER).kind}" if plan.one(Slot.NORMALISER) is not None else "none"),
            '"""',
            "",
            "import triton",
            "import triton.language as tl",
        ]
        helpers = [header, _mask_helper(plan), logits]
        if part == "forward":
            tail = ([select, ACC_SHARED, ACC_FORWARD] if has_acc else []) + [COMMON, FORWARD]
        else:
            helpers.append(logits_bwd)
            tail = ([select, select_grad, ACC_SHARED, ACC_BACKWARD] if has_acc else []) + [COMMON, BACKWARD]
        blocks = ["\n".join(lines) for lines in helpers] + ["\n".join(t) if isinstance(t, list) else t.strip("\n")
                                                         for t in tail]
        sources[part] = "\n\n\n".join(blocks) + "\n"
    return sources

"""Checks of what a spec's transforms compute that need no formula: the reference's gradients are the derivatives of
its outputs (``finite-differences``: a learnable parameter that no gradient reaches is caught, whatever the
backends agree on), and a probability map's weights as the map returns them (``weights``: the dtype, exact zeros at
the pairs that are not allowed, rows that sum to 1 where the map declares it). Both read the transforms through the
reference backend, so they are the same for every backend under test (computed once per run) and hold the truth
itself to account; and a probability map's blocked form (``map-blocks``: ``start``, ``update`` and ``finish`` over
key blocks of 4) against its weights, which the blocked backend takes only past one key block of its own size.
Built on :mod:`.checks`.
"""

from __future__ import annotations

import torch

from ..dispatch import Variant
from ..errors import UnsupportedError
from ..transforms.base import Slot
from .checks import Shape, Target, Unsupported, compare, memo, random_case
from .vectors import run_batch

#: the inputs of the finite-difference check: small (every perturbation is one forward pass), GQA, two rows
FD_SHAPE = Shape("finite-differences", 2, 4, 2, 6, 4)
#: central-difference steps, tried in order until one agrees (a step that crosses a kink of relu or a max disagrees)
FD_STEPS = (1e-6, 1e-5, 1e-7)
#: agreement: |autograd - differences| <= FD_RTOL * max(|autograd|, |differences|) + FD_ATOL * (1 + |f|)
FD_RTOL, FD_ATOL = 1e-5, 1e-8
#: a parameter of at most this many elements is checked element by element, a larger one per leading index
FD_ELEMENTS = 8


def _objective(variant, inputs: dict) -> float:
    """<out, cotangent> of the reference in float64 (the scalar whose gradient ``run_batch`` takes)."""
    out = run_batch(variant, inputs, torch.float64, False)["out"]
    return float((out * inputs["cotangent"]).sum())


def _directions(name: str, tensor: torch.Tensor, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """(where, direction) pairs that perturb ``tensor``: per batch row and head for q, k, v and per-token inputs
    (B, H, N[, D]); per element for a small parameter, per leading index for a larger one; each direction is random
    (normal) on its part and 0 elsewhere."""
    out = []
    if name in ("q", "k", "v") or name.startswith("input."):
        head = "key/value head" if name in ("k", "v") else "head"
        for b in range(tensor.shape[0]):
            for h in range(tensor.shape[1]):
                d = torch.zeros_like(tensor)
                d[b, h] = torch.randn(d[b, h].shape, generator=gen, dtype=torch.float64)
                out.append((f"batch row {b}, {head} {h}", d))
        return out
    if tensor.numel() <= FD_ELEMENTS:
        for index in range(tensor.numel()):
            d = torch.zeros(tensor.numel(), dtype=torch.float64)
            d[index] = 1.0
            at = torch.unravel_index(torch.tensor(index), tensor.shape) if tensor.dim() else ()
            where = tuple(int(i) for i in at)
            out.append((f"element {where}" if where else "the scalar", d.view(tensor.shape)))
        return out
    for index in range(tensor.shape[0]):
        d = torch.zeros_like(tensor)
        d[index] = torch.randn(d[index].shape, generator=gen, dtype=torch.float64)
        out.append((f"index {index} (a random direction)", d))
    return out


def _named(name: str) -> str:
    """How a failure line names what was perturbed: q, k, v, or the transform and its parameter or input."""
    if name.startswith(("param.", "input.")):
        what, key = name.split(".", 1)
        kind, _, short = key.rpartition(".")
        return f"transform '{kind}' {'parameter' if what == 'param' else 'per-token input'} '{short}'"
    return name


def finite_difference_problem(target: Target) -> str | None:
    """The first disagreement between the reference's float64 gradients (autograd through the transforms' torch
    maths) and central differences of its outputs, as one line, or None."""
    variant = target.reference()
    inputs = random_case(target, FD_SHAPE)
    with torch.enable_grad():
        grads = run_batch(variant, inputs, torch.float64, True)
    if not all(bool(torch.isfinite(t).all()) for t in grads.values()):
        return None  # the differential checks report a non-finite reference (and trace it to its transform)
    f0 = abs(_objective(variant, inputs))
    gen = target.generator("finite-differences")
    for key in sorted(k for k in grads if k.startswith("grad.")):
        name = key.removeprefix("grad.")
        tensor = inputs[name]
        for where, direction in _directions(name, tensor, gen):
            auto = float((grads[key] * direction).sum())
            seen = []
            for step in FD_STEPS:
                plus = _objective(variant, {**inputs, name: tensor + step * direction})
                minus = _objective(variant, {**inputs, name: tensor - step * direction})
                numeric = (plus - minus) / (2 * step)
                seen.append(numeric)
                if abs(auto - numeric) <= FD_RTOL * max(abs(auto), abs(numeric)) + FD_ATOL * (1 + f0):
                    break
            else:
                numeric = seen[0]
                hint = " (no gradient reaches it: detached, or computed outside autograd?)" if auto == 0 else ""
                return (f"finite differences (float64, the reference): {_named(name)}, {where}: autograd gives "
                        f"{auto:.6g} where central differences of the outputs give {numeric:.6g}{hint}")
    return None


def check_finite_differences(target: Target) -> None:
    """The reference's float64 gradients with respect to q, k, v, every transform parameter and every per-token
    input equal central differences of its outputs, on small seeded inputs (B = 2, 4 query heads over 2, N = 6,
    D = 4): per batch row and head for the token inputs, per element (or per leading index) for a parameter.
    Computed once per spec and run (it does not depend on the backend under test)."""
    if target.dtype != torch.float64:
        raise Unsupported("finite differences run in float64 only (the reference's own float64 gradients)")
    problem = memo(target, ("finite-differences",), lambda: finite_difference_problem(target) or "")
    if problem:
        raise AssertionError(problem)


# -- a probability map's weights --------------------------------------------------------------------------------
#: the inputs of the weights check: GQA, a key mask that leaves a query with no key, an odd length
WEIGHTS_SHAPE = Shape("weights", 2, 4, 2, 13, 8, masked_rows=True)


def normalised(mapped) -> bool:
    """Whether the map declares that each row with an allowed key sums to 1: the class attribute ``normalised``,
    or ``softmax_map`` (its weights are the masked softmax)."""
    return bool(getattr(mapped, "normalised", False) or getattr(mapped, "softmax_map", False))


def weights_problem(mapped, logits: torch.Tensor, allowed: torch.Tensor, ctx, weights) -> str | None:
    """What is wrong with ``weights`` as ``mapped.weights(logits, allowed, ctx, ...)`` returned them, as one line
    naming the transform (and the batch row, head and positions where it matters), or None."""
    name = f"transform '{mapped.kind}' (probability)"
    if not isinstance(weights, torch.Tensor):
        return f"{name}: weights() returned {type(weights).__name__}, not a tensor"
    if weights.shape != logits.shape:
        return f"{name}: weights() returned shape {tuple(weights.shape)} for logits of shape {tuple(logits.shape)}"
    dtype = str(logits.dtype).removeprefix("torch.")
    if weights.dtype != logits.dtype:
        return (f"{name}: weights() returned {str(weights.dtype).removeprefix('torch.')} weights for {dtype} logits: "
                f"return the logits' dtype (a backend casts them quietly, so the precision asked for is not the one "
                f"computed)")
    allowed = allowed.expand_as(weights)
    w = weights.detach()
    nonzero = ~allowed & (w != 0)
    if bool(nonzero.any()):
        b, h, i, j = (int(x) for x in nonzero.nonzero()[0].tolist())
        qpos = int(ctx.qpos.expand(*w.shape[:3], 1)[b, h, i, 0])
        kpos = int(ctx.kpos.expand(w.shape[0], w.shape[1], 1, w.shape[3])[b, h, 0, j])
        return (f"{name}: weights() gives {float(w[b, h, i, j]):.3g} at a pair that is not allowed (batch row {b}, "
                f"head {h}, query position {qpos}, key position {kpos}; {int(nonzero.sum())} such pairs, in {dtype}): "
                f"it must be exactly 0 there")
    if normalised(mapped):
        rows = allowed.any(-1)
        total = w.to(torch.float64).sum(-1)
        tol = 4 * torch.finfo(w.dtype).eps * max(1, w.shape[-1])
        off = rows & ((total - 1).abs() > tol)
        if bool(off.any()):
            b, h, i = (int(x) for x in off.nonzero()[0].tolist())
            qpos = int(ctx.qpos.expand(*w.shape[:3], 1)[b, h, i, 0])
            return (f"{name}: a row of weights sums to {float(total[b, h, i]):.7g}, not 1 (off by "
                    f"{float(total[b, h, i] - 1):.2g}; batch row {b}, head {h}, "
                    f"query position {qpos}, in {dtype}), but the map declares its rows normalised "
                    f"({'softmax_map' if getattr(mapped, 'softmax_map', False) else 'normalised'} = True)")
    return None


def weights_problem_of(target: Target) -> str | None:
    """Runs the reference's batch form in the target's dtype and reads every call of the map's ``weights``."""
    variant = target.reference()
    mapped = variant.plan.one(Slot.PROBABILITY)
    original = mapped.weights
    problems: list[str] = []

    def watched(logits, allowed, ctx, params):
        weights = original(logits, allowed, ctx, params)
        if not problems:
            problem = weights_problem(mapped, logits, allowed, ctx, weights)
            if problem:
                problems.append(problem)
        return weights

    mapped.weights = watched
    try:
        run_batch(variant, random_case(target, WEIGHTS_SHAPE), target.dtype, False)
    finally:
        del mapped.weights
    return problems[0] if problems else None


def check_weights(target: Target) -> None:
    """A probability map's weights as it returns them to the reference (batch form, GQA, a query with no key, in
    the tested dtype): the logits' dtype, exactly 0 at every pair that is not allowed, and each row with an allowed
    key summing to 1 (within a few units in the last place per key) where the map declares ``normalised`` or
    ``softmax_map``. Computed once per spec and dtype (it does not depend on the backend under test)."""
    if "probability" not in target.spec.slots():
        raise Unsupported("spec has no probability map")
    problem = memo(target, ("weights", target.dtype), lambda: weights_problem_of(target) or "")
    if problem:
        raise AssertionError(problem)


#: the blocked form's check: key and query blocks of MAP_BLOCK, so that every row merges several key blocks; GQA, a
#: masked row, positions with gaps
MAP_BLOCK = 4
MAP_BLOCKS_SHAPE = Shape("map-blocks-n21", 2, 4, 2, 21, 8, masked_rows=True, offset=True)


class _SmallBlocks(Variant):
    """The spec on the blocked backend with blocks of :data:`MAP_BLOCK` keys and queries (the registered one keeps
    its own size: 256, so a map's blocked form runs only past 256 visible keys)."""

    def backend_for(self, device, dtype, mode):
        from ..backends.blocked import BlockedBackend

        registered = super().backend_for(device, dtype, mode)  # the registered blocked backend's verdict first
        return BlockedBackend(MAP_BLOCK, f"{registered.name} (blocks of {MAP_BLOCK})")


def map_blocks_problem(target: Target) -> str | None:
    """The blocked backend's outputs and gradients with blocks of :data:`MAP_BLOCK`, in the target's dtype, against
    the float64 reference's (the tolerance of the differential checks); None when they agree."""
    inputs = random_case(target, MAP_BLOCKS_SHAPE)
    truth = run_batch(target.reference(), inputs, torch.float64, True)
    low = run_batch(target.reference(), inputs, target.dtype, True) if target.dtype != torch.float64 else None
    try:
        got = run_batch(_SmallBlocks(target.spec, "blocked", target.registry), inputs, target.dtype, True)
    except UnsupportedError as exc:  # the blocked backend declines the spec: nothing of the blocked form to check
        raise Unsupported(f"the blocked backend declines the spec: {exc}") from None
    try:
        compare(target, f"map-blocks {MAP_BLOCKS_SHAPE.id} (blocks of {MAP_BLOCK} keys)", got, truth, low, inputs)
    except AssertionError as exc:
        return str(exc)
    return None


def check_map_blocks(target: Target) -> None:
    """A probability map's blocked form (``start``, ``update``, ``finish``, ``combine``: what the blocked backend
    runs once a query block sees more keys than its block size) over key and query blocks of :data:`MAP_BLOCK`,
    outputs and gradients against the float64 reference on fresh inputs (GQA, a masked row, positions with gaps).
    Computed once per spec and dtype, whatever the backend under test: the registered blocked backend takes the
    map's ``weights`` (its reference form) while the visible keys fit one block of its own size (256), so the
    differential checks at small sizes do not reach the blocked form."""
    if "probability" not in target.spec.slots():
        raise Unsupported("spec has no probability map")
    if "blocked" not in target.registry.backends:
        raise Unsupported("no blocked backend registered")
    problem = memo(target, ("map-blocks", target.dtype), lambda: map_blocks_problem(target) or "")
    if problem:
        raise AssertionError(problem)

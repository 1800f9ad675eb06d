"""The suite's shared pieces and its batch checks. :class:`Target` (a spec on a backend in a dtype on a device),
the shapes and profiles, seeded inputs, the memo of reference results and :func:`close`, the tolerance rule that
traces a non-finite result to its transform; then the checks of the batch form (stored vectors, differential
shapes, ``return_accumulated``, packed documents, causality, batch invariance, determinism). The decode checks are in
:mod:`.checks_decode`. Each check raises AssertionError with one line on failure and :class:`Unsupported` when it
does not apply or the backend declines the case (with its reason).

What a green run proves, and what it cannot, is written in docs/conformance.md.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import Mode, batch_mode
from ..dispatch import Variant
from ..inputs import check_positions, check_qkv
from .fragments import fragment_culprit
from .tolerance import check_close
from .trace import culprit
from .vectors import VectorCase, inputs_of, load, make_inputs, params_of, run_batch, run_case

HALF = (torch.float16, torch.bfloat16)
#: First position of the offset shapes: past float16's largest finite value (65,504).
OFFSET = 69_990


class Unsupported(Exception):
    """The check does not apply to this spec, or the backend declined the case; the message says why."""


class Declined(Unsupported):
    """The backend declined the case. ``spec_level``: it declines the spec itself (forward, float32, on the
    target's device), not just this dtype or mode: when the user named the backend, that counts as a failure."""

    def __init__(self, message: str, spec_level: bool) -> None:
        super().__init__(message)
        self.spec_level = spec_level


@dataclass(frozen=True)
class Shape:
    id: str
    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    masked_rows: bool = False
    offset: bool = False  # positions from OFFSET on, with gaps that grow and differ per batch row


DIFFERENTIAL_SHAPES = (
    Shape("n1", 1, 2, 1, 1, 8),
    Shape("gqa-n63", 2, 4, 2, 63, 8),
    Shape("n127", 1, 2, 2, 127, 16),
    Shape("masked-rows-n33", 2, 2, 1, 33, 8, masked_rows=True),
    Shape("offset-gaps-n45", 2, 4, 2, 45, 8, masked_rows=True, offset=True),  # and a row with no key
    # GQA over several blocks of every backend (blocked 256 queries, flex 128, triton <= 64)
    Shape("gqa-n1030", 1, 2, 1, 1030, 8),
)
#: The shapes checked in float16 and bfloat16: one that has GQA, a masked row and positions past float16's range
#: (each shape costs a compilation per dtype in the compiling backends, so the default run stays short).
HALF_SHAPES = ("offset-gaps-n45",)
#: The shapes of the quick profile (``attnzoo conformance --quick``): N = 1 (a row of one key), an odd size with GQA
#: and a masked row, and GQA with a masked row and offset positions, all small; every other check runs as in the
#: full profile. Not the N = 1,030 shape, which takes minutes in Triton's interpreter.
QUICK_SHAPES = ("n1", "masked-rows-n33", "offset-gaps-n45")
#: The profiles: the differential shapes each one checks (float16 and bfloat16 keep to :data:`HALF_SHAPES`).
PROFILES = {"full": tuple(s.id for s in DIFFERENTIAL_SHAPES), "quick": QUICK_SHAPES}


@dataclass
class Target:
    """What a check runs: a spec on a backend in a dtype on a device, and the reference to compare with.

    The reference (the truth in float64, and the reference in the tested dtype) always runs on CPU."""

    spec: Any
    backend: str
    dtype: torch.dtype
    registry: Any
    seed: int = 0
    device: str = "cpu"

    def variant(self, backend: str | None = None) -> Variant:
        return Variant(self.spec, backend or self.backend, self.registry)

    def reference(self) -> Variant:
        return Variant(self.spec, "reference", self.registry)

    def require(self, *, grad: bool = False, decode: bool = False) -> None:
        backend = self.registry.backends[self.backend]
        mode = Mode.DECODE if decode else batch_mode(grad)
        plan = self.variant().plan
        device = torch.device(self.device)
        reasons = backend.verdict(plan, device, self.dtype, mode)
        if reasons:
            spec_level = bool(backend.verdict(plan, device, torch.float32, Mode.FORWARD))
            raise Declined("; ".join(reasons), spec_level)

    def generator(self, label: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}/{self.spec.name}/{label}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


# -- inputs, runs and the memo of reference results -----------------------------------------------------------------
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memo(target: Target, key: tuple, compute):
    """Reference results are the same for every backend under test: compute each once per registry."""
    table = _MEMO.setdefault(target.registry, {})
    full = (target.spec.hash, target.seed, *key)
    if full not in table:
        table[full] = compute()
    return table[full]


def offset_positions(batch: int, length: int) -> torch.Tensor:
    """(B, N) positions from OFFSET on with gaps 1, 2, 3, ... (cycling) that differ per batch row."""
    gaps = 1 + (torch.arange(length) + torch.arange(batch).view(-1, 1)) % (3 + torch.arange(batch).view(-1, 1))
    gaps[:, 0] = 0
    return OFFSET + gaps.cumsum(-1)


def random_case(target: Target, shape: Shape) -> dict[str, torch.Tensor]:
    """Seeded float64 inputs of ``shape`` for ``target``'s spec (the same for every backend: memoised)."""
    case = VectorCase(shape.id, "", (), shape.batch, shape.heads, shape.kv_heads, shape.length, shape.head_dim,
                      masked_rows=shape.masked_rows)
    gen_seed = int(target.generator(shape.id).initial_seed())
    inputs = memo(target, ("inputs", shape), lambda: make_inputs(target.reference(), case, f"{gen_seed}"))
    if shape.offset:
        inputs = {**inputs, "positions": offset_positions(shape.batch, shape.length)}
    return inputs


def _traced_inputs(target: Target, inputs: dict, dtype):
    """The plan, rows, grouped parameters, positions and key mask of ``inputs`` in ``dtype``, as backends get them."""
    variant = target.reference()
    q, k, v = (inputs[n].to(dtype) for n in ("q", "k", "v"))
    n = q.shape[2]
    positions = check_positions(inputs.get("positions"), q.shape[0], n, q.device)
    grouped = variant.plan.add_inputs(variant.plan.split_params(params_of(inputs, dtype), check_qkv(q, k, v), q),
                                      inputs_of(inputs, dtype), q.shape[0], q.shape[1], n, q)
    return variant.plan, q, k, v, grouped, positions, inputs.get("key_mask")


def _trace(target: Target, inputs: dict, dtype) -> str | None:
    return culprit(*_traced_inputs(target, inputs, dtype))


#: the axes of the results whose failure lines name them (batch row, head, token), by result key
AXES = {"out": ("batch row", "head", "token", "dim"), "grad.q": ("batch row", "head", "token", "dim"),
        "grad.k": ("batch row", "key/value head", "token", "dim"),
        "grad.v": ("batch row", "key/value head", "token", "dim")}


def compare(target: Target, name: str, got: dict, truth: dict, low: dict | None, inputs: dict | None = None
            ) -> None:
    """:func:`close` of every result (``<name>: <key>``)."""
    for key in truth:
        close(target, f"{name}: {key}", got[key], truth[key], low[key] if low else None, inputs, AXES.get(key))


def close(target: Target, name: str, got: torch.Tensor, truth: torch.Tensor, low: torch.Tensor | None,
          inputs: dict | None = None, axes: tuple[str, ...] | None = None) -> None:
    """``check_close``; a non-finite result (or truth) is traced, on ``inputs`` in batch form, to the transform
    whose term first goes non-finite: its torch maths (in float64, then the tested dtype; :func:`culprit`), then,
    on the triton backend, its Triton fragment rendered in torch at the pairs that may attend; else the message
    says the backend produced it."""
    try:
        check_close(name, got, truth, low, target.dtype, axes)
    except AssertionError as exc:
        if inputs is None or "non-finite" not in str(exc):
            raise
        for dtype in dict.fromkeys((torch.float64, target.dtype)):
            blame = _trace(target, inputs, dtype)
            if blame:
                raise AssertionError(f"{name}: {blame} (the transform's own maths, not the backend)") from None
        fragments = _runs_fragments(target)
        if fragments:
            blame = fragment_culprit(*_traced_inputs(target, inputs, target.dtype))
            if blame:
                raise AssertionError(f"{name}: {blame}") from None
        unwritten = "(an unwritten or overflowing element)"
        if str(exc).endswith(unwritten):
            traced = "torch maths or Triton fragment" if fragments else "own maths"
            raise AssertionError(f"{str(exc).removesuffix(unwritten).rstrip()}, and no transform's {traced} "
                                 f"gives non-finite values on these inputs: the backend produced it "
                                 f"{unwritten}") from None
        raise


def _runs_fragments(target: Target) -> bool:
    """Whether the backend under test runs the transforms' Triton fragments (the triton backend)."""
    try:
        from ..backends.triton.backend import TritonBackend
    except ImportError:
        return False
    return isinstance(target.registry.backends.get(target.backend), TritonBackend)


# -- the checks ---------------------------------------------------------------------------------------------------
def check_vector(target: Target, case: VectorCase) -> None:
    """Stored vectors: inputs, and outputs/gradients the reference computed in float64, under the tolerance rule.

    Decode vectors get no allowance from the reference's own decoding in the tested dtype (it could share a bug
    with the backend under test): only the floor."""
    target.require(grad=case.mode == "batch", decode=case.mode == "decode")
    meta, tensors = load(target.spec.name)
    if meta["spec_hash"] != target.spec.hash:
        raise AssertionError(f"vectors were generated for another version of spec '{target.spec.name}' "
                             f"({meta['spec_hash'][:12]} != {target.spec.hash[:12]}): regenerate them")
    prefix = f"{case.id}."
    inputs = {k.removeprefix(prefix): v for k, v in tensors.items()
              if k.startswith(prefix) and not k.startswith(prefix + "expected.")}
    truth = {k.removeprefix(prefix + "expected."): v for k, v in tensors.items()
             if k.startswith(prefix + "expected.")}
    got = run_case(target.variant(), case, {k: v.to(target.device) for k, v in inputs.items()}, target.dtype)
    low = None
    if target.dtype != torch.float64 and case.mode == "batch":
        low = memo(target, ("vector-low", case.id, target.dtype),
                   lambda: run_case(target.reference(), case, inputs, target.dtype))
    kept = truth.pop("kept_positions", None)
    got_kept = got.pop("kept_positions", None)
    if kept is not None and target.dtype == torch.float64 and not torch.equal(got_kept.cpu(), kept):
        raise AssertionError(f"vector {case.id}: cache kept positions {got_kept.flatten().tolist()}, expected "
                             f"{kept.flatten().tolist()}")
    compare(target, f"vector {case.id}", got, truth, low, inputs)


def check_differential(target: Target, shape: Shape, grad: bool) -> None:
    """Fresh random inputs against the float64 reference: outputs (and gradients of q, k, v and parameters)."""
    target.require(grad=grad)
    inputs = random_case(target, shape)
    truth = memo(target, ("batch", shape, grad, torch.float64),
                 lambda: run_batch(target.reference(), inputs, torch.float64, grad))
    low = None
    if target.dtype != torch.float64:
        low = memo(target, ("batch", shape, grad, target.dtype),
                   lambda: run_batch(target.reference(), inputs, target.dtype, grad))
    got = run_batch(target.variant(), inputs, target.dtype, grad, target.device)
    compare(target, f"{'gradients' if grad else 'outputs'} {shape.id}", got, truth, low, inputs)


def check_accumulated(target: Target) -> None:
    """``return_accumulated``: F (B, N, N) equals the reference's F, and is kept in float32 or wider."""
    if "accumulator" not in target.spec.slots():
        raise Unsupported("spec has no accumulator")
    target.require()
    shape = Shape("accumulated", 2, 4, 2, 45, 8, offset=True)
    inputs = random_case(target, shape)
    truth = memo(target, ("accumulated", torch.float64),
                 lambda: run_batch(target.reference(), inputs, torch.float64, False, selection=True))
    low = None
    if target.dtype != torch.float64:
        low = memo(target, ("accumulated", target.dtype),
                   lambda: run_batch(target.reference(), inputs, target.dtype, False, selection=True))
    got = run_batch(target.variant(), inputs, target.dtype, False, target.device, selection=True)
    if got["F"] is None:
        raise AssertionError("return_accumulated: F is None for a spec with an accumulator")
    wide = (torch.float32, torch.float64)
    if got["F"].dtype not in wide or (target.dtype == torch.float64 and got["F"].dtype != torch.float64):
        raise AssertionError(f"return_accumulated: F is {str(got['F'].dtype).removeprefix('torch.')}: accumulated "
                             f"state must be kept in float32 or wider (float64 for float64 inputs)")
    compare(target, "return_accumulated", got, truth, low, inputs)


#: the documents of the packed check: one token (a document that sees only itself), an odd length, a long one
PACKED_LENGTHS = (1, 63, 200)


def _documents_alone(variant, inputs: dict, dtype, grad: bool) -> dict[str, torch.Tensor]:
    """Each document of a packed row run alone through ``variant`` (no packing involved), assembled: the outputs
    and the gradients of q, k, v and the per-token inputs side by side, the parameters' gradients summed."""
    parts: list[dict[str, torch.Tensor]] = []
    start = 0
    for length in PACKED_LENGTHS:
        tokens = slice(start, start + length)
        alone = {}
        for key, value in inputs.items():
            if key in ("q", "k", "v", "cotangent"):
                alone[key] = value[:, :, tokens]
            elif key.startswith("input."):
                alone[key] = value[..., tokens]
            else:
                alone[key] = value
        parts.append(run_batch(variant, alone, dtype, grad))
        start += length
    out = {}
    for key in parts[0]:
        if key.startswith("grad.param."):
            out[key] = sum(p[key] for p in parts)
        else:
            out[key] = torch.cat([p[key] for p in parts], dim=-1 if key.startswith("grad.input.") else 2)
    return out


def check_packed(target: Target, grad: bool) -> None:
    """A packed row of three documents (lengths 1, 63, 200; ``documents=`` as a list of lengths) equals each
    document run alone through the reference: outputs, and gradients of q, k, v, parameters and per-token inputs
    (positions restart, F resets, each document's first token is the protected one)."""
    target.require(grad=grad)
    inputs = random_case(target, Shape("packed", 1, 4, 2, sum(PACKED_LENGTHS), 8))
    truth = memo(target, ("packed", grad, torch.float64),
                 lambda: _documents_alone(target.reference(), inputs, torch.float64, grad))
    low = None
    if target.dtype != torch.float64:
        low = memo(target, ("packed", grad, target.dtype),
                   lambda: _documents_alone(target.reference(), inputs, target.dtype, grad))
    got = run_batch(target.variant(), inputs, target.dtype, grad, target.device, documents=list(PACKED_LENGTHS))
    compare(target, f"packed documents {PACKED_LENGTHS}", got, truth, low, inputs)


def check_causality(target: Target) -> None:
    """Perturbing tokens after position t leaves outputs at positions <= t unchanged."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal")
    target.require()
    inputs = random_case(target, Shape("causality", 1, 2, 1, 40, 8))
    gen = target.generator("causality-perturb")
    changed = dict(inputs)
    for name in ("q", "k", "v"):
        noise = torch.randn(changed[name][:, :, 25:].shape, generator=gen, dtype=torch.float64)
        changed[name] = torch.cat([changed[name][:, :, :25], changed[name][:, :, 25:] + 3 * noise], dim=2)
    for name in [key for key in changed if key.startswith("input.")]:  # per-token inputs of the later tokens too
        noise = torch.randn(changed[name][..., 25:].shape, generator=gen, dtype=torch.float64)
        changed[name] = torch.cat([changed[name][..., :25], changed[name][..., 25:] + 3 * noise], dim=-1)
    variant = target.variant()
    a = run_batch(variant, inputs, target.dtype, False, target.device)["out"][:, :, :25]
    b = run_batch(variant, changed, target.dtype, False, target.device)["out"][:, :, :25]
    close(target, "causality: outputs before the perturbed tokens", b, a.to(torch.float64), None, inputs,
          AXES["out"])


def check_batch_invariance(target: Target) -> None:
    """Each batch row computed alone equals the same row computed in a batch of 3."""
    target.require()
    inputs = random_case(target, Shape("batch", 3, 2, 1, 21, 8))
    variant = target.variant()
    whole = run_batch(variant, inputs, target.dtype, False, target.device)["out"]
    for row in range(3):
        alone = {k: (v[row:row + 1] if k in ("q", "k", "v") or k.startswith("input.") else v)
                 for k, v in inputs.items()}
        one = run_batch(variant, alone, target.dtype, False, target.device)["out"]
        close(target, f"batch invariance: row {row}", one, whole[row:row + 1].to(torch.float64), None, inputs,
              AXES["out"])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN in the same places counting as equal (the differential checks report NaN)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def check_determinism(target: Target) -> None:
    """Two runs on the same inputs give bitwise identical outputs and gradients."""
    backend = target.registry.backends[target.backend]
    if not getattr(backend, "deterministic", True):
        raise Unsupported(f"backend '{target.backend}' does not claim determinism")
    target.require(grad=True)
    inputs = random_case(target, Shape("determinism", 1, 2, 1, 37, 8))
    first = run_batch(target.variant(), inputs, target.dtype, True, target.device)
    second = run_batch(target.variant(), inputs, target.dtype, True, target.device)
    for key in first:
        if not _same(first[key], second[key]):
            raise AssertionError(f"determinism: {key} differs between two identical runs")

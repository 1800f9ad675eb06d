"""The checks every backend (and every plugin's transforms) is held to. Each raises AssertionError with one line
on failure and :class:`Unsupported` when the backend declines the case (with its reason)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import Backend
from ..dispatch import Variant
from .tolerance import check_close
from .vectors import VectorCase, load, make_inputs, params_of, run_case


class Unsupported(Exception):
    """The backend declined this case; the message is its reason."""


@dataclass(frozen=True)
class Shape:
    id: str
    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    masked_rows: bool = False


DIFFERENTIAL_SHAPES = (
    Shape("n1", 1, 2, 1, 1, 8),
    Shape("gqa-n63", 2, 4, 2, 63, 8),
    Shape("n127", 1, 2, 2, 127, 16),
    Shape("masked-rows-n33", 2, 2, 1, 33, 8, masked_rows=True),
    Shape("gqa-n300", 1, 4, 2, 300, 8),  # more than one 256-query block
)


@dataclass
class Target:
    """What a check runs: a spec on a backend in a dtype, and the reference to compare with."""

    spec: Any
    backend: str
    dtype: torch.dtype
    registry: Any
    seed: int = 0

    def variant(self, backend: str | None = None) -> Variant:
        return Variant(self.spec, backend or self.backend, self.registry)

    def reference(self) -> Variant:
        return Variant(self.spec, "reference", self.registry)

    def require(self, *, grad: bool = False, decode: bool = False) -> None:
        backend = self.registry.backends[self.backend]
        variant = self.variant()
        reasons = backend.supports(variant.plan, torch.device("cpu"), self.dtype, grad)
        if reasons:
            raise Unsupported("; ".join(reasons))
        if decode and type(backend).extend is Backend.extend:
            raise Unsupported(f"backend '{self.backend}' does not implement decoding")

    def generator(self, label: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}/{self.spec.name}/{label}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


def _random_case(target: Target, shape: Shape) -> dict[str, torch.Tensor]:
    case = VectorCase(shape.id, "", (), shape.batch, shape.heads, shape.kv_heads, shape.length, shape.head_dim,
                      masked_rows=shape.masked_rows)
    gen_seed = int(target.generator(shape.id).initial_seed())
    return make_inputs(target.reference(), case, f"{gen_seed}")


def _compare(target: Target, name: str, got: dict, truth: dict, low: dict | None) -> None:
    for key in truth:
        check_close(f"{name}: {key}", got[key], truth[key], low[key] if low else None, target.dtype)


# -- the checks ---------------------------------------------------------------------------------------------------
def check_vector(target: Target, case: VectorCase) -> None:
    """Stored vectors: inputs, and outputs/gradients the reference computed in float64."""
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
    got = run_case(target.variant(), case, inputs, target.dtype)
    low = run_case(target.reference(), case, inputs, target.dtype) if target.dtype != torch.float64 else None
    kept = truth.pop("kept_positions", None)
    got_kept = got.pop("kept_positions", None)
    if kept is not None and target.dtype == torch.float64 and not torch.equal(got_kept, kept):
        raise AssertionError(f"vector {case.id}: cache kept positions {got_kept.flatten().tolist()}, expected "
                             f"{kept.flatten().tolist()}")
    _compare(target, f"vector {case.id}", got, truth, low)


def _forward(variant: Variant, inputs: dict, dtype, grad: bool) -> dict[str, torch.Tensor]:
    case = VectorCase("x", "", (), *inputs["q"].shape[:2], inputs["k"].shape[1], *inputs["q"].shape[2:])
    if grad:
        return run_case(variant, case, inputs, dtype)
    q, k, v = (inputs[n].to(dtype) for n in ("q", "k", "v"))
    with torch.no_grad():
        return {"out": variant(q, k, v, params=params_of(inputs, dtype), key_mask=inputs.get("key_mask"))}


def check_differential(target: Target, shape: Shape, grad: bool) -> None:
    """Fresh random inputs against the float64 reference: outputs (and gradients of q, k, v and parameters)."""
    target.require(grad=grad)
    inputs = _random_case(target, shape)
    truth = _forward(target.reference(), inputs, torch.float64, grad)
    low = _forward(target.reference(), inputs, target.dtype, grad) if target.dtype != torch.float64 else None
    got = _forward(target.variant(), inputs, target.dtype, grad)
    _compare(target, f"{'gradients' if grad else 'outputs'} {shape.id}", got, truth, low)


def check_causality(target: Target) -> None:
    """Perturbing tokens after position t leaves outputs at positions <= t unchanged."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal")
    target.require()
    inputs = _random_case(target, Shape("causality", 1, 2, 1, 40, 8))
    gen = target.generator("causality-perturb")
    changed = dict(inputs)
    for name in ("q", "k", "v"):
        noise = torch.randn(changed[name][:, :, 25:].shape, generator=gen, dtype=torch.float64)
        changed[name] = torch.cat([changed[name][:, :, :25], changed[name][:, :, 25:] + 3 * noise], dim=2)
    variant = target.variant()
    a = _forward(variant, inputs, target.dtype, False)["out"][:, :, :25]
    b = _forward(variant, changed, target.dtype, False)["out"][:, :, :25]
    check_close("causality: outputs before the perturbed tokens", b, a.to(torch.float64), None, target.dtype)


def check_batch_invariance(target: Target) -> None:
    """Each batch row computed alone equals the same row computed in a batch of 3."""
    target.require()
    inputs = _random_case(target, Shape("batch", 3, 2, 1, 21, 8))
    variant = target.variant()
    whole = _forward(variant, inputs, target.dtype, False)["out"]
    for row in range(3):
        alone = {k: (v[row:row + 1] if k in ("q", "k", "v") else v) for k, v in inputs.items()}
        one = _forward(variant, alone, target.dtype, False)["out"]
        check_close(f"batch invariance: row {row}", one, whole[row:row + 1].to(torch.float64), None, target.dtype)


def _decode(variant, inputs, dtype, budget=None, prefill=0):
    q, k, v = (inputs[n].to(dtype) for n in ("q", "k", "v"))
    params = params_of(inputs, dtype)
    cache = variant.new_cache(batch=q.shape[0], budget=budget)
    outs = []
    with torch.no_grad():
        if prefill:
            outs.append(variant.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache, params))
        for i in range(prefill, q.shape[2]):
            outs.append(variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params))
    return torch.cat(outs, dim=2), cache


def check_decode(target: Target) -> None:
    """A prefill followed by token-by-token decoding (no budget) equals the batch form of the reference."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    inputs = _random_case(target, Shape("decode", 2, 4, 2, 30, 8))
    truth = _forward(target.reference(), inputs, torch.float64, False)["out"]
    low, _ = _decode(target.reference(), inputs, target.dtype, prefill=11) if target.dtype != torch.float64 \
        else (None, None)
    got, _ = _decode(target.variant(), inputs, target.dtype, prefill=11)
    check_close("prefill + decode vs batch", got, truth, low, target.dtype)


def check_evictor(target: Target) -> None:
    """Evictor properties: budget >= N changes nothing; the cache holds exactly the budget; BOS kept (selective)."""
    if target.spec.cache is None:
        raise Unsupported("spec has no cache evictor")
    target.require(decode=True)
    inputs = _random_case(target, Shape("evict", 1, 2, 1, 24, 8))
    variant = target.variant()
    truth = _forward(target.reference(), inputs, torch.float64, False)["out"]
    full, cache = _decode(variant, inputs, target.dtype, budget=24)
    check_close("budget >= N", full, truth, None, target.dtype)
    if cache.evicted:
        raise AssertionError(f"budget >= N: {cache.evicted} tokens evicted")
    for budget in (6, 9):
        _, cache = _decode(variant, inputs, target.dtype, budget=budget)
        if cache.num_tokens != budget:
            raise AssertionError(f"budget {budget}: cache holds {cache.num_tokens} tokens")
        if target.spec.cache.evictor == "selective" and not bool((cache.positions == 1).any(-1).all()):
            raise AssertionError(f"budget {budget}: BOS was evicted")


def check_determinism(target: Target) -> None:
    """Two runs on the same inputs give bitwise identical outputs and gradients."""
    backend = target.registry.backends[target.backend]
    if not getattr(backend, "deterministic", True):
        raise Unsupported(f"backend '{target.backend}' does not claim determinism")
    target.require(grad=True)
    inputs = _random_case(target, Shape("determinism", 1, 2, 1, 37, 8))
    first = _forward(target.variant(), inputs, target.dtype, True)
    second = _forward(target.variant(), inputs, target.dtype, True)
    for key in first:
        if not torch.equal(first[key], second[key]):
            raise AssertionError(f"determinism: {key} differs between two identical runs")

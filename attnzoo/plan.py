"""A spec resolved against the registry: transform instances by slot, the evictor, parameter declarations.

Backends consume a :class:`Plan`; it holds no backend-specific state. The steps every backend computes the same
way live in ``attnzoo/core/composition.py`` (held: ``plan.composition.row_scale(...)``), the checks of a call's
inputs in ``attnzoo/inputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .core.composition import Composition
from .transforms.base import Dims, ParamSpec, Slot, TokenInput, Transform

__all__ = ["Plan"]


@dataclass
class Plan:
    spec: Any
    transforms: list[Transform]
    causal: bool
    scale: float | None
    by_slot: dict[Slot, list[Transform]] = field(default_factory=dict)
    evictor_cls: type | None = None
    composition: Composition = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.composition = Composition(self.transforms, self.by_slot, self.causal, self.scale)

    def logit_scale(self, head_dim: int) -> float:
        """The scale of the logits: the spec's ``attention.scale``, else 1/sqrt(D) (as the composition's)."""
        return self.composition.logit_scale(head_dim)

    @classmethod
    def from_spec(cls, spec, registry) -> Plan:
        transforms = [registry.transforms[entry.kind](entry) for entry in spec.transforms]
        by_slot: dict[Slot, list[Transform]] = {}
        for t in transforms:
            by_slot.setdefault(t.slot, []).append(t)
        evictor_cls = registry.evictors[spec.cache.evictor] if spec.cache is not None else None
        return cls(spec, transforms, spec.attention.causal, spec.attention.scale, by_slot, evictor_cls)

    def one(self, slot: Slot) -> Transform | None:
        items = self.by_slot.get(slot, [])
        return items[0] if items else None

    def many(self, slot: Slot) -> list[Transform]:
        return self.by_slot.get(slot, [])

    # -- parameters ---------------------------------------------------------------------------------------------
    def param_specs(self) -> dict[str, tuple[Transform, ParamSpec]]:
        return {f"{t.kind}.{p.name}": (t, p) for t in self.transforms for p in t.parameters()}

    def init_params(self, dims: Dims, dtype=torch.float32, device=None) -> dict[str, torch.Tensor]:
        return {key: p.initial(dims, dtype=dtype, device=device) for key, (_, p) in self.param_specs().items()}

    def split_params(self, params: dict[str, torch.Tensor] | None, dims: Dims, like: torch.Tensor
                     ) -> dict[str, dict[str, torch.Tensor]]:
        """Check ``params`` against the declarations and group them per transform kind (short names)."""
        specs = self.param_specs()
        if params is None:
            params = self.init_params(dims, dtype=like.dtype, device=like.device)
        unknown = sorted(set(params) - set(specs))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} for spec '{self.spec.name}' "
                             f"(expected: {', '.join(sorted(specs)) or 'none'})")
        out: dict[str, dict[str, torch.Tensor]] = {t.kind: {} for t in self.transforms}
        for key, (t, p) in specs.items():
            if key not in params:
                raise ValueError(f"missing parameter {key!r} for spec '{self.spec.name}'")
            value = params[key]
            want = dims.resolve(p.shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"parameter {key!r} must have shape {want}, got {got}")
            out[t.kind][p.name] = value.to(like.dtype) if value.dtype != like.dtype else value
        return out

    def token_inputs(self) -> dict[str, tuple[Transform, TokenInput]]:
        return {f"{t.kind}.{i.name}": (t, i) for t in self.transforms for i in t.token_inputs()}

    def add_inputs(self, grouped: dict[str, dict[str, torch.Tensor]], inputs: dict[str, torch.Tensor] | None,
                   batch: int, heads: int, tokens: int, like: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """Check the per-token ``inputs`` ``{"<kind>.<name>": (B, H, N)}`` against the transforms' declarations
        and put each beside its transform's parameters (a copy of ``grouped``)."""
        wanted = self.token_inputs()
        inputs = inputs or {}
        unknown = sorted(set(inputs) - set(wanted))
        if unknown:
            raise ValueError(f"unknown per-token input {unknown[0]!r} for spec '{self.spec.name}' "
                             f"(expected: {', '.join(sorted(wanted)) or 'none'})")
        if not wanted:
            return grouped
        out = {kind: dict(group) for kind, group in grouped.items()}
        for key, (t, declared) in wanted.items():
            if key not in inputs:
                raise ValueError(f"spec '{self.spec.name}' needs the per-token input {key!r} (B, H, N): pass "
                                 f"inputs={{{key!r}: ...}} (attnzoo.nn.Attention computes it from the layer input x)")
            value = inputs[key]
            want = (batch, heads, tokens)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"per-token input {key!r} must have shape (B, H, N) = {want}, got {got}")
            out[t.kind][declared.name] = value.to(like.dtype) if value.dtype != like.dtype else value
        return out

    def check_dims(self, dims: Dims) -> None:
        """Raise ValueError if a transform's options do not fit the sizes of a call."""
        for t in self.transforms:
            t.check_dims(dims)

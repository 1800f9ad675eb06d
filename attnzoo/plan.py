"""A spec resolved against the registry: transform instances by slot, the evictor, parameter declarations.

Backends consume a :class:`Plan`; it holds no backend-specific state. The steps every backend computes the same
way live in ``attnzoo/backends/composition.py`` (inherited: ``plan.row_scale(...)``), the checks of a call's
inputs in ``attnzoo/inputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .backends.composition import Composition, DecodeStep
from .transforms.base import Dims, ParamSpec, Slot, Transform

__all__ = ["DecodeStep", "Plan"]


@dataclass
class Plan(Composition):
    spec: Any
    transforms: list[Transform]
    causal: bool
    scale: float | None
    by_slot: dict[Slot, list[Transform]] = field(default_factory=dict)
    evictor_cls: type | None = None

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

    def check_dims(self, dims: Dims) -> None:
        """Raise ValueError if a transform's options do not fit the sizes of a call."""
        for t in self.transforms:
            t.check_dims(dims)

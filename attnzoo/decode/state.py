"""What the full decode path validated for a cache, and the fast step it chose (docs/decoding.md, "A step
validated once").

A :class:`StepState` belongs to one cache (``cache.step_state``): the spec that made the cache, the (H, H_kv, D) of
its steps, the fingerprint of the parameter tensors that transformed its rows, and the :class:`FastStep` a backend
offered for a call signature. :mod:`attnzoo.decode.step` writes it; the cache's storage only forgets the fast step
(:meth:`StepState.forget`) when something the step relies on changes (rows set, rows reordered, a new next
position).
"""

from __future__ import annotations

from typing import Any

import torch


class StepState:
    """The validated step state of one cache: ``spec_hash``/``spec_name`` (the spec whose ``new_cache`` made it;
    another spec's steps are refused), ``geometry`` ((H, H_kv, D) of its steps, set by the first), ``params_key``
    (which parameter tensors, at which version, transformed its rows), and the fast step chosen: ``fast`` (a
    :class:`FastStep`, or None), valid for ``variant`` and the call ``signature`` (shapes, dtypes and devices of
    q, k and v) it was validated for."""

    __slots__ = ("spec_hash", "spec_name", "geometry", "params_key", "fast", "variant", "signature")

    def __init__(self, spec_hash: str | None = None, spec_name: str | None = None) -> None:
        self.spec_hash, self.spec_name = spec_hash, spec_name
        self.geometry: tuple[int, int, int] | None = None
        self.params_key: tuple | None = None
        self.fast: FastStep | None = None
        self.variant: Any = None
        self.signature: tuple | None = None

    def __repr__(self) -> str:
        fast = None if self.fast is None else f"{self.fast.name} ({self.fast.kind})"
        return f"StepState(spec={self.spec_name!r}, geometry={self.geometry}, fast={fast})"

    def check_spec(self, spec) -> None:
        """Refuse, with one line, a step of another spec than the one whose ``new_cache`` made this cache."""
        if self.spec_hash is not None and self.spec_hash != spec.hash:
            raise ValueError(f"this cache was made by spec '{self.spec_name}' ({self.spec_hash[:12]}), not by "
                             f"'{spec.name}' ({spec.hash[:12]}): its evictor, scores and stored rows are that spec's; "
                             f"make one with this variant's new_cache()")

    def check_geometry(self, dims) -> None:
        """Refuse a step of another (H, H_kv, D) than the first step's; record it at the first."""
        geometry = (dims.num_heads, dims.num_kv_heads, dims.head_dim)
        if self.geometry is not None and self.geometry != geometry:
            held = self.geometry
            raise ValueError(f"this cache holds steps of {held[0]} query heads, {held[1]} key/value heads and head "
                             f"size {held[2]}, got {geometry[0]}, {geometry[1]} and {geometry[2]}")
        self.geometry = geometry

    def check_params(self, fingerprint: tuple) -> None:
        """Refuse other parameter tensors (or versions) than those that transformed the rows held; record them at
        the first step."""
        if self.params_key is None:
            self.params_key = fingerprint
        elif self.params_key != fingerprint:
            raise ValueError("the transform parameters differ from those that transformed the keys and values "
                             "already in this cache (it stores them transformed): start a new cache after changing "
                             "parameters")

    def choose(self, fast: FastStep | None, variant=None, signature: tuple | None = None) -> None:
        """The fast step for later steps of ``variant`` with this call ``signature`` (None: the full path)."""
        self.fast, self.variant, self.signature = fast, variant, signature

    def forget(self) -> None:
        """Drop the fast step: the next step goes through every check again."""
        self.fast = None


class FastStep:
    """A fast decoding step a backend offers for one cache (``Backend.decode_step``), taken by later steps while
    the full path's checks still hold (:class:`StepState`) and ``ready(cache)``, its own preconditions, is true.

    ``name``: the step (``"plain"``, or the evictor's kind: ``"selective"``, ``"sink_window"``, ``"h2o"``,
    ``"tova"``); ``kind``: ``"torch"`` (torch operations that call the evictor's Python rule: the step's
    definition) or ``"fused"`` (its C form, :mod:`attnzoo.decode.fused`); ``torch_step(q, k, v, cache) -> out``.
    Calling it checks the inputs' storages (:func:`check_inputs`) and runs the torch step."""

    kind = "torch"

    def __init__(self, name: str, ready, torch_step) -> None:
        self.name = name
        self.ready = ready
        self.torch_step = torch_step

    def __call__(self, q, k, v, cache):
        check_inputs(q, k, v)
        return self.torch_step(q, k, v, cache)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, kind={self.kind!r})"


def extent(t: torch.Tensor) -> int:
    """Bytes from the start of ``t``'s storage to the end of its last element (0 when it has none)."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def uncovered(name: str, t: torch.Tensor, need: int) -> ValueError:
    have = t.untyped_storage().nbytes()
    return ValueError(f"{name} of shape {tuple(t.shape)} needs {need} bytes of storage but its storage holds {have} "
                      f"(freed or resized after it was made?): the lean decoding step does not read past it")


_PYTHON_KEY = torch._C.DispatchKey.Python


def check_inputs(q, k, v) -> None:
    """One line (a ValueError) if the storage of q, k or v does not cover its view (freed or resized after the view
    was made). torch checks a view's storage when it makes a view, not when a kernel reads one, and the fast steps
    hand their inputs to kernels (``scatter_``, SDPA, the C steps) without making one first. A tensor whose
    operations go to a ``__torch_dispatch__`` (a fake tensor, a wrapper subclass) is left to it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if type(t) is not torch.Tensor and torch._C._dispatch_keys(t).has(_PYTHON_KEY):
            continue
        if t.dim() == 4:  # the steps' inputs: spelled out, a quarter of the generic sum's cost
            (n0, n1, n2, n3), (s0, s1, s2, s3) = t.shape, t.stride()
            last = t.storage_offset() + (n0 - 1) * s0 + (n1 - 1) * s1 + (n2 - 1) * s2 + (n3 - 1) * s3
            need = (last + 1) * t.element_size() if n0 and n1 and n2 and n3 else 0
        else:
            need = extent(t)
        if need > t.untyped_storage().nbytes():
            raise uncovered(name, t, need)

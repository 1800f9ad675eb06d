"""A model's own attention as a spec, and the rules that compose it with the user's (docs/transformers.md).

Each layer's :class:`~attnzoo.integrations.transformers.interface.LayerCall` (what the layer passes to
transformers' attention interface) becomes that layer's *native spec*:

- ``scaling`` → ``attention.scale`` (left unset when it is ``1/sqrt(head_dim)``): ``query_pre_attn_scalar``
  (Gemma), ``attention_multiplier`` (Granite), GPT-2's per-layer scaling, ...;
- the window or chunk of the mask transformers builds for the layer (read from its mask function, :mod:`.masks`) →
  a ``sliding_window`` or ``chunked`` mask (``layer_types``: Gemma 2/3, gpt-oss, Qwen3, Cohere 2, llama4, ...;
  ``sliding_window`` of every layer: Mistral, Phi-3, Starcoder2);
- ``softcap`` → a ``softcap`` logits transform (Gemma 2's ``attn_logit_softcapping``);
- ``s_aux`` → an ``attention_sink`` whose parameter *is* the module's own (gpt-oss's ``sinks``): it keeps the
  model's name in the state dict and checkpoints.

What the module does before calling the interface (q/k norms, RoPE, partial rotary, no-RoPE layers) stays the
model's, as do the projections and everything outside attention.

:data:`CONFLICTS` says when the user's spec and the native one want the same thing; :func:`compose` refuses a
conflict with one line naming the layer and both transforms, unless ``prefer`` says which side wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...registry import get_registry
from ...spec import load_spec
from ...transforms.base import Slot
from .base import PREFER, IntegrationError
from .interface import LayerCall

#: Mask kinds that bound how far back a query sees (a window) in the built-in catalogue.
WINDOW_KINDS = frozenset({"sliding_window", "local_global", "chunked"})


@dataclass(frozen=True)
class NativeLayer:
    """One layer's attention as the model computes it, and the spec that says so."""

    call: LayerCall
    model_type: str

    @property
    def layer(self) -> int:
        return self.call.layer

    def scale(self) -> float | None:
        """The logit scale, or None when it is attnzoo's default ``1/sqrt(head_dim)``."""
        c = self.call
        return None if math.isclose(c.scaling, c.head_dim ** -0.5, rel_tol=1e-6) else c.scaling

    def transforms(self) -> list[dict]:
        """The native transforms, each tagged with the feature it stands for: ``[(feature, entry)]``."""
        return [entry for _, entry in self.features()]

    def features(self) -> list[tuple[str, dict]]:
        c = self.call
        out = []
        if c.sliding_window is not None:
            out.append(("window", {"kind": "sliding_window", "window": c.sliding_window}))
        if c.chunk is not None:
            out.append(("chunk", {"kind": "chunked", "chunk": c.chunk}))
        if c.softcap is not None:
            out.append(("softcap", {"kind": "softcap", "cap": c.softcap}))
        if c.sinks is not None:
            out.append(("sink", {"kind": "attention_sink", "learnable": True, "value": 0.0}))
        return out

    @property
    def name(self) -> str:
        kind = self.model_type.lower().replace("_", "-")
        parts = ([kind] + [f"window{self.call.sliding_window}"] * (self.call.sliding_window is not None)
                 + [f"chunk{self.call.chunk}"] * (self.call.chunk is not None))
        return "-".join(parts)[:64]

    def spec_data(self) -> dict:
        c = self.call
        said = [f"scale {c.scaling:g}" if self.scale() is not None else "scale 1/sqrt(head_dim)"]
        if c.sliding_window is not None:
            said.append(f"sliding window {c.sliding_window}")
        if c.chunk is not None:
            said.append(f"chunked attention {c.chunk}")
        if c.softcap is not None:
            said.append(f"logit softcap {c.softcap:g}")
        if c.sinks is not None:
            said.append(f"learned sinks ({c.module}.{c.sinks})")
        return {"name": self.name,
                "summary": f"{c.module} layer {c.layer} as transformers computes it: {', '.join(said)}",
                "attention": {"causal": True, "scale": self.scale()},
                "transforms": self.transforms()}

    def spec(self):
        return load_spec(self.spec_data())

    @property
    def bound(self) -> dict[str, str]:
        """Transform parameters that are the module's own: ``{"<kind>.<name>": module attribute}``."""
        return {"attention_sink.sink": self.call.sinks} if self.call.sinks is not None else {}


def _bounds_keys(cls, entry) -> bool:
    return cls.slot is Slot.MASK and (entry.kind in WINDOW_KINDS or cls(entry).earliest_key(1 << 30) is not None)


#: The composition rules, as data: native feature -> (what on the user's side conflicts with it, the test of a
#: user's transform (its class, its entry)). The scale's rule is :func:`compose`'s ``attention.scale`` check.
CONFLICTS = {
    "window": ("a mask that bounds how far back queries see (sliding_window, local_global, chunked, ...)",
               _bounds_keys),
    "chunk": ("a mask that bounds how far back queries see (sliding_window, local_global, chunked, ...)",
              _bounds_keys),
    "softcap": ("a softcap transform", lambda cls, entry: entry.kind == "softcap"),
    "sink": ("a normaliser transform (attention_sink: one per spec), or a probability map (it replaces the softmax "
             "the sinks are a term of)", lambda cls, entry: cls.slot in (Slot.NORMALISER, Slot.PROBABILITY)),
    "scale": ("attention.scale other than the model's", None),
}


def _user_side(feature: str, spec) -> list[int]:
    """Indices of the user's transforms that want what the native ``feature`` is (:data:`CONFLICTS`)."""
    registry = get_registry()
    clashes = CONFLICTS[feature][1]
    return [i for i, entry in enumerate(spec.transforms) if clashes(registry.transforms[entry.kind], entry)]


def compose(native: NativeLayer, user, prefer: str = "error"):
    """The spec layer ``native.layer`` runs: the native transforms (first in their slots: they act on the logits as
    the model computes them) and the user's. A conflict (:data:`CONFLICTS`) is refused with one line unless
    ``prefer`` is ``"model"`` (the native side wins) or ``"spec"`` (the user's wins). Returns (spec, bound:
    ``{"<kind>.<name>": module attribute}`` of the native parameters kept)."""
    if prefer not in PREFER:
        raise IntegrationError(f"prefer must be one of {', '.join(PREFER)}, got {prefer!r}")
    c = native.call
    here = f"{c.module} (layer {c.layer})"
    data = user.model_dump(mode="json")
    users = list(data["transforms"])
    dropped_user: set[int] = set()
    kept_native = []
    for feature, entry in native.features():
        clash = _user_side(feature, user)
        if clash and prefer == "error":
            theirs = ", ".join(f"transforms[{i}] ({users[i]['kind']})" for i in clash)
            raise IntegrationError(f"{here}: spec '{user.name}' {theirs} conflicts with the model's {entry['kind']} "
                                   f"({_said(entry, c)}): pass prefer='model' or prefer='spec' to apply()")
        if clash and prefer == "model":
            dropped_user.update(clash)
        if not clash or prefer == "model":
            kept_native.append((feature, entry))
    scale = native.scale()
    own = data["attention"].get("scale")
    if own is not None and not math.isclose(own, c.scaling, rel_tol=1e-6):
        if prefer == "error":
            raise IntegrationError(f"{here}: spec '{user.name}' sets attention.scale = {own} but the model scales "
                                   f"logits by {c.scaling}: remove scale from the spec to use the model's, or pass "
                                   f"prefer='model' or prefer='spec' to apply()")
        scale = own if prefer == "spec" else c.scaling
    elif own is not None:
        scale = own
    if not kept_native and scale == own and not dropped_user:
        return user, {}
    masks = [e for f, e in kept_native if f in ("window", "chunk")]
    logits = [e for f, e in kept_native if f == "softcap"]
    sinks = [e for f, e in kept_native if f == "sink"]
    data["transforms"] = masks + logits + [e for i, e in enumerate(users) if i not in dropped_user] + sinks
    data["attention"]["scale"] = scale
    if kept_native or dropped_user:
        data["name"] = f"{user.name}.{native.name}"[:64]
    try:
        spec = load_spec(data)
    except ValueError as exc:
        raise IntegrationError(f"{here}: spec '{user.name}' with the model's attention: {exc}") from None
    bound = native.bound if any(f == "sink" for f, _ in kept_native) else {}
    return spec, bound


def _said(entry: dict, call: LayerCall) -> str:
    if entry["kind"] == "attention_sink":
        return f"its learned sinks, {call.module}.{call.sinks}"
    return ", ".join(f"{k} {v}" for k, v in entry.items() if k != "kind") or "as the model ships it"

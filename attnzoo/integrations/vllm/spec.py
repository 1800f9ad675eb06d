"""Which spec a vLLM attention layer runs, and what is declined: the checkpoint's attnzoo record (``config.attnzoo``,
as ``zt.save_pretrained`` writes it, read by the transformers integration's one reader,
:func:`~attnzoo.integrations.transformers.records.check_record`) composed with the layer's native attention (what
vLLM hands its attention backend: scale, sliding window, soft-capping, learned sinks), by the transformers
integration's rules; the tensors of the attnzoo cores read from the checkpoint's safetensors files. Needs no vLLM
import (tested without it)."""

from __future__ import annotations

import functools
import glob
import os
import re

import torch

from ...spec import load_spec
from ...transforms.base import Slot
from ..transformers.base import CONFIG_KEY, CORE_MARK, IntegrationError, is_core_key
from ..transformers.interface import LayerCall
from ..transformers.native import NativeLayer, compose

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


_MISSING = object()


def config_file(model) -> str:
    """What a message calls the ``config.json`` of vLLM's ``model`` (a checkpoint directory or a hub name)."""
    model = str(model) if model is not None else "<model>"
    return os.path.join(model, "config.json") if os.path.isdir(model) else f"{model} (config.json)"


def record_of(hf_config, model=None) -> dict | None:
    """The attnzoo record of a model configuration, checked and normalised as every host reads it
    (:func:`~attnzoo.integrations.transformers.records.check_record`), or None when the configuration has no
    ``attnzoo`` key (the checkpoint was not saved by attnzoo: vLLM's own attention serves it). A key that holds a
    malformed record is refused with one line naming ``config.json`` (of ``model``) and the field, never read as no
    record."""
    from ..transformers.records import check_record

    record = getattr(hf_config, CONFIG_KEY, _MISSING) if hf_config is not None else _MISSING
    if record is _MISSING:
        return None
    return check_record(record, config_file(model))


def layer_index(layer_name: str) -> int:
    """The decoder layer of a vLLM attention layer's name (``model.layers.3.self_attn.attn`` -> 3)."""
    found = _LAYER.search(layer_name)
    if found is None:
        raise IntegrationError(f"vLLM attention layer '{layer_name}': its name gives no decoder layer index "
                               f"(model.layers.<i>....), so attnzoo cannot find its parameters")
    return int(found.group(1))


def native_call(layer: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                sliding_window: int | None, softcap: float | None, has_sinks: bool) -> LayerCall:
    """A layer's native attention as the transformers integration describes it (vLLM gives the same facts)."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    return LayerCall(layer=layer, module="vLLM Attention", num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, scaling=float(scale), sliding_window=window,
                     softcap=float(softcap) if softcap else None, sinks="sinks" if has_sinks else None)


def layer_spec(record: dict, call: LayerCall, model_type: str, where: str):
    """(the composed spec, the native parameters it binds) of one layer, refused with one line when declined.
    ``record``: as :func:`record_of` returns it (checked)."""
    user = load_spec(record["spec"])
    spec, bound = compose(NativeLayer(call, model_type), user, record["prefer"])
    reason = declined(spec)
    if reason:
        raise IntegrationError(f"{where}: spec '{user.name}' cannot be served by vLLM: {reason}")
    return spec, bound


def declined(spec) -> str | None:
    """Why vLLM's paged KV cache cannot run ``spec`` exactly (one reason naming the transform), or None."""
    from ...dispatch import Variant

    if not spec.attention.causal:
        return "attention.causal is false: vLLM serves causal decoders"
    plan = Variant(spec, "reference").plan
    acc = plan.one(Slot.ACCUMULATOR)
    evictor = getattr(spec.cache, "evictor", None) if spec.cache is not None else None
    if acc is not None and evictor is None:  # with an evictor, F lives in the request's page (ring.py)
        return (f"transform '{acc.kind}' (accumulator) without a cache evictor: its F, a running sum per key, is "
                f"state vLLM's paged KV cache does not hold (a spec with an evictor keeps it in the request's page)")
    if spec.cache is not None and evictor is None:
        return "a cache section without an evictor: nothing to bound a request's page by"
    mapped = plan.one(Slot.PROBABILITY)
    if mapped is not None:
        return (f"transform '{mapped.kind}' (probability) replaces the softmax: not yet checked against transformers "
                f"+ attnzoo under vLLM (docs/vllm.md)")
    for t in plan.transforms:
        if t.token_inputs():
            return f"transform '{t.kind}' reads per-token inputs (the layer input), which vLLM's attention is not given"
    for t in plan.composition.feature_transforms():
        return f"transform '{t.kind}' needs per-token features kept beside the keys, which vLLM's cache does not hold"
    return None


#: the slots whose transforms map each token's query, key, value or output rows on their own, at its position
#: (``RowMapTransform``: per token, so keys and values can be stored mapped)
ROW_SLOTS = frozenset({Slot.QUERY, Slot.KEY, Slot.VALUE, Slot.OUTPUT})


def native_rows(spec, call: LayerCall, model_type: str) -> bool:
    """Whether the layer's composed ``spec`` is the layer's native attention (what vLLM's own kernel computes: its
    scale, window, soft-capping, sinks) over rows mapped token by token: with its row maps (:data:`ROW_SLOTS`) left
    out, its transforms, attention options (the logit scale as applied) and cache are those of the native attention
    composed with a spec of no transforms. vLLM's kernel then runs it exactly on queries mapped before it, keys and
    values mapped as they are written and outputs mapped after it (``backend.AttnzooCPUImpl``; docs/vllm.md,
    "Which kernel runs a layer"). Decided by the transforms' slots, never their kinds: a plugin's row map takes the
    same path."""
    from ...dispatch import Variant

    if spec.cache is not None:
        return False
    native, _ = compose(NativeLayer(call, model_type), load_spec({"name": "native", "transforms": []}))

    def reduced(s):
        plan = Variant(s, "reference").plan
        data = s.function()
        data["transforms"] = [e for e, t in zip(data["transforms"], plan.transforms, strict=True)
                              if t.slot not in ROW_SLOTS]
        data["attention"]["scale"] = plan.logit_scale(call.head_dim)
        return data

    return reduced(spec) == reduced(native)


@functools.lru_cache(maxsize=8)
def _parameter_index(model_dir: str) -> dict[str, str]:
    """{tensor name: file} of every tensor of the attnzoo cores in the checkpoint's safetensors files."""
    from safetensors import safe_open

    found = {}
    for file in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():
                if is_core_key(key):
                    found[key] = file
    return found


def layer_parameters(model_dir: str, layer: int) -> dict[str, torch.Tensor]:
    """Every tensor of decoder layer ``layer``'s attnzoo core in the checkpoint ``model_dir``, by its key in the
    core's ``state_dict()`` (``transform_params.<name>``, ``token_projections.<name>.weight``, ...), as
    ``zt.load_transform_params`` reads them (a tensor of the core is never left to vLLM's weight loading)."""
    from safetensors import safe_open

    out = {}
    for key, file in _parameter_index(model_dir).items():
        found = _LAYER.search(key)
        if found is None or int(found.group(1)) != layer:
            continue
        with safe_open(file, framework="pt") as fh:
            out[f".{key}".split(CORE_MARK, 1)[1]] = fh.get_tensor(key)
    return out

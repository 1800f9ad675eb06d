"""Put an attnzoo spec into a Hugging Face transformers model in one call (docs/transformers.md).

``apply(model, spec)`` works on any causal decoder whose attention modules call the function registered in
transformers' attention interface. It reads each layer's own attention from what the layer passes to that
interface (its *native spec*: scaling, sliding window, soft-capping, learned sinks; :func:`native_spec`), composes
the user's spec with it, gives every attention module an :class:`attnzoo.nn.Attention` core (the submodule
``attnzoo``, which owns the user's transforms' parameters), registers the ``"attnzoo"`` attention and mask
functions with transformers and switches the model to them. The model's projections, RoPE, q/k norms and
everything else stay the model's own; attnzoo replaces only the attention core (what ``sdpa`` or ``eager``
computes).

Decoding goes through :class:`AttnzooCache`, a transformers ``Cache`` whose layers are attnzoo ``KVCache`` objects
(the spec's evictor, a per-layer budget, windows that hold no more than the window): transformers holds no copy of
the keys and values. After ``apply``, ``model.generate()`` uses it unless it is given another cache.

The parts: :mod:`.interface` (the probe and the attention function), :mod:`.native` (native specs and the
composition rules), :mod:`.cache` (the cache), :mod:`.core` (``apply``), :mod:`.checkpoints` (save and load),
:mod:`.records` (a checkpoint's record, read the same way by every host), :mod:`.sharding` (``shard_sequence``:
the model trained context-parallel, docs/distributed.md), :mod:`.models` (``smollm2()``: a real pretrained model,
converted once into attnzoo's cache).
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("attnzoo.integrations.transformers needs transformers: pip install 'attnzoo[transformers]'"
                      ) from exc

from .base import (
    ATTN_IMPLEMENTATION,
    CHECKPOINT_GUARD,
    CONFIG_KEY,
    CORE_MARK,
    CORE_NAME,
    PARAM_MARK,
    CheckpointSpecMismatchError,
    FamilyWarning,
    FunctionWarning,
    IntegrationError,
    ProbeError,
    is_core_key,
)
from .cache import AttnzooCache, AttnzooLayer, layer_budgets
from .checkpoints import (
    METADATA_HASH,
    METADATA_NAME,
    METADATA_SPEC,
    from_pretrained,
    load_transform_params,
    stamp_safetensors,
)
from .core import apply, is_applied, layer_specs, native_layers, native_spec
from .interface import LayerCall, attention_forward, attention_mask, probe
from .models import ModelError, smollm2
from .native import CONFLICTS, NativeLayer, compose
from .records import check_record
from .sharding import is_sharded, sequence_shard, shard_sequence, unshard_sequence

__all__ = [
    "ATTN_IMPLEMENTATION", "AttnzooCache", "AttnzooLayer", "CHECKPOINT_GUARD", "CONFIG_KEY", "CONFLICTS", "CORE_MARK",
    "CORE_NAME", "CheckpointSpecMismatchError", "FamilyWarning", "FunctionWarning", "IntegrationError", "LayerCall",
    "METADATA_HASH",
    "METADATA_NAME", "METADATA_SPEC", "ModelError", "NativeLayer", "PARAM_MARK", "ProbeError", "apply",
    "attention_forward", "attention_mask", "check_record", "compose", "from_pretrained", "is_applied", "is_core_key",
    "layer_budgets", "layer_specs", "load_transform_params", "native_layers", "native_spec", "probe",
    "stamp_safetensors",
    "is_sharded", "sequence_shard", "shard_sequence", "smollm2", "unshard_sequence",
]

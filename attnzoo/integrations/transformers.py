"""Put an attnzoo spec into a Hugging Face transformers model in one call (docs/transformers.md).

``apply(model, spec)`` gives every attention layer an :class:`attnzoo.nn.Attention` core (the submodule
``attnzoo`` of the layer's attention module, which owns the transforms' parameters), registers the ``"attnzoo"``
attention and mask functions with transformers and switches the model to them. The model's projections, RoPE and
everything else stay the model's own; attnzoo replaces only the attention core (what ``sdpa`` or ``eager`` computes).

Decoding goes through :class:`AttnzooCache`, a transformers ``Cache`` whose layers are attnzoo ``KVCache`` objects
(the spec's evictor, a per-layer budget): transformers holds no copy of the keys and values. After ``apply``,
``model.generate()`` uses it unless it is given another cache.

Supported families: Llama, Qwen2, Mistral, GPT-NeoX, GPT-2 (decoder-only, causal). Anything else is refused with one
line naming it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("attnzoo.integrations.transformers needs transformers: pip install 'attnzoo[transformers]'"
                      ) from exc

from ..errors import AttnzooError
from ..nn import Attention
from ..spec import load_spec

__all__ = [
    "ATTN_IMPLEMENTATION", "AttnzooCache", "CheckpointSpecMismatchError", "IntegrationError", "SUPPORTED_FAMILIES",
    "apply", "attention_forward", "attention_mask", "from_pretrained", "is_applied", "load_transform_params",
    "stamp_safetensors",
]

#: The name under which the attention and mask functions are registered with transformers.
ATTN_IMPLEMENTATION = "attnzoo"
#: Name of the attnzoo core submodule on each attention module, and of the record in the model config.
CORE_NAME = "attnzoo"
CONFIG_KEY = "attnzoo"
#: Substring that marks the transforms' parameters in a state dict / checkpoint.
PARAM_MARK = f".{CORE_NAME}.transform_params."

_UNSET: Any = object()


class IntegrationError(AttnzooError, ValueError):
    """The transformers integration cannot do what was asked; the message is one line."""


class CheckpointSpecMismatchError(IntegrationError):
    """A checkpoint was saved with another spec than the model's (the message names the file and both hashes)."""


# -- families ------------------------------------------------------------------------------------------------------
def _geometry_gqa(module, config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, module.head_dim, kv_heads


def _geometry_neox(module, config) -> tuple[int, int, int]:
    return config.num_attention_heads, module.head_size, config.num_attention_heads


def _geometry_gpt2(module, config) -> tuple[int, int, int]:
    return module.num_heads, module.head_dim, module.num_heads


@dataclass(frozen=True)
class _Family:
    attention_classes: tuple[str, ...]
    geometry: Callable[[Any, Any], tuple[int, int, int]]  # (num_heads, head_dim, num_kv_heads)


#: model_type -> how to find and size its attention modules.
SUPPORTED_FAMILIES: dict[str, _Family] = {
    "llama": _Family(("LlamaAttention",), _geometry_gqa),
    "qwen2": _Family(("Qwen2Attention",), _geometry_gqa),
    "mistral": _Family(("MistralAttention",), _geometry_gqa),
    "gpt_neox": _Family(("GPTNeoXAttention",), _geometry_neox),
    "gpt2": _Family(("GPT2Attention",), _geometry_gpt2),
}


def _family(model) -> tuple[str, _Family]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if model_type not in SUPPORTED_FAMILIES:
        known = ", ".join(sorted(SUPPORTED_FAMILIES))
        raise IntegrationError(f"{name} (model_type '{model_type}') is not supported by attnzoo's transformers "
                               f"integration (supported: {known})")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise IntegrationError(f"{name} has cross-attention (add_cross_attention / encoder-decoder): attnzoo's "
                               f"transformers integration supports decoder-only self-attention only")
    return model_type, SUPPORTED_FAMILIES[model_type]


def _attention_modules(model, family: _Family) -> list[torch.nn.Module]:
    """The model's self-attention modules, ordered by ``layer_idx`` (which must be 0..L-1)."""
    found = [m for m in model.modules()
             if any(c.__name__ in family.attention_classes for c in type(m).__mro__)]
    name = type(model).__name__
    if not found:
        raise IntegrationError(f"{name}: no attention module of class {' / '.join(family.attention_classes)} found")
    indices = [getattr(m, "layer_idx", None) for m in found]
    if any(not isinstance(i, int) for i in indices) or sorted(indices) != list(range(len(found))):
        raise IntegrationError(f"{name}: attention modules must carry layer_idx 0..{len(found) - 1}, got {indices}")
    return sorted(found, key=lambda m: m.layer_idx)


def _where(module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


# -- spec, scale and budget ----------------------------------------------------------------------------------------
def _layer_spec(spec, scaling: float, head_dim: int, module):
    """The spec a layer runs: the spec itself when its scale agrees with the model's ``scaling``; the spec with
    ``attention.scale`` set to the model's scaling when the spec leaves the scale to its default (1/sqrt(D)) and the
    model scales differently (GPT-2's ``scale_attn_by_inverse_layer_idx``, ``scale_attn_weights=False``)."""
    own = spec.attention.scale
    if own is None:
        if math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-6):
            return spec
        data = spec.model_dump(mode="json")
        data["attention"]["scale"] = float(scaling)
        return load_spec(data)
    if not math.isclose(own, scaling, rel_tol=1e-6):
        raise IntegrationError(f"spec '{spec.name}' sets attention.scale = {own} but {_where(module)} scales logits "
                               f"by {scaling}: remove scale from the spec to use the model's")
    return spec


def _check_budget_value(value, where: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IntegrationError(f"{where}: a budget must be an int >= 1 or None, got {value!r}")
    return value


def _budgets(budget, spec, count: int) -> list[int | None]:
    """One budget per layer: the spec's ``cache.budget`` by default; an int or None for every layer; or a list."""
    if budget is _UNSET:
        budget = spec.cache.budget if spec.cache is not None else None
    if isinstance(budget, (list, tuple)):
        if len(budget) != count:
            raise IntegrationError(f"budget lists {len(budget)} values but the model has {count} attention layers")
        return [_check_budget_value(b, f"budget[{i}]") for i, b in enumerate(budget)]
    return [_check_budget_value(budget, "budget")] * count


def _budget_record(budgets: list[int | None]):
    return budgets[0] if len(set(budgets)) == 1 else list(budgets)


# -- registration with transformers --------------------------------------------------------------------------------
def _register() -> None:
    """Register the attention and mask functions under ``"attnzoo"`` (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask function for ``"attnzoo"``: hands the 2-D padding mask (B, tokens seen) through, like the
    flash-attention one, or None when nothing is padding. attnzoo builds causality from positions, and a KV cache
    remembers which of its tokens are padding, so the attention function needs only the new tokens' columns."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    attention_mask = attention_mask.to(torch.bool)
    return None if bool(attention_mask.all()) else attention_mask


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``"attnzoo"``.

    query (B, H, N, D), key/value (B, H_kv, M, D) as the model's attention module computed them (projected, RoPE'd);
    ``attention_mask`` the 2-D padding mask from :func:`attention_mask`; ``position_ids`` (0-based) in ``kwargs``.
    Without a cache, M == N and attnzoo's batch form runs with positions ``position_ids + 1`` and the padding mask as
    ``key_mask``. With an :class:`AttnzooCache`, key/value are the N new tokens only (the cache's ``update`` hands
    them back untouched) and the layer's attnzoo ``KVCache`` prefills (N > 1) or decodes (N == 1). Returns
    (output (B, N, H, D), None): attention weights are not materialised."""
    core = getattr(module, CORE_NAME, None)
    where = _where(module)
    if not isinstance(core, Attention):
        raise IntegrationError(f"{where} has no attnzoo core: the model's attn_implementation is "
                               f"'{ATTN_IMPLEMENTATION}' but attnzoo.integrations.transformers.apply() did not run "
                               f"on it")
    if dropout:
        raise IntegrationError(f"{where}: attention dropout {dropout} was asked for (training mode); attnzoo has no "
                               f"attention dropout: set the config's attention dropout to 0.0")
    expected = getattr(core, "hf_scaling", None)
    if scaling is not None and expected is not None and not math.isclose(float(scaling), expected, rel_tol=1e-6):
        raise IntegrationError(f"{where}: transformers passes scaling {scaling} but apply() built the layer for "
                               f"{expected}: run apply() again")
    b, _, n, _ = query.shape
    cache = getattr(module, "_attnzoo_cache", None)
    x = getattr(module, "_attnzoo_input", None) if len(core.token_projections) else None  # the layer input
    sliding = kwargs.get("sliding_window")
    positions = _positions(kwargs.get("position_ids"), b, n, where)
    if isinstance(cache, AttnzooCache):
        layer = cache._layer_for(module)
        mask = _new_token_mask(attention_mask, b, n, where, exact=False)
        _check_window(sliding, layer.seen, where)
        out = layer.attend(core, query, key, value, mask, positions, where, x=x)
    else:
        if key.shape[2] != n:
            held = type(cache).__name__ if cache is not None else "a cache"
            raise IntegrationError(f"{where}: {held} handed {key.shape[2]} keys for {n} queries; attnzoo decodes only "
                                   f"with attnzoo.integrations.transformers.AttnzooCache(model) (generate() picks it "
                                   f"after apply(); pass cache=AttnzooCache(model) to a manual forward)")
        mask = _new_token_mask(attention_mask, b, n, where, exact=True)
        _check_window(sliding, n, where)
        out = core(query, key, value, positions=positions, key_mask=mask, x=x)
    return out.transpose(1, 2), None


def _new_token_mask(attention_mask, b: int, n: int, where: str, exact: bool) -> torch.Tensor | None:
    """(B, N) bool of the N new tokens (False = padding), or None when all are real."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise IntegrationError(f"{where}: attnzoo takes a 2-D padding mask (batch, tokens), got {shape}: custom "
                               f"4-D masks are not supported")
    cols = attention_mask.shape[1]
    if attention_mask.shape[0] != b or cols < n or (exact and cols != n):
        raise IntegrationError(f"{where}: the padding mask has shape {tuple(attention_mask.shape)} for {n} new tokens "
                               f"of batch {b}" + (" without a cache" if exact else ""))
    mask = attention_mask[:, cols - n:].to(torch.bool)
    return None if bool(mask.all()) else mask


def _positions(position_ids, b: int, n: int, where: str) -> torch.Tensor | None:
    """attnzoo's 1-based positions (B, N) from transformers' 0-based ``position_ids`` (1, N) or (B, N)."""
    if position_ids is None:
        return None
    if position_ids.dim() != 2 or position_ids.shape[-1] != n or position_ids.shape[0] not in (1, b):
        raise IntegrationError(f"{where}: position_ids of shape {tuple(position_ids.shape)} do not fit {n} tokens of "
                               f"batch {b} (multi-dimensional positions are not supported)")
    return position_ids.expand(b, n).to(torch.int64) + 1


def _check_window(sliding_window, tokens: int, where: str) -> None:
    """Sliding-window layers (Mistral, Qwen2 with use_sliding_window) equal plain causal attention as long as the
    sequence fits in the window; beyond it attnzoo would attend keys the model masks, so refuse."""
    if sliding_window is not None and tokens > sliding_window:
        raise IntegrationError(f"{where}: the model's sliding window ({sliding_window} tokens) is exceeded ({tokens} "
                               f"tokens): attnzoo attends every earlier token; use a spec with a local mask, or a "
                               f"config without sliding_window")


# -- the cache -----------------------------------------------------------------------------------------------------
class _AttnzooLayer(CacheLayerMixin):
    """One layer of :class:`AttnzooCache`: an attnzoo ``KVCache`` (created at the first forward, for its batch) and
    the count of tokens seen. ``keys``/``values`` stay None: transformers holds no copy of them."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, index: int, core: Attention, budget: int | None) -> None:
        super().__init__()
        self.index = index
        self.core = core
        self.budget = budget
        self.kv = None
        self.seen = 0
        self._pending: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"AttnzooLayer(index={self.index}, seen={self.seen}, kv={self.kv!r})"

    # transformers' layer API ----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand the new tokens back untouched (the attention function appends them to the attnzoo cache)."""
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        self._pending = key_states
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen (padding included), not tokens held: transformers derives positions and input slicing from
        it. :meth:`AttnzooCache.memory` reports the tokens held."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv = None
        self.seen = 0
        self._pending = None
        self.is_initialized = False

    def offload(self) -> None:  # the attnzoo cache stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise IntegrationError("AttnzooCache cannot crop (assisted or speculative decoding): an evicting cache "
                               "cannot give tokens back")

    def _reorder(self, index: torch.Tensor) -> None:
        if self.kv is None:
            return
        if not hasattr(self.kv, "reorder"):
            raise IntegrationError("this attnzoo version's KVCache has no reorder(): beam search and batch "
                                   "selection need it")
        self.kv.reorder(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv is not None:
            self._reorder(torch.arange(self.kv.batch).repeat_interleave(repeats))

    # attnzoo ----------------------------------------------------------------------------------------------------
    def attend(self, core: Attention, q, k, v, key_mask, positions, where: str, x=None) -> torch.Tensor:
        """Prefill (T > 1) or decode (T = 1) the new tokens q (B, H, T, D), k/v (B, H_kv, T, D) into this layer's
        attnzoo cache; ``key_mask`` (B, T) or None; ``positions`` (B, T) 1-based from transformers, or None."""
        if self._pending is not k:
            raise IntegrationError(f"{where}: the keys handed to attention are not those AttnzooCache.update() "
                                   f"returned (a model family that post-processes cached keys is not supported)")
        self._pending = None
        b, _, n, _ = q.shape
        if self.kv is None:
            self.kv = core.new_cache(b, budget=self.budget)
            start = _first_positions(positions, key_mask)
            if start is not None:
                self.kv.next_position = start
        elif self.kv.batch != b:
            raise IntegrationError(f"{where}: AttnzooCache holds batch {self.kv.batch}, the model was called with "
                                   f"batch {b}")
        if positions is not None:
            _check_cache_positions(self.kv.next_position, positions, key_mask, where)
        if n == 1:
            return core.decode(q, k, v, self.kv, key_mask=key_mask, x=x)
        return core.prefill(q, k, v, self.kv, key_mask=key_mask, x=x)

    def memory(self) -> dict:
        report = {"layer": self.index, "seen": self.seen, "budget": self.budget, "tokens": 0, "evicted": 0,
                  "bytes": 0, "allocated_bytes": 0}
        if self.kv is not None:
            report.update(self.kv.memory())
        return report


def _first_positions(pos, key_mask) -> torch.Tensor | None:
    """Where each row starts when transformers' positions do not start at 0 (a continued sequence): the 1-based
    position of each row's first real token, or None when every row starts at 1."""
    if pos is None:
        return None
    real = key_mask if key_mask is not None else torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
    first = torch.where(real, pos, torch.iinfo(torch.int64).max).min(-1).values
    first = torch.where(real.any(-1), first, torch.ones_like(first))
    if bool((first == 1).all()):
        return None
    if bool((first < 1).any()):
        raise IntegrationError(f"position_ids start below 0: {(first - 1).tolist()}")
    return first


def _check_cache_positions(next_position, pos, key_mask, where: str) -> None:
    """The cache numbers each row's real tokens itself; refuse when transformers' position_ids (which drove RoPE)
    disagree, rather than give position-aware transforms other positions than the model's."""
    n = pos.shape[1]
    start = next_position.to(pos.device)
    if key_mask is None:
        expected = start[:, None] + torch.arange(n, device=pos.device)
        bad = pos != expected
    else:
        real = key_mask.to(torch.int64)
        expected = start[:, None] + real.cumsum(-1) - real
        bad = (pos != expected) & key_mask
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0].tolist())
        raise IntegrationError(f"{where}: position_ids disagree with the attnzoo cache: row {row}, new token {col} "
                               f"has position_id {int(pos[row, col]) - 1} where the cache expects "
                               f"{int(expected[row, col]) - 1} (one position per real token, padding excluded)")


class AttnzooCache(Cache):
    """A transformers ``Cache`` backed by one attnzoo ``KVCache`` per attention layer (the spec's evictor).

    ``AttnzooCache(model)`` after :func:`apply`; ``budget`` (int, None or one value per layer) defaults to the
    budget recorded by ``apply``. ``update()`` hands the new keys and values back untouched; the attention function
    prefills or decodes the layer's ``KVCache``, so transformers holds no copy. Beam search (``reorder_cache``),
    ``batch_select_indices`` and ``batch_repeat_interleave`` reorder the rows of every ``KVCache``; ``crop`` is
    refused (assisted decoding). :meth:`memory` reports tokens and bytes per layer."""

    def __init__(self, model, budget=_UNSET) -> None:
        modules = _applied_modules(model)
        record = getattr(model.config, CONFIG_KEY)
        if budget is _UNSET:
            budget = record.get("budget")
        budgets = _budgets(budget, None, len(modules))
        layers = []
        for module, b in zip(modules, budgets, strict=True):
            core = getattr(module, CORE_NAME)
            _validate_budget(core, b, module)
            layers.append(_AttnzooLayer(module.layer_idx, core, b))
        super().__init__(layers=layers)

    def _layer_for(self, module) -> _AttnzooLayer:
        index = module.layer_idx
        layer = self.layers[index] if 0 <= index < len(self.layers) else None
        if layer is None or layer.core is not getattr(module, CORE_NAME, None):
            raise IntegrationError(f"{_where(module)}: this AttnzooCache was made for another model (or before apply() "
                                   f"ran again): make a new AttnzooCache(model)")
        return layer

    @property
    def kv_caches(self) -> list:
        """The attnzoo ``KVCache`` of each layer (None before the first forward)."""
        return [layer.kv for layer in self.layers]

    @property
    def budgets(self) -> list[int | None]:
        return [layer.budget for layer in self.layers]

    def memory(self) -> list[dict]:
        """Per layer: ``layer``, ``seen`` (tokens processed), ``tokens`` (held per row and head), ``budget``,
        ``evicted``, ``bytes`` (held) and ``allocated_bytes``."""
        return [layer.memory() for layer in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(layer.kv.nbytes for layer in self.layers if layer.kv is not None)

    @property
    def batch_size(self) -> int:
        sizes = {layer.kv.batch for layer in self.layers if layer.kv is not None}
        return sizes.pop() if len(sizes) == 1 else -1


def _validate_budget(core: Attention, budget, module) -> None:
    try:
        core.new_cache(1, budget=budget)
    except ValueError as exc:
        raise IntegrationError(f"{_where(module)}: {exc}") from None


# -- apply ---------------------------------------------------------------------------------------------------------
def _cache_hook(module, args, kwargs):
    """Forward pre-hook: remember the cache the attention module was called with, and its input (the hidden states,
    for transforms that take per-token inputs from the layer input), for the attention function."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    module._attnzoo_input = hidden if isinstance(hidden, torch.Tensor) else None
    cache = None
    for name in ("cache", "past_key_values", "layer_past"):
        if kwargs.get(name) is not None:
            cache = kwargs[name]
            break
    module._attnzoo_cache = getattr(cache, "self_attention_cache", cache)


def _cache_unhook(module, args, kwargs, output):
    module._attnzoo_cache = None
    module._attnzoo_input = None


def _applied_modules(model) -> list[torch.nn.Module]:
    if not is_applied(model):
        raise IntegrationError(f"{type(model).__name__}: call attnzoo.integrations.transformers.apply(model, spec) "
                               f"first")
    _, family = _family(model)
    return _attention_modules(model, family)


def is_applied(model) -> bool:
    """Whether :func:`apply` has been run on ``model`` (its config carries the record, its layers the cores)."""
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not isinstance(record, dict) or getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    return any(isinstance(getattr(m, CORE_NAME, None), Attention) for m in model.modules())


def apply(model, spec, *, budget=_UNSET, backend: str = "auto"):
    """Make ``model`` (a transformers model of a supported family) use ``spec`` for its attention, in place.

    ``spec``: a registered name (``"ssa"``), a path, a mapping or a Spec. Each attention module gets a submodule
    ``attnzoo`` (an :class:`attnzoo.nn.Attention`) that owns the transforms' parameters, so they are part of
    ``model.parameters()`` and ``state_dict()``. ``budget``: tokens an :class:`AttnzooCache` keeps per layer (an
    int, None for no eviction, or a list with one value per layer); default the spec's ``cache.budget``.
    ``backend``: attnzoo backend (``"auto"`` picks per call). The spec's ``attention.scale`` must agree with the
    model's; unset, the model's scaling is used. The spec, its hash and the budget are recorded in
    ``model.config.attnzoo`` (written by ``save_pretrained``). Returns the model. Applying again replaces the
    spec (and resets the transforms' parameters)."""
    _, family = _family(model)
    loaded = load_spec(spec)
    if not loaded.attention.causal:
        raise IntegrationError(f"spec '{loaded.name}' is not causal: a causal language model needs attention.causal "
                               f"true")
    modules = _attention_modules(model, family)
    budgets = _budgets(budget, loaded, len(modules))
    config = model.config
    for module, layer_budget in zip(modules, budgets, strict=True):
        heads, head_dim, kv_heads = family.geometry(module, config)
        scaling = float(module.scaling)
        layer_spec = _layer_spec(loaded, scaling, head_dim, module)
        reference = next(module.parameters(), None)
        dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
        device = reference.device if reference is not None else None
        try:
            core = Attention(layer_spec, heads, head_dim, kv_heads, backend=backend, dtype=dtype, device=device,
                             input_dim=config.hidden_size)
            core.variant.plan.check_dims(_dims(heads, head_dim, kv_heads))
        except ValueError as exc:
            raise IntegrationError(f"{_where(module)}: {exc}") from None
        core.hf_scaling = scaling
        _validate_budget(core, layer_budget, module)
        setattr(module, CORE_NAME, core)
        if not getattr(module, "_attnzoo_hooked", False):
            module.register_forward_pre_hook(_cache_hook, with_kwargs=True)
            module.register_forward_hook(_cache_unhook, with_kwargs=True, always_call=True)
            module._attnzoo_hooked = True
        module._attnzoo_cache = None
    _register()
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        raise IntegrationError(f"{type(model).__name__} does not let transformers switch its attention "
                               f"implementation to '{ATTN_IMPLEMENTATION}'")
    setattr(config, CONFIG_KEY, {"spec": loaded.model_dump(mode="json"), "name": loaded.name, "hash": loaded.hash,
                                 "budget": _budget_record(budgets), "backend": backend})
    _install_generate_default(model)
    model.save_pretrained = _SaveWithSpec(model)
    return model


def _dims(heads: int, head_dim: int, kv_heads: int):
    from ..transforms.base import Dims

    return Dims(num_heads=heads, head_dim=head_dim, num_kv_heads=kv_heads)


class _PrepareCacheWithAttnzoo:
    """``generate()``'s cache preparation for an applied model, set on the model instance: an
    :class:`AttnzooCache` by default; a cache passed by the caller, ``use_cache=False`` or a
    ``cache_implementation`` keep transformers' way (transformers 5 has no other hook for a default cache class).
    An object rather than a bound method, so that the model still pickles and deep-copies."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        model = self.model
        if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
                and generation_config.cache_implementation in (None, "dynamic") and is_applied(model)):
            model_kwargs["cache"] = AttnzooCache(model)
            return None
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)


def _install_generate_default(model) -> None:
    if hasattr(type(model), "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = _PrepareCacheWithAttnzoo(model)


# -- checkpoints ---------------------------------------------------------------------------------------------------
#: Keys of the spec record in each safetensors file's metadata (beside the record in config.json).
METADATA_HASH, METADATA_NAME, METADATA_SPEC = "attnzoo_spec_hash", "attnzoo_spec_name", "attnzoo_spec"


class _SaveWithSpec:
    """``save_pretrained`` of an applied model, set on the instance: transformers' own, then the spec (name, hash,
    the spec itself) written into the metadata of every safetensors file saved, so the weights carry it too. An
    object rather than a bound method, so that the model still pickles and deep-copies."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        record = getattr(self.model.config, CONFIG_KEY, None)
        if isinstance(record, dict) and "hash" in record:
            for file in sorted(glob.glob(os.path.join(os.fspath(save_directory), "*.safetensors"))):
                stamp_safetensors(file, record)
        return result


def stamp_safetensors(file: str, record: dict) -> None:
    """Write the spec ``record`` (as in ``config.attnzoo``) into the ``__metadata__`` of a safetensors file. The
    header is rewritten and the tensor bytes streamed after it unchanged, into a temporary file that replaces the
    original only once complete (an interrupted stamp loses nothing)."""
    with open(file, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
        meta = dict(header.get("__metadata__") or {})
        meta.update({METADATA_HASH: str(record["hash"]), METADATA_NAME: str(record.get("name", "")),
                     METADATA_SPEC: json.dumps(record.get("spec"), sort_keys=True)})
        header["__metadata__"] = meta
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; keeps the data 8-byte aligned
        tmp = f"{file}.attnzoo-tmp"
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            shutil.copyfileobj(fh, out, 1 << 20)
    os.replace(tmp, file)


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def from_pretrained(path_or_name, *, budget=_UNSET, backend: str | None = None, **kwargs):
    """Load a checkpoint saved after :func:`apply`: ``AutoModelForCausalLM.from_pretrained(path_or_name, **kwargs)``,
    then the recorded spec applied again and the transforms' parameters restored from the checkpoint's safetensors
    files (:func:`load_transform_params`). ``budget``/``backend`` override the recorded ones."""
    from transformers import AutoModelForCausalLM

    model = _quietly(lambda: AutoModelForCausalLM.from_pretrained(path_or_name, **kwargs))
    record = getattr(model.config, CONFIG_KEY, None)
    if not isinstance(record, dict) or "spec" not in record or "hash" not in record:
        raise IntegrationError(f"{path_or_name}: its config records no attnzoo spec (it was not saved after apply()); "
                               f"load it with transformers and call apply(model, spec)")
    apply(model, record["spec"], budget=record.get("budget") if budget is _UNSET else budget,
          backend=backend or record.get("backend", "auto"))
    if model.config.attnzoo["hash"] != record["hash"]:
        raise CheckpointSpecMismatchError(
            f"{path_or_name}: the recorded spec '{record.get('name')}' hashes to {model.config.attnzoo['hash'][:12]} "
            f"here but was saved as {str(record['hash'])[:12]} (a transform or plugin changed its defaults)")
    load_transform_params(model, path_or_name, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    return model


def _quietly(load):
    """Run a transformers load without its report when the report lists only the attnzoo parameters as unexpected
    keys (they are restored right after by :func:`load_transform_params`, which refuses missing or extra ones). A
    report that lists anything else is shown whole."""
    import logging

    class _OnlyAttnzooKeys(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if "LOAD REPORT" not in message:
                return True
            rows = [line for line in message.splitlines()[2:] if "|" in line and line.strip("-+| ")]
            return not rows or not all(PARAM_MARK in row for row in rows)

    drop = _OnlyAttnzooKeys()
    handlers = list(logging.getLogger("transformers").handlers)
    for handler in handlers:
        handler.addFilter(drop)
    try:
        return load()
    finally:
        for handler in handlers:
            handler.removeFilter(drop)


def _resolve(path_or_name, filename: str, hub_kwargs: dict) -> str | None:
    base = os.fspath(path_or_name)
    local = os.path.join(base, hub_kwargs.get("subfolder") or "", filename)
    if os.path.isdir(base):
        return local if os.path.isfile(local) else None
    from transformers.utils import cached_file

    return cached_file(base, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub_kwargs)


def _checkpoint_files(path_or_name, hub_kwargs: dict) -> tuple[str, list[str]]:
    """(config.json, safetensors files) of a checkpoint directory, hub name, or one ``.safetensors`` file."""
    path = os.fspath(path_or_name)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise IntegrationError(f"{path}: not a .safetensors file or a checkpoint directory (attnzoo reads "
                                   f"parameters only from safetensors, never from pickles)")
        config = os.path.join(os.path.dirname(path) or ".", "config.json")
        if not os.path.isfile(config):
            raise IntegrationError(f"{path}: no config.json beside it to say which spec it was saved with")
        return config, [path]
    config = _resolve(path, "config.json", hub_kwargs)
    if config is None:
        raise IntegrationError(f"{path}: no config.json (not a transformers checkpoint)")
    index = _resolve(path, "model.safetensors.index.json", hub_kwargs)
    if index is not None:
        with open(index, encoding="utf-8") as fh:
            names = sorted(set(json.load(fh).get("weight_map", {}).values()))
        files = [_resolve(path, name, hub_kwargs) for name in names]
        missing = [n for n, f in zip(names, files, strict=True) if f is None]
        if missing:
            raise IntegrationError(f"{index}: lists {missing[0]}, which is missing")
        return config, files
    single = _resolve(path, "model.safetensors", hub_kwargs)
    if single is None:
        raise IntegrationError(f"{path}: no model.safetensors (attnzoo reads parameters only from safetensors, never "
                               f"from pickles such as pytorch_model.bin)")
    return config, [single]


def _record_of(config_file: str) -> dict:
    with open(config_file, encoding="utf-8") as fh:
        record = json.load(fh).get(CONFIG_KEY)
    if not isinstance(record, dict) or "hash" not in record:
        raise IntegrationError(f"{config_file}: records no attnzoo spec (the checkpoint was not saved after apply())")
    return record


def load_transform_params(model, path_or_name, **hub_kwargs) -> list[str]:
    """Copy the transforms' parameters of a checkpoint (directory, hub name or ``.safetensors`` file, read with
    ``safetensors``) into ``model``, which :func:`apply` has prepared. Refuses with one line, naming the file: a
    checkpoint saved with another spec (both hashes), a parameter missing from it, one the model does not have, or a
    shape that differs. Returns the state-dict keys loaded."""
    from safetensors import safe_open

    mine = getattr(model.config, CONFIG_KEY, None) if is_applied(model) else None
    if mine is None:
        raise IntegrationError(f"{type(model).__name__}: call apply(model, spec) before loading transform parameters")
    config_file, files = _checkpoint_files(path_or_name, hub_kwargs)
    theirs = _record_of(config_file)
    if theirs["hash"] != mine["hash"]:
        raise CheckpointSpecMismatchError(
            f"{config_file}: checkpoint saved with spec '{theirs.get('name')}' (hash {str(theirs['hash'])[:12]}), "
            f"the model uses spec '{mine['name']}' (hash {mine['hash'][:12]})")
    wanted = {k: v for k, v in model.state_dict(keep_vars=True).items() if PARAM_MARK in k}
    found: dict[str, tuple[str, str]] = {}  # checkpoint key -> (file, key)
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():
                if PARAM_MARK in key:
                    found[key] = (file, key)
    mapping = _match_keys(list(wanted), list(found), getattr(model, "base_model_prefix", ""))
    shown = files[0] if len(files) == 1 else os.path.dirname(files[0])
    missing = [k for k in wanted if k not in mapping]
    if missing:
        raise IntegrationError(f"{shown}: holds no value for {len(missing)} attnzoo parameter(s) of the model "
                               f"(first: {missing[0]})")
    extra = sorted(set(found) - set(mapping.values()))
    if extra:
        raise IntegrationError(f"{shown}: holds {len(extra)} attnzoo parameter(s) the model does not have (first: "
                               f"{extra[0]})")
    for file in files:
        with safe_open(file, framework="pt") as fh:
            meta = fh.metadata() or {}
        stamped = meta.get(METADATA_HASH)
        if stamped is not None and stamped != mine["hash"]:
            raise CheckpointSpecMismatchError(
                f"{file}: weights saved with spec '{meta.get(METADATA_NAME)}' (hash {stamped[:12]}), the model uses "
                f"spec '{mine['name']}' (hash {mine['hash'][:12]})")
    tensors = {}
    for key, source in mapping.items():
        file, name = found[source]
        with safe_open(file, framework="pt") as fh:
            value = fh.get_tensor(name)
        if tuple(value.shape) != tuple(wanted[key].shape):
            raise IntegrationError(f"{file}: {name} has shape {tuple(value.shape)}, the model's "
                                   f"{key} has {tuple(wanted[key].shape)}")
        tensors[key] = value
    with torch.no_grad():
        for key, value in tensors.items():
            wanted[key].copy_(value)
    return sorted(tensors)


def _match_keys(wanted: list[str], found: list[str], prefix: str) -> dict[str, str]:
    """Model key -> checkpoint key: the same key, or the same without/with the base model's prefix (a checkpoint
    of the bare model loaded into one with a head, or the reverse)."""
    available = set(found)
    out = {}
    for key in wanted:
        candidates = [key]
        if prefix:
            candidates += [key.removeprefix(prefix + "."), f"{prefix}.{key}"]
        for c in candidates:
            if c in available:
                out[key] = c
                break
    return out

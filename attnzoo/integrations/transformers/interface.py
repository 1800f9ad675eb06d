"""transformers' attention interface: what each layer of a model passes to it, and attnzoo's function behind it.

Support follows the interface, not a table of families: a model's attention modules call the function registered
for ``config._attn_implementation`` with the projected (and RoPE'd, q/k-normed) query, key and value and keyword
arguments that say what the attention computes (``scaling``, ``sliding_window``, ``softcap``, ``s_aux`` for
learned sinks). :func:`probe` runs a forward pass of two tokens with a recording function registered in its place
and reads, per module, the geometry from the tensors and the features from those arguments
(:class:`LayerCall`). A module that computes attention without calling the interface is found and refused by
name, as is a keyword argument attnzoo does not know how to compute.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ...nn import Attention
from . import masks
from .base import (
    ATTN_IMPLEMENTATION,
    CORE_NAME,
    FamilyWarning,
    IntegrationError,
    ProbeError,
    cache_argument,
    one_line,
    where,
)
from .cache import recording_cache

#: The name a probing forward registers its recording function under.
PROBE_IMPLEMENTATION = "attnzoo-probe"

#: Keyword arguments of the attention function that change what it computes, and that attnzoo reads.
SEMANTIC_KWARGS = ("scaling", "dropout", "sliding_window", "softcap", "s_aux", "is_causal")
#: Keyword arguments models pass through that do not change the attention (bookkeeping, or read elsewhere:
#: positions from ``position_ids``, the cache from the module call).
PASSIVE_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "past_key_values", "cache", "position_embeddings", "layer_idx",
    "head_mask", "token_type_ids", "logits_to_keep", "labels", "attention_mask", "shift_labels",
    "num_items_in_batch",
})


@dataclass(frozen=True)
class LayerCall:
    """What one attention module asks of transformers' attention interface (read by :func:`probe`)."""

    layer: int                 #: ``layer_idx``
    module: str                #: the module's class name
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None  #: keys ``i - window < j <= i``, or None (read from the layer's mask)
    softcap: float | None      #: ``cap * tanh(logit / cap)``, or None
    sinks: str | None          #: the module's parameter passed as ``s_aux`` (learned sink logits), or None
    chunk: int | None = None   #: chunked attention: keys ``j <= i`` of the query's chunk of this many tokens
    #: what the module passes as ``sliding_window=`` (checked at every call; the window itself is read from the mask)
    passed_window: int | None = None
    #: the mask's fingerprint at :attr:`pairs` (masks.fingerprint), checked at every call; None: no mask was handed
    mask: torch.Tensor | None = field(default=None, repr=False, compare=False)
    pairs: masks.Pairs | None = field(default=None, repr=False, compare=False)


# -- registration --------------------------------------------------------------------------------------------------
def register() -> None:
    """Register the attention and mask functions under ``"attnzoo"`` (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask function for ``"attnzoo"``: hands the 2-D padding mask (B, tokens seen) through, like the
    flash-attention one (all True when transformers gave none). attnzoo builds causality, windows and chunks from
    positions, and a KV cache remembers which of its tokens are padding, so the attention function needs only the
    new tokens' columns. The mask function transformers built the mask from is remembered with it
    (:func:`masks.remember`): the attention function checks that each layer still gets the mask ``apply()`` read."""
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask  # a custom 4-D mask: refused by the attention function
    if attention_mask is None:
        padding = torch.ones(batch_size, q_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    else:
        padding = attention_mask.to(torch.bool, copy=True)
    return masks.remember(padding, mask_function, attention_mask, kv_length + kv_offset)


# -- the probe -----------------------------------------------------------------------------------------------------
_recording: list | None = None
_probe_cache = None


@dataclass(frozen=True)
class _Seen:
    """One call of the probe's attention function."""

    module: torch.nn.Module
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    kwargs: dict
    mask: object           #: the attention_mask passed (a tensor the probe's mask function built, or other)
    stored_by: list        #: the cache layers whose update() returned these keys


def _probe_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The probe's attention function, with transformers' own calling convention (:func:`attention_forward`)."""
    if _recording is not None:
        layers = getattr(_probe_cache, "layers", None) or []
        stored_by = [i for i, layer in enumerate(layers) if getattr(layer, "_pending", None) is key]
        given = dict(kwargs, dropout=dropout, scaling=scaling)
        _recording.append(_Seen(module, tuple(query.shape), tuple(key.shape), tuple(value.shape), given,
                                attention_mask, stored_by))
    b, h, n, _ = query.shape
    return query.new_zeros(b, n, h, value.shape[-1]), None


def _probe_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function=None, attention_mask=None, **kwargs):
    """The probe's mask function: the mask transformers' sdpa would get, remembered with its mask function."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    function = mask_function if mask_function is not None else causal_mask_function
    built = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, mask_function=function, attention_mask=attention_mask,
                      allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                      use_vmap=bool(kwargs.get("use_vmap", False)), device=kwargs.get("device", "cpu"))
    return masks.remember(built, function, attention_mask, kv_length + kv_offset)


def probe(model) -> list[tuple[torch.nn.Module, LayerCall]]:
    """Run a forward pass of two tokens with a recording attention function and a recording cache, and read what
    each attention module passes to the interface: ``[(module, LayerCall)]`` ordered by ``layer_idx``. The mask
    transformers builds for each layer is read too (:mod:`.masks`): its window or chunk is part of the layer's
    spec. Refuses with one line a model whose attention bypasses the interface, a non-causal one, a mask or
    arguments attnzoo cannot compute, and a layer whose keys are not the ones it stored in the cache (shared with
    another layer, or changed after the cache's update)."""
    global _recording, _probe_cache
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise IntegrationError(f"{name} is not a transformers model (no config / set_attn_implementation)")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise IntegrationError(f"{name} has cross-attention (add_cross_attention / encoder-decoder): attnzoo's "
                               f"transformers integration supports decoder-only self-attention only")
    AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_forward)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, _probe_mask)
    previous, training = config._attn_implementation, model.training  # noqa: SLF001 -- transformers' own
    reference = next(model.parameters(), None)
    device = reference.device if reference is not None else torch.device("cpu")
    calls: list = []
    try:
        model.set_attn_implementation(PROBE_IMPLEMENTATION)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal, named
        raise IntegrationError(f"{name} does not let transformers switch its attention implementation "
                               f"({one_line(exc)}): it does not dispatch through the attention interface") from None
    try:
        model.eval()
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        _recording, _probe_cache = calls, recording_cache(model)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                  **{cache_argument(model): _probe_cache})
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward, named in one line
        raise ProbeError(f"{name}: a forward pass of 2 tokens with a cache like attnzoo's, run to read what its "
                         f"attention computes, failed ({one_line(exc)[:300]})") from None
    finally:
        _recording = _probe_cache = None
        model.train(training)
        if previous is not None:
            model.set_attn_implementation(previous)
    try:
        return _read_calls(model, calls)
    finally:
        masks.forget()


def _read_calls(model, calls: list[_Seen]) -> list[tuple[torch.nn.Module, LayerCall]]:
    name = type(model).__name__
    called = [seen.module for seen in calls]
    _refuse_bypassing(model, called)
    seen_ids: set[int] = set()
    read = []
    sizes = masks.hints(model.config, None)
    for seen in calls:
        module = seen.module
        here = where(module)
        if id(module) in seen_ids:
            raise IntegrationError(f"{here} called the attention function twice in one forward pass: attnzoo "
                                   f"supports one attention call per layer")
        seen_ids.add(id(module))
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int):
            raise IntegrationError(f"{here}: an attention module without an integer layer_idx is not supported")
        _refuse_foreign_keys(seen, here)
        call = read_call(module, seen.q_shape, seen.k_shape, seen.v_shape, seen.kwargs)
        entry = masks.issued(seen.mask)
        if seen.mask is not None and entry is None:
            raise IntegrationError(f"{here} passes the attention function a mask or bias of its own (not the mask "
                                   f"transformers' mask interface built): attnzoo cannot compute it")
        shape = masks.MaskShape("causal")
        if entry is not None:  # read once per mask: the layers of one type share it
            sizes_here = tuple(sorted(set(sizes) | {call.passed_window} - {None}))
            shape = entry.taken.get(sizes_here)
            if shape is None:
                shape = entry.taken[sizes_here] = masks.read_mask(entry.function, list(sizes_here), here,
                                                                       meta=entry.tensor.device.type == "meta")
        read.append((module, _with_mask(call, shape, here), entry))
    layers = getattr(model.config, "num_hidden_layers", None)
    if isinstance(layers, int) and len(read) != layers:
        raise IntegrationError(f"{name}: {len(read)} of its {layers} layers call transformers' attention interface "
                               f"(the others compute attention another way, or are not attention layers): attnzoo "
                               f"supports models whose every layer does")
    indices = sorted(call.layer for _, call, _ in read)
    if indices != list(range(len(read))):
        raise IntegrationError(f"{name}: attention modules must carry layer_idx 0..{len(read) - 1}, got {indices} "
                               f"(layers that share another layer's keys and values are not supported)")
    shapes = [masks.MaskShape("window", c.sliding_window) if c.sliding_window else
              masks.MaskShape("chunk", c.chunk) if c.chunk else masks.MaskShape("causal") for _, c, _ in read]
    pairs = masks.fingerprint_pairs(shapes, sizes)
    out = []
    for module, call, entry in read:
        want = None
        if entry is not None:
            want = entry.taken.get(id(pairs))
            if want is None:
                want = entry.taken[id(pairs)] = masks.fingerprint(entry.function, pairs)
        out.append((module, replace(call, mask=want, pairs=pairs)))
    return sorted(out, key=lambda pair: pair[1].layer)


def _refuse_foreign_keys(seen: _Seen, here: str) -> None:
    """The keys a layer attends to must be the ones its own cache layer's update() returned (as attnzoo's cache
    holds them): a layer that reads another layer's keys, or changes its keys after storing them, is refused."""
    own = seen.module.layer_idx
    if own in seen.stored_by:
        return
    if seen.stored_by:
        raise IntegrationError(f"{here} attends to the keys and values cache layer {seen.stored_by[0]} stored (KV "
                               f"sharing between layers): attnzoo's cache holds each layer's own; not supported")
    raise IntegrationError(f"{here} attends to keys other than the ones it stores in the cache (it reuses another "
                           f"layer's keys and values, or expands or changes its keys after the cache update, as "
                           f"MLA's latent expansion does): attnzoo's cache cannot hold what it attends to; not "
                           f"supported")


def _with_mask(call: LayerCall, shape: masks.MaskShape, here: str) -> LayerCall:
    """The layer's call with the window or chunk its mask says; refuses a mask that disagrees with the
    ``sliding_window`` the module passes (the model would compute one thing under eager or sdpa attention and
    another under flash attention)."""
    passed = call.passed_window
    if passed is not None and (shape.kind != "window" or shape.size != passed):
        raise IntegrationError(f"{here} passes sliding_window={passed} but the mask transformers builds for it is "
                               f"{shape}: the model computes different attention under different implementations; "
                               f"not supported")
    if shape.kind == "window":
        return replace(call, sliding_window=shape.size)
    if shape.kind == "chunk":
        return replace(call, chunk=shape.size)
    return call


def _refuse_bypassing(model, called: list) -> None:
    """A module named like an attention module that did not call the interface (and does not wrap one that did)
    computes its attention some other way: refuse it by name rather than leave it as it is."""
    name = type(model).__name__
    called_ids = {id(m) for m in called}
    wrappers = set()
    for prefix, module in model.named_modules():
        if id(module) in called_ids:
            parts = prefix.split(".")
            wrappers.update(".".join(parts[:i]) for i in range(len(parts)))
    for prefix, module in model.named_modules():
        cls = type(module).__name__
        if (id(module) in called_ids or prefix in wrappers or isinstance(module, Attention)
                or not cls.endswith("Attention") or any(p == CORE_NAME for p in prefix.split("."))):
            continue
        raise IntegrationError(f"{cls} ({prefix}) computes its attention without transformers' attention interface "
                               f"(it never calls the function registered for attn_implementation): attnzoo cannot "
                               f"replace it")
    if not called:
        raise IntegrationError(f"{name}: no module called transformers' attention interface during a forward pass: "
                               f"attnzoo has nothing to replace")


def _refuse_unknown(kwargs: dict, here: str) -> None:
    """A keyword argument that may change what the attention computes, and that attnzoo does not read."""
    for key, value in kwargs.items():
        if value is not None and key not in SEMANTIC_KWARGS and key not in PASSIVE_KWARGS:
            raise IntegrationError(f"{here} passes {key!r} to the attention function, which attnzoo does not know "
                                   f"how to compute: not supported")


def read_call(module, q_shape, k_shape, v_shape, kwargs) -> LayerCall:
    """The :class:`LayerCall` of one call of the attention function (refusing what attnzoo cannot compute)."""
    here = where(module)
    _refuse_unknown(kwargs, here)
    causal = getattr(module, "is_causal", True) is not False and kwargs.get("is_causal", True) is not False
    if not causal:
        raise IntegrationError(f"{here} is not causal (bidirectional or encoder attention): attnzoo's transformers "
                               f"integration supports causal decoders only")
    _, heads, _, head_dim = q_shape
    kv_heads = k_shape[1]
    if v_shape[-1] != head_dim or k_shape[-1] != head_dim:
        raise IntegrationError(f"{here}: queries, keys and values of different head sizes ({head_dim}, "
                               f"{k_shape[-1]}, {v_shape[-1]}) are not supported")
    if heads % kv_heads:
        raise IntegrationError(f"{here}: {heads} query heads do not divide into {kv_heads} key/value heads")
    scaling = kwargs.get("scaling")
    scaling = float(scaling) if scaling is not None else head_dim ** -0.5
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise IntegrationError(f"{here}: sliding_window {window!r} is not a positive int")
    softcap = kwargs.get("softcap")
    sinks = None
    s_aux = kwargs.get("s_aux")
    if s_aux is not None:
        sinks = next((n for n, p in module.named_parameters(recurse=False) if p is s_aux), None)
        if sinks is None or tuple(s_aux.shape) != (heads,):
            raise IntegrationError(f"{here} passes s_aux (learned sinks) that is not a parameter of its own of shape "
                                   f"({heads},): not supported")
    return LayerCall(layer=module.layer_idx, module=type(module).__name__, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, scaling=scaling, sliding_window=None,
                     softcap=float(softcap) if softcap is not None else None, sinks=sinks, passed_window=window)


def _check_call(module, core, scaling, kwargs, attention_mask=None) -> None:
    """Each call must still ask for what :func:`probe` read when the spec was composed: its arguments, and the mask
    transformers built for it (:func:`masks.check_call`)."""
    call: LayerCall | None = getattr(core, "hf_call", None)
    if call is None:
        return
    here = where(module)
    _refuse_unknown(kwargs, here)
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2):  # other shapes: refused below
        masks.check_call(masks.issued(attention_mask), attention_mask, call.pairs, call.mask, here)
    if scaling is not None and not math.isclose(float(scaling), call.scaling, rel_tol=1e-6):
        raise IntegrationError(f"{here}: transformers passes scaling {scaling} but apply() built the layer for "
                               f"{call.scaling}: run apply() again")
    if kwargs.get("sliding_window") != call.passed_window:
        raise IntegrationError(f"{here}: transformers passes sliding_window {kwargs.get('sliding_window')} but "
                               f"apply() built the layer for {call.passed_window}: run apply() again")
    softcap = kwargs.get("softcap")
    if (softcap is None) != (call.softcap is None) or (softcap is not None and float(softcap) != call.softcap):
        raise IntegrationError(f"{here}: transformers passes softcap {softcap} but apply() built the layer for "
                               f"{call.softcap}: run apply() again")
    s_aux = kwargs.get("s_aux")
    if (s_aux is None) != (call.sinks is None) or (s_aux is not None and s_aux is not getattr(module, call.sinks)):
        raise IntegrationError(f"{here}: the learned sinks passed (s_aux) are not those apply() bound: run apply() "
                               f"again")


# -- attnzoo's attention function ----------------------------------------------------------------------------------
def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention function for ``"attnzoo"`` (:func:`attend`). Under ``torch.compile`` it runs outside
    the graph (:func:`_outside_the_graph`): the rest of the model compiles around it.

    Its parameters are those of transformers' own functions (``sdpa_attention_forward``, ``eager_attention_forward``,
    ``flash_attention_forward``): ``dropout`` is the sixth positional one, ``scaling`` the seventh. A wrapper written
    for transformers' functions calls it the same way: kvpress, imported after ``apply()``, replaces every function
    in ``ALL_ATTENTION_FUNCTIONS`` with one that calls ``func(module, query, key, value, attention_mask, dropout,
    **kwargs)`` (tests/integrations/transformers/test_hf_peers.py)."""
    if torch.compiler.is_compiling():
        return _outside_the_graph(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)
    return attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@torch.compiler.disable(reason="attnzoo's attention (its dispatch and KV cache are data-dependent) runs eagerly; "
                        "torch.compile compiles the rest of the model around it")
def _outside_the_graph(*args, **kwargs):
    return attend(*args, **kwargs)


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """What ``"attnzoo"`` computes in transformers.

    query (B, H, N, D), key/value (B, H_kv, M, D) as the model's attention module computed them (projected, RoPE'd,
    q/k-normed); ``attention_mask`` the 2-D padding mask from :func:`attention_mask`; ``position_ids`` (0-based) in
    ``kwargs``. Without a cache, M == N and attnzoo's batch form runs with positions from ``position_ids`` and the
    padding mask as ``key_mask``. With an :class:`~attnzoo.integrations.transformers.AttnzooCache`, key/value are
    the N new tokens only (the cache's ``update`` hands them back untouched) and the layer's attnzoo ``KVCache``
    prefills (N > 1) or decodes (N == 1). Returns (output (B, N, H, D), None): attention weights are not
    materialised, except with ``output_attentions`` in the batch form (the reference's probabilities)."""
    from .cache import AttnzooCache

    core = getattr(module, CORE_NAME, None)
    here = where(module)
    if not isinstance(core, Attention):
        raise IntegrationError(f"{here} has no attnzoo core: the model's attn_implementation is "
                               f"'{ATTN_IMPLEMENTATION}' but attnzoo.integrations.transformers.apply() did not run "
                               f"on it")
    if module._forward_hooks:  # noqa: SLF001 -- torch.nn.Module's hooks (a kvpress press registers one)
        _refuse_presses(module, here)
    if dropout:
        raise IntegrationError(f"{here}: attention dropout {dropout} was asked for (training mode); attnzoo has no "
                               f"attention dropout: set the config's attention dropout to 0.0")
    _check_call(module, core, scaling, kwargs, attention_mask)
    b, _, n, _ = query.shape
    cache = getattr(module, "_attnzoo_cache", None)
    x = getattr(module, "_attnzoo_input", None) if len(core.token_projections) else None  # the layer input
    position_ids = kwargs.get("position_ids")
    if getattr(core, "hf_slot_temperature", None) is not None:
        _warn_slot_temperature(module, core, cache, position_ids, attention_mask, n, query.device)
    decoding = isinstance(cache, AttnzooCache)
    if getattr(core, "parallel", None) is not None and (decoding or kwargs.get("output_attentions")):
        what = "decoding (an AttnzooCache)" if decoding else "output_attentions"
        raise IntegrationError(f"{here}: {what} with a sequence-sharded model (shard_sequence): run "
                               f"unshard_sequence(model) first")
    if isinstance(cache, AttnzooCache):
        if kwargs.get("output_attentions"):
            raise IntegrationError(f"{here}: output_attentions with a cache: attnzoo materialises attention weights "
                                   f"in the batch form only (a forward without a cache, use_cache=False)")
        layer = cache.layer_for(module)
        mask = _new_token_mask(attention_mask, b, n, here, exact=False)
        kv = layer.kv
        upcoming = kv.uniform_next_position if kv is not None else None
        if (n == 1 and b == 1 and mask is None and upcoming is not None
                and isinstance(position_ids, torch.Tensor) and position_ids.numel() == 1
                and int(position_ids) + 1 == upcoming):
            given = None  # one token of one row where the cache expects it: nothing more to check
        else:
            given = _given_positions(position_ids, b, n, here)
        out = layer.attend(core, query, key, value, mask, given, here, x=x)
    else:
        if key.shape[2] != n:
            held = type(cache).__name__ if cache is not None else "a cache"
            raise IntegrationError(f"{here}: {held} handed {key.shape[2]} keys for {n} queries; attnzoo decodes only "
                                   f"with attnzoo.integrations.transformers.AttnzooCache(model) (generate() picks it "
                                   f"after apply(); pass cache=AttnzooCache(model) to a manual forward)")
        mask = _new_token_mask(attention_mask, b, n, here, exact=True)
        positions = own_positions(_given_positions(position_ids, b, n, here), mask, here)
        out = core(query, key, value, positions=positions, key_mask=mask, x=x)
        if kwargs.get("output_attentions"):  # materialised by the reference, only when asked for
            with torch.no_grad():
                probs = core.variant.probabilities(query, key, value, params=core.params(), positions=positions,
                                                   key_mask=mask, inputs=core.token_inputs(x, n))
            return out.transpose(1, 2).contiguous(), probs.to(query.dtype)
    # (B, N, H, D) contiguous, as transformers' own attention functions return it (models view it: afmoe)
    return out.transpose(1, 2).contiguous(), None


#: Packages whose forward hooks on an attention module compress the keys and values transformers' cache holds.
CACHE_PRESSES = ("kvpress",)


def _refuse_presses(module, here: str) -> None:
    """A kvpress press (``with press(model):``) hooks every attention module and, after its forward, rewrites the
    keys and values of transformers' cache layer; after ``apply()`` attnzoo's cache holds them (transformers' holds
    none), so the press would compress nothing, or fail on a layer without keys: refuse it here, before the layer
    runs, in one line."""
    for hook in module._forward_hooks.values():  # noqa: SLF001 -- torch.nn.Module's hooks
        owner = getattr(hook, "__self__", None)
        origin = type(owner).__module__ if owner is not None else getattr(hook, "__module__", None) or ""
        package = origin.split(".")[0]
        if package in CACHE_PRESSES:
            name = type(owner).__name__ if owner is not None else getattr(hook, "__qualname__", "a hook")
            raise IntegrationError(f"{here}: a {package} press ({name}) is hooked on this layer; it compresses the "
                                   f"keys and values of transformers' cache, and after apply() attnzoo's cache "
                                   f"holds them: compress with an evicting spec instead (zt.apply(model, 'tova', "
                                   f"budget=...); h2o, streaming, selective-pruned), or run the press on a model "
                                   f"apply() did not touch")


def _warn_slot_temperature(module, core, cache, position_ids, attention_mask, n: int, device) -> None:
    """Llama 4's temperature tuning (``core.hf_slot_temperature``: the layer's ``floor_scale``) scaled this call's
    queries by their slot, their index in the call plus the cache length before it, not by their position (Llama 4
    passes its attention no ``position_ids``: attnzoo numbers each row's real tokens, as for the row alone): warn
    when that gives a real token another scale than its position would, as behind left padding (the row then
    differs from itself alone in transformers' own computation, before attnzoo's attention runs). Once per model
    (``core.hf_notices``, shared by its layers' cores)."""
    from .cache import AttnzooCache

    notices = getattr(core, "hf_notices", None)
    if not isinstance(notices, set) or "slot temperature" in notices:
        return
    past = 0
    if cache is not None and callable(getattr(cache, "get_seq_length", None)):
        past = max(int(cache.get_seq_length(module.layer_idx)) - n, 0)  # the cache's update() has run
    real = None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[1] >= n:
        real = attention_mask[:, attention_mask.shape[1] - n:].to(device=device, dtype=torch.bool)
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == n:
        positions = position_ids.to(device=device, dtype=torch.int64) + 1
    else:  # attnzoo's own numbering: each row's real tokens from 1, or on from where its cache is
        start = torch.ones((), dtype=torch.int64, device=device)
        layer = cache.layers[module.layer_idx] if isinstance(cache, AttnzooCache) else None
        if layer is not None and layer.kv is not None:
            start = layer.kv.next_position.to(device)[:, None]
        step = real.to(torch.int64) if real is not None else torch.ones(1, n, dtype=torch.int64, device=device)
        positions = start + step.cumsum(-1) - step
    scale = core.hf_slot_temperature
    slots = torch.arange(past + 1, past + n + 1, device=device)
    differs = torch.floor(slots / scale) != torch.floor(positions / scale)
    if real is not None:
        differs = differs & real
    if not bool(differs.any()):
        return
    notices.add("slot temperature")
    warnings.warn(f"{where(module)}: attn_temperature_tuning scales each query by its index in the call (the cache "
                  f"length plus the token's index), not by its position: a left-padded row is scaled as if its "
                  f"padding were tokens (floor_scale {scale:g}), so it differs from the row alone in transformers' "
                  f"own computation, before attnzoo's attention runs", FamilyWarning, stacklevel=2)


def _new_token_mask(attention_mask, b: int, n: int, here: str, exact: bool) -> torch.Tensor | None:
    """(B, N) bool of the N new tokens (False = padding), or None when all are real."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise IntegrationError(f"{here}: attnzoo takes a 2-D padding mask (batch, tokens), got {shape}: custom "
                               f"4-D masks are not supported")
    cols = attention_mask.shape[1]
    if attention_mask.shape[0] != b or cols < n or (exact and cols != n):
        raise IntegrationError(f"{here}: the padding mask has shape {tuple(attention_mask.shape)} for {n} new tokens "
                               f"of batch {b}" + (" without a cache" if exact else ""))
    mask = attention_mask[:, cols - n:].to(torch.bool)
    return None if bool(mask.all()) else mask


def _given_positions(position_ids, b: int, n: int, here: str) -> torch.Tensor | None:
    """transformers' 0-based ``position_ids`` (1, N) or (B, N) as 1-based (B, N), or None."""
    if position_ids is None:
        return None
    if position_ids.dim() != 2 or position_ids.shape[-1] != n or position_ids.shape[0] not in (1, b):
        raise IntegrationError(f"{here}: position_ids of shape {tuple(position_ids.shape)} do not fit {n} tokens of "
                               f"batch {b} (multi-dimensional positions are not supported)")
    return position_ids.expand(b, n).to(torch.int64) + 1


def counts_padding(given: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a padded row's positions number its padding too (``0, 1, 2, ...`` over every token, as transformers
    numbers a batch it is given no ``position_ids`` for); ``generate()`` and :func:`derive_position_ids` number
    real tokens only."""
    if mask is None:
        return False
    steps = torch.arange(given.shape[1], device=given.device)
    return bool(((given == given[:, :1] + steps).all(-1) & ~mask.all(-1) & ~(~mask).all(-1)).any())


def derive_position_ids(module, args, kwargs):
    """Forward pre-hook of an applied model: a call with a padded 2-D ``attention_mask`` and no ``position_ids``
    gets them from the mask, as ``generate()`` makes them (each row's real tokens numbered from 0), so that a
    manual forward or decoding loop on a left-padded batch computes what ``generate()`` does: RoPE or position
    embeddings, position-aware transforms and selective attention's protected first token alike."""
    config = getattr(module, "config", None)
    if (kwargs.get("position_ids") is not None or len(args) > 1
            or getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION):
        return None
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or bool(mask.all()):
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor):
        return None
    real = mask.to(torch.int64)
    position_ids = (real.cumsum(-1) - 1).masked_fill(real == 0, 1)[:, -ids.shape[1]:]
    return args, {**kwargs, "position_ids": position_ids}


def own_positions(given: torch.Tensor | None, mask: torch.Tensor | None, here: str) -> torch.Tensor | None:
    """attnzoo's positions of a whole sequence: ``given`` (from ``position_ids``), or, when transformers passed
    none, each row's real tokens numbered from 1 (the numbering :func:`derive_position_ids` gave the model).
    Positions that number the padding are refused: the first real token would not be position 1."""
    if given is None:
        if mask is None:
            return None
        real = mask.to(torch.int64)
        return (real.cumsum(-1)).clamp(min=1)
    if counts_padding(given, mask):
        raise IntegrationError(f"{here}: position_ids number the padding of a left-padded row: pass position_ids "
                               f"from the attention mask (attention_mask.cumsum(-1) - 1), as generate() does")
    return given

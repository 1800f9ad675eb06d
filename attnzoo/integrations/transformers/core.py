"""``apply``: each attention layer of a transformers model runs its native spec composed with the user's."""

from __future__ import annotations

import warnings

import torch

from ...nn import Attention
from ...spec import load_spec
from .base import (
    ATTN_IMPLEMENTATION,
    CONFIG_KEY,
    CORE_NAME,
    PREFER,
    UNSET,
    FamilyWarning,
    FunctionWarning,
    IntegrationError,
    ProbeError,
    applied_modules,
    cache_argument,
    is_applied,
    one_line,
    where,
)
from .cache import AttnzooCache, budgets_for, validate_budget
from .interface import derive_position_ids, probe, register
from .native import NativeLayer, compose


def native_layers(model) -> list[NativeLayer]:
    """Each attention layer's own attention, read from what it passes to transformers' attention interface (a
    forward pass of two tokens; see :func:`~attnzoo.integrations.transformers.interface.probe`)."""
    model_type = str(getattr(model.config, "model_type", None) or type(model).__name__)
    return [NativeLayer(call, model_type) for _, call in probe(model)]


def native_spec(model) -> list:
    """Each layer's native spec (an :class:`attnzoo.Spec`: the model's scaling, sliding window, soft-capping and
    learned sinks as transforms), in layer order. ``vanilla`` composed with it is the model as it ships."""
    return [layer.spec() for layer in native_layers(model)]


#: Sizes a probe of a configuration may shrink: they do not change what attention computes.
_SHRINKABLE = {"vocab_size": 128, "intermediate_size": 16, "intermediate_size_mlp": 16, "moe_intermediate_size": 16,
               "shared_expert_intermediate_size": 16, "num_local_experts": 2,
               "num_experts": 2, "num_experts_per_tok": 1, "n_routed_experts": 2}

#: The largest size :func:`config_native_layers` builds a model from, per configuration field (any spelling a
#: family uses; in sub-configurations too): generous for released models (at most about 130 layers, 128 heads,
#: head_dim 512, 512 experts). Layers and experts are modules built and run one by one (the probe's time grows with
#: them); heads, head_dim and the hidden size are what attention computes and are never shrunk.
_SIZE_LIMITS = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "depth"), 256),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "num_heads", "num_kv_heads",
                     "n_kv_heads", "multi_query_group_num"), 4096),
    **dict.fromkeys(("head_dim", "kv_channels", "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
                    4096),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "kv_lora_rank", "q_lora_rank"), 1 << 18),
    **dict.fromkeys(("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "ffn_hidden_size", "n_inner", "ffn_dim", "d_ff"), 1 << 22),
    "vocab_size": 1 << 24,
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_shared_experts",
                     "num_experts_per_tok"), 1024),
}
#: The most memory :func:`config_native_layers` allocates when a model's forward cannot run on the meta device.
_CPU_BYTES = 1 << 30


def _clip(text, limit: int = 80) -> str:
    """``text`` (any value, as ``str``) cut to ``limit`` characters with an ellipsis: what a message echoes of a
    configuration."""
    text = str(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _check_sizes(config, path: str = "", depth: int = 0) -> None:
    """One line naming the field and the limit for a size over :data:`_SIZE_LIMITS` in ``config`` or its
    sub-configurations (PretrainedConfig attributes or dicts, 4 levels deep)."""
    from transformers import PretrainedConfig

    items = config.items() if isinstance(config, dict) else vars(config).items()
    for key, value in list(items):
        if not isinstance(key, str):
            continue
        if depth < 4 and isinstance(value, (dict, PretrainedConfig)):
            _check_sizes(value, f"{path}{key}.", depth + 1)
            continue
        limit = _SIZE_LIMITS.get(key)
        if limit is None:
            continue
        numbers = value if isinstance(value, (list, tuple)) else [value]
        for number in numbers:
            if isinstance(number, (int, float)) and not isinstance(number, bool) and number > limit:
                raise IntegrationError(f"{path}{key} = {_clip(value)} is over {limit:,}, the most a model is built "
                                       f"with to read its attention (a generous bound for released models)")


def _build(config, **kwargs):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' refusal, in one line
        raise IntegrationError(f"{type(config).__name__}: transformers builds no causal LM from it "
                               f"({_clip(one_line(exc), 240)})") from None


def _on_meta(model) -> list[NativeLayer] | None:
    """The native layers of ``model`` (built on the meta device), or None when its forward cannot run there."""
    try:
        return native_layers(model)
    except ProbeError:
        return None


def config_native_layers(config) -> list[NativeLayer]:
    """The native layers of a model configuration (a transformers ``PretrainedConfig``) without its weights: the
    model is built on the meta device and probed there (a mixture of experts with transformers'
    ``experts_implementation="batched_mm"``, whose routing runs on meta). A model whose forward still cannot run on
    meta is built on the CPU in bfloat16 with its vocabulary and MLPs shrunk (they do not change what its attention
    computes; its attention layers keep their sizes) if that takes at most 1 GiB. Sizes over :data:`_SIZE_LIMITS`
    (layers, heads, head_dim, hidden size, experts, vocabulary, MLP widths) are refused first with one line naming
    the field and the limit, as is a model that would take more than 1 GiB on the CPU."""
    _check_sizes(config)
    with torch.device("meta"):
        model = _build(config)
    layers = _on_meta(model)
    if layers is None:
        try:
            with torch.device("meta"):
                model = _build(config, experts_implementation="batched_mm")
        except IntegrationError:  # no such option for this model (or this transformers)
            pass
        else:
            layers = _on_meta(model)
    if layers is not None:
        return layers
    try:
        small = config.__class__.from_dict(config.to_dict())
    except Exception as exc:  # noqa: BLE001 - transformers' refusal, in one line
        raise IntegrationError(f"{type(config).__name__}: transformers cannot copy it ({_clip(one_line(exc), 240)})"
                               ) from None
    for key, value in _SHRINKABLE.items():
        if isinstance(getattr(small, key, None), int) and getattr(small, key) > value:
            setattr(small, key, value)
    vocab = getattr(small, "vocab_size", None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(vocab, int) and isinstance(getattr(small, key, None), int) and getattr(small, key) >= vocab:
            setattr(small, key, None)
    with torch.device("meta"):
        sized = _build(small, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in [*sized.parameters(), *sized.buffers()])
    if total > _CPU_BYTES:
        raise IntegrationError(f"{type(config).__name__}: its forward does not run on the meta device, and built on "
                               f"the CPU to read its attention (vocabulary and MLPs shrunk) it would take "
                               f"{total / (1 << 30):.1f} GiB, over the 1 GiB this allocates (hidden_size "
                               f"{_clip(getattr(config, 'hidden_size', '?'))}, num_hidden_layers "
                               f"{_clip(getattr(config, 'num_hidden_layers', '?'))})")
    del sized
    return native_layers(_build(small, dtype=torch.bfloat16))


def apply(model, spec, *, budget=UNSET, backend: str = "auto", prefer: str = "error"):
    """Make ``model`` (a transformers decoder whose attention goes through its attention interface) run ``spec``
    composed with each layer's own attention, in place.

    ``spec``: a registered name (``"ssa"``), a path, a mapping or a Spec. Each layer runs the user's transforms
    added to its native spec (:func:`native_spec`: the model's scaling, sliding window, soft-capping, learned sinks).
    A conflict (two windows, two sinks, two softcaps, another scale) is refused with one line naming the layer and
    both transforms unless ``prefer`` is ``"model"`` or ``"spec"``. Each attention module gets a submodule
    ``attnzoo`` (an :class:`attnzoo.nn.Attention`) that owns the user's transforms' parameters, so they are part of
    ``model.parameters()`` and ``state_dict()``; native parameters (gpt-oss's sinks) stay the module's own.
    ``budget``: tokens an :class:`AttnzooCache` keeps per layer (an int, a float in (0, 1]: that fraction of each
    request's prompt, None for no eviction, or a list with one value per layer); default the spec's
    ``cache.budget``. ``backend``: attnzoo backend (``"auto"`` picks per call). The spec, its hash, the budget and
    ``prefer`` are recorded in ``model.config.attnzoo`` (written by
    ``save_pretrained``). Returns the model. Applying again replaces the spec (and resets its parameters). Where
    transformers' own cached ``generate()`` computes something else than its forward (a cache layer that keeps
    fewer keys than the layer's mask attends to: moshi), it warns in one line (:class:`~.base.FamilyWarning`)."""
    if prefer not in PREFER:
        raise IntegrationError(f"prefer must be one of {', '.join(PREFER)}, got {prefer!r}")
    loaded = load_spec(spec)
    if not loaded.attention.causal:
        raise IntegrationError(f"spec '{loaded.name}' is not causal: a causal language model needs attention.causal "
                               f"true")
    pairs = probe(model)
    model_type = str(getattr(model.config, "model_type", None) or type(model).__name__)
    budgets = budgets_for(budget, loaded, len(pairs))
    config = model.config
    built = []
    notices: set[str] = set()  # the family warnings already given at a call (shared by the model's cores)
    for (module, call), layer_budget in zip(pairs, budgets, strict=True):
        layer_spec, bound = compose(NativeLayer(call, model_type), loaded, prefer)
        reference = next(module.parameters(), None)
        dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float32
        device = reference.device if reference is not None else None
        try:
            core = Attention(layer_spec, call.num_heads, call.head_dim, call.num_kv_heads, backend=backend,
                             dtype=dtype, device=device, input_dim=_hidden_size(config))
            core.variant.plan.check_dims(_dims(call.num_heads, call.head_dim, call.num_kv_heads))
            for key, attribute in bound.items():
                core.bind_parameter(key, module, attribute)
        except ValueError as exc:
            raise IntegrationError(f"{where(module)}: {exc}") from None
        core.hf_call = call
        core.hf_slot_temperature = slot_temperature(module)
        core.hf_notices = notices
        validate_budget(core, layer_budget, module)
        built.append((module, core))
    changed = function_change(built[0][1], pairs[0][1], model_type, prefer, config) if built else None
    for module, core in built:  # only once every layer is built: a refusal leaves the model as it was
        setattr(module, CORE_NAME, core)
        if not getattr(module, "_attnzoo_hooked", False):
            module.register_forward_pre_hook(_cache_hook, with_kwargs=True)
            module.register_forward_hook(_cache_unhook, with_kwargs=True, always_call=True)
            module._attnzoo_hooked = True
        module._attnzoo_cache = None
    own_positions = _numbers_its_own_positions(model)
    for host in {id(m): m for m in (model, getattr(model, "base_model", model))}.values():
        if not own_positions and not getattr(host, "_attnzoo_positions_hooked", False):
            host.register_forward_pre_hook(derive_position_ids, with_kwargs=True)
            host._attnzoo_positions_hooked = True
    register()
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        raise IntegrationError(f"{type(model).__name__} does not let transformers switch its attention "
                               f"implementation to '{ATTN_IMPLEMENTATION}'")
    setattr(config, CONFIG_KEY, {"spec": loaded.model_dump(mode="json"), "name": loaded.name, "hash": loaded.hash,
                                 "budget": budgets[0] if len(set(budgets)) == 1 else list(budgets),
                                 "backend": backend, "prefer": prefer})
    _install_generate_default(model)
    from .saving import SaveWithSpec

    model.save_pretrained = SaveWithSpec(model)
    mismatch = cache_window_mismatch(model, [call for _, call in pairs], model_type)
    if mismatch is not None:
        warnings.warn(mismatch, FamilyWarning, stacklevel=2)
    if changed is not None and changed > FUNCTION_TOLERANCE:
        kinds = ", ".join(sorted({t.kind for t in loaded.transforms})) or "its attention section"
        warnings.warn(f"spec '{loaded.name}' changes what this model's attention computes before anything is evicted "
                      f"(layer 0 on a random probe: the output moved by {changed:.2g} of its size): its transforms "
                      f"({kinds}) start away from the pretrained function and need training (a fine-tune) before "
                      f"the model answers as it did; to serve a pretrained checkpoint as it is, use an evictor-only "
                      f"spec (snapkv-span, snapkv, h2o, tova, streaming, knorm, keydiff; docs/transformers.md)",
                      FunctionWarning, stacklevel=2)
    return model


#: the relative change of a layer's attention output, on the probe, above which :func:`apply` warns: far above
#: float32 rounding between two backends (1e-6), far below what a transform that changes the function moves
FUNCTION_TOLERANCE = 1e-3


def function_change(core: Attention, call, model_type: str, prefer: str, config) -> float | None:
    """How far ``core`` (a layer's attention with the user's transforms, as applied) moves the layer's own
    attention's output, max |a - b| / max |b|, on a seeded random probe (one row of 48 tokens, float32), the native
    parameters bound alike; None where it cannot run (the meta device, a probe that fails)."""
    try:
        native, bound = compose(NativeLayer(call, model_type), load_spec({"name": "native", "attention":
                                                                           {"causal": True}}), prefer)
        params = core.params()
        device = next((t.device for t in params.values()), None)
        if device is not None and device.type == "meta":
            return None
        plain = Attention(native, call.num_heads, call.head_dim, call.num_kv_heads, backend="reference",
                          dtype=torch.float32, device=device, input_dim=_hidden_size(config))
        gen = torch.Generator().manual_seed(0)
        h, hkv, d, n = call.num_heads, call.num_kv_heads, call.head_dim, 48
        q, k, v = (torch.randn(1, heads, n, d, generator=gen).to(device) for heads in (h, hkv, hkv))
        x = torch.randn(1, n, _hidden_size(config) or 1, generator=gen).to(device)
        own = {key: t.detach().float() for key, t in params.items()}
        with torch.no_grad():
            a = core.variant(q, k, v, params=own, inputs=core.token_inputs(x, n) if len(core.token_projections)
                             else None)
            b = plain.variant(q, k, v, params={key: own[key] for key in plain.params() if key in own})
        scale = float(b.abs().amax())
        return float((a.float() - b).abs().amax()) / scale if scale > 0 else None
    except Exception:  # noqa: BLE001 - a measurement, never a reason to refuse the apply
        return None


def cache_window_mismatch(model, calls, model_type: str) -> str | None:
    """One line when the cache transformers' own ``generate()`` builds for ``model`` (a ``DynamicCache`` from its
    text configuration) keeps fewer past keys on a layer than the mask the probe read for that layer attends to
    (moshi: ``config.sliding_window`` makes every cache layer a sliding one while its mask is causal): transformers'
    cached generation then computes something else than its forward, and attnzoo, which computes the mask with or
    without its cache, cannot match both. Read from what the host builds (its cache layers' ``sliding_window``
    against the layers' masks), not from a list of families; None when they agree or the cache cannot be built."""
    if not callable(getattr(model, "_supports_default_dynamic_cache", None)):
        return None
    try:
        from transformers import DynamicCache

        if not model._supports_default_dynamic_cache():
            return None
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else None
        layers = list(DynamicCache(config=config or model.config).layers)
    except Exception:  # noqa: BLE001 - no cache of transformers' own to compare with
        return None
    for call in calls:
        kept = getattr(layers[call.layer], "sliding_window", None) if call.layer < len(layers) else None
        if isinstance(kept, bool) or not isinstance(kept, int):
            continue
        reach = call.sliding_window or call.chunk  # keys back, the query's own included; None: every earlier key
        if reach is not None and reach <= kept:
            continue
        mask = ("causal" if reach is None else f"a window of {reach}" if call.sliding_window else
                f"chunks of {reach}")
        return (f"{type(model).__name__} ({model_type}): transformers' own cached generate() computes something "
                f"else than its forward: its DynamicCache keeps {kept - 1} past tokens on layer {call.layer} "
                f"(sliding_window {kept}) where the layer's mask is {mask}; attnzoo computes the mask with or "
                f"without its cache (the forward, transformers' generate() with use_cache=False), so its greedy "
                f"tokens can differ from transformers' cached generate()")
    return None


def slot_temperature(module) -> float | None:
    """``floor_scale`` of a layer that scales its queries by their index in the call rather than by their position
    (Llama 4's ``attn_temperature_tuning`` on its no-RoPE layers: ``log1p(floor((i + 1) / floor_scale))``, ``i`` the
    cache length plus the token's index), or None. Read from the module's own attributes: the scaling happens in
    the module's forward before it calls the interface, so the probe sees only scaled queries, and at the probe's
    two tokens the scale is 1 (released configs: floor_scale 8192)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    scale = getattr(module, "floor_scale", None)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        return None
    return float(scale)


def _hidden_size(config) -> int | None:
    """The width of the layer input (for transforms that project it), from the text configuration of a composite
    model; None when the configuration names none (a spec that needs it is then refused by the core)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "hidden_size", None)
    return width if isinstance(width, int) else None


def _numbers_its_own_positions(model) -> bool:
    """Whether the model derives absolute positions from its input ids when it is given none (RoBERTa and its
    copies: real tokens numbered from ``padding_idx + 1``, the padding left out): such a model already numbers a
    left-padded row as the row alone, and positions derived from the mask would number it another way."""
    return any(hasattr(type(m), "create_position_ids_from_input_ids") for m in model.modules())


def layer_specs(model) -> list:
    """The spec each layer of an applied model runs (its native spec composed with the user's), in layer order."""
    return [getattr(m, CORE_NAME).spec for m in applied_modules(model)]


def _dims(heads: int, head_dim: int, kv_heads: int):
    from ...transforms.base import Dims

    return Dims(num_heads=heads, head_dim=head_dim, num_kv_heads=kv_heads)


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


class _PrepareCacheWithAttnzoo:
    """``generate()``'s cache preparation for an applied model, set on the model instance: an
    :class:`AttnzooCache` by default; a cache passed by the caller, ``use_cache=False`` or a
    ``cache_implementation`` keep transformers' way (transformers 5 has no other hook for a default cache class).
    An :class:`AttnzooCache` passed by the caller is used even where the configuration or the call says
    ``use_cache=False`` (a checkpoint saved for training often does): transformers would otherwise feed the whole
    sequence again at every step into the cache it was given (a ``DynamicCache`` then holds each token several times
    and numbers the repeated tokens after the ones it holds). An object rather than a bound method, so that the
    model still pickles and deep-copies."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        model = self.model
        name = cache_argument(model)
        if isinstance(model_kwargs.get(name), AttnzooCache) and generation_config.use_cache is False:
            generation_config.use_cache = True  # this call's copy: generate() passes it on to every forward
        if (model_kwargs.get(name) is None and generation_config.use_cache is not False
                and generation_config.cache_implementation in (None, "dynamic") and is_applied(model)):
            model_kwargs[name] = AttnzooCache(model)
            return None
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)


def _install_generate_default(model) -> None:
    if hasattr(type(model), "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = _PrepareCacheWithAttnzoo(model)

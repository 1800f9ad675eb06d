"""The family sweep's models (:mod:`.sweep`): each causal LM family built tiny, with no downloads.

:func:`config` makes a family's tiny configuration with ``AutoConfig.for_model``: width 64, 4 query heads over 2
key/value heads of 16 (every head its keys for multi-head latent attention, keys wider than values as in the real
ones), a vocabulary of 128, 2 experts where it has experts, windows and chunks of 4 tokens, and enough layers that
every kind of layer the family has appears (the first few layers when that is enough, else the first layer of each
kind: what ``layer_types`` and the other per-layer lists say, which layers lists of indices name, which layers read
another's keys and values). The sizes are set generically, a key only where the configuration has it (aliases
included: ``n_embd``, ``n_head``, ``d_model``, ...); :data:`FIXES` holds the few per-family keys the generic rule
cannot find, :data:`PREPARE` what a built model needs before it runs. :func:`build` builds it (eager attention,
float32, eval mode) and draws its weights again at a scale where attention patterns matter (:func:`redraw`), so a
wrong pattern moves the logits; :class:`CannotBuild` says why transformers cannot.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from typing import Any

VOCAB, PAD, BOS = 128, 0, 1
#: Windows, chunks and other local spans of the sweep's models (tokens).
WINDOW = 4
#: Layers when the family has a single kind of layer; families with several kinds get as many as it takes.
LAYERS = 2
MAX_LAYERS = 4

# -- the configurations --------------------------------------------------------------------------------------------
_MLA = frozenset({"kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"})
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "swa_num_key_value_heads")
#: Each value is set on every key of its group that the configuration has (its own name or an alias).
_SIZES: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), VOCAB),
    (("hidden_size_per_layer_input",), 16),
    (("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "emb_dim", "model_dim", "word_embed_proj_dim",
      "hidden_size_global"), 64),
    (("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff", "dff", "dim_ff",
      "feed_forward_size", "ffn_hidden_size", "d_inner"), 64),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
      "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size", "dense_intermediate_size",
      "first_dense_intermediate_size", "prefix_dense_intermediate_size", "shared_experts_intermediate_size",
      "intermediate_size_mlp", "mlp_only_intermediate_size"), 32),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads",
      "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
      "swa_num_attention_heads"), 4),
    (_KV_HEADS, 2),
    (("head_dim", "kv_channels", "d_head", "dim_head", "attention_head_size", "attention_head_dim",
      "swa_head_dim"), 16),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
      "max_source_positions", "context_length"), 256),
    (("sliding_window", "window_size", "attention_window", "attention_window_size", "local_window_size",
      "sliding_window_size", "local_attention_window_len", "attention_chunk_size"), WINDOW),
    # linear attention and state-space layers of hybrids (refused, but built small)
    (("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads"), 2),
    (("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    (("state_size", "mamba_d_state", "ssm_state_size"), 8),
    (("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 4),
    (("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 32),
    (("mamba_d_ssm",), 128),
    # mixtures of experts: 2 experts, both used (no routing tie can flip between the model and attnzoo)
    (("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 2),
    (("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts", "moe_k"), 2),
    (("n_group", "topk_group", "num_expert_group", "n_shared_experts", "num_shared_experts",
      "moe_num_shared_experts", "n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...): the real ratio, keys wider than values
    (("q_lora_rank", "kv_lora_rank"), 32),
    (("qk_nope_head_dim",), 16),
    (("qk_rope_head_dim",), 8),
    (("v_head_dim",), 16),
    # layer kinds: the first layer dense, the others as the family's
    (("first_k_dense_replace", "num_dense_layers", "max_window_layers"), 1),
    (("use_sliding_window", "is_decoder"), True),
)
_IDS = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)
#: Keys of the layer count (the first the configuration has is the one the model reads).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
               "encoder_layers", "num_encoder_layers")

#: Per-family keys the generic rule cannot find (set after it, on the text configuration), each with its reason.
#: They apply to the configuration with the default's layers, before the layers are cut down.
FIXES: dict[str, dict[str, Any]] = {
    # hybrids whose default (or whose generic cut) has no attention layer at all
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(full_attn_idxs=[1]),                         # its default has no convolution layer
    "xlstm": dict(qk_dim_factor=1.0),                         # its decoding cache assumes keys as wide as values
    "zamba": dict(_layers=12),                                # ties the weights of >= 2 hybrid layers
    # layers that read another layer's keys and values (KV sharing), which the default leaves off
    "gemma4_text": dict(num_kv_shared_layers=10),
    "gemma4": dict(num_kv_shared_layers=10),
    "blt": dict(encoder_hash_byte_group_vocab=256),           # a hash embedding of 500k rows by default
    "kolibri1_1": dict(index_num_heads=1),                    # at most the query heads of one key head
    "mamba2": dict(head_dim=32),                              # heads x head_dim = expand x hidden
    "dots3_note_text": dict(head_dim=24),                     # its window layers: qk_nope + qk_rope wide
    "dots3_note": dict(head_dim=24),
    "zaya": dict(num_experts_per_tok=1),                      # "supports num_experts_per_tok=1 only"
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16]),  # sum to the width, product positions
}

#: What a family needs done to the built model before it runs (with the reason).
PREPARE: dict[str, Any] = {
    "xmod": lambda model: model.set_default_language(model.config.languages[0]),  # "Input language unknown"
}


@contextlib.contextmanager
def quiet():
    """transformers' warnings and log lines about the tiny configurations, silenced for the duration."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


class CannotBuild(Exception):
    """transformers cannot build the family tiny, or its eager model does not run on CPU."""


def _layer_count(config) -> tuple[str | None, int | None]:
    for key in _LAYER_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None, None


def _read(config, key: str, default):
    try:
        return getattr(config, key, default)
    except Exception:  # noqa: BLE001 - a per-layer attribute with no global value
        return default


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _layers(full, first: int | None = None) -> dict[str, Any]:
    """The layer count and the per-layer keys of a configuration cut down from ``full`` (the tiny configuration
    with every layer of the family's default): each kind of layer at least once, the first few layers when that is
    enough, else the first layer of each kind. A layer's kind is what the per-layer lists say of it
    (``layer_types``, ``mlp_layer_types``, ...), whether lists of layer indices name it (``mlp_only_layers``,
    ``attn_layer_indices``, ``cross_attention_layers``, ...), whether it reads another layer's keys and values
    (``kv_source_layers``, ``num_kv_shared_layers``). The lists are sliced and the indices renumbered. ``first``:
    keep the first ``first`` layers instead."""
    key, count = _layer_count(full)
    if key is None:
        return {}
    fields = {k: _read(full, k, v) for k, v in full.to_dict().items()}  # as the model reads them (not serialised)
    refs = {k for k, v in fields.items() if "source" in k and isinstance(v, list) and len(v) == count
            and all(_is_index(x) and x <= i for i, x in enumerate(v))}
    indices = {k: set(v) for k, v in fields.items() if k not in refs and isinstance(v, list) and v
               and any(w in k for w in ("layer", "idx", "indices")) and len(set(v)) == len(v)
               and all(_is_index(x) and x < count for x in v)}
    lists = {k: v for k, v in fields.items() if isinstance(v, list) and len(v) == count and k not in indices
             and not k.endswith("_ids") and k != "architectures"}
    shared = fields.get("num_kv_shared_layers")
    shared = shared if _is_index(shared) and 0 < shared < count else 0

    def kind(i: int) -> tuple:
        return (*(("self" if v[i] == i else "another") if k in refs else str(v[i]) for k, v in lists.items()),
                *(i in v for v in indices.values()), i >= count - shared)

    kinds = [kind(i) for i in range(count)]
    wanted = set(kinds)
    prefix = next(n for n in range(1, count + 1) if set(kinds[:n]) == wanted)
    if first is not None:
        keep = set(range(min(first, count)))
    elif prefix <= MAX_LAYERS:
        keep = set(range(max(prefix, min(LAYERS, count))))
    else:  # the first layer of each kind, and the layers they read from
        keep = {kinds.index(k) for k in wanted}
        keep |= {lists[k][i] for k in refs for i in keep} | set(range(max(0, LAYERS - len(keep))))
    keep = sorted(keep)
    out: dict[str, Any] = {name: len(keep) for name in _LAYER_KEYS if name in fields}
    out.update({k: [keep.index(v[i]) if k in refs else v[i] for i in keep] for k, v in lists.items()})
    out.update({k: [keep.index(i) for i in sorted(v) if i in keep] for k, v in indices.items()})
    if shared:
        out["num_kv_shared_layers"] = sum(i >= count - shared for i in keep)
    for name, value in fields.items():  # per-layer tables keyed by layer index: renumbered, their sizes tiny
        if ("layer" in name and isinstance(value, dict) and value
                and all(str(k).isdigit() and int(k) < count for k in value)):
            out[name] = {new: {**value[k], **_sizes(value[k])} if isinstance(value[k], dict) else value[k]
                         for k in value for new, old in enumerate(keep) if int(k) == old}
    return out


def _sizes(fields: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for keys, value in _SIZES:
        for key in keys:
            if key in fields:
                out[key] = value
    if _MLA & set(fields):  # multi-head latent attention: every head has its keys (no GQA)
        out.update({k: 4 for k in _KV_HEADS if k in fields})
    return out


def _scalars(default) -> dict[str, Any]:
    """The generic tiny sizes for one configuration: only the keys it has (its own fields, as ``to_dict()`` lists
    them: GPT-2's ``hidden_size`` is set through its field ``n_embd``)."""
    fields = default.to_dict()
    out = _sizes(fields)
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: head_dim is the rotary part where it has one
        if "head_dim" in fields:
            out["head_dim"] = out["qk_rope_head_dim"]
        if "swa_head_dim" in fields:  # a window layer of plain attention beside the latent ones: the same width
            out["swa_head_dim"] = out["qk_rope_head_dim"] + out["qk_nope_head_dim"]
    for key, value in fields.items():
        if isinstance(value, dict) and key not in ("id2label", "label2id") and _sizes(value):
            out[key] = {**value, **_sizes(value)}  # a nested table of sizes (kimi_linear's linear_attn_config)
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("layerdrop")):
            out[key] = 0.0
        if key in ("rotary_dim", "rotary_emb_dim") and isinstance(value, int):
            out[key] = 8
    out.update({k: v for k, v in _IDS.items() if k in fields})
    return out


def _tiny(default, make, fixes: dict) -> dict[str, Any]:
    """The keyword arguments of one tiny configuration: the sizes (and ``fixes``), then its layers read from the
    configuration ``make(**sizes)`` builds with every layer of the default (so that per-layer lists the
    configuration derives from the sizes, such as ``layer_types`` from ``use_sliding_window``, are derived)."""
    fixes = dict(fixes)
    first = fixes.pop("_layers", None)
    out = {**_scalars(default), **fixes}  # the fixes apply to the full configuration and stay unless its layers
    try:                                 # say otherwise (a count of shared layers, counted again in the tiny one)
        full = make(**out)
    except Exception:  # noqa: BLE001 - the sizes alone do not validate: the default's layers
        full = default
    return {**out, **_layers(full, first)}


@functools.cache
def _default(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def config(model_type: str):
    """The tiny configuration of ``model_type`` (raises :class:`CannotBuild` with transformers' reason)."""
    with quiet():
        try:
            default = _default(model_type)
        except Exception as exc:  # noqa: BLE001 - transformers' refusal, in one line
            raise CannotBuild(f"transformers cannot build its configuration: {one_line(exc)}") from None
        return _config(model_type, default)


def _config(model_type: str, default):
    from transformers import AutoConfig

    fixes = FIXES.get(model_type, {})
    subs = [name for name in getattr(default, "sub_configs", None) or {} if hasattr(getattr(default, name, None),
                                                                                   "to_dict")]
    text = "text_config" if "text_config" in subs else "decoder" if "decoder" in subs else None
    kwargs = _tiny(default, functools.partial(AutoConfig.for_model, model_type), {} if text else fixes)
    for name in subs:  # a composite configuration: each part tiny, the family's fixes on its text part
        sub = getattr(default, name)
        kwargs[name] = _tiny(sub, type(sub), fixes if name == text else {})
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise CannotBuild(f"transformers cannot build it tiny: {one_line(exc)}") from None


def _default_builds(model_type: str) -> bool:
    """Whether transformers builds the family's default configuration as a causal LM (``is_decoder``: on the meta
    device, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    flags = {k: v for keys, v in _SIZES if isinstance(v, bool) for k in keys if k in _default(model_type).to_dict()}
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(_default(model_type).__class__(**flags))
    except Exception:  # noqa: BLE001
        return False
    return True


def one_line(exc: BaseException) -> str:
    """The exception's first line (and the next, when the first only announces it), at most 300 characters."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


def redraw(model, seed: int = 0) -> None:
    """Weights at a scale where attention patterns matter: every matrix normal with std ``1/sqrt(fan_in)``
    (embeddings ``1/sqrt(width)``), norms, biases and other vectors as built, learned sinks standard normal."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(seed)
    done: set[int] = set()

    def draw(p, std):
        if id(p) in done or not p.is_floating_point():
            return
        done.add(id(p))
        p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * std)

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()  # noqa: N806
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, nn.Parameter):
                continue
            if isinstance(module, nn.Linear):
                draw(weight, module.in_features ** -0.5)
            elif isinstance(module, nn.Embedding):  # rows of the width's scale (logits of tied heads O(1))
                draw(weight, weight.shape[-1] ** -0.5)
            elif Conv1D and isinstance(module, Conv1D):
                draw(weight, weight.shape[0] ** -0.5)
            elif isinstance(module, nn.Conv1d | nn.Conv2d):
                draw(weight, math.prod(weight.shape[1:]) ** -0.5)
        for name, p in model.named_parameters():
            if "sink" in name.rsplit(".", 1)[-1]:
                draw(p, 1.0)
            elif p.dim() >= 2:
                draw(p, p.shape[-1] ** -0.5)


def build(model_type: str, seed: int = 0):
    """The tiny random-init causal LM of ``model_type``: eager attention, float32, eval mode, weights redrawn
    (:func:`redraw`). Raises :class:`CannotBuild` with the reason."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config(model_type)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        which = "it tiny" if _default_builds(model_type) else "it (nor its default configuration)"
        raise CannotBuild(f"transformers cannot build {which}: {one_line(exc)}") from None
    if model_type in PREPARE:
        PREPARE[model_type](model)
    redraw(model, seed)
    return model.eval()

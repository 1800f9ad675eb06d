"""The family matrix: a tiny, randomly initialised configuration of every model family the integration is tested
on (no downloads). The test suite runs each through the same checks, and the docs' table of families and their
native specs (docs/reference/families.md) is generated from it.

Every family here is supported for the same reason, not by name: its attention modules call transformers'
attention interface. Windows are small (4 tokens) so that short sequences cross them; the layers alternate where
the family does (``layer_types``).
"""

from __future__ import annotations

from typing import Any

VOCAB, PAD, BOS = 64, 0, 1
#: The sliding window of the matrix's windowed families.
WINDOW = 4

_IDS = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)
_GQA = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, **_IDS)
_ALTERNATING = ["sliding_attention", "full_attention"]

#: family (config.model_type) -> (what it shows, config keyword arguments)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("plain causal GQA", dict(_GQA)),
    "qwen2": ("sliding window on the layers past max_window_layers",
              dict(_GQA, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("a sliding window on every layer", dict(_GQA, sliding_window=WINDOW)),
    "qwen3": ("q/k norms (the model's), alternating window layers",
              dict(_GQA, use_sliding_window=True, sliding_window=WINDOW, layer_types=_ALTERNATING)),
    "gemma2": ("query_pre_attn_scalar, logit soft-capping, alternating window layers",
               dict(_GQA, query_pre_attn_scalar=32, sliding_window=WINDOW, attn_logit_softcapping=50.0,
                    layer_types=_ALTERNATING)),
    "gemma3_text": ("query_pre_attn_scalar, q/k norms, alternating window layers",
                    dict(_GQA, query_pre_attn_scalar=32, sliding_window=WINDOW, layer_types=_ALTERNATING)),
    "gpt_oss": ("learned sinks, alternating window layers, mixture of experts",
                dict(_GQA, sliding_window=WINDOW, layer_types=_ALTERNATING, num_local_experts=2,
                     num_experts_per_tok=1)),
    "phi3": ("fused qkv projection, a sliding window on every layer",
             dict({k: v for k, v in _GQA.items() if k != "head_dim"}, sliding_window=WINDOW)),
    "olmo2": ("q/k norms over the whole projection", dict(_GQA)),
    "smollm3": ("no RoPE on some layers (the model's)", dict(_GQA, no_rope_layer_interval=2)),
    "granite": ("attention_multiplier as the logit scale", dict(_GQA, attention_multiplier=0.3)),
    "starcoder2": ("a sliding window on every layer, biases",
                   dict({k: v for k, v in _GQA.items() if k != "head_dim"}, sliding_window=WINDOW)),
    "cohere2": ("alternating window layers, parallel blocks",
                dict(_GQA, sliding_window=WINDOW, layer_types=_ALTERNATING)),
    "glm4": ("partial rotary, extra norms", dict(_GQA)),
    "gpt_neox": ("fused qkv, no GQA", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256, **_IDS)),
    "gpt2": ("per-layer scaling (scale_attn_by_inverse_layer_idx)",
             dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, scale_attn_by_inverse_layer_idx=True,
                  attn_pdrop=0.0, **_IDS)),
}


def available() -> list[str]:
    """The families of :data:`FAMILIES` that the installed transformers ships."""
    from transformers import CONFIG_MAPPING

    return [name for name in FAMILIES if name in CONFIG_MAPPING]


def config(family: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**FAMILIES[family][1], **overrides})


def tiny_model(family: str, dtype=None, **overrides):
    """A tiny randomly initialised causal LM of ``family`` (seed the caller), eval mode, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(family, **overrides), attn_implementation="eager",
                                             dtype=dtype or torch.float32)
    return model.eval()

"""The mask is part of a layer's attention (attnzoo/integrations/transformers/masks.py): a window or chunk that lives
only in the mask transformers builds (qwen2_moe's max_window_layers, phimoe's sliding_window, llama4's
attention_chunk_size) is read into the layer's native spec and computed exactly; a mask attnzoo cannot express, a
mask that changes after apply(), keys that are not those the layer stored (KV sharing, MLA's expansion, a repeat
after the update) and a module's own bias are refused in one line at apply() or at the call, never replaced."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers import masks  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB, PAD, BOS, SIZE = 64, 0, 1, 4
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=BOS,
            eos_token_id=None)
#: the window or chunk exists only in the mask transformers builds: the modules pass no sliding_window=
ONLY_IN_THE_MASK = {
    "qwen2_moe": (dict(use_sliding_window=True, sliding_window=SIZE, max_window_layers=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1),
                  [("window", SIZE), None, None, None]),
    "phimoe": (dict(sliding_window=SIZE, num_local_experts=2, num_experts_per_tok=1), [("window", SIZE)] * 4),
    "llama4_text": (dict(attention_chunk_size=SIZE, intermediate_size_mlp=64, num_local_experts=2,
                         num_experts_per_tok=1), [("chunk", SIZE)] * 3 + [None]),
}
GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None)


def tiny(family: str, **extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**BASE, **ONLY_IN_THE_MASK.get(family, ({}, None))[0], **extra})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # weights at a scale where a wrong attention pattern moves the logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 2.0 * p.shape[-1] ** -0.5)
    return model


def prompt(length: int) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (length,))
    ids[0] = BOS
    return ids


def spec_of(layer) -> tuple | None:
    c = layer.call
    return ("window", c.sliding_window) if c.sliding_window else ("chunk", c.chunk) if c.chunk else None


@pytest.mark.parametrize("family", sorted(ONLY_IN_THE_MASK))
def test_a_window_or_chunk_only_in_the_mask_is_read_and_exact(family):
    model = tiny(family)
    want_spec = ONLY_IN_THE_MASK[family][1]
    assert [spec_of(layer) for layer in zt.native_layers(model)] == want_spec
    rows = [prompt(6 * SIZE), prompt(3 * SIZE + 1)]  # several windows / chunks
    width = max(len(r) for r in rows)
    padded = torch.full((2, width), PAD)
    for i, r in enumerate(rows):
        padded[i, width - len(r):] = r
    mask = (padded != PAD).long()
    with torch.no_grad():
        want = [model(r[None]).logits[0] for r in rows]
    want_tokens = model.generate(rows[1][None], max_new_tokens=3 * SIZE, **GREEDY)

    zt.apply(model, "vanilla")
    with torch.no_grad():
        got = model(rows[0][None]).logits[0]
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
        batch = model(padded, attention_mask=mask).logits
    for i, r in enumerate(rows):  # a padded row is the row alone
        torch.testing.assert_close(batch[i, width - len(r):], want[i], rtol=1e-5, atol=1e-5)
    out = model.generate(rows[1][None], max_new_tokens=3 * SIZE, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, want_tokens)
    for report, shape in zip(out.cache.memory(), want_spec, strict=True):  # held between steps: under one window/chunk
        if shape is not None:
            assert report["tokens"] < SIZE and report["expired"] > 0, report
    together = model.generate(padded, attention_mask=mask, max_new_tokens=2 * SIZE, **GREEDY)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=2 * SIZE, **GREEDY)
        assert torch.equal(together[i, width - len(r):], alone[0]), i

    kinds = [[t.kind for t in s.transforms] for s in zt.native_spec(model)]
    assert kinds == [[{"window": "sliding_window", "chunk": "chunked"}[s[0]]] if s else [] for s in want_spec]
    assert "chunked attention" in zt.native_layers(model)[0].spec().summary or family != "llama4_text"


def test_decode_memory_of_a_chunked_layer_stays_under_its_chunk():
    model = zt.apply(tiny("llama4_text", num_hidden_layers=1, no_rope_layers=[1]), "vanilla")
    assert zt.native_layers(model)[0].call.chunk == SIZE
    cache = zt.AttnzooCache(model)
    ids = prompt(3)[None]
    held = []
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        for _ in range(7 * SIZE):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, cache=cache, use_cache=True)
            held.append(cache.memory()[0]["tokens"])
    assert max(held) <= SIZE - 1 and cache.memory()[0]["seen"] == 3 + 7 * SIZE, held  # a chunk's past, never more


def test_a_window_changed_after_apply_is_refused_at_the_call_not_replaced():
    model = zt.apply(tiny("phimoe"), "vanilla")
    ids = prompt(4 * SIZE)[None]
    with torch.no_grad():
        model(ids)
        model.config.sliding_window = SIZE + 2  # transformers now builds another mask; the layers were built for 4
        with pytest.raises(zt.IntegrationError, match=r"layer 0\) was handed a mask other than the one apply\(\) read"
                           ) as caught:
            model(ids)
    assert "\n" not in str(caught.value)


def test_composing_a_user_window_with_a_native_chunk_is_a_conflict():
    model = tiny("llama4_text")
    spec = {"name": "local", "transforms": [{"kind": "sliding_window", "window": 3}]}
    with pytest.raises(zt.IntegrationError, match=r"conflicts with the model's chunked \(chunk 4\)"):
        zt.apply(model, spec)
    zt.apply(model, spec, prefer="model")
    assert [t.kind for t in zt.layer_specs(model)[0].transforms] == ["chunked"]


@pytest.mark.parametrize("family, extra, says", [
    ("jetmoe", dict(num_local_experts=2, num_experts_per_tok=1, kv_channels=16), "changes its keys after the cache"),
    ("deepseek_v2", dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                         first_k_dense_replace=1), "MLA's latent expansion"),
    ("doge", dict(), "a mask or bias of its own"),
])
def test_what_attnzoo_cannot_hold_or_compute_is_refused_at_apply(family, extra, says):
    model = tiny(family, num_hidden_layers=2, **extra)
    with pytest.raises(zt.IntegrationError, match=says) as caught:
        zt.apply(model, "vanilla")
    assert "\n" not in str(caught.value) and "(layer 0)" in str(caught.value)
    assert getattr(model.config, "attnzoo", None) is None  # the model is left as it was


@pytest.mark.parametrize("function, shape", [
    (causal_mask_function, masks.MaskShape("causal")),
    (sliding_window_causal_mask_function(5), masks.MaskShape("window", 5)),
    (sliding_window_causal_mask_function(1), masks.MaskShape("window", 1)),
    (chunked_causal_mask_function(7, torch.zeros(1, dtype=torch.long)), masks.MaskShape("chunk", 7)),
])
def test_read_mask_says_what_a_mask_function_allows(function, shape):
    assert masks.read_mask(function, [5, 7], "L") == shape


@pytest.mark.parametrize("function, says", [
    (lambda b, h, q, kv: kv >= 0, "not causal"),
    (and_masks(causal_mask_function, lambda b, h, q, kv: (q - kv) % 2 == 0), "not a contiguous run"),
    (and_masks(causal_mask_function, lambda b, h, q, kv: (kv > q - 3) | (kv == 0)), "not a contiguous run"),
    (and_masks(causal_mask_function, lambda b, h, q, kv: kv >= (q // 8) * 8 - 2), "neither a sliding window nor"),
    (lambda b, h, q, kv: torch.ones(10, 10, dtype=torch.bool)[q, kv] & (kv <= q), "cannot be evaluated"),
])
def test_read_mask_refuses_what_it_cannot_express(function, says):
    with pytest.raises(zt.IntegrationError, match=says) as caught:
        masks.read_mask(function, [8], "Attention (layer 3)")
    assert str(caught.value).startswith("Attention (layer 3): ") and "\n" not in str(caught.value)


def test_llama4_temperature_tuning_and_no_rope_layers_stay_the_models():
    """Llama 4 scales the queries of its no-RoPE layers by a temperature of their position (attn_temperature_tuning,
    floor_scale, attn_scale) before it calls the interface: the model's own computation, kept exact."""
    model = tiny("llama4_text", floor_scale=2, attn_scale=0.5, attn_temperature_tuning=True,
                 no_rope_layers=[1, 1, 1, 0])
    assert [m.use_rope for m in model.modules() if hasattr(m, "use_rope")] == [1, 1, 1, 0]
    ids = prompt(5 * SIZE)[None]
    with torch.no_grad():
        want = model(ids).logits
    want_tokens = model.generate(ids[:, :5], max_new_tokens=4 * SIZE, **GREEDY)
    zt.apply(model, "vanilla")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(ids[:, :5], max_new_tokens=4 * SIZE, **GREEDY), want_tokens)


@pytest.mark.parametrize("family", sorted(ONLY_IN_THE_MASK))
def test_cli_native_spec_prints_windows_and_chunks_read_from_the_mask(family, tmp_path, capsys):
    from attnzoo.cli import main

    AutoConfig.for_model(family, **{**BASE, **ONLY_IN_THE_MASK[family][0]}).save_pretrained(tmp_path)
    assert main(["native-spec", str(tmp_path / "config.json")]) == 0  # built on meta, or small on the CPU
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("layer")]
    shown = [("window", SIZE) if f"sliding_window(window={SIZE})" in line else
             ("chunk", SIZE) if f"chunked(chunk={SIZE})" in line else None for line in lines]
    assert shown == ONLY_IN_THE_MASK[family][1]
    assert main(["native-spec", str(tmp_path / "config.json"), "--spec", "local"]) == 2  # two windows: a conflict
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--prefer model" in err


def test_a_model_that_numbers_its_own_positions_keeps_its_numbering_on_a_padded_batch():
    """RoBERTa-style decoders derive positions from the input ids when given none (real tokens from padding_idx + 1):
    positions are not derived from the mask for them, so a padded row is the row alone without position_ids."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("roberta", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, is_decoder=True, pad_token_id=PAD,
                                  max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    rows = [prompt(9), prompt(5)]
    padded = torch.full((2, 9), PAD)
    padded[0], padded[1, 4:] = rows[0], rows[1]
    with torch.no_grad():
        want = [model(r[None]).logits[0] for r in rows]
        zt.apply(model, "vanilla")
        got = model(padded, attention_mask=(padded != PAD).long()).logits
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i, 9 - len(r):], want[i], rtol=1e-5, atol=1e-5)

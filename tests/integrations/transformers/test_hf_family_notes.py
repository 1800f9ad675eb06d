"""Where transformers itself limits what attnzoo can promise, attnzoo says so where the user meets it (docs/
transformers.md, "Family notes"): an AttnzooCache passed to generate() is used even under use_cache=False; moshi's
own cache keeps fewer keys than its mask attends to (a FamilyWarning at apply()); emu3 saves a configuration
AutoModelForCausalLM cannot load (from_pretrained loads it through its own class); Llama 4's temperature tuning
scales queries by their index in the call (a FamilyWarning at the first left-padded call where that differs)."""

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers import matrix, sweep_models  # noqa: E402
from attnzoo.integrations.transformers.sweep import left_pad  # noqa: E402

pytestmark = pytest.mark.slow

PAD, BOS, VOCAB = matrix.PAD, matrix.BOS, matrix.VOCAB
GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None)


def prompt(length: int) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (length,))
    ids[0] = BOS
    return ids


def family_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, zt.FamilyWarning)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen2"])
def test_an_attnzoo_cache_passed_to_generate_is_used_under_use_cache_false(family):
    """transformers passes a given cache on under use_cache=False and feeds it the whole sequence at every step;
    attnzoo's cache, passed by the caller, is used step by step as under use_cache=True."""
    torch.manual_seed(0)
    model = matrix.tiny_model(family, use_cache=False)  # a checkpoint saved for training says so
    assert model.config.use_cache is False
    ids = prompt(7)[None]
    new = 3 * matrix.WINDOW
    want = model.generate(ids, max_new_tokens=new, **GREEDY)  # no cache: the model's own forward
    zt.apply(model, "vanilla")
    for extra in ({}, {"use_cache": False}):  # from the config, and said again in the call
        cache = zt.AttnzooCache(model)
        got = model.generate(ids, cache=cache, max_new_tokens=new, **extra, **GREEDY)
        assert torch.equal(got, want), extra
        assert [layer.seen for layer in cache.layers] == [ids.shape[1] + new - 1] * len(cache.layers)
    assert torch.equal(model.generate(ids, max_new_tokens=new, **GREEDY), want)  # no cache passed: none used


def test_moshi_warns_at_apply_that_its_own_cache_is_not_its_forward():
    moshi = sweep_models.build("moshi")
    ids = prompt(9)[None]
    want = moshi.generate(ids, max_new_tokens=6, use_cache=False, **GREEDY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zt.apply(moshi, "vanilla")
    [message] = family_warnings(caught)
    assert "\n" not in message and message.startswith("MoshiForCausalLM (moshi): ")
    assert "DynamicCache keeps 3 past tokens on layer 0 (sliding_window 4) where the layer's mask is causal" in message
    assert torch.equal(moshi.generate(ids, max_new_tokens=6, **GREEDY), want)  # the forward's tokens, cached

    for family in ("llama", "gemma3_text", "qwen2", "mistral"):  # windows the cache and the mask agree on
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zt.apply(matrix.tiny_model(family), "vanilla")
        assert family_warnings(caught) == [], family


def test_emu3_loads_through_its_own_class_and_an_unloadable_config_is_refused_in_one_line(tmp_path):
    model = sweep_models.build("emu3")
    ids = prompt(9)[None]
    zt.apply(model, "vanilla")
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Unrecognized configuration class"):  # transformers' own limit
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    loaded = zt.from_pretrained(tmp_path)
    assert type(loaded) is type(model) and zt.is_applied(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, want, rtol=0, atol=1e-6)

    config_file = tmp_path / "config.json"
    data = json.loads(config_file.read_text())
    data["architectures"] = ["AttnzooLlamaForCausalLM"]  # a causal LM, but not built from an Emu3TextConfig
    config_file.write_text(json.dumps(data))
    with pytest.raises(zt.IntegrationError) as caught:
        zt.from_pretrained(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{config_file}: transformers ")
    assert "no causal LM for the configuration class Emu3TextConfig" in message
    assert "AutoModelForCausalLM does not list it" in message


def llama4(**extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                  intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                  no_rope_layers=[1, 0], floor_scale=2, attn_scale=0.5, pad_token_id=PAD,
                                  bos_token_id=BOS, eos_token_id=None, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_llama4_temperature_tuning_warns_at_a_left_padded_call_where_the_row_differs_from_itself_alone():
    model = llama4(attn_temperature_tuning=True)
    rows = [prompt(8), prompt(5)]
    padded, mask = left_pad(rows)
    with torch.no_grad():  # transformers' own: the padded row is not the row alone (the queries' slots differ)
        alone = model(rows[1][None]).logits[0]
        eager = model(padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[1, 3:]
    assert (eager - alone).abs().max() > 1e-4
    zt.apply(model, "vanilla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(rows[0][None], use_cache=False)
        model.generate(rows[1][None], max_new_tokens=4, **GREEDY)
        assert family_warnings(caught) == []  # a row alone: its slots are its positions
        model.generate(padded, attention_mask=mask, max_new_tokens=4, **GREEDY)
        with torch.no_grad():
            model(padded, attention_mask=mask, use_cache=False)
    [message] = family_warnings(caught)  # once per model
    assert "\n" not in message and message.startswith("Llama4TextAttention (layer 1): attn_temperature_tuning ")
    assert "floor_scale 2" in message

    plain = zt.apply(llama4(attn_temperature_tuning=False), "vanilla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = plain(padded, attention_mask=mask, use_cache=False).logits[1, 3:]
            alone = plain(rows[1][None], use_cache=False).logits[0]
    assert family_warnings(caught) == []
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)

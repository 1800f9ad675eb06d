"""The vLLM plugin's spec side without vLLM (attnzoo.integrations.vllm.spec, docs/vllm.md): what is declined and
why, the record of a configuration, a layer's index, and a layer's parameters read from a saved checkpoint."""

from __future__ import annotations

import types

import pytest
import torch

from attnzoo.integrations.transformers.base import IntegrationError
from attnzoo.integrations.vllm.spec import declined, layer_index, record_of
from attnzoo.spec import load_spec


@pytest.mark.parametrize("name, words", [
    ({"name": "selective-no-cache", "transforms": [{"kind": "selective_mask"}]},
     ["selective_mask", "accumulator", "without a cache evictor"]),
    ("forgetting", ["forgetting_gate", "features"]),
    ("sigmoid", ["sigmoid", "probability", "replaces the softmax"]),
    ("diff", ["diff", "probability"]),
])
def test_what_the_paged_cache_cannot_hold_is_declined_naming_the_transform(name, words):
    reason = declined(load_spec(name))
    assert reason is not None and "\n" not in reason
    for word in words:
        assert word in reason


@pytest.mark.parametrize("name", ["vanilla", "ssa", "alibi", "alibi-learnable", "softcap", "sink", "qk-norm", "local",
                                  "selective", "selective-ssa", "selective-pruned", "h2o", "tova", "streaming",
                                  "snapkv", "knorm", "keydiff"])
def test_the_specs_in_scope_are_served(name):
    """Evicting specs (the selective accumulator with an evictor too) are served in a page per request
    (attnzoo/integrations/vllm/ring.py; tests/integrations/vllm/test_vllm.py serves them)."""
    assert declined(load_spec(name)) is None


def _record(name: str) -> dict:
    """A record as save_pretrained writes it, naming a registered spec."""
    return {"spec": name, "name": name, "hash": load_spec(name).hash}


def test_a_configuration_without_a_record_runs_vllms_own_attention():
    assert record_of(types.SimpleNamespace()) is None
    assert record_of(types.SimpleNamespace(attnzoo=_record("ssa"))) == {
        **_record("ssa"), "budget": None, "backend": "auto", "prefer": "error"}
    # an attnzoo key that holds no valid record is refused, never read as no record
    # (tests/integrations/transformers/test_checkpoint_records.py)
    with pytest.raises(IntegrationError, match=r"/ckpt \(config.json\): attnzoo.spec: missing"):
        record_of(types.SimpleNamespace(attnzoo={"name": "x"}), "/ckpt")


def test_layer_index_from_vllms_layer_name():
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(IntegrationError, match="no decoder layer index"):
        layer_index("encoder.attn")


def test_a_layers_parameters_come_from_the_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.vllm.spec import layer_parameters

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    zt.apply(model, "ssa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.save_pretrained(tmp_path)
    for index, layer in enumerate(model.model.layers):
        got = layer_parameters(str(tmp_path), index)
        want = layer.self_attn.attnzoo.state_dict()  # transform_params.<name>, by the core's state-dict keys
        assert got.keys() == want.keys() and want
        for name, value in want.items():
            assert torch.equal(got[name], value.detach())


def _config(record, tp=1, pp=1, speculative=None, transfer=None, hybrid=False, **hf_fields):
    hf = types.SimpleNamespace(**({"attnzoo": record} if record is not None else {}),
                               **{"num_attention_heads": 4, **hf_fields})
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, model="/ckpt", max_model_len=1024, is_hybrid=hybrid,
                                           get_total_num_kv_heads=lambda: 2, get_head_size=lambda: 16),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        scheduler_config=types.SimpleNamespace(enable_chunked_prefill=True, max_num_batched_tokens=256),
        cache_config=types.SimpleNamespace(enable_prefix_caching=True), speculative_config=speculative,
        kv_transfer_config=transfer)


def test_an_evicting_checkpoint_turns_off_what_would_change_its_history(caplog):
    """A pruned checkpoint whose evictor scores the prompt by every query (H2O): a prompt is attended whole (no
    chunks), no prefix-cache hits; said once at start, the whole-prompt step in a line of its own (the evictors
    prefilled in chunks: ``test_vllm_chunks.py``)."""
    import logging

    from attnzoo.integrations.vllm.start import check_config

    config = _config(_record("h2o"))
    with caplog.at_level(logging.WARNING, logger="attnzoo.integrations.vllm.start"):
        check_config(config, on_cpu=True)
    assert not config.scheduler_config.enable_chunked_prefill and not config.cache_config.enable_prefix_caching
    assert config.scheduler_config.max_num_batched_tokens == 1024
    lines = [r.getMessage() for r in caplog.records if "chunked prefill" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("attnzoo: /ckpt: attnzoo spec 'h2o': chunked prefill is not served for this evicting "
                               "spec (evictor 'h2o' scores the prompt by every query's attention; chunked prefill "
                               "is served for tova, sink_window, snapkv, knorm, keydiff, not for selective, "
                               "h2o): every prompt is prefilled whole in one step, then "
                               "evicted to the budget")
    assert "max_model_len 1024" in lines[0]
    caplog.clear()
    off = _config(_record("h2o"))
    off.scheduler_config.enable_chunked_prefill, off.scheduler_config.max_num_batched_tokens = False, 2048
    with caplog.at_level(logging.WARNING, logger="attnzoo.integrations.vllm.start"):
        check_config(off, on_cpu=True)  # asked for whole prompts already: nothing to say about chunks
    assert not [r for r in caplog.records if "chunked prefill" in r.getMessage()]
    assert off.scheduler_config.max_num_batched_tokens == 2048
    plain = _config(_record("ssa"))
    check_config(plain, on_cpu=True)  # a spec without a cache: vLLM's settings as they were
    assert plain.scheduler_config.enable_chunked_prefill and plain.cache_config.enable_prefix_caching


def test_the_engine_start_check_refuses_in_one_line():
    from attnzoo.integrations.vllm import ServeDeclined
    from attnzoo.integrations.vllm.start import check_config

    check_config(_config(None), on_cpu=False)  # no record: vLLM's own attention, anywhere
    check_config(_config(_record("ssa")), on_cpu=True)
    check_config(_config(_record("ssa"), tp=2), on_cpu=True)  # 4 heads, 2 key/value heads: each rank its own
    check_config(_config(_record("snapkv"), tp=2), on_cpu=True)
    sliding = ["sliding_attention"] * 2
    check_config(_config(_record("ssa"), model_type="qwen3", layer_types=sliding), on_cpu=True)  # every layer alike
    check_config(_config(_record("ssa"), model_type="gemma2", layer_types=sliding[:1] + ["full_attention"]),
                 on_cpu=True)  # Gemma 2's model hands each layer its own window
    for config, on_cpu, words in [
        (_config(_record("ssa")), False, ["/ckpt", "'ssa'", "CPU"]),
        (_config(_record("ssa"), pp=2), True, ["'ssa'", "pipeline parallelism (pipeline_parallel_size 2)"]),
        # tensor parallel (test_vllm_tp.py): what cannot be split exactly
        (_config(_record("ssa"), tp=2, num_attention_heads=9), True, ["tensor_parallel_size 2", "9 query heads"]),
        (_config(_record("tova"), tp=2), True, ["tensor_parallel_size 2", "'tova'", "mixes heads"]),
        (_config(_record("alibi"), tp=2), True, ["tensor_parallel_size 2", "'alibi'"]),
        # vLLM 0.32's Qwen2/Qwen3 build every layer alike: a window on some layers only is refused at start
        (_config(_record("vanilla"), model_type="qwen3", layer_types=["sliding_attention", "full_attention"]), True,
         ["layers 0..0 of 2", "qwen3", "max_window_layers"]),
        (_config(_record("selective-pruned"), speculative=object()), True, ["speculative decoding", "evicted"]),
        (_config(_record("h2o"), transfer=object()), True, ["KV connector"]),
        (_config({**_record("h2o"), "budget": 0.25}), True, ["0.25", "vLLM needs a token budget: its page is sized"]),
        (_config(_record("streaming"), hybrid=True), True, ["hybrid model", "recomputed"]),
        # Llama 4's chunked layers run as per-chunk virtual batches in vLLM (positions restart): declined
        (_config(_record("vanilla"), attention_chunk_size=8192), True,
         ["'vanilla'", "attention_chunk_size 8192", "virtual batches"]),
    ]:
        with pytest.raises(ServeDeclined) as caught:
            check_config(config, on_cpu)
        assert "\n" not in str(caught.value) and all(w in str(caught.value) for w in words)


def test_a_fraction_of_the_prompt_is_refused_where_the_page_is_sized():
    """A budget that is a fraction of each request's prompt (a float) is not served: a request's page is sized once,
    at engine start. Refused in one line where the page is sized (``page_budget``: at start, and in a worker of an
    engine started another way), before any setting of vLLM is changed."""
    from attnzoo.integrations.vllm import ServeDeclined
    from attnzoo.integrations.vllm.start import _serve_pruned, page_budget

    assert page_budget({"budget": [16, 20]}, 1024) == 20
    assert page_budget({"budget": [16, None]}, 1024) == 1024
    for budget in (0.25, [16, 0.5]):
        with pytest.raises(IntegrationError) as caught:
            page_budget({"budget": budget}, 1024)
        line = str(caught.value)
        assert "\n" not in line and "fraction of the prompt" in line and "token budget" in line, line
    config = _config(_record("snapkv"))
    with pytest.raises(ServeDeclined) as caught:
        _serve_pruned(config, {**_record("snapkv"), "budget": 0.25}, "/ckpt: attnzoo spec 'snapkv'")
    line = str(caught.value)
    assert "\n" not in line and line.startswith("/ckpt: attnzoo spec 'snapkv': budget 0.25") and "fraction" in line
    assert config.scheduler_config.enable_chunked_prefill and config.cache_config.enable_prefix_caching

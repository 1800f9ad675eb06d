"""attnzoo.integrations.transformers: a spec in a Hugging Face model in one call (docs/transformers.md).

Tiny randomly initialised models (2 layers, hidden 32, vocabulary 64), float32, no downloads."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo  # noqa: E402
from attnzoo.integrations import transformers as zt  # noqa: E402

VOCAB, PAD, BOS = 64, 0, 1
GREEDY = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD, eos_token_id=None)
IDS = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)


def make(family: str, **overrides):
    """A tiny, randomly initialised causal LM of ``family`` in eval mode (seeded by the caller)."""
    gqa = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, **IDS)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**gqa, **overrides}))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**gqa, **overrides}))
    elif family == "mistral":  # the default sliding window (4096) is far beyond these sequences
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**gqa, **overrides}))
    elif family == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            **IDS, **overrides))
    elif family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **IDS, **overrides))
    else:
        raise AssertionError(family)
    return model.eval()


def prompts(batch: int, length: int) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (batch, length))
    ids[:, 0] = BOS
    return ids


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
    return ids, (ids != PAD).long()


def perturb(model, scale: float = 0.5) -> None:
    """Move the transforms' parameters off their initial values; SSA's position coefficient exp(-exp(b)) starts
    at 6e-4 (b = 2): b near -1 makes it about 0.7, so that positions change the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_logit"):
                p.fill_(-1.0).add_(0.3 * torch.randn_like(p))
            elif ".attnzoo." in name:
                p.add_(scale * torch.randn_like(p))


FAMILIES = ["llama", "qwen2", "mistral", "gpt_neox", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_vanilla_gives_the_models_own_logits(family):
    extra = {"scale_attn_by_inverse_layer_idx": True} if family == "gpt2" else {}  # a per-layer scaling
    model = make(family, **extra)
    ids = prompts(2, 9)
    padded, mask = left_pad([ids[0], ids[1, :5]])
    # position_ids as generate() makes them: after apply() a padded call without them gets these (GPT-2's absolute
    # position embeddings would otherwise number the padding, as plain transformers does)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want, want_padded = model(ids).logits, model(padded, attention_mask=mask, position_ids=position_ids).logits
    assert zt.apply(model, "vanilla") is model
    assert model.config._attn_implementation == "attnzoo"
    cores = [m.attnzoo for m in model.modules() if isinstance(getattr(m, "attnzoo", None), attnzoo.nn.Attention)]
    assert len(cores) == 2
    with torch.no_grad():
        got, got_padded = model(ids).logits, model(padded, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(got_padded[real], want_padded[real], rtol=0, atol=1e-5)


def test_ssa_parameters_belong_to_the_model_and_round_trip_through_save_pretrained(tmp_path):
    model = zt.apply(make("llama"), "ssa")
    names = [n for n, _ in model.named_parameters() if ".attnzoo." in n]
    assert len(names) == 8 and "model.layers.1.self_attn.attnzoo.transform_params.query_temperature__token_weight" \
        in names
    assert set(names) <= set(model.state_dict())
    record = model.config.attnzoo
    assert record["hash"] == attnzoo.load_spec("ssa").hash and record["name"] == "ssa"
    perturb(model)
    ids = prompts(2, 9)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attnzoo"]
    assert saved["hash"] == record["hash"] and saved["spec"]["name"] == "ssa"
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as fh:
        meta = fh.metadata()
    assert meta["attnzoo_spec_hash"] == record["hash"] and meta["format"] == "pt"
    assert json.loads(meta["attnzoo_spec"])["name"] == "ssa"

    loaded = zt.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "attnzoo"
    for (name, p), (name2, p2) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert name == name2 and torch.equal(p, p2), name
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)

    other = zt.apply(make("llama"), "selective-ssa")
    with pytest.raises(zt.CheckpointSpecMismatchError) as caught:
        zt.load_transform_params(other, tmp_path)
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message
    assert record["hash"][:12] in message and other.config.attnzoo["hash"][:12] in message


def test_weights_stamped_with_another_spec_are_refused(tmp_path):
    """The safetensors metadata is checked too: a config.json edited to match cannot smuggle in other weights."""
    model = zt.apply(make("llama"), "ssa")
    model.save_pretrained(tmp_path)
    zt.stamp_safetensors(str(tmp_path / "model.safetensors"), {"hash": "f" * 64, "name": "other", "spec": None})
    with pytest.raises(zt.CheckpointSpecMismatchError) as caught:
        zt.load_transform_params(model, tmp_path)
    assert "\n" not in str(caught.value) and "model.safetensors" in str(caught.value) and "ffffffffffff" in \
        str(caught.value)


def test_a_stamp_that_lies_about_its_spec_is_refused(tmp_path):
    """The spec embedded in the safetensors metadata is read and checked: a true hash beside another spec fails."""
    model = zt.apply(make("llama"), "ssa")
    model.save_pretrained(tmp_path)
    record = dict(model.config.attnzoo)
    lying = copy.deepcopy(record["spec"])
    lying["transforms"] = lying["transforms"][:1]
    zt.stamp_safetensors(str(tmp_path / "model.safetensors"), {**record, "spec": lying})
    with pytest.raises(zt.CheckpointSpecMismatchError) as caught:
        zt.load_transform_params(model, tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "model.safetensors" in message and "embedded spec" in message
    zt.stamp_safetensors(str(tmp_path / "model.safetensors"), record)  # the true stamp loads again
    assert zt.load_transform_params(model, tmp_path)


def test_a_checkpoint_config_never_names_a_file_on_the_loading_machine(tmp_path):
    """config.json's attnzoo.spec is an embedded record or a registered name: a path is refused unread."""
    secret = tmp_path / "secret.yaml"
    secret.write_text("name: hunter2-password\n")
    model = zt.apply(make("llama"), "ssa")
    model.save_pretrained(tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    data = json.loads(config.read_text())
    for spec, reason in ((str(secret), "is a path"), ("no-such-spec", "a name no plugin registers"),
                         (17, "got int")):
        data["attnzoo"]["spec"] = spec
        config.write_text(json.dumps(data))
        with pytest.raises(zt.IntegrationError) as caught:
            zt.from_pretrained(tmp_path / "ckpt")
        message = str(caught.value)
        assert "\n" not in message and reason in message and "hunter2" not in message
    data["attnzoo"]["spec"] = "ssa"  # a registered name is allowed
    config.write_text(json.dumps(data))
    assert zt.from_pretrained(tmp_path / "ckpt").config.attnzoo["name"] == "ssa"


def test_load_refuses_missing_parameters_and_pickles(tmp_path):
    model = zt.apply(make("gpt2"), "ssa")
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    dropped = next(k for k in weights if ".attnzoo." in k)
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(zt.IntegrationError, match="holds no value for 1 attnzoo parameter"):
        zt.load_transform_params(model, tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"not read")
    with pytest.raises(zt.IntegrationError, match="never from pickles"):
        zt.load_transform_params(model, tmp_path / "weights.bin")


def test_transform_parameters_train_through_the_model():
    model = zt.apply(make("qwen2"), "selective-ssa").train()
    groups = attnzoo.nn.parameter_groups(model, lr=1e-3, transform_lr=1e-2)
    assert [len(g["params"]) for g in groups] == [len(list(model.parameters())) - 8, 8]
    ids = prompts(2, 7)
    with attnzoo.nn.recording_accumulated(model) as record:
        loss = model(ids, labels=ids, use_cache=False).loss
    assert len(record.tensors) == 2  # selective attention's F of both layers, for the memory loss
    (loss + record.memory_loss()).backward()
    grads = [p.grad for n, p in model.named_parameters() if ".attnzoo." in n]
    assert len(grads) == 8 and all(g is not None and g.abs().max() > 0 for g in grads)


def test_pruned_cache_with_room_generates_what_selective_attention_does():
    base = make("llama")
    ids = prompts(1, 8)
    full = zt.apply(copy.deepcopy(base), "selective")
    pruned = zt.apply(copy.deepcopy(base), "selective-pruned", budget=64)
    want = full.generate(ids, **GREEDY)
    assert torch.equal(full.generate(ids, use_cache=False, **GREEDY), want)
    out = pruned.generate(ids, return_dict_in_generate=True, **GREEDY)
    assert isinstance(out.cache, zt.AttnzooCache)  # generate() picks the attnzoo cache after apply()
    assert torch.equal(out.sequences, want)
    assert all(report["evicted"] == 0 for report in out.cache.memory())


def test_small_budgets_hold_per_layer_and_transformers_holds_no_tensors():
    model = zt.apply(make("mistral"), "selective-pruned", budget=[3, 5])
    assert model.config.attnzoo["budget"] == [3, 5]
    cache = zt.AttnzooCache(model)
    out = model.generate(prompts(2, 9), cache=cache, **GREEDY)
    assert out.shape == (2, 14)
    reports = cache.memory()
    assert [r["budget"] for r in reports] == [3, 5] and [r["tokens"] for r in reports] == [3, 5]
    assert all(r["seen"] == 13 and r["bytes"] > 0 for r in reports)
    assert cache.get_seq_length() == 13 and cache.nbytes == sum(r["bytes"] for r in reports)
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None
        held = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
        assert all(t.shape == (2,) for t in held)  # per-row bookkeeping of positions only, no keys or values
        assert isinstance(layer.kv, attnzoo.KVCache) and layer.kv.num_tokens <= layer.budget
    assert not any(isinstance(v, torch.Tensor) for v in vars(cache).values())


def test_beam_search_with_the_attnzoo_cache_equals_beam_search_without_a_cache():
    model = zt.apply(make("gpt_neox"), "selective")
    ids = prompts(2, 6)
    want = model.generate(ids, num_beams=3, use_cache=False, **GREEDY)
    got = model.generate(ids, num_beams=3, **GREEDY)
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec, budget", [("ssa", None), ("selective-pruned", 4)])
def test_left_padded_batch_generates_what_each_row_generates_alone(spec, budget):
    model = zt.apply(make("llama"), spec, budget=budget)
    perturb(model)  # SSA's position-aware temperatures: a row's positions must not depend on its padding
    ids = prompts(2, 8)
    rows = [ids[0], ids[1, :5]]
    padded, mask = left_pad(rows)
    batch = model.generate(padded, attention_mask=mask, **GREEDY)
    if budget is None:  # the batch form (no cache) takes its positions from position_ids + 1
        assert torch.equal(model.generate(padded, attention_mask=mask, use_cache=False, **GREEDY), batch)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **GREEDY)
        assert torch.equal(batch[i, padded.shape[1] - len(row):], alone[0]), i


def test_refusals_are_one_line():
    def one_line(exc_info):
        message = str(exc_info.value)
        assert message and "\n" not in message
        return message

    class BypassingAttention(transformers.models.llama.modeling_llama.LlamaAttention):
        """Computes its attention with SDPA directly, never through transformers' attention interface."""

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            b, n, _ = hidden_states.shape
            q = self.q_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
            k = self.k_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), None

    bypassing = make("llama")
    layer = bypassing.model.layers[1]
    replaced = BypassingAttention(bypassing.config, layer_idx=1)
    replaced.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = replaced
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(bypassing, "vanilla")
    assert "BypassingAttention (model.layers.1.self_attn)" in one_line(caught) and "interface" in str(caught.value)
    assert bypassing.config._attn_implementation != "attnzoo"  # a refusal leaves the model as it was

    class NamedOtherwise(BypassingAttention):
        pass

    NamedOtherwise.__name__ = "SelfAttn"  # a bypassing module whose name does not say attention: counted out
    hidden = make("llama")
    quiet = NamedOtherwise(hidden.config, layer_idx=0)
    quiet.load_state_dict(hidden.model.layers[0].self_attn.state_dict())
    hidden.model.layers[0].self_attn = quiet
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(hidden, "vanilla")
    assert "1 of its 2 layers call transformers' attention interface" in one_line(caught)

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(t5, "vanilla")
    assert "T5ForConditionalGeneration" in one_line(caught) and "cross-attention" in str(caught.value)

    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(bert, "vanilla")
    assert "BertSelfAttention (layer 0) is not causal" in one_line(caught)

    scaled = {"name": "scaled", "attention": {"scale": 0.5}}
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(make("llama"), scaled)
    assert "attention.scale" in one_line(caught)

    model = zt.apply(make("gpt2"), "vanilla").train()  # GPT-2's attn_pdrop is 0.1
    with pytest.raises(zt.IntegrationError) as caught:
        model(prompts(1, 4))
    assert "dropout" in one_line(caught)

    model.eval()
    dynamic = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompts(1, 4), cache=dynamic, use_cache=True)
        with pytest.raises(zt.IntegrationError) as caught:
            model(prompts(1, 1), cache=dynamic, use_cache=True)
    assert "AttnzooCache" in one_line(caught)


def check_cached_steps_equal_the_batch_form(model, ids, prefill: int = 6):
    """A prefill of ``prefill`` tokens then one token per step through an AttnzooCache: the batch form's logits."""
    with torch.no_grad():
        want = model(ids).logits
        cache = zt.AttnzooCache(model)
        steps = [model(ids[:, :prefill], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(prefill, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-5, atol=1e-5)
    return cache


def test_manual_decoding_loop_with_the_cache_matches_the_batch_form():
    model = zt.apply(make("llama"), "selective-ssa", budget=None)
    perturb(model)
    ids = prompts(1, 10)
    cache = check_cached_steps_equal_the_batch_form(model, ids)
    assert cache.memory()[0]["tokens"] == 10 and cache.get_seq_length() == 10

    offset = torch.arange(5, 15)[None]  # a continued sequence: the cache starts at the first position_id
    with torch.no_grad():
        want = model(ids, position_ids=offset).logits
        cache = zt.AttnzooCache(model)
        steps = [model(ids[:, :6], position_ids=offset[:, :6], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, i:i + 1], position_ids=offset[:, i:i + 1], cache=cache, use_cache=True).logits
                  for i in range(6, 10)]
        torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-5, atol=1e-5)
        with pytest.raises(zt.IntegrationError, match="position_ids disagree with the attnzoo cache"):
            model(ids[:, :1], position_ids=offset[:, :1], cache=cache, use_cache=True)


def test_a_gate_from_the_layer_input_is_owned_by_each_layer_and_decodes_like_the_batch_form():
    """The forgetting gate with source: input (as the paper computes it): apply() gives each layer's core a
    projection of the layer's input (the hidden states the attention module receives) to one gate per head, part
    of the model's parameters and trained through it; decoding with the cache equals the batch form."""
    spec = {"name": "fox-input", "attention": {"causal": True},
            "transforms": [{"kind": "forgetting_gate", "source": "input", "bias_init": 1.0}]}
    model = zt.apply(make("llama"), spec, budget=None)
    names = [n for n, _ in model.named_parameters() if "token_projections" in n]
    assert len(names) == 4 and all(".attnzoo.token_projections.forgetting_gate__gate." in n for n in names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "token_projections" in name:
                p.add_(0.5 * torch.randn_like(p))
    ids = prompts(1, 10)
    check_cached_steps_equal_the_batch_form(model, ids)
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "token_projections" in n]
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)

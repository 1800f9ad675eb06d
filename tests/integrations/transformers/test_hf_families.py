"""The family matrix (attnzoo.integrations.transformers.matrix): every family the installed transformers ships,
tiny random-init configs, no downloads. ``vanilla`` must be the model's own eager attention (logits within 1e-5 in
float32, greedy tokens equal) through a left-padded batch, generation to 4x the sliding window, beams and a
save/load round trip; a window layer's cache never holds more than its window."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo  # noqa: E402
from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers import matrix  # noqa: E402
from attnzoo.integrations.transformers.sweep import left_pad  # noqa: E402

FAMILIES = matrix.available()
PAD, BOS, VOCAB, W = matrix.PAD, matrix.BOS, matrix.VOCAB, matrix.WINDOW
NEW = 4 * W  # generated tokens: past four windows
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def randomise_sinks(model) -> None:
    """Learned sinks start at zero-ish; random ones make them matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.randn_like(p))


def prompt(length: int) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (length,))
    ids[0] = BOS
    return ids


def window_layers(model) -> list[int]:
    return [call.layer for call in (layer.call for layer in zt.native_layers(model)) if call.sliding_window]


@pytest.mark.parametrize("family", FAMILIES)
def test_vanilla_is_the_models_own_attention(family, tmp_path):
    torch.manual_seed(0)
    eager = matrix.tiny_model(family)
    randomise_sinks(eager)
    rows = [prompt(7), prompt(4)]
    padded, mask = left_pad(rows)
    with torch.no_grad():
        want = eager(rows[0][None]).logits
        want_rows = [eager(r[None]).logits[0] for r in rows]
    want_tokens = eager.generate(rows[0][None], **GREEDY)
    want_beams = eager.generate(rows[0][None], num_beams=2, **{**GREEDY, "max_new_tokens": 6})
    windows = window_layers(eager)

    model = zt.apply(eager, "vanilla")
    with torch.no_grad():
        torch.testing.assert_close(model(rows[0][None]).logits, want, rtol=0, atol=1e-5)
        # a left-padded batch: each row's logits are its own alone (transformers' own padded batch numbers the
        # padding into its windows; attnzoo numbers real tokens only, so a row does not depend on its batch);
        # position_ids as generate() makes them, for the models with absolute position embeddings (GPT-2)
        got = model(padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i, padded.shape[1] - len(r):], want_rows[i], rtol=0, atol=1e-5)

    out = model.generate(rows[0][None], return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, want_tokens)
    for report in out.cache.memory():  # measured: a window layer holds window - 1 tokens between steps
        if report["layer"] in windows:
            assert report["tokens"] == W - 1 and report["expired"] > 0, report
        else:
            assert report["tokens"] == len(rows[0]) + NEW - 1 and report["expired"] == 0, report
    assert torch.equal(model.generate(rows[0][None], num_beams=2, **{**GREEDY, "max_new_tokens": 6}), want_beams)

    batch = model.generate(padded, attention_mask=mask, **GREEDY)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], **GREEDY)
        assert torch.equal(batch[i, padded.shape[1] - len(r):], alone[0]), i

    model.save_pretrained(tmp_path)
    loaded = zt.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(rows[0][None]).logits, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError) as caught:  # plain transformers cannot build it without its spec
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "attnzoo.integrations.transformers.from_pretrained" in str(caught.value)


def test_native_specs_say_what_each_layer_computes():
    torch.manual_seed(0)
    specs = zt.native_spec(matrix.tiny_model("gemma2"))
    assert [s.model_dump(mode="json")["transforms"] for s in specs] == [
        [{"kind": "sliding_window", "window": W}, {"kind": "softcap", "cap": 50.0}], [{"kind": "softcap", "cap": 50.0}]]
    assert all(s.attention.scale == pytest.approx(32 ** -0.5) for s in specs)  # query_pre_attn_scalar
    oss = zt.native_spec(matrix.tiny_model("gpt_oss"))
    assert [[t.kind for t in s.transforms] for s in oss] == [["sliding_window", "attention_sink"], ["attention_sink"]]
    assert all(s.attention.scale is None for s in oss)
    granite = zt.native_spec(matrix.tiny_model("granite"))
    assert all(s.attention.scale == pytest.approx(0.3) and not s.transforms for s in granite)
    gpt2 = zt.native_spec(matrix.tiny_model("gpt2"))  # scale_attn_by_inverse_layer_idx: 1/sqrt(D)/(layer+1)
    assert gpt2[0].attention.scale is None and gpt2[1].attention.scale == pytest.approx(16 ** -0.5 / 2)


def test_gpt_oss_sinks_are_the_models_parameters_and_round_trip(tmp_path):
    torch.manual_seed(1)
    model = matrix.tiny_model("gpt_oss")
    randomise_sinks(model)
    ids = prompt(9)[None]
    with torch.no_grad():
        want = model(ids).logits
    zt.apply(model, "vanilla")
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.0.self_attn.sinks" in names and not any(".attnzoo." in n for n in names)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-5)
        sinks = model.model.layers[1].self_attn.sinks
        sinks.add_(1.0)  # the model's own parameter drives attnzoo's sink
        moved = model(ids).logits
    assert (moved - want).abs().max() > 1e-3
    model.save_pretrained(tmp_path)
    loaded = zt.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[1].self_attn.sinks, sinks)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, moved, rtol=0, atol=1e-6)
    # gradients reach the model's sinks through attnzoo's attention
    loaded.train()
    loaded(ids, labels=ids, use_cache=False).loss.backward()
    assert loaded.model.layers[0].self_attn.sinks.grad.abs().max() > 0


def test_composition_conflicts_are_one_line_and_prefer_decides():
    torch.manual_seed(0)
    model = matrix.tiny_model("gpt_oss")
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(model, "sink")
    message = str(caught.value)
    assert "\n" not in message and "GptOssAttention (layer 0)" in message
    assert "transforms[0] (attention_sink)" in message and "prefer=" in message
    zt.apply(model, "sink", prefer="spec")  # the spec's own learnable sink, in place of the model's
    assert [t.kind for t in zt.layer_specs(model)[0].transforms] == ["sliding_window", "attention_sink"]
    assert any(".attnzoo.transform_params.attention_sink__sink" in n for n, _ in model.named_parameters())
    with pytest.raises(zt.IntegrationError, match=r"Gemma2Attention \(layer 0\).*local.*sliding_window"):
        zt.apply(matrix.tiny_model("gemma2"), "local")
    local = zt.apply(matrix.tiny_model("gemma2"), "local", prefer="model")
    assert [t.model_dump() for t in zt.layer_specs(local)[0].transforms][0] == {"kind": "sliding_window", "window": W}
    assert [t.kind for t in zt.layer_specs(local)[1].transforms] == ["softcap", "sliding_window"]  # full layer
    with pytest.raises(zt.IntegrationError, match="softcap"):
        zt.apply(matrix.tiny_model("gemma2"), "softcap")
    with pytest.raises(zt.IntegrationError, match="attention.scale"):
        zt.apply(matrix.tiny_model("granite"), {"name": "scaled", "attention": {"scale": 0.125}})


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "gpt_oss"])
def test_selective_pruned_keeps_windows_and_sinks_and_padded_rows_equal_alone(family):
    torch.manual_seed(2)
    model = matrix.tiny_model(family)
    randomise_sinks(model)
    zt.apply(model, "selective-pruned", budget=6)
    kinds = [[t.kind for t in s.transforms] for s in zt.layer_specs(model)]
    assert kinds[0][0] == "sliding_window" and all("selective_mask" in k for k in kinds)
    assert all(("attention_sink" in k) == (family == "gpt_oss") for k in kinds)
    rows = [prompt(9), prompt(5)]
    padded, mask = left_pad(rows)
    out = model.generate(padded, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], **GREEDY)
        assert torch.equal(out.sequences[i, padded.shape[1] - len(r):], alone[0]), i
    assert all(report["tokens"] <= 6 for report in out.cache.memory())
    beams = model.generate(rows[0][None], num_beams=2, **{**GREEDY, "max_new_tokens": 5})
    assert beams.shape == (1, 14)


def test_training_ssa_inside_qwen3_with_parameter_groups(tmp_path):
    torch.manual_seed(3)
    model = zt.apply(matrix.tiny_model("qwen3"), "ssa").train()
    groups = attnzoo.nn.parameter_groups(model, lr=1e-3, transform_lr=1e-2)
    assert "weight_decay" not in groups[0]  # the model's own parameters keep the optimizer's weight decay
    optimizer = torch.optim.AdamW(groups, weight_decay=0.1)
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0
    ids = torch.stack([prompt(12), prompt(12)])
    before = [p.detach().clone() for p in groups[1]["params"]]
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(not torch.equal(a, b) for a, b in zip(before, groups[1]["params"], strict=True))
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    model.save_pretrained(tmp_path)  # the trained temperatures travel with the checkpoint
    loaded = zt.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, want, rtol=0, atol=1e-6)
    beams = loaded.generate(ids[:1, :6], num_beams=2, **{**GREEDY, "max_new_tokens": 5})
    assert torch.equal(beams, loaded.generate(ids[:1, :6], num_beams=2, use_cache=False,
                                              **{**GREEDY, "max_new_tokens": 5}))


def test_manual_loop_on_a_padded_batch_numbers_real_tokens_from_one():
    """Without position_ids, transformers numbers the padding too; attnzoo numbers each row's real tokens from 1
    (RoPE depends on differences only, so the model computes the same) and selective attention keeps its BOS."""
    torch.manual_seed(4)
    model = zt.apply(matrix.tiny_model("llama"), "selective-ssa", budget=None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attnzoo." in name:
                p.add_(0.5 * torch.randn_like(p))
    rows = [prompt(8), prompt(5)]
    padded, mask = left_pad(rows)
    with torch.no_grad():
        got = model(padded, attention_mask=mask).logits  # no position_ids
        cache = zt.AttnzooCache(model)
        step = model(padded, attention_mask=mask, cache=cache, use_cache=True).logits
        nxt = torch.randint(2, VOCAB, (2, 1))
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        decoded = model(nxt, attention_mask=mask2, cache=cache, use_cache=True).logits
    for i, r in enumerate(rows):
        with torch.no_grad():
            alone = model(r[None]).logits[0]
            alone_next = model(torch.cat([r, nxt[i]])[None]).logits[0, -1]
        torch.testing.assert_close(got[i, padded.shape[1] - len(r):], alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(step[i, padded.shape[1] - len(r):], alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(decoded[i, -1], alone_next, rtol=0, atol=1e-5)
    assert [int(p) for p in cache.layers[0].kv.next_position] == [10, 7]


def test_cli_native_spec_of_a_config(tmp_path, capsys):
    from attnzoo.cli import main

    matrix.config("gemma2").save_pretrained(tmp_path)
    assert main(["native-spec", str(tmp_path / "config.json")]) == 0
    shown = capsys.readouterr().out
    assert "layer   0" in shown and "sliding_window" in shown and "softcap" in shown
    assert main(["native-spec", str(tmp_path / "config.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [len(layer["spec"]["transforms"]) for layer in data] == [2, 1]
    (tmp_path / "bad.json").write_text('{"model_type": "no-such-model"}')
    assert main(["native-spec", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.json" in err


@pytest.mark.slow
def test_output_attentions_are_the_models_probabilities_and_compile_runs_around_attnzoo():
    torch.manual_seed(5)
    eager = matrix.tiny_model("gemma2")  # softcap and a window: the probabilities of the native spec
    ids = prompt(9)[None]
    with torch.no_grad():
        want = eager(ids, output_attentions=True, use_cache=False).attentions
    model = zt.apply(eager, "vanilla")
    with torch.no_grad():
        got = model(ids, output_attentions=True, use_cache=False)
    assert len(got.attentions) == len(want) == 2
    for a, b in zip(got.attentions, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(zt.IntegrationError, match="output_attentions with a cache"):
        model(ids, output_attentions=True, cache=zt.AttnzooCache(model), use_cache=True)

    compiled = torch.compile(model, backend="eager")  # dynamo traces the model, attnzoo's attention runs outside
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, got.logits, rtol=0, atol=1e-6)
    torch._dynamo.reset()  # trace again: the frames compiled above would be reused
    try:
        with pytest.raises(Exception, match="runs eagerly"):  # fullgraph: torch refuses, with attnzoo's reason
            with torch.no_grad():
                torch.compile(model, backend="eager", fullgraph=True)(ids, use_cache=False)
    finally:
        torch._dynamo.reset()

"""The probability maps in a model: ``zt.apply(model, "sigmoid")`` (and softpick, stick-breaking, differential
attention) on a tiny Llama trains (the loss falls over a few optimizer steps, and λ's vectors get finite, nonzero
gradients), generates (greedy decoding through the cache gives the tokens the full forward gives), and round-trips
through ``save_pretrained`` and ``zt.from_pretrained``.

Tiny randomly initialised models (2 layers, hidden 32, 4 heads over 2 key/value heads, vocabulary 64), float32, no
downloads."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.integrations import transformers as zt  # noqa: E402

VOCAB, PAD, BOS = 64, 0, 1
GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def make():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD,
                                      bos_token_id=BOS, eos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def prompts(batch, length, seed=0):
    ids = torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = BOS
    return ids


def greedy_by_full_forward(model, ids, steps):
    """Greedy tokens from the whole sequence each time (no cache): what generate must reproduce."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("spec", ["sigmoid", "softpick", "stick-breaking", "diff"])
def test_a_model_with_a_probability_map_trains_generates_and_round_trips(spec, tmp_path):
    torch.manual_seed(0)
    model = zt.apply(make(), spec)
    ids = prompts(2, 12)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    if spec == "diff":  # λ's vectors and the norm's gain learn from the first step
        grads = {name: p.grad for name, p in model.named_parameters() if ".attnzoo." in name}
        assert any("lambda_q1" in name for name in grads) and any("diff_norm" in name for name in grads)
        for name, grad in grads.items():
            assert grad is not None and torch.isfinite(grad).all() and bool(grad.abs().sum() > 0), name
    model.eval()

    prompt = ids[:, :6]
    with torch.no_grad():
        generated = model.generate(prompt, **GREEDY)
    assert torch.equal(generated, greedy_by_full_forward(model, prompt, GREEDY["max_new_tokens"]))
    # a left-padded batch: each row generates what it generates alone (padding is never weighed, and sigmoid's n
    # is a row's own position)
    short = ids[1, :3]
    padded = torch.stack([prompt[0], torch.cat([torch.full((3,), PAD), short])])
    mask = (torch.arange(6) >= torch.tensor([[0], [3]])).long()
    with torch.no_grad():
        batch = model.generate(padded, attention_mask=mask, **GREEDY)
        assert torch.equal(batch[0], generated[0])
        assert torch.equal(batch[1, 3:], model.generate(short[None], **GREEDY)[0])

    model.save_pretrained(tmp_path)
    loaded = zt.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.model.layers[0].self_attn.attnzoo.variant.spec.name == spec


def test_a_map_conflicts_with_learned_sinks_and_prefer_decides():
    """gpt-oss's learned sinks are a term of the softmax a probability map replaces: one line, and prefer decides
    (the spec's map without the model's sinks, or the model's sinks without the map)."""
    from attnzoo.integrations.transformers import matrix

    torch.manual_seed(0)
    with pytest.raises(zt.IntegrationError) as caught:
        zt.apply(matrix.tiny_model("gpt_oss"), "sigmoid")
    message = str(caught.value)
    assert "\n" not in message and "GptOssAttention (layer 0)" in message
    assert "transforms[0] (sigmoid) conflicts with the model's attention_sink" in message and "prefer=" in message
    mapped = zt.apply(matrix.tiny_model("gpt_oss"), "sigmoid", prefer="spec")
    assert [t.kind for t in zt.layer_specs(mapped)[0].transforms] == ["sliding_window", "sigmoid"]
    kept = zt.apply(matrix.tiny_model("gpt_oss"), "sigmoid", prefer="model")
    assert [t.kind for t in zt.layer_specs(kept)[1].transforms] == ["attention_sink"]
    with torch.no_grad():
        assert torch.isfinite(mapped(prompts(1, 7)).logits).all()

"""``AttnzooCache(model, budget=..., kv_bits=8, 4, 3 or 2)``: every layer's keys and values held in that many bits
between steps (attnzoo/decode/quant.py; issue 52), on a tiny Llama built from a config. Logits are compared to a
tolerance, never bit for bit."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers.base import IntegrationError  # noqa: E402

VOCAB, PAD, BOS = 64, 0, 1
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def tiny(spec="h2o", budget=None, dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, bos_token_id=BOS,
                         eos_token_id=None)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return zt.apply(model, spec, budget=budget)


def prompt(length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (1, length), generator=g)
    ids[:, 0] = BOS
    return ids


@pytest.mark.parametrize("bad", [1, 5, 16, True, 8.0, "8"])
def test_kv_bits_other_than_8_4_3_2_or_none_is_refused_in_one_line(bad):
    model = tiny()
    with pytest.raises(IntegrationError, match="kv_bits") as info:
        zt.AttnzooCache(model, kv_bits=bad)
    assert "\n" not in str(info.value)
    assert zt.AttnzooCache(model, kv_bits=None).kv_bits is None


def test_a_head_size_kv_bits_cannot_pack_whole_is_refused_in_one_line():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, bos_token_id=BOS)
    model = zt.apply(LlamaForCausalLM(config).eval(), "h2o", budget=None)  # head size 12
    with pytest.raises(IntegrationError, match="kv_bits=3 packs eight codes in three bytes: the head size must be a "
                                               "multiple of 8, got 12") as info:
        zt.AttnzooCache(model, kv_bits=3)
    assert "\n" not in str(info.value)
    assert zt.AttnzooCache(model, kv_bits=2).kv_bits == 2


def test_kv_rotate_is_on_by_default_and_can_be_turned_off():
    model = tiny("h2o", budget=None)
    ids = prompt(16)
    with torch.no_grad():
        full = step_logits(model, ids, 6, zt.AttnzooCache(model))
        rotated = zt.AttnzooCache(model, kv_bits=4)
        plain = zt.AttnzooCache(model, kv_bits=4, kv_rotate=False)
        a, b = step_logits(model, ids, 6, rotated), step_logits(model, ids, 6, plain)
    assert rotated.kv_rotate and all(layer.kv._packed.rotated for layer in rotated.layers)
    assert not any(layer.kv._packed.rotated for layer in plain.layers)
    spread = float(full.std())
    assert float((a - full).abs().max()) < 0.3 * spread and float((b - full).abs().max()) < 0.3 * spread
    assert rotated.copy().layers[0].kv._packed.rotated
    with pytest.raises(IntegrationError, match="kv_rotate must be True or False") as info:
        zt.AttnzooCache(model, kv_bits=4, kv_rotate="yes")
    assert "\n" not in str(info.value)


def step_logits(model, ids, steps, cache):
    """Logits of the prompt's last token and of ``steps`` greedy tokens after it, one forward a step."""
    out = model(ids, cache=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(token, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


def test_8_bit_decoding_stays_close_to_full_precision():
    model = tiny("h2o", budget=None)  # nothing evicted: the same tokens attended, in 8 bits or not
    ids = prompt(16)
    with torch.no_grad():
        full = step_logits(model, ids, 10, zt.AttnzooCache(model))
        cache = zt.AttnzooCache(model, kv_bits=8)
        eight = step_logits(model, ids, 10, cache)
        four = step_logits(model, ids, 10, zt.AttnzooCache(model, kv_bits=4))
    spread = float(full.std())
    assert float((eight - full).abs().max()) < 0.02 * spread
    assert float((four - full).abs().max()) < 0.3 * spread
    assert float((eight - full).abs().max()) < float((four - full).abs().max())
    assert all(layer.kv.packed_bits == 8 for layer in cache.layers)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_generate_with_kv_bits_runs_and_holds_fewer_bytes(bits):
    model = tiny("h2o", budget=8)
    ids = prompt(12)
    cache = zt.AttnzooCache(model, kv_bits=bits)
    out = model.generate(ids, cache=cache, return_dict_in_generate=True, **GREEDY)
    assert out.sequences.shape == (1, 20)
    full = zt.AttnzooCache(model)
    model.generate(ids, cache=full, **GREEDY)
    reports = cache.memory()
    assert all(r["kv_bits"] == bits and r["tokens"] == 8 for r in reports)
    assert all(r["kv_bits"] is None for r in full.memory())
    # per layer, 2 heads of 8 tokens, head size 16: codes (16 * bits / 8 bytes) and a float16 scale and zero point,
    # for keys and values; an int64 position and H2O's float32 score
    per_token = 2 * ({8: 16, 4: 8, 3: 6, 2: 4}[bits] + 4) + 8 + 4
    assert cache.nbytes == sum(r["bytes"] for r in reports) == 2 * 2 * 8 * per_token
    assert full.nbytes == 2 * 2 * 8 * (2 * 16 * 4 + 8 + 4)


def test_a_left_padded_batch_generates_each_row_alone_in_8_bits():
    model = tiny("h2o", budget=6, dtype=torch.float64)
    rows = [prompt(12, seed=2)[0], prompt(9, seed=3)[0]]
    padded = torch.full((2, 12), PAD)
    for i, r in enumerate(rows):
        padded[i, 12 - len(r):] = r
    out = model.generate(padded, attention_mask=(padded != PAD).long(), cache=zt.AttnzooCache(model, kv_bits=8),
                         **GREEDY)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], cache=zt.AttnzooCache(model, kv_bits=8), **GREEDY)
        assert out[i, 12 - len(r):].tolist() == alone[0].tolist(), i


def test_beam_search_reorders_packed_layers():
    model = tiny("tova", budget=8)
    cache = zt.AttnzooCache(model, kv_bits=8)
    out = model.generate(prompt(10), cache=cache, num_beams=3, num_return_sequences=2, max_new_tokens=6,
                         do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert out.shape == (2, 16)
    assert all(layer.kv.packed_bits == 8 and layer.kv.batch == 3 for layer in cache.layers)


def test_kv_recent_needs_kv_bits_and_an_int_and_holds_the_newest_exactly():
    """``AttnzooCache(kv_bits=4, kv_recent=N)``: refused in one line without ``kv_bits`` or with a bad N; with N at
    least every token the model attends, generation reads no code and gives the full-precision cache's tokens; with a
    small N each layer holds N tokens' rows beside the codes (counted in its bytes)."""
    model = tiny("h2o", budget=16)
    for bad, words in ((dict(kv_recent=4), "give kv_bits too"), (dict(kv_bits=4, kv_recent=-1), "kv_recent must be"),
                       (dict(kv_bits=4, kv_recent=True), "kv_recent must be")):
        with pytest.raises(IntegrationError, match=words) as info:
            zt.AttnzooCache(model, **bad)
        assert "\n" not in str(info.value)
    ids = prompt(12)
    full = model.generate(ids, cache=zt.AttnzooCache(model), **GREEDY)
    exact = model.generate(ids, cache=zt.AttnzooCache(model, kv_bits=4, kv_recent=32), **GREEDY)
    assert torch.equal(full, exact)
    small, plain = zt.AttnzooCache(model, kv_bits=4, kv_recent=3), zt.AttnzooCache(model, kv_bits=4)
    model.generate(ids, cache=small, **GREEDY)
    model.generate(ids, cache=plain, **GREEDY)
    layers = model.config.num_hidden_layers
    extra = layers * 2 * 1 * 2 * 3 * 16 * 4  # keys and values, batch 1, 2 KV heads, 3 tokens, head_dim 16, float32
    assert small.nbytes - plain.nbytes == extra

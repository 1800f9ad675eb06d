"""``AttnzooCache(model, budget=..., evict="prefill")``: a prompt is compressed down to the budget, generated tokens
are all kept (kvpress's way: a compressed context, then a free answer; issue 52). Checked on a tiny Llama against the
plain model with a 4-D mask that hides the evicted prompt tokens from the generated tokens' queries only (the prompt
itself was attended in full at prefill). Logits compared to a tolerance."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers.base import IntegrationError  # noqa: E402

VOCAB, BOS = 64, 1


def models():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=None,
                         attn_implementation="sdpa")  # eager takes its softmax in float32
    plain = LlamaForCausalLM(config).to(torch.float64).eval()
    zoo = LlamaForCausalLM(LlamaConfig.from_dict(config.to_dict())).to(torch.float64).eval()
    zoo.load_state_dict(plain.state_dict())
    return plain, zt.apply(zoo, "streaming", budget=8)  # 4 sinks + the 4 most recent: the same set in every head


def test_a_prompt_is_compressed_and_every_generated_token_is_kept():
    plain, zoo = models()
    g = torch.Generator().manual_seed(3)
    n, steps = 16, 6
    ids = torch.randint(2, VOCAB, (1, n + steps), generator=g)
    ids[0, 0] = BOS
    cache = zt.AttnzooCache(zoo, evict="prefill")
    with torch.no_grad():
        logits = [zoo(ids[:, :n], cache=cache, use_cache=True).logits[0, -1]]
        assert [layer.kv.num_tokens for layer in cache.layers] == [8, 8]
        for t in range(n, n + steps - 1):
            logits.append(zoo(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
        kept = cache.layers[0].kv.positions[0, 0].tolist()
        # the plain model over the whole sequence; the generated tokens' queries see the kept prompt tokens only
        total = n + steps - 1
        allowed = torch.ones(total, total).tril().bool()
        hidden = [p for p in range(1, n + 1) if p not in kept[:8]]  # 1-based positions evicted at prefill
        for p in hidden:
            allowed[n:, p - 1] = False
        mask = torch.zeros(1, 1, total, total, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        want = plain(ids[:, :total], attention_mask=mask).logits[0, n - 1:]
    assert kept[:8] == [1, 2, 3, 4, 13, 14, 15, 16] and kept[8:] == list(range(17, 17 + steps - 1))
    assert [layer.kv.num_tokens for layer in cache.layers] == [8 + steps - 1] * 2  # grew by the generated tokens
    assert all(layer.kv.evicted == n - 8 for layer in cache.layers)
    torch.testing.assert_close(torch.stack(logits), want, rtol=1e-9, atol=1e-9)


def test_the_default_keeps_the_budget_and_a_bad_mode_is_one_line():
    _, zoo = models()
    ids = torch.randint(2, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    cache = zt.AttnzooCache(zoo)
    with torch.no_grad():
        zoo.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert cache.evict == "always" and all(layer.kv.num_tokens == 8 for layer in cache.layers)
    grown = zt.AttnzooCache(zoo, evict="prefill", kv_bits=4)
    with torch.no_grad():
        zoo.generate(ids, cache=grown, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert all(layer.kv.num_tokens == 12 and layer.kv.packed_bits == 4 for layer in grown.layers)
    with pytest.raises(IntegrationError, match="evict must be 'always' or 'prefill'") as info:
        zt.AttnzooCache(zoo, evict="decode")
    assert "\n" not in str(info.value)

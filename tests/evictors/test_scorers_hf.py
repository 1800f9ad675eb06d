"""The prompt scorers (snapkv, knorm, keydiff) through transformers' generate(): a left-padded batch generates what
each row generates alone, at budgets that evict, on tiny llama and gpt_neox (float64)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from attnzoo.integrations import transformers as zt  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB, PAD, BOS = 64, 0, 1
GREEDY = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD, eos_token_id=None)
CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
}
SPECS = {
    "snapkv": {"evictor": "snapkv", "budget": 6, "window": 2, "kernel": 3},
    "knorm": {"evictor": "knorm", "budget": 4},
    "keydiff": {"evictor": "keydiff", "budget": 4},
}


def tiny(family: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None,
                                  **CONFIGS[family])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().eval()
    with torch.no_grad():  # weights at a scale where what is evicted moves the tokens
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 2.0 * p.shape[-1] ** -0.5)
    return model


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_left_padded_batch_with_a_scorer_generates_each_row_alone(family, kind):
    cache = SPECS[kind]
    model = zt.apply(tiny(family), {"name": f"t-{kind}", "cache": cache})
    torch.manual_seed(2)
    rows = [torch.randint(2, VOCAB, (length,)) for length in (12, 11, 9, 5)]  # behind 0, 1, 3 and 7 padding tokens
    for r in rows:
        r[0] = BOS
    width = len(rows[0])
    padded = torch.full((len(rows), width), PAD)
    for i, r in enumerate(rows):
        padded[i, width - len(r):] = r
    out = model.generate(padded, attention_mask=(padded != PAD).long(), return_dict_in_generate=True, **GREEDY)
    assert all(report["tokens"] <= cache["budget"] for report in out.cache.memory())
    for i, r in enumerate(rows):
        alone = model.generate(r[None], **GREEDY)
        assert out.sequences[i, width - len(r):].tolist() == alone[0].tolist(), (i, width - len(r))

"""A left-padded batch generates what each row generates alone with an evictor at a budget that evicts, on tiny
llama, gpt_neox and bert (as a decoder), float64: those that read the attention probabilities (H2O, TOVA, SnapKV's
window) and the key scorers (knorm, keydiff).

Issue 51: each padding query's attention went to its row's first real token's H2O score, so a padded row evicted
other tokens than the row alone; before the fix the three h2o cases here fail (rows behind 1, 3 or 7 padding
tokens generate other tokens). TOVA reads the last query only, which is real in a left-padded prompt, so generate()
never showed it; a padding token decoded did (tests/decode/test_padding.py)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from attnzoo.integrations import transformers as zt  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB, PAD, BOS, BUDGET = 64, 0, 1, 4
GREEDY = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD, eos_token_id=None)
CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "bert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, is_decoder=True,
                 max_position_embeddings=64),
}


#: the cache section of each spec: the shipped evictor at a budget that evicts (snapkv's window and kernel scaled down)
CACHES = {
    "h2o": {"evictor": "h2o", "budget": BUDGET},
    "tova": {"evictor": "tova", "budget": BUDGET},
    "snapkv": {"evictor": "snapkv", "budget": 6, "window": 2, "kernel": 3},
    "knorm": {"evictor": "knorm", "budget": BUDGET},
    "keydiff": {"evictor": "keydiff", "budget": BUDGET},
}


def tiny(family: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None,
                                  **CONFIGS[family])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().eval()
    with torch.no_grad():  # weights at a scale where the attention pattern, and so what is evicted, moves the tokens
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 2.0 * p.shape[-1] ** -0.5)
    return model


@pytest.mark.parametrize("spec", sorted(CACHES))
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_left_padded_batch_with_eviction_generates_each_row_alone(family, spec):
    cache = CACHES[spec]
    model = zt.apply(tiny(family), {"name": f"padded-{spec}", "cache": cache})
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

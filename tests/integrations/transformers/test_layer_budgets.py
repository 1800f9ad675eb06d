"""``zt.layer_budgets``: one budget per layer holding in all what one budget in every layer holds, flat or
pyramid (PyramidKV's shape: a straight line from (1 + slope) x budget at the first layer to (1 - slope) x at the
last), for ``apply`` and ``AttnzooCache``. By hand, and on a tiny randomly initialised Llama (no downloads)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.integrations import transformers as zt  # noqa: E402


def test_pyramid_by_hand():
    # 4 layers, budget 10, slope 0.5: 15, 11.67, 8.33, 5 -> 15, 12, 8, 5 (the remainders .67 and .33: one token
    # to the largest), 40 in all
    assert zt.layer_budgets(4, 10, slope=0.5) == [15, 12, 8, 5]
    assert zt.layer_budgets(4, 10, shape="flat") == [10] * 4
    assert zt.layer_budgets(4, 10, slope=0) == [10] * 4
    for count, budget, slope in [(30, 780, 0.5), (7, 3, 0.6), (12, 129, 0.25), (2, 5, 0.5)]:
        spread = zt.layer_budgets(count, budget, slope=slope)
        assert sum(spread) == count * budget and len(spread) == count, spread
        assert spread == sorted(spread, reverse=True) and min(spread) >= 1, spread
    fractions = zt.layer_budgets(3, 0.25, slope=0.5)
    assert fractions == pytest.approx([0.375, 0.25, 0.125])


@pytest.mark.parametrize("args, kwargs, match", [
    ((4, 10), {"shape": "cone"}, "shape must be 'flat' or 'pyramid'"),
    ((4, 10), {"slope": 1.0}, r"slope must be a number in \[0, 1\)"),
    ((4, 10), {"slope": True}, "slope must be a number"),
    ((4, 0), {}, "int >= 1"),
    ((4, None), {}, "a budget is needed"),
    ((4, 0.8), {"slope": 0.5}, "first layer's fraction 1.2 is over 1"),
    ((0, 10), {}, "number of layers must be >= 1"),
    ((7, 3), {"slope": 0.9}, "the last layer would hold no token"),
])
def test_bad_arguments_are_one_line(args, kwargs, match):
    with pytest.raises(zt.IntegrationError, match=match):
        zt.layer_budgets(*args, **kwargs)


def test_a_pyramid_cache_holds_each_layers_budget():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=None)
    model = zt.apply(transformers.LlamaForCausalLM(config).eval(), "snapkv")
    spread = zt.layer_budgets(model, 8, slope=0.5)
    assert spread == [12, 8, 4]
    zt.apply(model, "snapkv", budget=spread)
    cache = zt.AttnzooCache(model)
    ids = torch.randint(2, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert [layer.kv.num_tokens for layer in cache.layers] == spread

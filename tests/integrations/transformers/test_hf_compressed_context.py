"""Budgets as fractions of the prompt, and one compressed context that answers several questions
(docs/transformers.md, "Compress once, ask several questions"): ``AttnzooCache.copy()`` and ``crop()``.

Tiny randomly initialised Llama models (2 layers, hidden 32, vocabulary 64), float32, no downloads."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.decode.create import prompt_budget  # noqa: E402
from attnzoo.evictors.base import resolve_budget  # noqa: E402
from attnzoo.integrations import transformers as zt  # noqa: E402

VOCAB, PAD, BOS = 64, 0, 1
GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None)


def llama(spec: str, **apply_kwargs):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD,
                                      bos_token_id=BOS, eos_token_id=None)
    return zt.apply(transformers.LlamaForCausalLM(config).eval(), spec, **apply_kwargs)


def tokens(length: int, seed: int, bos: bool = False) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    if bos:
        ids[:, 0] = BOS
    return ids


def held(cache) -> list:
    """Every tensor a layer's KVCache shows (tokens, positions, scores), copied."""
    return [(layer.kv.keys.clone(), layer.kv.values.clone(), layer.kv.positions.clone(),
             {name: t.clone() for name, t in layer.kv.state.items()}, layer.kv.next_position, layer.seen)
            for layer in cache.layers]


def same(a: list, b: list) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
               and x[3].keys() == y[3].keys() and all(torch.equal(x[3][n], y[3][n]) for n in x[3])
               and torch.equal(x[4], y[4]) and x[5] == y[5] for x, y in zip(a, b, strict=True))


def two_step(model, context, question, new_tokens, kv_bits=None):
    """A fresh cache: the context prefilled alone, then generate() over context + question (the question's prefill
    and the answer)."""
    cache = zt.AttnzooCache(model, kv_bits=kv_bits)
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
        return model.generate(torch.cat([context, question], 1), cache=cache, max_new_tokens=new_tokens, **GREEDY)


@pytest.mark.parametrize("spec, budget, kv_bits", [("h2o", 6, None), ("selective-pruned", 5, None),
                                                   ("tova", 0.5, None), ("h2o", 6, 8)])
def test_copies_of_one_compressed_context_answer_as_two_step_prefills_and_leave_it_unchanged(spec, budget, kv_bits):
    model = llama(spec, budget=budget)
    context = tokens(12, 1, bos=True)
    questions = [tokens(4, 2), tokens(5, 3)]
    cache = zt.AttnzooCache(model, kv_bits=kv_bits)
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)  # the context compressed alone: question-agnostic
    assert all(r["evicted"] > 0 and r["tokens"] == r["budget"] < 12 for r in cache.memory())
    before = held(cache)
    answers = []
    for question in questions:
        copied = cache.copy()
        assert all(c.kv is not o.kv and c.core is o.core for c, o in zip(copied.layers, cache.layers, strict=True))
        with torch.no_grad():
            got = model.generate(torch.cat([context, question], 1), cache=copied, max_new_tokens=6, **GREEDY)
        assert torch.equal(got, two_step(model, context, question, 6, kv_bits))
        assert same(held(cache), before)  # the context cache is as it was
        answers.append(got[0, -6:])
    assert cache.get_seq_length() == 12
    if kv_bits:
        assert all(layer.kv.packed_bits == kv_bits for layer in cache.layers)


def test_the_question_inside_the_compressed_prompt_is_the_question_aware_mode():
    """One prefill of context + question compresses with the question's attention (kvpress's question-aware mode);
    the context prefilled alone first compresses without it: here they keep other tokens."""
    model = llama("tova", budget=6)
    context, question = tokens(12, 1, bos=True), tokens(4, 2)
    ids = torch.cat([context, question], 1)
    aware = zt.AttnzooCache(model)
    with torch.no_grad():
        model(ids, cache=aware, use_cache=True)
        agnostic = zt.AttnzooCache(model)
        model(context, cache=agnostic, use_cache=True)
        model(question, cache=agnostic, use_cache=True)
    assert aware.get_seq_length() == agnostic.get_seq_length() == 16
    pairs = zip(aware.layers, agnostic.layers, strict=True)
    assert any(not torch.equal(a.kv.positions, b.kv.positions) for a, b in pairs)


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_crop_goes_back_to_the_context_while_nothing_was_evicted_since(kv_bits):
    model = llama("h2o", budget=18)  # 12 of context + 4 of question + 1 generated token fed back: no eviction
    context = tokens(12, 1, bos=True)
    first, second = tokens(4, 2), tokens(4, 3)
    cache = zt.AttnzooCache(model, kv_bits=kv_bits)
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
        before = held(cache)
        model.generate(torch.cat([context, first], 1), cache=cache, max_new_tokens=2, **GREEDY)
        assert cache.get_seq_length() == 17 and all(r["evicted"] == 0 for r in cache.memory())
        cache.crop(12)
        assert same(held(cache), before)  # the tokens and the scores the context left (h2o's accumulated attention)
        # the second answer evicts (12 + 4 + 6 > 18), by the scores the context left
        got = model.generate(torch.cat([context, second], 1), cache=cache, max_new_tokens=6, **GREEDY)
    assert all(r["evicted"] > 0 for r in cache.memory())
    assert torch.equal(got, two_step(model, context, second, 6, kv_bits))


def test_crop_after_an_eviction_is_refused_in_one_line_and_leaves_the_cache_as_it_was():
    model = llama("h2o", budget=6)
    context = tokens(12, 1, bos=True)
    cache = zt.AttnzooCache(model)
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
        model.generate(torch.cat([context, tokens(4, 2)], 1), cache=cache, max_new_tokens=3, **GREEDY)
    before = held(cache)
    for length in (12, -3, 14):
        with pytest.raises(zt.IntegrationError) as caught:
            cache.crop(length)
        message = str(caught.value)
        assert "\n" not in message and "copy()" in message and "cannot go back" in message, message
        assert same(held(cache), before)
    cache.crop(cache.get_seq_length())  # no tokens to drop: nothing to do
    assert same(held(cache), before)


def test_crop_names_the_evictions_since_the_context_and_the_states_it_keeps():
    model = llama("h2o", budget=6)
    cache = zt.AttnzooCache(model)
    with torch.no_grad():
        model(tokens(12, 1, bos=True), cache=cache, use_cache=True)
        model(tokens(4, 2), cache=cache, use_cache=True)  # the question's prefill evicts 4 tokens
    with pytest.raises(zt.IntegrationError, match=r"back to 12 tokens seen: 4 tokens were evicted or expired since"):
        cache.crop(12)
    with pytest.raises(zt.IntegrationError, match=r"keeps no state at 13 tokens seen .* kept now: none\)"):
        cache.crop(13)
    with torch.no_grad():
        model(tokens(1, 3), cache=cache, use_cache=True)
    with pytest.raises(zt.IntegrationError, match=r"keeps no state at 12 tokens seen .* kept now: none\)"):
        cache.crop(12)
    roomy = zt.AttnzooCache(model, budget=40)
    with torch.no_grad():
        model(tokens(12, 1, bos=True), cache=roomy, use_cache=True)
        model(tokens(4, 2), cache=roomy, use_cache=True)
        model(tokens(1, 3), cache=roomy, use_cache=True)
    with pytest.raises(zt.IntegrationError, match=r"keeps no state at 14 tokens seen .* kept now: \[12, 16\]\)"):
        roomy.crop(14)
    roomy.crop(16)
    assert roomy.get_seq_length() == 16 and [r["tokens"] for r in roomy.memory()] == [16, 16]


def test_a_fraction_is_resolved_at_each_requests_prefill_and_fixed_while_decoding():
    fraction = zt.AttnzooCache(llama("h2o", budget=0.5))
    model = llama("h2o", budget=0.5)
    assert model.config.attnzoo["budget"] == 0.5
    prompt = tokens(11, 1, bos=True)
    cache = zt.AttnzooCache(model)
    assert cache.budgets == [0.5, 0.5] and fraction.budgets == [0.5, 0.5]
    with torch.no_grad():
        got = model.generate(prompt, cache=cache, max_new_tokens=5, **GREEDY)
        # round(0.5 * 11) = 6 (round half to even): the same tokens as an int budget of 6
        want = llama("h2o", budget=6).generate(prompt, max_new_tokens=5, **GREEDY)
    assert torch.equal(got, want)
    assert [(r["budget"], r["tokens"]) for r in cache.memory()] == [(6, 6), (6, 6)]
    cache.reset()  # another request, another prompt: resolved again
    with torch.no_grad():
        model(tokens(20, 4, bos=True), cache=cache, use_cache=True)
    assert [(r["budget"], r["tokens"]) for r in cache.memory()] == [(10, 10), (10, 10)]
    whole = zt.AttnzooCache(model, budget=1.0)  # the whole prompt kept, then the prompt's size
    with torch.no_grad():
        model(prompt, cache=whole, use_cache=True)
        assert [(r["budget"], r["tokens"], r["evicted"]) for r in whole.memory()] == [(11, 11, 0)] * 2
        model(tokens(1, 5), cache=whole, use_cache=True)
    assert [(r["tokens"], r["evicted"]) for r in whole.memory()] == [(11, 1)] * 2


def test_a_left_padded_batch_resolves_a_fraction_by_its_longest_row():
    model = llama("selective-pruned", budget=[0.5, 0.25])
    assert model.config.attnzoo["budget"] == [0.5, 0.25]
    ids = torch.cat([torch.full((1, 4), PAD), tokens(6, 2, bos=True)], 1)
    ids = torch.cat([tokens(10, 1, bos=True), ids])
    cache = zt.AttnzooCache(model)
    with torch.no_grad():
        model(ids, attention_mask=(ids != PAD).long(), cache=cache, use_cache=True)
    assert [r["budget"] for r in cache.memory()] == [5, 2]  # round(0.5 * 10), max(2, round(0.25 * 10)) for selective


def test_a_fraction_in_the_spec_is_recorded_saved_and_read_back(tmp_path):
    spec = {"name": "h2o-half", "attention": {"causal": True}, "cache": {"evictor": "h2o", "budget": 0.5}}
    model = llama(spec)
    assert model.config.attnzoo["budget"] == 0.5 and zt.AttnzooCache(model).budgets == [0.5, 0.5]
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attnzoo"]["budget"] == 0.5
    loaded = zt.from_pretrained(tmp_path)
    assert loaded.config.attnzoo["budget"] == 0.5
    prompt = tokens(9, 1, bos=True)
    with torch.no_grad():
        assert torch.equal(loaded.generate(prompt, max_new_tokens=4, **GREEDY),
                           model.generate(prompt, max_new_tokens=4, **GREEDY))


@pytest.mark.parametrize("budget", [True, 0, -1, 1.5, 0.0, math.nan, "0.5", [0.5, 2.0]])
def test_budgets_that_are_neither_a_count_nor_a_fraction_are_refused_in_one_line(budget):
    model = llama("h2o")
    for make in (lambda: zt.apply(model, "h2o", budget=budget), lambda: zt.AttnzooCache(model, budget=budget)):
        with pytest.raises(zt.IntegrationError) as caught:
            make()
        assert "\n" not in str(caught.value) and "budget" in str(caught.value)


def test_a_fraction_without_an_evictor_is_refused_at_apply():
    with pytest.raises(zt.IntegrationError, match=r"no cache evictor, so a budget \(0.5\)"):
        llama("ssa", budget=0.5)


def test_the_evictor_checks_the_resolved_budget_naming_the_fraction():
    class EvenOnly:
        kind = "even"

        def check_budget(self, budget):
            return None if budget % 2 == 0 else f"even budgets only, got {budget}"

    assert resolve_budget(0.5, 12, EvenOnly()) == 6 and resolve_budget(7, 3, EvenOnly()) == 7
    with pytest.raises(ValueError, match=r"^budget 5 \(fraction 0.5 of a 10-token prompt\): even budgets only"):
        resolve_budget(0.5, 10, EvenOnly())
    plan = llama("streaming", budget=0.1).model.layers[0].self_attn.attnzoo.variant.plan
    assert prompt_budget(plan, 0.1, 20) == plan.spec.cache.sink + 1  # at least the smallest budget it accepts

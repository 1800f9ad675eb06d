"""A cache copied (attnzoo.decode.rewind.copy_cache) and taken back to a mark (mark/rewind); budgets as fractions
of the prompt in a spec's ``cache:`` section (attnzoo.evictors.base.resolve_budget, decode.create.prompt_budget)."""

import pytest
import torch

import attnzoo
from attnzoo.decode.create import prompt_budget
from attnzoo.decode.rewind import copy_cache, mark, rewind

D, H, HKV = 8, 4, 2


def rows(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, H, n, D, generator=g, dtype=torch.float64),
            torch.randn(2, HKV, n, D, generator=g, dtype=torch.float64),
            torch.randn(2, HKV, n, D, generator=g, dtype=torch.float64))


def run(variant, cache, seeds, first=10):
    """A prefill of ``first`` tokens (seed ``seeds[0]``), then one token per later seed; the outputs."""
    outs = [variant.prefill(*rows(first, seeds[0]), cache)]
    outs += [variant.decode(*rows(1, s), cache) for s in seeds[1:]]
    return torch.cat(outs, dim=2)


def snapshot(cache):
    return (cache.keys.clone(), cache.values.clone(), cache.positions.clone(),
            {n: t.clone() for n, t in cache.state.items()}, cache.next_position, cache.evicted, len(cache))


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True)) and a[3].keys() == b[3].keys() and all(
        torch.equal(a[3][n], b[3][n]) for n in a[3]) and torch.equal(a[4], b[4]) and a[5:] == b[5:]


@pytest.mark.parametrize("spec, budget", [("h2o", 6), ("selective-pruned", 5), ("tova", 4), ("streaming", 6),
                                          ("vanilla", None)])
def test_a_copy_steps_as_its_original_and_leaves_it_unchanged(spec, budget):
    variant = attnzoo.compile(spec, backend="reference")
    cache = variant.new_cache(batch=2, budget=budget)
    run(variant, cache, [1, 2, 3])
    before = snapshot(cache)
    copied = copy_cache(cache)
    assert copied.keys.data_ptr() != cache.keys.data_ptr() and copied.evictor is cache.evictor
    twin = variant.new_cache(batch=2, budget=budget)
    run(variant, twin, [1, 2, 3])
    outs = [variant.decode(*rows(1, s), copied) for s in (4, 5, 6)]
    assert all(torch.equal(o, variant.decode(*rows(1, s), twin)) for o, s in zip(outs, (4, 5, 6), strict=True))
    assert equal(snapshot(cache), before) and equal(snapshot(copied), snapshot(twin))


def test_rewind_puts_back_the_tokens_and_scores_of_the_mark_while_nothing_was_evicted():
    variant = attnzoo.compile("h2o", backend="reference")
    cache = variant.new_cache(batch=2, budget=16)
    run(variant, cache, [1])
    at, before = mark(cache), snapshot(cache)
    for s in (2, 3, 4):
        variant.decode(*rows(1, s), cache)
    assert cache.evicted == 0 and len(cache) == 13
    rewind(cache, at)
    assert equal(snapshot(cache), before)
    twin = variant.new_cache(batch=2, budget=16)
    run(variant, twin, [1])
    for s in range(5, 14):  # past the budget: evicts by the scores the mark held
        assert torch.equal(variant.decode(*rows(1, s), cache), variant.decode(*rows(1, s), twin))
    assert cache.evicted > 0 and equal(snapshot(cache), snapshot(twin))
    with pytest.raises(ValueError, match=r"^cannot rewind the cache: \d+ tokens were evicted or expired since"):
        rewind(cache, at)


def test_a_spec_budget_may_be_a_fraction_resolved_at_the_prompt():
    data = {"name": "half", "attention": {"causal": True}, "cache": {"evictor": "h2o", "budget": 0.5}}
    spec = attnzoo.load_spec(data)
    assert spec.cache.budget == 0.5 and attnzoo.load_spec({**data, "cache": {"evictor": "h2o", "budget": 1}}).hash \
        != attnzoo.load_spec({**data, "cache": {"evictor": "h2o", "budget": 1.0}}).hash  # 1 token, the whole prompt
    variant = attnzoo.compile(spec, backend="reference")
    with pytest.raises(ValueError, match=r"^budget 0.5 is a fraction of the prompt: .*prompt_budget"):
        variant.new_cache(batch=1)
    assert prompt_budget(variant.plan, attnzoo.decode.create.UNSET, 11) == 6  # round half to even
    assert prompt_budget(variant.plan, 0.25, 3) == 1 and prompt_budget(variant.plan, 7, 3) == 7
    for bad in (True, 0, -2, 1.5, 0.0, float("nan"), "0.5"):
        with pytest.raises(attnzoo.SpecError, match=r"cache.budget: a budget is an int >= 1 \(tokens\), a float in"):
            attnzoo.load_spec({**data, "cache": {"evictor": "h2o", "budget": bad}})
    recent = {**data, "cache": {"evictor": "h2o", "budget": 0.5, "recent": 4}}  # check_budget waits for the prompt
    plan = attnzoo.compile(attnzoo.load_spec(recent), backend="reference").plan
    assert prompt_budget(plan, 0.5, 4) == 5  # the smallest budget h2o accepts with recent 4

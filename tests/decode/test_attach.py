"""A cache over buffers its caller owns (``KVCache.attach``, what vLLM's pruned pages use: docs/vllm.md, "KV
pruning"): decoding on a cache re-attached to the same page every step equals decoding on one cache, in float64,
and the steps write into the page instead of moving out of it."""

from __future__ import annotations

import pytest
import torch

import attnzoo

BUDGET, PREFILL, STEPS = 6, 9, 30


def _page(cache, slots):
    """Buffers of ``slots`` slots holding ``cache``'s tokens in position order (what a vLLM page holds)."""
    b, h, m, d = cache.keys.shape
    page = {"keys": cache.keys.new_zeros(b, h, slots, d), "values": cache.values.new_zeros(b, h, slots, d),
            "positions": torch.zeros(b, h, slots, dtype=torch.int64)}
    page["keys"][:, :, :m], page["values"][:, :, :m] = cache.keys, cache.values
    page["positions"][:, :, :m] = cache.positions
    for name in cache.state_names:
        page[f"state.{name}"] = cache.state[name].new_zeros(b, h, slots)
        page[f"state.{name}"][:, :, :m] = cache.state[name]
    return page


@pytest.mark.parametrize("spec", ["h2o", "selective-pruned", "streaming", "tova"])
def test_a_cache_attached_to_a_page_decodes_as_one_cache(spec):
    variant = attnzoo.compile(spec, backend="blocked")
    gen = torch.Generator().manual_seed(5)
    n = PREFILL + STEPS
    q = torch.randn(1, 4, n, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    budget = 8 if spec == "streaming" else BUDGET  # streaming keeps 4 sink tokens: a window of 4
    one = variant.new_cache(1, budget=budget)
    variant.prefill(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], one)
    first = variant.new_cache(1, budget=budget)
    variant.prefill(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], first)
    page = _page(first, budget + 1)
    header = {"held": first.num_tokens, "next": int(first.next_position[0]), "evicted": first.evicted,
              "expired": first.expired, "scrambled": False}
    moved = 0
    for i in range(PREFILL, n):
        want = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], one)
        cache = variant.new_cache(1, budget=budget)
        cache.attach(page["keys"], page["values"], page["positions"],
                     {name: page[f"state.{name}"] for name in cache.state_names}, header["held"], header["next"],
                     evicted=header["evicted"], expired=header["expired"], scrambled=header["scrambled"])
        got = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        buffers = cache.buffers()
        if any(buffers[name].data_ptr() != page[name.replace("held.", "state.")].data_ptr() for name in buffers):
            moved += 1  # the caller copies the settled tokens back (as the vLLM backend does)
            page = _page(cache, budget + 1)
        header = {"held": cache.num_tokens, "next": int(cache.next_position[0]), "evicted": cache.evicted,
                  "expired": cache.expired, "scrambled": cache.scrambled}
        assert cache.num_tokens <= budget
    torch.testing.assert_close(cache.positions, one.positions, rtol=0, atol=0)
    assert one.evicted > 0
    # the steps write into the page; TOVA's evictor assigns each step's scores as a new tensor, copied back
    assert moved <= 2 or spec == "tova", moved


def test_a_cache_re_attached_with_the_last_step_state_keeps_the_fast_step():
    """``attach(step_state=...)``: a cache re-attached every step takes the fast step the previous one validated
    (not the full path each step), with the same outputs as one cache."""
    variant = attnzoo.compile("h2o", backend="blocked")
    gen = torch.Generator().manual_seed(7)
    n = PREFILL + STEPS
    q = torch.randn(3, 4, n, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(3, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    one, first = variant.new_cache(3, budget=BUDGET), variant.new_cache(3, budget=BUDGET)
    for cache in (one, first):
        variant.prefill(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], cache)
    page, held, nxt, state, kinds = _page(first, BUDGET + 1), first.num_tokens, first.next_position, None, []
    for i in range(PREFILL, n):
        want = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], one)
        cache = variant.new_cache(3, budget=BUDGET)
        cache.attach(page["keys"], page["values"], page["positions"],
                     {name: page[f"state.{name}"] for name in cache.state_names}, held, nxt, step_state=state)
        kinds.append(cache.lean_step_kind)
        got = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        page, held, nxt, state = _page(cache, BUDGET + 1), cache.num_tokens, cache.next_position, cache.step_state
    assert kinds[0] is None and all(kind is not None for kind in kinds[1:]), kinds
    with pytest.raises(ValueError, match="validated for batch 3, not 2"):
        variant.new_cache(2, budget=BUDGET).attach(page["keys"][:2], page["values"][:2], page["positions"][:2],
                                                  {n[6:]: t[:2] for n, t in page.items() if n.startswith("state.")},
                                                  held, nxt[:2], step_state=state)


def test_attach_refuses_buffers_that_do_not_fit():
    variant = attnzoo.compile("h2o", backend="blocked")
    cache = variant.new_cache(1, budget=4)
    keys = torch.zeros(1, 2, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="attach: .* do not fit"):
        cache.attach(keys, keys, torch.zeros(1, 2, 4, dtype=torch.int64), {}, 2, 3)
    with pytest.raises(ValueError, match="no buffer for the per-token scores"):
        cache.attach(keys, keys.clone(), torch.zeros(1, 2, 5, dtype=torch.int64), {}, 2, 3)

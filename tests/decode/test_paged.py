"""Pages as a cache's storage (attnzoo.decode.paged, docs/decoding.md "Pages"): a prompt's kept tokens written into
pages, a cache opened over a batch of them (in place where consecutive, else gathered), stepped and committed, against
each row alone in attnzoo's own cache (float64); the header as the cache's state; the refusals."""

from __future__ import annotations

import pytest
import torch

from attnzoo.core.numerics import accumulator_dtype
from attnzoo.decode import paged
from attnzoo.decode.paged import EVICTED, EXPIRED, GENERATION, HELD, MAGIC, NEXT, SCRAMBLED, PageLayout, Pages
from attnzoo.nn import Attention
from attnzoo.spec import load_spec

H, HKV, D = 4, 2, 16


def _core(spec: str, dtype=torch.float64):
    torch.manual_seed(3)
    core = Attention(load_spec(spec), H, D, HKV, backend="blocked", dtype=dtype)
    with torch.no_grad():
        for p in core.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return core


def _pages(core, budget: int, count: int, dtype=torch.float64) -> tuple[PageLayout, torch.Tensor, Pages]:
    names = tuple(core.new_cache(1, budget=budget).state_names)
    layout = PageLayout(HKV, D, dtype, budget, names, accumulator_dtype(dtype))
    size = torch.empty((), dtype=dtype).element_size()
    memory = torch.full((count, layout.page_bytes // size + 3), float("nan"), dtype=dtype)  # never zeroed
    return layout, memory, Pages(layout.all_views(memory))


def _prompts(core, pages, blocks, lengths, gen):
    """Each prompt alone: the core's prefill into its own cache (the reference), its kept tokens into its page."""
    refs = []
    for block, length in zip(blocks, lengths, strict=True):
        q, k, v = (torch.randn(1, h, length, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        cache = core.new_cache(1, budget=pages.sections["keys"].shape[2] - 1)
        core.prefill(q, k, v, cache)
        pages.write(torch.tensor([block]), cache)
        refs.append(cache)
    return refs


@pytest.mark.parametrize("spec", ["h2o", "selective-pruned", "snapkv", "knorm"])
@pytest.mark.parametrize("blocks", [[5, 3, 4, 6], [1, 4, 6, 2]], ids=["consecutive-shuffled", "gathered"])
def test_a_paged_cache_steps_as_each_row_alone(spec, blocks):
    """Prompts of several lengths written into their pages, then decode steps of the pages as one batch, the cache
    kept while :meth:`current` says so: every step's outputs and every page's header (tokens held, next position,
    evicted, expired) equal each request's own cache's (float64); the commit says whether the cache may step again
    (in place: yes, gathered: no); a page's tokens in position order are the reference's."""
    budget, gen = 8, torch.Generator().manual_seed(0)
    core = _core(spec)
    layout, memory, pages = _pages(core, budget, 8)
    refs = _prompts(core, pages, blocks, [20, 11, 31, 9], gen)
    given = torch.tensor(blocks)
    cache, kept, agains, state = None, [], [], None
    for _ in range(6):
        lengths = torch.tensor([int(r.next_position[0]) for r in refs])
        if cache is not None and cache.current(lengths):
            kept.append(True)
        else:
            cache = pages.open(core.new_cache(4, budget=budget), given, held=budget, next_position=lengths,
                               step_state=state)  # what the last cache validated: its fast step kept
        order = cache.order if cache.order is not None else torch.arange(4)
        q, k, v = (torch.randn(4, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        out = core.decode(q.index_select(0, order), k.index_select(0, order), v.index_select(0, order), cache)
        state, again = cache.step_state, cache.commit()
        agains.append(again)
        cache = cache if again else None
        for row, i in enumerate(order.tolist()):
            want = core.decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], refs[i])
            torch.testing.assert_close(out[row:row + 1], want, rtol=1e-10, atol=1e-10)
        for i, ref in enumerate(refs):
            header = pages.headers[blocks[i]].tolist()
            assert header[0] == MAGIC and header[GENERATION] == 1
            assert [header[HELD], header[NEXT], header[EVICTED], header[EXPIRED]] == [
                ref.num_tokens, int(ref.next_position[0]), ref.evicted, ref.expired]
    # in place, the cache steps again from the step after the first that kept its buffers in the pages (a full
    # path's first step may give an evictor's scores a tensor of their own: copied back, opened afresh)
    assert (not any(agains) and not kept) if blocks != [5, 3, 4, 6] else (all(agains[2:]) and len(kept) >= 4)
    for i, ref in enumerate(refs):  # a page's slots in position order are its request's tokens
        page = {name: view[blocks[i]:blocks[i] + 1] for name, view in pages.sections.items() if name != "hdr"}
        pos = page["positions"][..., :budget]
        order = pos.argsort(-1)
        torch.testing.assert_close(pos.gather(-1, order), ref.positions)
        keys = page["keys"][:, :, :budget]
        torch.testing.assert_close(keys.gather(2, order[..., None].expand_as(keys)), ref.keys)
        for name in ref.state_names:
            torch.testing.assert_close(page[f"state.{name}"][..., :budget].gather(-1, order), ref.state[name])


def test_a_page_written_by_another_is_opened_afresh():
    """A cache steps again only while each page's header is what its commit left: a prompt written into one of its
    pages since (the same length: only the generation tells them apart), or the host's next position not the page's,
    and :meth:`current` says no; the cache opened afresh then steps as each request alone."""
    budget, gen = 8, torch.Generator().manual_seed(1)
    core = _core("h2o")
    _, _, pages = _pages(core, budget, 6)
    refs = _prompts(core, pages, [2, 3], [12, 12], gen)
    lengths = torch.tensor([13, 13])
    cache = pages.open(core.new_cache(2, budget=budget), torch.tensor([2, 3]), held=budget, next_position=lengths)
    q, k, v = (torch.randn(2, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
    core.decode(q, k, v, cache)
    assert cache.commit()
    for i in range(2):
        core.decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], refs[i])
    assert cache.current(lengths + 1) and not cache.current(lengths) and not cache.current(lengths + 2)
    refs[1:] = _prompts(core, pages, [3], [13], gen)  # page 3 taken by a new request, also at 13 tokens
    assert pages.headers[3, GENERATION] == 2 and not cache.current(lengths + 1)
    cache = pages.open(core.new_cache(2, budget=budget), torch.tensor([2, 3]), held=budget,
                       next_position=lengths + 1)
    out = core.decode(q, k, v, cache)
    cache.commit()
    for i in range(2):
        torch.testing.assert_close(out[i:i + 1], core.decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], refs[i]),
                                   rtol=1e-10, atol=1e-10)


def test_the_header_holds_the_slot_order_a_lean_step_left():
    """A fused or lean step writes the new token into its victim's slot: the pages' headers say the slots are out of
    position order (SCRAMBLED), and a cache opened on one of them alone settles them before a full step reads
    them: its outputs equal the request's alone."""
    budget, gen = 8, torch.Generator().manual_seed(2)
    core = _core("h2o")
    _, _, pages = _pages(core, budget, 4)
    refs = _prompts(core, pages, [0, 1], [15, 15], gen)
    state = None
    for step in range(3):  # opened each step, its step state carried: the lean step from the second on
        lengths = torch.tensor([16 + step] * 2)
        cache = pages.open(core.new_cache(2, budget=budget), torch.tensor([0, 1]), held=budget,
                           next_position=lengths, step_state=state)
        q, k, v = (torch.randn(2, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        core.decode(q, k, v, cache)
        state = cache.step_state
        cache.commit()
        for i in range(2):
            core.decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], refs[i])
    assert cache.scrambled and pages.headers[:2, SCRAMBLED].tolist() == [1, 1]
    alone = pages.open(core.new_cache(1, budget=budget), torch.tensor([1]), next_position=torch.tensor([19]))
    assert alone.scrambled == cache.scrambled
    q, k, v = (torch.randn(1, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
    torch.testing.assert_close(core.decode(q, k, v, alone), core.decode(q, k, v, refs[1]), rtol=1e-10, atol=1e-10)
    alone.commit()
    assert pages.headers[1, NEXT] == 20 and pages.headers[1, HELD] == budget


@pytest.mark.parametrize(("field", "value", "reason"), [
    (HELD, 7, "holds 7 tokens, not 8"), (NEXT, 30, "does not continue at token 13"),
    (0, 0, "holds no cache")])
def test_a_page_whose_header_disagrees_is_refused_before_any_write(field, value, reason):
    """Every page's header is checked before a cache is opened on it: the magic, the tokens held, the host's next
    position; a page that disagrees is refused in one line naming its block, and nothing is written."""
    budget, gen = 8, torch.Generator().manual_seed(3)
    core = _core("h2o")
    _, memory, pages = _pages(core, budget, 6)
    _prompts(core, pages, [1, 2, 3], [12, 12, 12], gen)
    pages.headers[2, field] = value
    before = memory.clone()
    with pytest.raises(ValueError) as caught:
        pages.open(core.new_cache(3, budget=budget), torch.tensor([1, 2, 3]), held=budget,
                   next_position=torch.tensor([13, 13, 13]))
    line = str(caught.value)
    assert "\n" not in line and f"the page of block 2 {reason}" in line and "nothing was written" in line
    assert torch.equal(memory.view(torch.int64), before.view(torch.int64))


def test_the_refusals_of_pages():
    """One line each: a cache with more tokens than a page's slots, or with padding, written into pages; a cache
    opened from one that holds tokens, on pages repeated, out of range or not given as int64, with next positions
    not one per page, or of a spec whose scores the pages have no section for; a paged cache packed or copied, or
    committed holding more tokens than a page or padding."""
    budget, gen = 4, torch.Generator().manual_seed(4)
    core = _core("h2o")
    layout, memory, pages = _pages(core, budget, 3)
    big = core.new_cache(1, budget=None)
    core.prefill(*(torch.randn(1, h, 9, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV)), big)
    before = memory.clone()
    with pytest.raises(ValueError, match="holds 9 tokens, a page 5 slots"):
        pages.write(torch.tensor([0]), big)
    padded = core.new_cache(1, budget=budget)
    core.prefill(*(torch.randn(1, h, 3, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV)), padded,
                 key_mask=torch.tensor([[False, True, True]]))
    with pytest.raises(ValueError, match="padding"):
        pages.write(torch.tensor([0]), padded)
    with pytest.raises(ValueError, match="distinct pages"):
        pages.write(torch.tensor([5]), big)
    assert torch.equal(memory.view(torch.int64), before.view(torch.int64))
    _prompts(core, pages, [0], [6], gen)
    with pytest.raises(ValueError, match="a fresh cache of 1 rows"):
        pages.open(big, torch.tensor([0]))
    for blocks, message in ((torch.tensor([0, 0]), "distinct pages in \\[0, 3\\)"), (torch.tensor([3]), "distinct"),
                            (torch.tensor([-1]), "distinct"), (torch.tensor([0.0]), "int64"), ([0], "int64")):
        with pytest.raises(ValueError, match=message):
            pages.open(core.new_cache(1, budget=budget), blocks)
    with pytest.raises(ValueError, match="no section 'state.accumulated' .* another spec"):  # h2o's pages, F
        pages.open(_core("selective-pruned").new_cache(1, budget=budget), torch.tensor([0]))
    with pytest.raises(ValueError, match="one per page"):
        pages.open(core.new_cache(1, budget=budget), torch.tensor([0]), next_position=torch.tensor([7, 7]))
    cache = pages.open(core.new_cache(1, budget=None), torch.tensor([0]))  # a cache that keeps every token
    core.prefill(*(torch.randn(1, h, 7, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV)), cache)
    before = memory.clone()
    with pytest.raises(ValueError, match="holds 11 tokens, a page 5 slots"):
        cache.commit()  # seven more tokens on the page's four: the cache grew past the page
    cache = pages.open(core.new_cache(1, budget=None), torch.tensor([0]))  # (at a budget, padding goes first)
    core.decode(*(torch.randn(1, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV)), cache,
                key_mask=torch.tensor([[False]]))
    with pytest.raises(ValueError, match="holds padding"):
        cache.commit()
    # the header and the tokens it holds as before (the in-place append wrote the slot past them only)
    assert torch.equal(pages.headers[0], layout.views(before[0])["hdr"])
    assert torch.equal(pages.sections["keys"][0, :, :4], layout.views(before[0])["keys"][0, :, :4])
    cache = pages.open(core.new_cache(1, budget=budget), torch.tensor([0]))
    with pytest.raises(ValueError, match="cannot be packed"):
        cache.pack(4)
    with pytest.raises(ValueError, match="copy the pages"):
        cache.copy()


def test_every_pages_views_are_each_pages_bytes():
    """The views of every page at once (``all_views``: what a batch opens) are the same bytes as one page's
    ``views``; a tensor that is not contiguous, or pages too small for the layout, are refused in one line."""
    layout = PageLayout(2, 8, torch.float32, 5, ("F", "score"), torch.float32)
    words = layout.page_bytes // 4 + 4
    memory = torch.randn(4, words, generator=torch.Generator().manual_seed(0))
    every = layout.all_views(memory)
    for block in range(4):
        one = layout.views(memory[block])
        for name, view in one.items():
            want = every[name][block] if name == "hdr" else every[name][block:block + 1]
            assert view.data_ptr() == want.data_ptr() and torch.equal(view.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        layout.all_views(memory.t())
    with pytest.raises(ValueError, match="the layout needs"):
        layout.all_views(memory[:, :8].clone())
    assert paged.consecutive(torch.tensor([4, 2, 3])) is not None and paged.consecutive(torch.tensor([1, 3])) is None


def test_gathered_caches_never_read_each_others_pages():
    """Pages that are not consecutive are gathered into buffers the process shares (one per section shape): two
    caches open at once (neither committed) get buffers of their own and each steps as its requests alone; a cache
    stepped again after its commit, once another open has taken the shared buffers, is refused in one line before
    the step reads them, its pages unchanged."""
    budget, gen = 8, torch.Generator().manual_seed(5)
    core = _core("h2o")
    _, memory, pages = _pages(core, budget, 12)
    refs = _prompts(core, pages, [1, 3, 5, 7], [14, 15, 16, 17], gen)

    def opened(blocks, rows):
        nexts = torch.tensor([int(refs[r].next_position[0]) for r in rows])
        return pages.open(core.new_cache(2, budget=budget), torch.tensor(blocks), held=budget, next_position=nexts)

    first, second = opened([1, 5], [0, 2]), opened([3, 7], [1, 3])  # both gathered, both open
    for cache, rows in ((first, [0, 2]), (second, [1, 3])):
        q, k, v = (torch.randn(2, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        out = core.decode(q, k, v, cache)
        for i, r in enumerate(rows):
            want = core.decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], refs[r])
            torch.testing.assert_close(out[i:i + 1], want, rtol=1e-10, atol=1e-10)
    assert not first.commit() and not second.commit()
    third = opened([1, 5], [0, 2])  # takes the shared buffers again
    before = memory.clone()
    q, k, v = (torch.randn(2, h, 1, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
    stale = first if first._shared else second  # noqa: SLF001 -- whichever held the shared buffers
    with pytest.raises(ValueError, match="open the pages afresh") as caught:
        core.decode(q, k, v, stale)
    assert "\n" not in str(caught.value)
    assert torch.equal(memory.view(torch.int64), before.view(torch.int64))
    out = core.decode(q, k, v, third)
    third.commit()
    for i, r in enumerate([0, 2]):
        torch.testing.assert_close(out[i:i + 1], core.decode(q[i:i + 1], k[i:i + 1], v[i:i + 1], refs[r]),
                                   rtol=1e-10, atol=1e-10)

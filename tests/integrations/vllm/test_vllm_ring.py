"""The ring page's typed views (attnzoo.integrations.vllm.ring, docs/vllm.md "KV pruning"): the views of every page
at once (``all_views``, what the serving layer batches with) are the same bytes as one page's ``views``. Needs vLLM
(ring.py subclasses its spec classes); no engine starts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_pages_views_are_each_pages_bytes(dtype):
    from attnzoo.integrations.vllm.ring import RingGeometry

    geometry = RingGeometry(2, 8, dtype, 5, ("F", "score"), torch.float32, 128)
    blocks = 4
    words = geometry.page_bytes // torch.empty((), dtype=dtype).element_size() + 4  # a block longer than the page
    cache = torch.randn(blocks, words, generator=torch.Generator().manual_seed(0)).to(dtype)
    every = geometry.all_views(cache)
    assert set(every) == {"hdr", "keys", "values", "positions", "state.F", "state.score"}
    for block in range(blocks):
        one = geometry.views(cache[block])
        for name, view in one.items():
            mine = every[name][block] if name == "hdr" else every[name][block:block + 1]
            assert mine.shape == view.shape and mine.dtype == view.dtype and mine.data_ptr() == view.data_ptr()
            assert mine.stride()[-1] == 1
    every["keys"].index_copy_(0, torch.tensor([2]), torch.ones(1, 2, 6, 8, dtype=dtype))  # written in place
    assert bool((geometry.views(cache[2])["keys"] == 1).all())
    assert not bool((geometry.views(cache[1])["keys"] == 1).all())
    with pytest.raises(ValueError, match="contiguous"):
        geometry.all_views(cache.t())


def _serving_layer(spec: str, budget: int, dtype):
    """The serving layer (``attnzoo.integrations.vllm.layer.Layer``) around a core of ``spec`` (its parameters moved
    off their initial values), made by its constructor without a checkpoint or an engine; and the core alone, for
    the reference."""
    from attnzoo.integrations.vllm.layer import Layer
    from attnzoo.nn import Attention
    from attnzoo.spec import load_spec

    torch.manual_seed(3)
    core = Attention(load_spec(spec), 4, 16, 2, backend="blocked", dtype=dtype)
    with torch.no_grad():
        for p in core.parameters():
            p.add_(0.3 * torch.randn_like(p))
    layer = Layer(core, budget, "test")
    assert layer.batchable
    return layer, core


@pytest.mark.parametrize("spec", ["selective-pruned", "h2o", "snapkv", "knorm", "keydiff"])
@pytest.mark.parametrize(("blocks", "paths"), [
    pytest.param([3, 4, 5, 6, 7], {True}, id="consecutive"),
    pytest.param([5, 3, 7, 4, 6], {True, False}, id="permuted"),  # in place once all five pages are full
    pytest.param([6, 2, 9, 4, 0], {False}, id="scattered")])
def test_the_pages_prefill_and_step_each_request_as_attnzoos_own_cache(spec, blocks, paths, monkeypatch):
    """The serving layer over ring pages (``attend_pruned``) against each request alone in attnzoo's own cache
    (core prefill, then decode steps), float64: prompts of one length prefilled as one batch, the full pages
    stepped as one batch, in place where their blocks are consecutive in any order (else gathered and scattered
    back), pages still filling stepped alone; outputs every step and each page's tokens at the end. Evictors with a
    per-token state (F, H2O's and SnapKV's scores, KeyDiff's similarities) and one without (KNorm)."""

    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.decode import paged
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for

    dtype, budget, lengths, steps = torch.float64, 8, [7, 20, 20, 20, 3], 12
    layer, core = _serving_layer(spec, budget, dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
    kv_cache = torch.zeros(10, geometry.page_bytes // 8 + 3, dtype=dtype)
    seen = []
    real = paged.consecutive  # which path the batched steps (over more than one page) take
    monkeypatch.setattr(paged, "consecutive", lambda b: (seen.append(real(b)) or seen[-1]) if b.numel() > 1
                        else real(b))
    gen = torch.Generator().manual_seed(0)
    caches = [core.new_cache(1, budget=budget) for _ in lengths]
    table = torch.tensor(blocks, dtype=torch.int32).unsqueeze(1)
    done = [0] * len(lengths)
    for step in range(steps + 1):
        counts = lengths if step == 0 else [1] * len(lengths)
        n, starts, done, meta = _metadata(counts, done, table)
        _serve_and_compare(layer, core, geometry, kv_cache, caches, meta, starts, step, gen)
    assert {s is not None for s in seen} == paths  # which path the batched steps took: in place, gathered
    pages = geometry.all_views(kv_cache)
    for i, cache in enumerate(caches):
        header = pages["hdr"][blocks[i]].tolist()  # magic, held, next position, generation, evicted, expired
        held = header[1]
        assert header[1:6] == [cache.num_tokens, int(cache.next_position[0]), 1, cache.evicted, cache.expired]
        # a fused step leaves each head's slots in its own order (the new token in its victim's slot)
        order = pages["positions"][blocks[i], :, :held].argsort(-1)
        torch.testing.assert_close(pages["positions"][blocks[i], :, :held].gather(-1, order), cache.positions[0])
        keys = pages["keys"][blocks[i], :, :held]
        torch.testing.assert_close(keys.gather(1, order[..., None].expand_as(keys)), cache.keys[0])


def test_a_batched_step_keeps_its_cache_until_a_page_changes(monkeypatch):
    """Full pages in consecutive blocks step on the cache of their last step (``PagedKVCache.current``: nothing
    opened, no layout) while each page's header is what that step's commit left; a new request prefilled into one
    of the blocks, at the same length as the request it replaces (only the page's generation tells them apart),
    gets a fresh cache; every step's outputs equal each request's alone in attnzoo's own cache (float64)."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.decode.paged import PagedKVCache
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for

    dtype, budget, blocks = torch.float64, 8, [3, 4, 5]
    layer, core = _serving_layer("h2o", budget, dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
    kv_cache = torch.zeros(10, geometry.page_bytes // 8 + 3, dtype=dtype)
    reused = []
    real = PagedKVCache.current
    monkeypatch.setattr(PagedKVCache, "current", lambda self, *a: reused.append(real(self, *a)) or reused[-1])
    gen = torch.Generator().manual_seed(0)
    caches = [core.new_cache(1, budget=budget) for _ in blocks]
    table = torch.tensor(blocks, dtype=torch.int32).unsqueeze(1)
    done = [0, 0, 0]
    for step in range(4):
        n, starts, done, meta = _metadata([20] * 3 if step == 0 else [1] * 3, done, table)
        _serve_and_compare(layer, core, geometry, kv_cache, caches, meta, starts, step, gen)
    assert reused == [True, True]  # the second batched step on: the same cache
    # block 4's request ends; a new one of 23 tokens, the others' length, is prefilled into it
    n, starts, _, meta = _metadata([23], [0], torch.tensor([[4]], dtype=torch.int32))
    fresh = core.new_cache(1, budget=budget)
    _serve_and_compare(layer, core, geometry, kv_cache, [fresh], meta, starts, 0, gen)
    caches[1] = fresh
    for _ in range(2):
        n, starts, done, meta = _metadata([1] * 3, done, table)
        _serve_and_compare(layer, core, geometry, kv_cache, caches, meta, starts, 1, gen)
    assert reused == [True, True, False, True]  # the generation changed: opened afresh, then kept again


def _step(layer, geometry, kv_cache, blocks, counts, done, gen):
    """One step of the serving layer over the ring pages of ``kv_cache``: ``counts[i]`` new tokens of request ``i``
    (after ``done[i]``), its page ``blocks[i]``; returns the output and the lengths after the step."""
    n, _, done, meta = _metadata(counts, done, torch.tensor(blocks, dtype=torch.int32).unsqueeze(1))
    q, k, v = (torch.randn(n, h, 16, generator=gen, dtype=kv_cache.dtype) for h in (4, 2, 2))
    out = torch.full((n, 64), float("nan"), dtype=kv_cache.dtype)
    layer.attend_pruned(geometry, q, k, v, kv_cache, meta, out)
    return out, done


def _serve_and_compare(layer, core, geometry, kv_cache, caches, meta, starts, step, gen):
    """One step of the serving layer (fresh q, k, v for every new token) against each request alone in its own
    attnzoo cache (``caches[i]``: its core's prefill at step 0, then decode), float64 tolerances."""
    n, dtype = meta.num_actual_tokens, kv_cache.dtype
    q, k, v = (torch.randn(n, h, 16, generator=gen, dtype=dtype) for h in (4, 2, 2))
    out = torch.full((n, 64), float("nan"), dtype=dtype)
    layer.attend_pruned(geometry, q, k, v, kv_cache, meta, out)
    for i, cache in enumerate(caches):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        args = [t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        want = (core.prefill if step == 0 else core.decode)(*args, cache)[0].transpose(0, 1)
        torch.testing.assert_close(out[rows].view_as(want), want, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, i=i, s=step: f"request {i}, step {s}: {m}")


def _metadata(counts, done, table):
    """vLLM's attention metadata for a step of ``counts[i]`` new tokens of request ``i`` (after ``done[i]``), its
    pages ``table``: (tokens in the step, each request's first row, the lengths after the step, the metadata)."""
    import types

    n = sum(counts)
    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    done = [d + c for d, c in zip(done, counts, strict=True)]
    meta = types.SimpleNamespace(num_actual_tokens=n, query_start_loc=starts,
                                 seq_lens=torch.tensor(done, dtype=torch.int32), block_table=table)
    return n, starts, done, meta


@pytest.mark.parametrize("spec", ["selective-pruned", "h2o"])
@pytest.mark.parametrize(("lengths", "counts", "blocks", "rows", "block"), [
    # the full pages' batched step (a repeated block is never a run of consecutive blocks: gathered, then scattered)
    pytest.param([20, 20, 20, 20], [1, 1, 1, 1], [3, 4, 5, 4], "1 and 3", 4, id="full-pages"),
    pytest.param([20, 20, 20, 20], [1, 1, 1, 1], [8, 8, 1, 8], "0, 1 and 3", 8, id="full-pages-three-rows"),
    pytest.param([5, 5, 20], [1, 1, 1], [3, 3, 4], "0 and 1", 3, id="lone-steps"),  # pages still filling
    pytest.param([0, 0, 0], [12, 12, 12], [5, 6, 5], "0 and 2", 5, id="prompts-of-one-length"),
    pytest.param([20, 0, 20], [1, 9, 1], [2, 7, 7], "1 and 2", 7, id="a-prompt-and-a-step")])
def test_a_step_whose_requests_share_a_page_is_refused_before_any_write(spec, lengths, counts, blocks, rows, block,
                                                                        monkeypatch):
    """Two requests of one step batch on one ring page (a scheduler or KV-manager bug: a page is one request's for
    its whole life) are refused in one line naming the requests (rows of the step's batch) and the block, on every
    path that writes pages (the full pages' batched step; lone steps; prompts of one length prefilled together; a
    prompt beside a step), and no page is written; without the check the same step writes them, or the paged cache's
    own check refuses a batch that holds a page twice (the full pages' step, prompts of one length)."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.integrations.transformers.base import IntegrationError
    from attnzoo.integrations.vllm import pages as page_ops
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for

    dtype, budget = torch.float64, 8
    layer, core = _serving_layer(spec, budget, dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
    kv_cache = torch.zeros(10, geometry.page_bytes // 8 + 3, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for b, n in {b: n for b, n in zip(blocks, lengths, strict=True) if n}.items():  # each page's own prompt first
        _step(layer, geometry, kv_cache, [b], [n], [0], gen)
    before = kv_cache.clone()
    with pytest.raises(IntegrationError) as caught:
        _step(layer, geometry, kv_cache, blocks, counts, lengths, gen)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("test: vLLM's scheduler gave requests")
    assert f"requests {rows} of this step" in line and f"same ring page, block {block}:" in line
    assert torch.equal(kv_cache, before)  # no page, no header written
    monkeypatch.setattr(page_ops, "distinct_pages", lambda *args: None)  # what the check stops
    try:  # pages written with no word, or (lone steps) the second request's header check, after the first wrote the
        # page; or a batch of pages refused by the paged cache itself (attnzoo.decode.paged: a page twice in a batch)
        _step(layer, geometry, kv_cache, blocks, counts, lengths, gen)
    except IntegrationError as exc:
        assert "does not continue" in str(exc) or "must be distinct pages" in str(exc)
        if "must be distinct pages" in str(exc):
            assert torch.equal(kv_cache, before)
            return
    assert not torch.equal(kv_cache, before)


@pytest.mark.parametrize(("field", "value"), [("HELD", 7), ("NEXT", 30), ("MAGIC", 0)])
def test_a_full_page_whose_header_disagrees_is_refused_before_any_write(field, value):
    """Which decoding requests step as one batch is read from the step's lengths (``Step.full_rows``: one new token
    after at least ``budget``); each such page's header must agree (the magic, ``budget`` held, the next position):
    a page that does not is refused in one line naming its block, and no page is written."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.integrations.transformers.base import IntegrationError
    from attnzoo.integrations.vllm import pages as page_ops
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for

    dtype, budget, blocks = torch.float64, 8, [3, 4, 5]
    layer, core = _serving_layer("h2o", budget, dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
    kv_cache = torch.zeros(10, geometry.page_bytes // 8 + 3, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    _, done = _step(layer, geometry, kv_cache, blocks, [20, 20, 20], [0, 0, 0], gen)
    header = geometry.all_views(kv_cache)["hdr"][4]
    header[0 if field == "MAGIC" else getattr(page_ops, field)] = value
    before = kv_cache.clone()
    with pytest.raises(IntegrationError) as caught:
        _step(layer, geometry, kv_cache, blocks, [1, 1, 1], done, gen)
    line = str(caught.value)
    reason = {"HELD": "holds 7 tokens, not 8", "NEXT": "does not continue at token 21", "MAGIC": "holds no cache"}
    assert "\n" not in line and f"block 4 {reason[field]}" in line and "nothing was written" in line
    assert torch.equal(kv_cache, before)


def test_a_request_without_new_tokens_shares_no_page():
    """A row of the step without new tokens writes nothing: its block id is not counted."""
    from attnzoo.integrations.transformers.base import IntegrationError
    from attnzoo.integrations.vllm.pages import distinct_pages

    distinct_pages([3, 3, 4], torch.tensor([0, 1, 1]), "test")
    with pytest.raises(IntegrationError, match="requests 0 and 1 of this step .* block 3:"):
        distinct_pages([3, 3, 4], torch.tensor([1, 1, 0]), "test")


def test_the_layers_of_a_forward_share_its_step():
    """The step's requests are read from vLLM's metadata once per forward (``step.step_of``, keyed by the metadata
    object, which vLLM builds once per forward and hands to every layer): two layers of other specs and budgets over
    one metadata object per step each still give their core's outputs alone, and a new metadata object is a new
    step."""

    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for
    from attnzoo.integrations.vllm.step import step_of

    dtype, lengths = torch.float64, [12, 20, 3]
    served = []
    for spec, budget in (("selective-pruned", 8), ("h2o", 6)):
        layer, core = _serving_layer(spec, budget, dtype)
        names = tuple(core.new_cache(1, budget=budget).state_names)
        geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
        served.append((layer, core, geometry, torch.zeros(5, geometry.page_bytes // 8 + 3, dtype=dtype),
                       [core.new_cache(1, budget=budget) for _ in lengths]))
    gen, done, table, steps = torch.Generator().manual_seed(0), [0] * len(lengths), torch.tensor([[3], [1], [4]]), []
    for step in range(6):
        counts = lengths if step == 0 else [1] * len(lengths)
        n, starts, done, meta = _metadata(counts, done, table)
        for layer, core, geometry, kv_cache, caches in served:
            _serve_and_compare(layer, core, geometry, kv_cache, caches, meta, starts, step, gen)
        steps.append(step_of(meta))
        assert step_of(meta) is steps[-1] and steps[-1].lengths == done
    assert len({id(s) for s in steps}) == len(steps)


def _held_bytes(root, exclude) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through containers and instances (not through
    modules, classes or functions' globals), the storage of ``exclude`` left out."""
    import functools
    import types

    seen, storages, stack = set(), {}, [root]
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, functools.partial):
            stack.extend(obj.args)
            stack.extend(obj.keywords.values())
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    storages.pop(exclude.untyped_storage().data_ptr(), None)
    return sum(storages.values())


@pytest.mark.parametrize("spec", ["h2o", "selective-pruned"])
def test_gathered_steps_keep_no_copy_of_the_pages_per_batch_size(spec):
    """The full pages' batched step over pages that are not consecutive gathers them into one buffer the process
    keeps (its capacity set once), so what a layer keeps between steps does not grow with the batch sizes it has
    stepped (issue 55: the step state each layer keeps per batch size held the fused step's buffers, a fresh
    gathered copy of the pages per batch size, and the server's memory grew round after round)."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.decode import paged
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for

    dtype, budget, blocks = torch.float32, 8, [1, 3, 5, 7, 9, 11, 13, 15]  # never consecutive: always gathered
    layer, core = _serving_layer(spec, budget, dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
    kv_cache = torch.zeros(16, geometry.page_bytes // 4 + 2, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    done = {}
    for b in blocks:  # each request's prompt, longer than the budget: its page full
        _step(layer, geometry, kv_cache, [b], [20], [0], gen)
        done[b] = 20
    held = []
    for rows in range(2, 9):
        mine = blocks[:rows]
        for _ in range(3):  # the first step validates, the later ones take the fast step
            assert paged.consecutive(torch.tensor(mine)) is None
            _, after = _step(layer, geometry, kv_cache, mine, [1] * rows, [done[b] for b in mine], gen)
            done.update(zip(mine, after, strict=True))
        held.append(_held_bytes(layer, kv_cache))
    assert max(held) - held[0] < geometry.page_bytes, held  # before: one gathered copy more per batch size

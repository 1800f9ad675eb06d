"""Left-padded batches, per-row positions, beam reordering and bulk eviction in the decode cache."""

import pytest
import torch

import attnzoo
from attnzoo.cache import KVCache

DECODING = ("reference", "blocked")
SPECS = ("vanilla", "ssa", "selective", "selective-pruned", "local-global", "h2o", "tova", "streaming", "forgetting",
         "sink")


def params_for(variant, h=4, d=8, hkv=2):
    base = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    return {key: value + 0.4 * torch.randn_like(value) for key, value in base.items()}


def decode_rows(variant, q, k, v, cache, params, prefill, key_mask=None):
    outs = [variant.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache, params=params,
                            key_mask=key_mask)] if prefill else []
    for i in range(prefill, q.shape[2]):
        outs.append(variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize("spec", SPECS)
def test_left_padded_batch_decodes_what_each_row_decodes_alone(spec, backend):
    """Rows with 0, 3 and 9 padding tokens: every real output, the kept positions and F equal the row run alone
    (its first real token is position 1, the protected one)."""
    torch.manual_seed(0)
    variant = attnzoo.compile(spec, backend=backend)
    params = params_for(variant)
    budget = 10 if variant.spec.cache is not None else None
    lengths, prompt, steps = (20, 17, 11), 20, 14
    b, n = len(lengths), prompt + steps
    q = torch.randn(b, 4, n, 8, dtype=torch.float64)
    k, v = torch.randn(2, b, 2, n, 8, dtype=torch.float64)
    key_mask = torch.zeros(b, prompt, dtype=torch.bool)
    for row, length in enumerate(lengths):
        key_mask[row, prompt - length:] = True
    # garbage in the padding slots must not matter
    q[:, :, :prompt][~key_mask[:, None].expand(b, 4, prompt)] = 1e3
    cache = variant.new_cache(batch=b, budget=budget)
    with torch.no_grad():
        batched = decode_rows(variant, q, k, v, cache, params, prompt, key_mask)
    assert budget is None or cache.num_tokens <= budget
    for row, length in enumerate(lengths):
        pad = prompt - length
        alone_cache = variant.new_cache(batch=1, budget=budget)
        rows = (t[row:row + 1, :, pad:] for t in (q, k, v))
        with torch.no_grad():
            alone = decode_rows(variant, *rows, alone_cache, params, length)
        torch.testing.assert_close(batched[row:row + 1, :, pad:], alone, rtol=0, atol=1e-10)
        assert int(cache.next_position[row]) == length + steps + 1
        if budget is not None and cache.valid is None:
            assert sorted(cache.positions[row, 0].tolist()) == sorted(alone_cache.positions[0, 0].tolist())
            if cache.accumulated() is not None:
                torch.testing.assert_close(cache.accumulated()[row], alone_cache.accumulated()[0], rtol=0, atol=1e-10)


def test_padding_is_evicted_first_and_never_attended():
    variant = attnzoo.compile("selective-pruned", backend="reference")
    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    key_mask = torch.tensor([[False] * 5 + [True] * 3, [True] * 8])
    cache = variant.new_cache(batch=2, budget=6)
    variant.prefill(q, k, v, cache, key_mask=key_mask)
    # row 0 had 5 padding tokens: the 2 evicted first are padding, 3 padding tokens are left (row 1 evicted 2 by F)
    assert cache.num_tokens == 6 and cache.valid is not None
    assert cache.valid[0, 0].tolist() == [False, False, False, True, True, True]
    assert cache.positions[0, 0, 3:].tolist() == [1, 2, 3]
    assert cache.next_position.tolist() == [4, 9]
    for _ in range(3):  # three more tokens: the padding goes first, then F decides
        variant.decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache)
    assert cache.valid is None and cache.positions[0, 0].tolist() == [1, 2, 3, 4, 5, 6]


def test_batch_form_ignores_positions_of_padding():
    """The batch form with a key mask: padding positions are ignored (any values), real ones must increase."""
    variant = attnzoo.compile("ssa", backend="reference")
    params = params_for(variant)
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 12, 8, dtype=torch.float64)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[0, :4] = False
    positions = torch.arange(1, 13).repeat(2, 1)
    positions[0] = torch.tensor([7, 7, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    alone = variant(q[:1, :, 4:], k[:1, :, 4:], v[:1, :, 4:], params=params)
    for backend, dtype, atol in (("reference", torch.float64, 1e-10), ("blocked", torch.float64, 1e-10),
                                 ("flex", torch.float32, 1e-5)):
        cast = {key: p.to(dtype) for key, p in params.items()}
        out = attnzoo.compile("ssa", backend=backend)(q.to(dtype), k.to(dtype), v.to(dtype), params=cast,
                                                      positions=positions, key_mask=key_mask)
        torch.testing.assert_close(out[:1, :, 4:].double(), alone, rtol=0, atol=atol)
    positions[0, 6] = 2  # a real token repeats its predecessor's position
    with pytest.raises(ValueError, match="increase strictly along each row"):
        variant(q, k, v, params=params, positions=positions, key_mask=key_mask)


@pytest.mark.parametrize("backend", DECODING)
def test_reorder_selects_rows_like_beam_search(backend):
    """After reorder([2, 0, 0]) the cache continues exactly as if those rows had been decoded from the start."""
    torch.manual_seed(1)
    variant = attnzoo.compile("selective-pruned", backend=backend)
    q = torch.randn(3, 4, 30, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, 2, 30, 8, dtype=torch.float64)
    index = torch.tensor([2, 0, 0])
    cache = variant.new_cache(batch=3, budget=12)
    with torch.no_grad():
        decode_rows(variant, q[:, :, :20], k[:, :, :20], v[:, :, :20], cache, None, 9)
        cache.reorder(index)
        got = decode_rows(variant, q[index, :, 20:], k[index, :, 20:], v[index, :, 20:], cache, None, 0)
        fresh = variant.new_cache(batch=3, budget=12)
        want = decode_rows(variant, q[index], k[index], v[index], fresh, None, 9)[:, :, 20:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert cache.batch == 3 and torch.equal(cache.positions, fresh.positions)
    with pytest.raises(ValueError, match="out of range"):
        cache.reorder(torch.tensor([3]))


@pytest.mark.parametrize("spec", ["selective-pruned", "h2o", "tova", "streaming"])
def test_bulk_eviction_equals_one_at_a_time(spec):
    """A long prefill into a small budget chooses all victims at once; the same tokens as one at a time."""
    torch.manual_seed(2)
    variant = attnzoo.compile(spec, backend="reference")
    q = torch.randn(2, 4, 60, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 60, 8, dtype=torch.float64)
    caches = []
    for bulk in (True, False):
        cache = variant.new_cache(batch=2, budget=9)
        if not bulk:
            cache.evictor.independent_scores = False
        decode_rows(variant, q, k, v, cache, None, 50)
        caches.append(cache)
    assert torch.equal(caches[0].positions, caches[1].positions)
    assert caches[0].evicted == caches[1].evicted == 51
    for name in caches[0].state:
        torch.testing.assert_close(caches[0].state[name], caches[1].state[name], rtol=0, atol=0)


def test_appending_copies_one_row_and_a_long_prefill_gives_its_room_back():
    variant = attnzoo.compile("selective-pruned", backend="blocked")
    cache = variant.new_cache(batch=1, budget=8)
    x = torch.randn(1, 2, 300, 4)
    variant.prefill(x, x, x, cache)
    assert cache.num_tokens == 8 and cache.capacity_bytes <= 2 * cache.nbytes
    pointers = set()
    for i in range(40):
        variant.decode(x[:, :, i:i + 1], x[:, :, i:i + 1], x[:, :, i:i + 1], cache)
        pointers.add(cache.keys.data_ptr())
    assert len(pointers) == 1  # the same buffer every step: no reallocation, no concatenation
    vanilla = attnzoo.compile("vanilla", backend="blocked").new_cache(batch=1)
    grown = set()
    for i in range(100):
        attnzoo.compile("vanilla", backend="blocked").decode(x[:, :, i:i + 1], x[:, :, i:i + 1], x[:, :, i:i + 1],
                                                             vanilla)
        grown.add(vanilla._k.shape[2])
    assert sorted(grown) == [16, 32, 64, 128]  # doubling: a handful of copies for 100 tokens


def test_changing_parameters_mid_cache_is_refused():
    layer = attnzoo.nn.Attention("ssa", num_heads=2, head_dim=4)
    cache = layer.new_cache(batch=1)
    x = torch.randn(1, 2, 1, 4)
    with torch.no_grad():
        layer.decode(x, x, x, cache)
        layer.decode(x, x, x, cache)
        next(layer.parameters()).add_(0.1)
        with pytest.raises(ValueError, match="start a new cache"):
            layer.decode(x, x, x, cache)


def test_cache_memory_report():
    cache = KVCache(batch=1, budget=None)
    cache.append(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    report = cache.memory()
    assert report["tokens"] == 5 and report["bytes"] == cache.nbytes == 2 * 2 * 5 * 4 * 4 + 2 * 5 * 8
    assert report["allocated_bytes"] >= report["bytes"]


@pytest.mark.parametrize("spec", ["ssa", "selective-pruned", "h2o"])
def test_triton_decodes_a_left_padded_batch_like_the_reference(spec):
    """The triton backend (interpreter) with padding in the cache: its general path (the decode kernel has no key
    mask) against the reference, float32."""
    pytest.importorskip("triton")
    torch.manual_seed(3)
    ref = attnzoo.compile(spec, backend="reference")
    params = {key: value.float() for key, value in params_for(ref).items()}
    budget = 9 if ref.spec.cache is not None else None
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, 2, 16, 8)
    key_mask = torch.tensor([[False] * 4 + [True] * 8, [True] * 12])
    outs = []
    for backend in ("reference", "triton"):
        variant = attnzoo.compile(spec, backend=backend)
        cache = variant.new_cache(batch=2, budget=budget)
        with torch.no_grad():
            outs.append(decode_rows(variant, q, k, v, cache, params, 12, key_mask))
    real = torch.cat([key_mask, torch.ones(2, 4, dtype=torch.bool)], dim=1)[:, None, :, None].expand_as(outs[0])
    torch.testing.assert_close(outs[1][real], outs[0][real], rtol=0, atol=2e-5)


def _real_slots(cache, row):
    """Per key/value head of batch row ``row``: (its real tokens' positions, in order, and their evictor scores
    and F by name)."""
    if cache.positions is None:  # nothing held yet: one head with nothing
        return [(torch.empty(0, dtype=torch.int64), {})]
    valid = cache.valid
    out = []
    for head in range(cache.positions.shape[1]):
        real = valid[row, head] if valid is not None else torch.ones_like(cache.positions[row, head], dtype=torch.bool)
        pos = cache.positions[row, head][real]
        order = pos.argsort()
        out.append((pos[order], {name: t[row, head][real][order] for name, t in cache.state.items()}))
    return out


@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize("spec", ["h2o", "tova", "selective-pruned"])
def test_padding_queries_never_score_a_token(spec, backend):
    """Issue 51: an evictor that reads probabilities (H2O, TOVA) gets only real queries' rows, and F only real
    queries' selections. Rows behind 1, 3 and 7 padding tokens, prefilled in two chunks (the first all padding for
    the row behind 7), then decoded with one padding token decoded in row 1: after every step each row keeps the
    positions, scores and F it keeps alone, where it runs only its real tokens, in the same steps, and its real
    outputs are its outputs alone. Before the fix each padding query's attention went to the first real token's H2O
    score (a padding query sees only it)."""
    torch.manual_seed(4)
    variant = attnzoo.compile(spec, backend=backend)
    params = params_for(variant)
    budget, pads, width, chunk, steps, idle_step = 6, (1, 3, 7), 12, 7, 10, 4
    b, n = len(pads), width + steps
    q = torch.randn(b, 4, n, 8, dtype=torch.float64)
    k, v = torch.randn(2, b, 2, n, 8, dtype=torch.float64)
    real = torch.ones(b, n, dtype=torch.bool)
    for row, pad in enumerate(pads):
        real[row, :pad] = False
    real[1, width + idle_step] = False  # row 1 decodes a padding token (docs/decoding.md: decode's key_mask)
    q[~real[:, None].expand(b, 4, n)] = 1e3  # what padding carries must not matter
    spans = [(0, chunk), (chunk, width)] + [(i, i + 1) for i in range(width, n)]
    batched = variant.new_cache(batch=b, budget=budget)
    alone = [variant.new_cache(batch=1, budget=budget) for _ in pads]
    with torch.no_grad():
        for start, stop in spans:
            rows = (t[:, :, start:stop] for t in (q, k, v))
            mask = real[:, start:stop]
            step = variant.decode if stop - start == 1 else variant.prefill
            out = step(*rows, batched, params=params, key_mask=mask)
            assert batched.num_tokens <= budget
            for row in range(b):
                mine = real[row, start:stop]
                if not bool(mine.any()):
                    continue  # the row alone has no such step
                take = (t[row:row + 1, :, start:stop][:, :, mine] for t in (q, k, v))
                want = (variant.decode if int(mine.sum()) == 1 else variant.prefill)(*take, alone[row], params=params)
                torch.testing.assert_close(out[row:row + 1, :, mine], want, rtol=0, atol=1e-10)
            for row in range(b):
                got, expected = _real_slots(batched, row), _real_slots(alone[row], 0)
                if alone[row].positions is None:
                    assert all(pos.numel() == 0 for pos, _ in got), (row, start)
                    continue
                for (pos, scores), (want_pos, want_scores) in zip(got, expected, strict=True):
                    assert pos.tolist() == want_pos.tolist(), (row, start, pos.tolist(), want_pos.tolist())
                    for name, want_score in want_scores.items():
                        torch.testing.assert_close(scores[name], want_score, rtol=0, atol=1e-10)
    assert batched.evicted > 0 and all(cache.evicted > 0 for cache in alone)
    assert batched.next_position.tolist() == [cache.next_position.item() for cache in alone]


def test_validity_that_differs_between_heads_is_refused():
    """Padding is per batch row: the backends mask held keys with the row's validity (``key_mask()``, the first
    head's), so a validity that differs between key/value heads (one head holding padding where another holds a
    token) would be attended with the first head's mask. Setting one is refused in one line; the same validity in
    every head is taken."""
    variant = attnzoo.compile("h2o")
    params = params_for(variant)
    cache = variant.new_cache(batch=2, budget=None)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 6, 8, dtype=torch.float64)
    variant.prefill(q, k, v, cache, params=params)
    uniform = torch.ones(2, 2, 6, dtype=torch.bool)
    uniform[1, :, :2] = False
    cache.valid = uniform
    assert cache.key_mask().tolist() == uniform[:, 0].tolist()
    mixed = uniform.clone()
    mixed[0, 1, 3] = False
    with pytest.raises(ValueError, match=r"must be the same in every key/value head") as info:
        cache.valid = mixed
    assert "\n" not in str(info.value)
    assert torch.equal(cache.valid, uniform)  # the refused validity was not taken


@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize("cache", [{"evictor": "snapkv", "window": 3, "kernel": 3}, {"evictor": "h2o"}],
                         ids=["snapkv", "h2o"])
def test_padding_kept_by_a_per_head_eviction_is_the_same_slots_in_every_head(cache, backend):
    """A second prefill chunk onto a left-padded cache, with padding of its own (two tokens leading row 2's chunk,
    one in the middle of row 1's), under an evictor that keeps a set per head, evicting fewer tokens than a row's
    padding: the padding kept is the same slots in every head (padding goes first, by slot, whatever an evictor's
    scores say of it: SnapKV's pooling gave padding at other positions other scores in each head, and its heads
    kept other padding slots, which attention, masking by the row's validity, read as real), so the next step's
    output is, for every head, softmax(q k / sqrt(d)) v over that head's real held tokens (written out here)."""
    torch.manual_seed(0)
    variant = attnzoo.compile({"name": f"t-{cache['evictor']}", "cache": cache}, backend=backend)
    params = variant.init_params(num_heads=6, head_dim=5, num_kv_heads=2, dtype=torch.float64)
    b, h, hkv, d, n = 3, 6, 2, 5, 24
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
    first = torch.ones(b, 11, dtype=torch.bool)
    first[1, :5] = False
    first[2, :8] = False
    second = torch.ones(b, 10, dtype=torch.bool)
    second[1, 7] = False
    second[2, :2] = False
    held = variant.new_cache(batch=b, budget=12)  # nine go from every row: row 2 keeps one of its ten padding
    with torch.no_grad():
        variant.prefill(q[:, :, :11], k[:, :, :11], v[:, :, :11], held, params=params, key_mask=first)
        variant.prefill(q[:, :, 11:21], k[:, :, 11:21], v[:, :, 11:21], held, params=params, key_mask=second)
        assert held.valid is not None and not bool(held.valid.all())  # padding survived the eviction
        held_k, held_v, valid = held.keys.clone(), held.values.clone(), held.valid.clone()
        out = variant.decode(q[:, :, 21:22], k[:, :, 21:22], v[:, :, 21:22], held, params=params)
    keys = torch.cat([held_k, k[:, :, 21:22]], dim=2).repeat_interleave(h // hkv, 1)
    values = torch.cat([held_v, v[:, :, 21:22]], dim=2).repeat_interleave(h // hkv, 1)
    real = torch.cat([valid, torch.ones(b, hkv, 1, dtype=torch.bool)], dim=2).repeat_interleave(h // hkv, 1)
    logits = (q[:, :, 21:22] @ keys.transpose(-1, -2)) / d ** 0.5
    want = logits.masked_fill(~real[:, :, None, :], float("-inf")).softmax(-1) @ values
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)

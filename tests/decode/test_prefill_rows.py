"""An evictor that declares ``probability_rows`` (SnapKV: its window, TOVA: 1) gets only the step's last rows'
probabilities (attnzoo/decode/step.py, ``evictor_query_rows``; issue 52): the kept sets, the scores and the outputs
equal those of the whole step's probabilities (forced here by the evictor declaring ``probability_rows = None``,
today's path), on every decoding backend, with GQA, odd sizes, left padding, padding among the last rows, rows at
different positions, a prefill in two chunks onto a non-empty cache, prompts shorter than the window and budgets
below it; and a long prompt's T x M probabilities are never made."""

import pytest
import torch

import attnzoo
from attnzoo.backends.blocked import BlockedBackend

DECODING = ("reference", "blocked")
EVICTORS = (("snapkv", {"window": 3, "kernel": 3}), ("snapkv", {"window": 8}), ("tova", {}))
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


def variant_of(kind, backend, spec=None, **options):
    body = {"name": f"t-{kind}", "cache": {"evictor": kind, **options}}
    if spec is not None:
        body = {**attnzoo.compile(spec).spec.model_dump(exclude_none=True), **body}
    return attnzoo.compile(body, backend=backend)


def inputs(seed, b, h, hkv, n, d, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def both_paths(variant, budget, b):
    """Two caches: the evictor's rows (as declared) and the whole step's probabilities (``probability_rows`` None),
    each recording the probabilities its evictor gets."""
    caches = []
    for full in (False, True):
        cache = variant.new_cache(batch=b, budget=budget)
        seen = []
        update = cache.evictor.update

        def spy(c, probs, _update=update, _seen=seen):
            _seen.append(tuple(probs.shape))
            return _update(c, probs)

        cache.evictor.update = spy
        if full:
            cache.evictor.probability_rows = None
        caches.append((cache, seen))
    return caches


def assert_same(rows, full, outs, tol):
    (out_rows, out_full) = outs
    torch.testing.assert_close(out_rows, out_full, rtol=tol, atol=tol)
    assert torch.equal(rows.positions, full.positions)  # the same kept set, slot by slot
    if rows.valid is not None or full.valid is not None:
        assert torch.equal(rows.valid, full.valid)
    torch.testing.assert_close(rows.keys, full.keys, rtol=0, atol=0)
    for name in rows.evictor.state_names:
        torch.testing.assert_close(rows.state[name], full.state[name], rtol=tol, atol=tol)


def run(variant, cache, chunks, q, k, v):
    """Prefill the chunks ((start, stop, key_mask or None), ...), then two decoding steps; the outputs joined."""
    outs = []
    with torch.no_grad():
        for start, stop, mask in chunks:
            outs.append(variant.prefill(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], cache,
                                        key_mask=mask))
        for i in range(chunks[-1][1], q.shape[2]):
            outs.append(variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache))
    return torch.cat(outs, dim=2)


def left_padding(b, n, lengths):
    mask = torch.zeros(b, n, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, n - length:] = True
    return mask


def check(backend, kind, options, dtype, budget, chunks, b=3, h=6, hkv=2, n=23, d=5, spec=None, seed=0,
          only_rows=True):
    variant = variant_of(kind, backend, spec=spec, **options)
    q, k, v = inputs(seed, b, h, hkv, n, d, dtype)
    (rows, seen_rows), (full, seen_full) = both_paths(variant, budget, b)
    outs = (run(variant, rows, chunks, q, k, v), run(variant, full, chunks, q, k, v))
    assert_same(rows, full, outs, TOLERANCE[dtype])
    declared = rows.evictor.probability_rows
    for (start, stop, _), got, whole in zip(chunks, seen_rows, seen_full, strict=False):  # then the decoding steps
        assert whole[2] == stop - start  # the whole step's rows, as before
        if only_rows and backend != "reference":  # the oracle hands every row; settle passes the real ones on
            assert got[2] == min(stop - start, declared)  # only the declared last rows
    return seen_rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("kind", "options"), EVICTORS)
@pytest.mark.parametrize("backend", DECODING)
def test_one_prompt(backend, kind, options, dtype):
    """A whole prompt into an empty cache (GQA 6/2, D 5, N 19, budget 7), then decoding."""
    check(backend, kind, options, dtype, budget=7, chunks=((0, 19, None),))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("kind", "options"), EVICTORS)
@pytest.mark.parametrize("backend", DECODING)
def test_left_padded_prompt(backend, kind, options, dtype):
    """Rows with 17, 9, 2 and 0 real tokens of 17 (fewer real queries than the window; a row of padding only)."""
    n = 17
    mask = left_padding(4, n, (17, 9, 2, 0))
    check(backend, kind, options, dtype, budget=6, chunks=((0, n, mask),), b=4, n=n + 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("kind", "options"), EVICTORS)
@pytest.mark.parametrize("backend", DECODING)
def test_padding_among_the_last_rows(backend, kind, options, dtype):
    """Padding inside the last rows (the evictor's rows then reach further back), and at the very end."""
    n = 16
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[0, [n - 2, n - 5]] = False
    mask[1, n - 3:] = False
    mask[2, :4] = False
    mask[2, n - 1] = False
    check(backend, kind, options, dtype, budget=6, chunks=((0, n, mask),), n=n + 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("kind", "options"), EVICTORS)
@pytest.mark.parametrize("backend", DECODING)
def test_two_chunks_onto_a_non_empty_cache(backend, kind, options, dtype):
    """A left-padded first chunk (rows then at different positions), then a second chunk with padding of its own,
    onto the held tokens; budgets above and below the window."""
    first = left_padding(3, 11, (11, 6, 3))
    second = torch.ones(3, 10, dtype=torch.bool)
    second[1, 7] = False
    second[2, :2] = False
    for budget in (12, 4):
        check(backend, kind, options, dtype, budget=budget, chunks=((0, 11, first), (11, 21, second)), n=24)
    check(backend, kind, options, dtype, budget=5, chunks=((0, 9, None), (9, 21, None)), n=22, seed=3)


@pytest.mark.parametrize(("kind", "options"), EVICTORS)
@pytest.mark.parametrize("backend", DECODING)
def test_prompt_shorter_than_the_window(backend, kind, options):
    """A prompt of at most SnapKV's window: every row, as before (TOVA: its one row); budget 2, below the
    window."""
    seen = check(backend, kind, options, torch.float64, budget=2, chunks=((0, 3, None),), n=6)
    assert seen[0][2] == (3 if kind == "snapkv" or backend == "reference" else 1)  # the oracle: every row


@pytest.mark.parametrize("spec", ["alibi", "softcap", "local", "sink"])
@pytest.mark.parametrize("backend", DECODING)
def test_logits_transforms_and_masks(backend, spec):
    """The rows' probabilities under the spec's logits transforms, mask and normaliser, as the whole step's."""
    mask = left_padding(3, 18, (18, 12, 5))
    for kind, options in EVICTORS:
        check(backend, kind, options, torch.float64, budget=6, chunks=((0, 18, mask), (18, 26, None)), n=28,
              spec=spec)


@pytest.mark.parametrize("kind", ["snapkv", "tova"])
def test_a_long_prompt_never_makes_the_whole_probabilities(kind, monkeypatch):
    """A 600-token prompt on the blocked backend: the output by the prompt's one SDPA call, no (B, H, T, M)
    probabilities made (the blocks never asked for them, no softmax over more than the evictor's rows), and the
    evictor gets its rows only; the forced whole step's takes the blocks with every row, as before."""
    n, window = 600, 16
    variant = variant_of(kind, "blocked", **({"window": window} if kind == "snapkv" else {}))
    q, k, v = inputs(1, 1, 6, 2, n, 8, torch.float32)
    made, softmaxes, sdpa_rows = [], [], []
    blocks, softmax, sdpa = BlockedBackend.blocks, torch.softmax, torch.nn.functional.scaled_dot_product_attention

    def spy_blocks(self, plan, qs, *args, want_probs=False, **kwargs):
        if want_probs:
            made.append(qs.shape[2])
        return blocks(self, plan, qs, *args, want_probs=want_probs, **kwargs)

    def spy_softmax(x, *args, **kwargs):
        softmaxes.append(x.numel())
        return softmax(x, *args, **kwargs)

    def spy_sdpa(q, *args, **kwargs):
        sdpa_rows.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(BlockedBackend, "blocks", spy_blocks)
    monkeypatch.setattr(torch, "softmax", spy_softmax)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    (rows, seen), (full, seen_full) = both_paths(variant, 64, 1)
    rows_declared = window if kind == "snapkv" else 1
    with torch.no_grad():
        out = variant.prefill(q, k, v, rows)
        assert made == [] and sdpa_rows == [n] and max(softmaxes) <= 6 * rows_declared * n
        out_full = variant.prefill(q, k, v, full)
    assert made == [n]  # the forced whole step's: every row through the blocks
    assert seen == [(1, 6, rows_declared, n)] and seen_full == [(1, 6, n, n)]
    torch.testing.assert_close(out, out_full, rtol=2e-5, atol=2e-5)
    assert torch.equal(rows.positions, full.positions)


def test_an_accumulator_keeps_the_whole_step():
    """Selective attention's F ties a query's probabilities to the step's earlier queries: TOVA over it gets the
    whole step's probabilities (the reference, the oracle, hands every step's), the same kept set as before."""
    for backend in DECODING:
        seen = check(backend, "tova", {}, torch.float64, budget=6, chunks=((0, 14, None), (14, 20, None)), n=22,
                     spec="selective", only_rows=False)
        assert seen[0][2] == 14

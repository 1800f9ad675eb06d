"""The prompt scorers as evictors (attnzoo/evictors/scorers.py): SnapKV, KNorm, KeyDiff.

Each rule is computed here by hand with plain torch (softmax, avg/max_pool1d, norms, cosines, topk), never through
the evictor's own code, on tiny caches; then decode against prefill, the reference against the blocked backend,
left padding against each row alone, ties, and the conformance suite on the shipped specs.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.cache import KVCache
from attnzoo.evictors.scorers import KeyDiff, KNorm, SnapKV

DECODING = ("reference", "blocked")


def variant_of(kind, backend="reference", **options):
    return attnzoo.compile({"name": f"t-{kind}", "cache": {"evictor": kind, **options}}, backend=backend)


def inputs(seed, b=2, h=4, hkv=2, n=20, d=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
    return q, k, v


def kept(cache):
    """(B, H_kv) lists of the kept positions, sorted."""
    pos = cache.positions
    return [[sorted(pos[i, j].tolist()) for j in range(pos.shape[1])] for i in range(pos.shape[0])]


def full_probs(q, k):
    """Causal softmax probabilities (B, H, N, N) of every query over every key, keys repeated over the group."""
    g = q.shape[1] // k.shape[1]
    kr = k.repeat_interleave(g, dim=1)
    logits = q @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1)


def attend(q, k, v):
    """One query's output over the given keys (no mask): q (D,), k, v (M, D)."""
    w = (k @ q / math.sqrt(q.shape[-1])).softmax(-1)
    return w @ v


# -- SnapKV by hand --------------------------------------------------------------------------------------------
def snapkv_by_hand(q, k, window, kernel, pool):
    """SnapKV's prompt scores as kvpress computes them: the last `window` queries' probabilities over the prompt
    (summed over those queries and over the group), the window's own keys left out, pooled with zero padding."""
    b, h, n, _ = q.shape
    hkv = k.shape[1]
    probs = full_probs(q, k)
    raw = probs[:, :, n - window:].sum(2).reshape(b, hkv, h // hkv, n).sum(2)
    prefix = raw[..., :n - window].reshape(b * hkv, 1, n - window)
    if pool == "avg":
        pooled = F.avg_pool1d(prefix, kernel, stride=1, padding=kernel // 2)  # count_include_pad: / kernel
    else:
        pooled = F.max_pool1d(prefix, kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(b, hkv, n - window), probs


@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize("pool", ["avg", "max"])
def test_snapkv_prefill_keeps_the_prompt_snapkv_names(pool, backend):
    window, kernel, budget, n = 4, 3, 10, 20
    q, k, v = inputs(1, n=n)
    variant = variant_of("snapkv", backend, window=window, kernel=kernel, pool=pool)
    cache = variant.new_cache(batch=2, budget=budget)
    out = variant.prefill(q, k, v, cache)
    torch.testing.assert_close(out, variant(q, k, v), rtol=0, atol=1e-12)  # every prompt query saw every key
    pooled, _ = snapkv_by_hand(q, k, window, kernel, pool)
    window_positions = list(range(n - window + 1, n + 1))
    want = []
    for i in range(2):
        want.append([])
        for j in range(2):  # evict the smallest (max pooling ties neighbours: the oldest of a tie goes)
            ranked = sorted((float(pooled[i, j, s]), s + 1) for s in range(n - window))
            top = [p for _, p in ranked[n - budget:]]
            want[-1].append(sorted(top + window_positions))
    assert kept(cache) == want
    if pool == "avg":  # the stored score of a kept prompt token is its pooled score (divided by the kernel)
        pos = cache.positions
        scored = pos <= n - window
        got = cache.state["score"][scored]
        expect = pooled.gather(-1, (pos.clamp(max=n - window) - 1))[scored]
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("decode", ["pooled", "accumulate"])
def test_snapkv_decoding_adds_each_generated_query(decode):
    """Prefill 20 tokens at budget 10 (window 4, avg kernel 3), then one generated token, all by hand: the new query
    attends over the 10 kept and itself; its attention (summed over the group) is added to the prompt's scores:
    ``pooled``: the newest 4 positions left out, pooled by position over the held tokens (an evicted neighbour counts
    0); ``accumulate``: as it is, every held token (H2O's rule); the smallest unprotected score goes."""
    window, kernel, budget, n, d = 4, 3, 10, 20, 8
    q, k, v = inputs(2, n=n + 1)
    variant = variant_of("snapkv", window=window, kernel=kernel, decode=decode)
    cache = variant.new_cache(batch=2, budget=budget)
    variant.prefill(q[:, :, :n], k[:, :, :n], v[:, :, :n], cache)
    held = kept(cache)
    prompt_scores = [[dict(zip(cache.positions[i, j].tolist(), cache.state["score"][i, j].tolist(), strict=True))
                      for j in range(2)] for i in range(2)]
    out = variant.decode(q[:, :, n:], k[:, :, n:], v[:, :, n:], cache)
    _, probs = snapkv_by_hand(q[:, :, :n], k[:, :, :n], window, kernel, "avg")
    for i in range(2):
        for j in range(2):
            positions = held[i][j] + [n + 1]
            idx = torch.tensor(positions) - 1
            raw = torch.zeros(len(positions), dtype=torch.float64)
            for head in (2 * j, 2 * j + 1):
                new = (k[i, j, idx] @ q[i, head, n] / math.sqrt(d)).softmax(-1)
                torch.testing.assert_close(out[i, head, 0], new @ v[i, j, idx], rtol=0, atol=1e-12)
                raw += new
            protected = [p > n + 1 - window for p in positions]
            if decode == "pooled":
                raw = torch.where(torch.tensor(protected), torch.zeros(()), raw)
            by_position = dict(zip(positions, raw.tolist(), strict=True))
            # the prompt's score: its last `window` queries' attention, its newest `window` keys left out, pooled
            prompt_raw = {p: float(probs[i, 2 * j:2 * j + 2, n - window:, p - 1].sum()) if p <= n - window else 0.0
                          for p in range(1, n + 1)}
            before = [sum(prompt_raw.get(p + o, 0.0) for o in range(-(kernel // 2), kernel // 2 + 1)) / kernel
                      if p <= n else 0.0 for p in positions]
            for p, s in zip(positions[:-1], before[:-1], strict=True):
                assert abs(prompt_scores[i][j][p] - s) < 1e-12
            if decode == "pooled":
                total = [before[s] + sum(by_position.get(p + o, 0.0) for o in range(-(kernel // 2), kernel // 2 + 1))
                         / kernel for s, p in enumerate(positions)]
            else:
                total = [before[s] + by_position[p] for s, p in enumerate(positions)]
            candidates = [(total[s], positions[s]) for s in range(len(positions)) if not protected[s]]
            victim = min(candidates)[1]
            assert kept(cache)[i][j] == [p for p in positions if p != victim], (i, j)
            score = cache.state["score"][i, j]
            for s, p in enumerate(cache.positions[i, j].tolist()):
                assert abs(float(score[s]) - total[positions.index(p)]) < 1e-12


def test_snapkv_holds_one_score_per_token():
    """Bytes: SnapKV keeps one float per held token beside its key and value, as H2O does (not its window's rows)."""
    q, k, v = inputs(3, n=40)
    cache = variant_of("snapkv", window=8, kernel=3).new_cache(batch=2, budget=12)
    variant_of("snapkv", window=8, kernel=3).prefill(q, k, v, cache)
    assert list(cache.state) == ["score"]
    kv = cache.keys.numel() * cache.keys.element_size() * 2
    per_token = cache.positions.numel() * (8 + 8)  # position (int64) + score (float64 for float64 keys)
    assert cache.nbytes == kv + per_token


def test_snapkv_ties_go_to_the_oldest_and_the_window_is_kept():
    ev = SnapKV(SnapKV.options_model()(evictor="snapkv", budget=4, window=2))
    cache = KVCache(batch=1, budget=4, evictor=ev, state_names=ev.state_names)
    cache.keys = cache.values = torch.zeros(1, 1, 5, 2, dtype=torch.float64)
    cache.positions = torch.tensor([[[1, 3, 4, 6, 7]]])
    cache.state = {name: torch.zeros(1, 1, 5, dtype=torch.float64) for name in ev.state_names}
    cache.state["score"] = torch.tensor([[[2.0, 1.0, 1.0, 0.0, 0.0]]])
    assert ev.protected(cache).tolist() == [[[False, False, False, True, True]]]  # positions > 7 - 2
    assert ev.victim(cache).item() == 1  # the tie 1.0 at positions 3 and 4: the oldest; 6 and 7 are protected


def test_snapkv_pooling_by_position_ties_tokens_with_the_same_neighbours():
    """Three prompt tokens within one kernel of each other pool the same three probabilities: an exact tie,
    whatever the order of the terms, so the oldest goes."""
    variant = variant_of("snapkv", window=2, kernel=7)
    q, k, v = inputs(3, b=1, h=2, hkv=1, n=5)
    cache = variant.new_cache(batch=1, budget=4)
    variant.prefill(q, k, v, cache)
    assert kept(cache) == [[[2, 3, 4, 5]]]  # positions 1-3 all pool positions 1-3: tied, position 1 goes


# -- KNorm and KeyDiff by hand ---------------------------------------------------------------------------------
def knorm_by_hand(k):
    return -k.norm(dim=-1)  # kvpress's KnormPress score: the highest are kept


def keydiff_by_hand(k):
    anchor = F.normalize(k, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(k, anchor, dim=-1)  # kvpress's KeyDiffPress score: the highest are kept


@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize(("kind", "by_hand"), [("knorm", knorm_by_hand), ("keydiff", keydiff_by_hand)])
def test_key_scorers_prefill_keep_what_kvpress_keeps(kind, by_hand, backend):
    budget, n = 7, 12
    q, k, v = inputs(4, n=n)
    variant = variant_of(kind, backend)
    cache = variant.new_cache(batch=2, budget=budget)
    out = variant.prefill(q, k, v, cache)
    torch.testing.assert_close(out, variant(q, k, v), rtol=0, atol=1e-12)
    top = by_hand(k).topk(budget, dim=-1).indices + 1
    assert kept(cache) == [[sorted(top[i, j].tolist()) for j in range(2)] for i in range(2)]


@pytest.mark.parametrize(("kind", "by_hand"), [("knorm", knorm_by_hand), ("keydiff", keydiff_by_hand)])
def test_key_scorers_decode_step_by_hand(kind, by_hand):
    """After the prefill, a generated token joins the held keys and the rule drops one of budget + 1 (KeyDiff's
    anchor: the held keys and the new one), after the new query attended over all of them."""
    budget, n = 7, 12
    q, k, v = inputs(5, n=n + 1)
    variant = variant_of(kind)
    cache = variant.new_cache(batch=2, budget=budget)
    variant.prefill(q[:, :, :n], k[:, :, :n], v[:, :, :n], cache)
    held = kept(cache)
    out = variant.decode(q[:, :, n:], k[:, :, n:], v[:, :, n:], cache)
    for i in range(2):
        for j in range(2):
            positions = held[i][j] + [n + 1]
            idx = torch.tensor(positions) - 1
            for head in (2 * j, 2 * j + 1):
                torch.testing.assert_close(out[i, head, 0], attend(q[i, head, n], k[i, j, idx], v[i, j, idx]),
                                           rtol=0, atol=1e-12)
            score = by_hand(k[i, j, idx].unsqueeze(0).unsqueeze(0))[0, 0]
            victim = positions[int(score.argmin())]
            assert kept(cache)[i][j] == [p for p in positions if p != victim]


def test_knorm_sink_keeps_the_first_positions():
    k = torch.ones(1, 1, 10, 4, dtype=torch.float64)
    k[0, 0, :3] *= 10  # the three largest norms are the first three
    variant = variant_of("knorm", sink=2)
    cache = variant.new_cache(batch=1, budget=5)
    variant.prefill(k.clone(), k, k.clone(), cache)
    assert kept(cache) == [[[1, 2, 8, 9, 10]]]  # position 3 (the largest) goes, then the oldest of the ties


@pytest.mark.parametrize("cls", [KNorm, KeyDiff])
def test_equal_keys_tie_to_the_oldest(cls):
    ev = cls(cls.options_model()(evictor=cls.kind, budget=3))
    cache = KVCache(batch=1, budget=3, evictor=ev, state_names=ev.state_names)
    cache.keys = torch.tensor([[[[1.0, 2.0], [3.0, 0.5], [1.0, 2.0], [3.0, 0.5]]]], dtype=torch.float64)
    cache.values = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    cache.positions = torch.tensor([[[2, 3, 5, 8]]])
    cache.state = {name: torch.zeros(1, 1, 4, dtype=torch.float64) for name in ev.state_names}
    ev.update(cache, None)
    # equal keys score bitwise equal; the victim is the oldest slot of the largest score (KNorm: position 3)
    score = ev.score(cache)[0, 0].tolist()
    assert score[0] == score[2] and score[1] == score[3]
    assert ev.victim(cache).item() == score.index(max(score))
    if cls is KNorm:
        assert ev.victim(cache).item() == 1


# -- properties --------------------------------------------------------------------------------------------------
SCORERS = [("snapkv", {"window": 3, "kernel": 3}), ("snapkv", {"window": 2, "kernel": 5, "pool": "max"}),
           ("knorm", {}), ("knorm", {"sink": 1}), ("keydiff", {}), ("keydiff", {"sink": 1, "recent": 2})]
#: scorers whose scores do not depend on how a prompt is cut into steps (SnapKV's step adds its last queries only)
CHUNK_FREE = [case for case in SCORERS if case[0] != "snapkv"]


@pytest.mark.parametrize(("kind", "options"), CHUNK_FREE)
def test_decode_equals_prefill_while_nothing_is_evicted(kind, options):
    """Token by token or in two chunks, a prompt within the budget gives the same outputs, positions and scores
    as one prefill (SnapKV's scores depend on the steps by its rule: a step adds its last `window` queries)."""
    q, k, v = inputs(6, n=14)
    variant = variant_of(kind, **options)
    results = []
    for chunks in ((14,), (5, 9), (1,) * 14):
        cache = variant.new_cache(batch=2, budget=14)
        outs, at = [], 0
        for size in chunks:
            s = slice(at, at + size)
            outs.append(variant.prefill(q[:, :, s], k[:, :, s], v[:, :, s], cache))
            at += size
        results.append((torch.cat(outs, 2), cache))
    for out, cache in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=1e-12)
        assert torch.equal(cache.positions, results[0][1].positions)
        for name in cache.state:
            torch.testing.assert_close(cache.state[name], results[0][1].state[name], rtol=0, atol=1e-12)


def test_knorm_decode_keeps_what_one_prefill_keeps():
    """A score of the key alone and no window: keeping the budget's smallest norms one token at a time keeps the
    same tokens as one prefill (the outputs differ: the queries saw other keys)."""
    q, k, v = inputs(7, n=30)
    variant = variant_of("knorm")
    one, stepwise = variant.new_cache(batch=2, budget=9), variant.new_cache(batch=2, budget=9)
    variant.prefill(q, k, v, one)
    for i in range(30):
        variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], stepwise)
    assert kept(one) == kept(stepwise)


@pytest.mark.parametrize(("kind", "options"), SCORERS)
def test_reference_and_blocked_keep_the_same_tokens(kind, options):
    q, k, v = inputs(8, n=40)
    runs = []
    for backend in DECODING:
        variant = variant_of(kind, backend, **options)
        cache = variant.new_cache(batch=2, budget=8)
        outs, positions = [variant.prefill(q[:, :, :15], k[:, :, :15], v[:, :, :15], cache)], [kept(cache)]
        for i in range(15, 40):
            outs.append(variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache))
            positions.append(kept(cache))
        runs.append((torch.cat(outs, 2), positions, {n: t.clone() for n, t in cache.state.items()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=1e-10)
    assert runs[1][1] == runs[0][1]
    for name, t in runs[0][2].items():
        torch.testing.assert_close(runs[1][2][name], t, rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize(("kind", "options"), SCORERS)
def test_a_padded_row_keeps_what_it_keeps_alone(kind, options, backend):
    """Rows behind 0, 3 and 6 padding tokens, the prompt in two chunks (evicting), then decoding: each row's
    outputs, kept positions and scores equal the row decoded alone."""
    lengths, prompt, steps, budget = (16, 13, 10), 16, 10, 8
    b, n = len(lengths), prompt + steps
    q, k, v = inputs(9, b=b, n=n)
    key_mask = torch.zeros(b, prompt, dtype=torch.bool)
    for row, length in enumerate(lengths):
        key_mask[row, prompt - length:] = True
    variant = variant_of(kind, backend, **options)

    def run(qs, ks, vs, cache, mask, first):
        outs = [variant.prefill(qs[:, :, :first], ks[:, :, :first], vs[:, :, :first], cache,
                                key_mask=None if mask is None else mask[:, :first]),
                variant.prefill(qs[:, :, first:prompt_of(qs)], ks[:, :, first:prompt_of(qs)],
                                vs[:, :, first:prompt_of(qs)], cache,
                                key_mask=None if mask is None else mask[:, first:])]
        for i in range(prompt_of(qs), qs.shape[2]):
            outs.append(variant.decode(qs[:, :, i:i + 1], ks[:, :, i:i + 1], vs[:, :, i:i + 1], cache))
        return torch.cat(outs, 2)

    def prompt_of(qs):
        return qs.shape[2] - steps

    cache = variant.new_cache(batch=b, budget=budget)
    with torch.no_grad():
        batched = run(q, k, v, cache, key_mask, 9)
    for row, length in enumerate(lengths):
        pad = prompt - length
        alone = variant.new_cache(batch=1, budget=budget)
        with torch.no_grad():
            out = run(*(t[row:row + 1, :, pad:] for t in (q, k, v)), alone, None, 9 - pad)
        torch.testing.assert_close(batched[row:row + 1, :, pad:], out, rtol=0, atol=1e-10)
        real = cache.valid is None or bool(cache.valid[row].all())
        assert real
        assert kept(cache)[row] == kept(alone)[0]
        for name in alone.state:
            torch.testing.assert_close(cache.state[name][row], alone.state[name][0], rtol=0, atol=1e-10)


def test_options_and_budgets_are_checked():
    with pytest.raises(ValueError, match="odd"):
        variant_of("snapkv", kernel=4)
    with pytest.raises(ValueError, match="budget >= 2"):
        attnzoo.compile({"name": "s", "cache": {"evictor": "snapkv", "budget": 1, "window": 8}})
    for kind in ("knorm", "keydiff"):
        with pytest.raises(ValueError, match="sink"):
            attnzoo.compile({"name": "s", "cache": {"evictor": kind, "budget": 3, "sink": 3}})
    assert SnapKV.independent_scores and KNorm.independent_scores and KeyDiff.independent_scores
    assert SnapKV.needs_probabilities and not KNorm.needs_probabilities and not KeyDiff.needs_probabilities


# -- the shipped specs through the conformance suite -----------------------------------------------------------
@pytest.mark.parametrize("backend", DECODING)
@pytest.mark.parametrize("spec", ["snapkv", "knorm", "keydiff"])
def test_scorer_specs_pass_conformance(spec, backend):
    from attnzoo.conformance import runner

    cases = runner.build_cases(attnzoo.get_registry(), [spec], [backend], (torch.float64, torch.float32),
                               profile="quick")
    results = runner.run_suite(cases)
    assert not runner.failed(results), runner.summary(results)


@pytest.mark.parametrize("backend", DECODING)
def test_snapkv_window_counts_only_a_rows_real_queries(backend):
    """A chunk that pads a row after it has real tokens (padding queries first, then real ones): the row's step adds
    its real queries only, as the same step does alone."""
    q, k, v = inputs(10, b=2, n=9)
    variant = variant_of("snapkv", backend, window=4, kernel=3)
    cache = variant.new_cache(batch=2, budget=30)
    variant.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache)
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    variant.prefill(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], cache, key_mask=mask)
    alone = variant.new_cache(batch=1, budget=30)
    variant.prefill(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5], alone)
    variant.prefill(q[:1, :, 7:], k[:1, :, 7:], v[:1, :, 7:], alone)
    real = cache.valid[0, 0]
    for name in alone.state:
        torch.testing.assert_close(cache.state[name][0][:, real], alone.state[name][0], rtol=0, atol=1e-12)
    assert float(alone.state["score"].abs().sum()) > 0


@pytest.mark.parametrize("pool", ["avg", "max"])
@pytest.mark.parametrize("positions", [[1, 2, 3, 10, 11, 13, 50], [1, 2, 3, 1000, 1001, 1003, 5000]],
                         ids=["dense", "search"])
def test_pooling_by_position_by_hand(positions, pool):
    """Both ways the pooling finds neighbours (a dense row of positions; a search when they are far apart) pool
    each token over the held positions within kernel // 2, an absent position counting 0."""
    from attnzoo.evictors.scorers import pool_by_position

    gen = torch.Generator().manual_seed(11)
    raw = torch.rand(2, 3, len(positions), generator=gen, dtype=torch.float64)
    pos = torch.tensor(positions).expand(2, 3, -1).contiguous()
    got = pool_by_position(raw, pos, 5, pool)
    for i in range(2):
        for j in range(3):
            at = dict(zip(positions, raw[i, j].tolist(), strict=True))
            for s, p in enumerate(positions):
                near = [at.get(p + o, 0.0) for o in range(-2, 3)]
                want = sum(near) / 5 if pool == "avg" else max(near)
                assert abs(float(got[i, j, s]) - want) < 1e-15


def test_snapkv_under_a_budget_within_its_window_keeps_budget_minus_one():
    """Budget 4 with window 8: the last 3 queries score and the newest 3 positions are kept, so one prompt token
    stays, the one those 3 queries attend to most (kernel 1: no pooling), as SnapKV with window 3 keeps it."""
    q, k, v = inputs(12, n=12)
    small = variant_of("snapkv", window=8, kernel=1)
    cache = small.new_cache(batch=2, budget=4)
    small.prefill(q, k, v, cache)
    pooled, _ = snapkv_by_hand(q, k, 3, 1, "avg")
    want = [[sorted([int(pooled[i, j].argmax()) + 1, 10, 11, 12]) for j in range(2)] for i in range(2)]
    assert kept(cache) == want


@pytest.mark.parametrize("kind", ["knorm", "keydiff"])
def test_key_scorers_recent_keeps_the_newest_positions(kind):
    """recent: 3 keeps positions n-2..n whatever their keys; the other budget - 3 are the rule's among the rest
    (KNorm: the smallest norms)."""
    q, k, v = inputs(13, n=12)
    k[:, :, -3:] *= 50  # the newest keys have the largest norms: without `recent` KNorm would drop them first
    variant = variant_of(kind, recent=3)
    cache = variant.new_cache(batch=2, budget=6)
    variant.prefill(q, k, v, cache)
    for i in range(2):
        for j in range(2):
            assert kept(cache)[i][j][-3:] == [10, 11, 12]
            if kind == "knorm":
                rest = k[i, j, :9].norm(dim=-1).argsort()[:3] + 1
                assert kept(cache)[i][j][:3] == sorted(rest.tolist())
    with pytest.raises(ValueError, match="recent"):
        variant.new_cache(batch=1, budget=3)

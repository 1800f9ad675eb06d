"""Decoding with a KV cache: equals the batch form, evictors choose as specified, known bugs are caught."""

import pytest
import torch
from broken import EvictsBosOnTie, EvictsNewest, registry_replacing, registry_with_broken_backends

import attnzoo
from attnzoo.cache import KVCache
from attnzoo.decode import fast as fast_steps
from attnzoo.decode import fused_build
from attnzoo.evictors.builtin import H2O, TOVA, Selective, SinkWindow

SHIPPED = sorted(attnzoo.get_registry().specs)



def perturbed_params(variant, h, d, hkv, scale=0.5):
    params = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    return {key: value + scale * torch.randn_like(value) for key, value in params.items()}


def decode_all(variant, q, k, v, cache, params=None):
    return torch.cat([variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params)
                      for i in range(q.shape[2])], dim=2)


def check_decode_matches_batch(spec, n=63, h=4, hkv=2, d=8, backend="reference", registry=None, budget=None):
    variant = attnzoo.compile(spec, backend=backend, registry=registry)
    q = torch.randn(2, h, n, d, dtype=torch.float64)
    k, v = torch.randn(2, 2, hkv, n, d, dtype=torch.float64)
    params = perturbed_params(variant, h, d, hkv)
    full = variant(q, k, v, params=params)
    cache = variant.new_cache(batch=2, budget=budget)
    steps = decode_all(variant, q, k, v, cache, params)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12)
    return cache


# -- evictor choices, hand cases ----------------------------------------------------------------------------------
def cache_with(positions, **state):
    m = len(positions)
    cache = KVCache(batch=1, budget=m - 1)
    cache.keys = cache.values = torch.zeros(1, 1, m, 1, dtype=torch.float64)
    cache.positions = torch.tensor(positions).view(1, 1, m)
    cache.state = {k: torch.tensor(v, dtype=torch.float64).view(1, 1, m) for k, v in state.items()}
    return cache


def opts(cls, **kw):
    return cls(cls.options_model()(evictor=cls.kind, **kw))


def test_selective_evicts_largest_f_never_bos_ties_to_oldest():
    assert opts(Selective).victim(cache_with([1, 2, 3, 4, 5], accumulated=[5, 1, 3, 3, 0])).item() == 2
    assert opts(Selective).victim(cache_with([1, 2, 3, 4], accumulated=[0, 0, 0, 0])).item() == 1  # not BOS
    assert opts(Selective).victim(cache_with([1, 4, 7], accumulated=[9, 2, 2.5])).item() == 2


def test_h2o_evicts_lowest_accumulated_attention_outside_the_recent_window():
    cache = cache_with([1, 2, 3, 4, 5], attention=[0.9, 0.1, 0.5, 0.0, 0.0])
    cache.budget = 4
    assert opts(H2O, recent=2).victim(cache).item() == 1  # positions 4, 5 are recent
    assert opts(H2O, recent=0).victim(cache).item() == 3  # tie 0.0 at positions 4 and 5 -> oldest


def test_tova_evicts_lowest_current_attention():
    assert opts(TOVA).victim(cache_with([1, 2, 3, 4], last_attention=[0.3, 0.1, 0.1, 0.5])).item() == 1


def test_sink_window_evicts_oldest_after_the_sinks():
    assert opts(SinkWindow, sink=2).victim(cache_with([1, 2, 3, 4, 5])).item() == 2
    assert opts(SinkWindow, sink=2).victim(cache_with([1, 2, 4, 5, 6])).item() == 2
    assert opts(SinkWindow, sink=0).victim(cache_with([3, 4, 5])).item() == 0


def test_sink_window_keeps_sinks_and_recent_tokens():
    x = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    variant = attnzoo.compile("streaming")
    cache = variant.new_cache(batch=1, budget=6)
    decode_all(variant, x, x, x, cache)
    assert cache.positions[0, 0].tolist() == [1, 2, 3, 4, 8, 9]
    assert cache.num_tokens == 6 and cache.evicted == 3
    assert cache.nbytes == 2 * (1 * 2 * 6 * 4 * 8) + 1 * 2 * 6 * 8


def test_h2o_keeps_per_head_sets():
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 1, 4, 20, 8, dtype=torch.float64)
    variant = attnzoo.compile({"name": "h", "cache": {"evictor": "h2o"}})
    cache = variant.new_cache(batch=1, budget=8)
    decode_all(variant, q, k, v, cache)
    kept = cache.positions[0]
    assert kept.shape == (4, 8)
    assert bool((kept.sort(-1).values[:, -4:] == torch.arange(17, 21)).all())  # recent = budget // 2
    assert len({tuple(row.tolist()) for row in kept}) > 1  # heads keep different heavy hitters


# -- properties -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SHIPPED)
def test_decode_equals_batch_without_budget(spec):
    check_decode_matches_batch(spec)


@pytest.mark.parametrize("n", [1, 2, 63])
def test_decode_equals_batch_odd_lengths(n):
    check_decode_matches_batch("selective-ssa", n=n)


@pytest.mark.parametrize("spec", ["selective-pruned", "h2o", "tova", "streaming", "selective-ssa"])
def test_budget_at_least_n_changes_nothing(spec):
    cache = check_decode_matches_batch(spec, n=40, budget=40)
    assert cache.evicted == 0 and cache.num_tokens == 40


def test_prefill_then_decode_equals_batch():
    variant = attnzoo.compile("selective-ssa")
    q = torch.randn(1, 4, 30, 8, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 30, 8, dtype=torch.float64)
    params = perturbed_params(variant, 4, 8, 2)
    cache = variant.new_cache(batch=1, budget=None)
    first = variant.prefill(q[:, :, :17], k[:, :, :17], v[:, :, :17], cache, params=params)
    rest = decode_all(variant, q[:, :, 17:], k[:, :, 17:], v[:, :, 17:], cache, params)
    torch.testing.assert_close(torch.cat([first, rest], 2), variant(q, k, v, params=params), rtol=0, atol=1e-12)


def check_bos_kept(registry=None, n=40, budget=5):
    variant = attnzoo.compile("selective-pruned", registry=registry)
    q = torch.randn(2, 2, n, 4, dtype=torch.float64)
    zeros = torch.zeros(2, 2, n, 4, dtype=torch.float64)  # all logits 0: every F is 0, every eviction a tie
    for keys in (torch.randn(2, 2, n, 4, dtype=torch.float64), zeros):
        cache = variant.new_cache(batch=2, budget=budget)
        for i in range(n):
            variant.decode(q[:, :, i:i + 1], keys[:, :, i:i + 1], keys[:, :, i:i + 1], cache)
            assert bool((cache.positions[..., 0] == 1).all()), f"BOS evicted at step {i + 1}"
        assert cache.num_tokens == budget


def test_bos_is_never_evicted():
    check_bos_kept()


def test_bos_evicted_on_a_tie_is_caught():
    with pytest.raises(AssertionError, match="BOS evicted"):
        check_bos_kept(registry_replacing("selective", EvictsBosOnTie, "evictors"))


def check_selective_eviction_is_max_f(registry=None):
    """With a budget, the selective evictor must drop exactly the token a brute-force max-F rule drops."""
    variant = attnzoo.compile("selective-pruned", registry=registry)
    q, k, v = torch.randn(3, 1, 2, 24, 4, dtype=torch.float64)
    cache = variant.new_cache(batch=1, budget=6)
    for i in range(24):
        before = cache.positions.clone() if cache.positions is not None else None
        f_before = cache.state["accumulated"].clone() if cache.state else None
        variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
        if before is not None and before.shape[2] == 6:
            pos, f = before[0, 0].tolist(), f_before[0, 0].tolist()
            best = max(f[j] for j in range(6) if pos[j] != 1)
            expected = min(pos[j] for j in range(6) if pos[j] != 1 and f[j] == best)
            assert expected not in cache.positions[0, 0].tolist(), f"step {i + 1}: kept {expected} (max F)"


def test_selective_evictor_drops_max_f():
    check_selective_eviction_is_max_f()


def test_evictor_dropping_newest_is_caught():
    with pytest.raises(AssertionError, match="max F"):
        check_selective_eviction_is_max_f(registry_replacing("selective", EvictsNewest, "evictors"))


@pytest.mark.parametrize("backend, spec", [("broken_zero_f_decode", "selective"),
                                           ("broken_position_collapse", "ssa-position"),
                                           ("broken_position_collapse", "ssa")])
def test_decoding_bugs_are_caught(backend, spec):
    with pytest.raises(AssertionError):
        check_decode_matches_batch(spec, n=20, backend=backend, registry=registry_with_broken_backends())


def test_cache_errors_are_clear():
    variant = attnzoo.compile("selective-pruned")
    with pytest.raises(ValueError, match="needs budget >= 2"):
        variant.new_cache(batch=1, budget=1)
    with pytest.raises(ValueError, match="no cache evictor"):
        attnzoo.compile("vanilla").new_cache(batch=1, budget=4)
    cache = variant.new_cache(batch=2)
    x = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="cache was made for batch 2"):
        variant.decode(x, x, x, cache)
    with pytest.raises(ValueError, match="decode takes one token"):
        variant.decode(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), cache)
    with pytest.raises(ValueError, match="not causal"):
        attnzoo.compile({"name": "bi", "attention": {"causal": False}}).new_cache(batch=1)


# -- numerics contract (docs/backends.md): position terms and accumulated state in at least float32 ----------------
@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_float16_decoding_past_position_65520_stays_finite(backend):
    """SSA's log(position) in float16 is inf from position 65,520 on; decoding there must stay finite and close
    to float64 (the position term is computed in float32)."""
    n, start = 40, 65_500
    q, k, v = (torch.randn(1, 2, n, 8).half() for _ in range(3))
    variant = attnzoo.compile("ssa", backend=backend)
    params = {key: (value + 0.3 * torch.randn_like(value)).half() for key, value in
              variant.init_params(num_heads=2, head_dim=8).items()}
    params["query_temperature.position_logit"] = torch.tensor(0.3).half()  # c ≈ 0.26: t_q ≈ 3.9 here
    wide = {key: value.double() for key, value in params.items()}
    truth = attnzoo.compile("ssa", backend="reference")(q.double(), k.double(), v.double(), params=wide,
                                                        positions=torch.arange(start, start + n))
    cache = variant.new_cache(batch=1)
    cache.next_position = start  # as if 65,499 tokens had been decoded before
    steps = decode_all(variant, q, k, v, cache, params)
    assert cache.positions[0, 0, -1] == start + n - 1
    assert steps.dtype == torch.float16 and bool(torch.isfinite(steps).all())
    torch.testing.assert_close(steps.double(), truth, rtol=0, atol=4e-3 * float(truth.abs().max()))


def f_relative_error(backend, spec, name, steps=200):
    """Decode ``steps`` bfloat16 tokens (no budget) and the same tokens in float64; return the bfloat16 cache's
    state ``name`` and max |state - state_float64| / max |state_float64|."""
    q, k, v = (torch.randn(1, 2, steps, 8).bfloat16() for _ in range(3))
    variant = attnzoo.compile(spec, backend=backend)
    caches = []
    for dtype in (torch.bfloat16, torch.float64):
        cache = variant.new_cache(batch=1, budget=None)
        decode_all(variant, q.to(dtype), k.to(dtype), v.to(dtype), cache)
        caches.append(cache.state[name])
    low, truth = caches
    return low, float((low.double() - truth).abs().max() / truth.abs().max())


@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("spec, name", [("selective-pruned", "accumulated"), ("h2o", "attention")])
def test_bfloat16_decoding_accumulates_state_in_float32(backend, spec, name):
    """F (and an evictor's running scores) summed in bfloat16 lose the small increments once the total is large:
    2.4% off after 200 steps (F ≈ 120). Kept in float32 they stay within bfloat16's per-step rounding."""
    state, error = f_relative_error(backend, spec, name)
    assert error < 1e-2, error  # measured: 4e-4 (F), 7e-4 (h2o); in bfloat16 2.4e-2 and 0.13
    assert state.dtype == torch.float32


# -- per-token features in the cache (the forgetting gate's running D) --------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("evictor", [{"evictor": "sink_window", "sink": 1}, {"evictor": "h2o", "recent": 2}])
def test_forgetting_decode_keeps_d_running_across_evictions(backend, evictor):
    """Each step, by hand: the query at position i attends the keys the cache holds after the step (H2O: before
    the step, and the new one; it evicts after attending), with logits
    q.k / sqrt(d) + D_i - D_j, where D_t = sum_{s <= t} log sigmoid(w_h . k_s + b_h) runs over every token, the
    evicted ones included (float64, GQA, per-head eviction for H2O)."""
    torch.manual_seed(5)
    spec = {"name": "forget-window", "transforms": [{"kind": "forgetting_gate", "bias_init": 1.0}],
            "cache": {"budget": 8, **evictor}}
    variant = attnzoo.compile(spec, backend=backend)
    b, h, hkv, n, d = 2, 4, 2, 30, 8
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = torch.randn(2, b, hkv, n, d, dtype=torch.float64)
    params = perturbed_params(variant, h, d, hkv)
    w, bias = params["forgetting_gate.weight"], params["forgetting_gate.bias"]
    kh = k.repeat_interleave(h // hkv, dim=1)
    dsum = torch.nn.functional.logsigmoid(torch.einsum("bhnd,hd->bhn", kh, w) + bias[:, None]).cumsum(-1)
    cache = variant.new_cache(batch=b)
    for i in range(n):
        before = cache.positions.clone() if i else torch.zeros(b, hkv, 0, dtype=torch.int64)
        got = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params)
        seen = torch.cat([before, torch.full((b, hkv, 1), i + 1)], 2) if "h2o" in evictor.values() \
            else cache.positions
        kept = (seen - 1).repeat_interleave(h // hkv, dim=1)  # (B, H, M) 0-based token indices
        keys, vals = kh.gather(2, kept[..., None].expand(-1, -1, -1, d)), \
            v.repeat_interleave(h // hkv, dim=1).gather(2, kept[..., None].expand(-1, -1, -1, d))
        logits = (q[:, :, i:i + 1] * keys).sum(-1) / d ** 0.5 + dsum[:, :, i:i + 1] - dsum.gather(2, kept)
        want = (torch.softmax(logits, -1)[..., None] * vals).sum(2, keepdim=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"step {i + 1}")
    assert cache.num_tokens == 8 and cache.evicted == n - 8


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_a_window_cache_drops_what_no_later_query_sees_and_decodes_exactly(backend):
    """A sliding-window spec (with softcap and a learned sink): prefill then decode a left-padded batch; the
    outputs equal the float64 batch form, and between steps the cache holds window - 1 tokens per row."""
    torch.manual_seed(0)
    window = 4
    spec = {"name": "w", "transforms": [{"kind": "sliding_window", "window": window}, {"kind": "softcap", "cap": 5.0},
                                        {"kind": "attention_sink"}]}
    variant = attnzoo.compile(spec, backend=backend)
    b, h, hkv, d, n = 2, 4, 2, 8, 13
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :3] = False
    params = variant.init_params(h, d, hkv, dtype=torch.float64)
    params["attention_sink.sink"] = torch.randn(h, dtype=torch.float64)
    positions = mask.long().cumsum(-1).clamp(min=1)
    want = attnzoo.compile(spec, backend="reference")(q, k, v, params=params, positions=positions, key_mask=mask)
    cache = variant.new_cache(b)
    outs = [variant.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache, params=params, key_mask=mask[:, :5])]
    held = [cache.num_tokens]
    for t in range(5, n):
        outs.append(variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache, params=params,
                                   key_mask=mask[:, t:t + 1]))
        held.append(cache.num_tokens)
    got = torch.cat(outs, dim=2)
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-10)
    assert held == [window - 1] * len(held)
    assert cache.memory()["expired"] == n - (window - 1) and cache.evicted == 0


def test_the_lean_step_decodes_what_the_full_path_does_and_keeps_every_refusal(lean_kind):
    """After one fully checked step, a spec with no transforms takes the lean step (validated once for its
    signature); it decodes what the reference does (past the buffers' growth: the fused append lays them out
    again), and anything that differs goes through the full checks."""
    torch.manual_seed(1)
    b, h, hkv, d, n = 2, 4, 2, 8, 40
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    lean, ref = attnzoo.compile("vanilla", backend="blocked"), attnzoo.compile("vanilla", backend="reference")
    caches = [lean.new_cache(b), ref.new_cache(b)]
    for variant, cache in zip((lean, ref), caches, strict=True):
        variant.prefill(q[:, :, :4], k[:, :, :4], v[:, :, :4], cache)
    for t in range(4, 10):
        got = lean.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[0])
        want = ref.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[1])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert caches[0].step_state.fast is not None and caches[1].step_state.fast is None  # the reference never takes it
    assert caches[0].lean_step_kind == lean_kind
    assert caches[0].num_tokens == 10 and int(caches[0].positions[0, 0, -1]) == 10
    with pytest.raises(ValueError, match="dtype"):
        lean.decode(q[:, :, 10:11].float(), k[:, :, 10:11].float(), v[:, :, 10:11].float(), caches[0])
    with pytest.raises(ValueError, match="batch"):
        lean.decode(q[:1, :, 10:11], k[:1, :, 10:11], v[:1, :, 10:11], caches[0])
    with pytest.raises(ValueError):
        lean.decode(q[:, :, 10:11, :4], k[:, :, 10:11, :4], v[:, :, 10:11, :4], caches[0])
    for cache in caches:  # rows reordered: the next step is checked in full again
        cache.reorder(torch.tensor([1, 0]))
    for t in range(10, n):
        got = lean.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[0])
        want = ref.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[1])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert caches[0].lean_step_kind == lean_kind and caches[0]._k.shape[2] > 16
    torch.testing.assert_close(caches[0].keys, caches[1].keys, rtol=0, atol=0)
    assert torch.equal(caches[0].positions, caches[1].positions)


def test_the_lean_step_under_a_sliding_window():
    torch.manual_seed(2)
    b, h, hkv, d, n, window = 2, 4, 2, 8, 16, 5
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    spec = {"name": "w", "attention": {"scale": 0.3}, "transforms": [{"kind": "sliding_window", "window": window}]}
    lean, ref = attnzoo.compile(spec, backend="blocked"), attnzoo.compile(spec, backend="reference")
    want = ref(q, k, v)
    cache = lean.new_cache(b)
    outs = [lean.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7], cache)]
    for t in range(7, n):
        outs.append(lean.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache))
        assert cache.num_tokens == window - 1
    assert cache.step_state.fast is not None
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec, budget", [("selective-pruned", 2), ("selective-pruned", 5), ("selective-pruned", 9),
                                          ("streaming", 5), ("streaming", 9), ("h2o", 4), ("h2o", 9), ("tova", 3),
                                          ("tova", 8), ("snapkv", 3), ("snapkv", 9)])
def test_lean_steps_replace_the_victim_in_place_and_equal_the_reference(spec, budget, lean_kind):
    """selective-pruned and streaming (sink + window) at their budget: the new token takes the evicted token's
    slot (no compaction); outputs, the tokens held and their F equal the float64 reference's step by step, ties
    (F = 0 early on) included."""
    torch.manual_seed(3)
    b, h, hkv, d, n = 2, 4, 2, 8, 30
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    lean = attnzoo.compile(spec, backend="blocked")
    ref = attnzoo.compile(spec, backend="reference")
    caches = [lean.new_cache(b, budget=budget), ref.new_cache(b, budget=budget)]
    for variant, cache in zip((lean, ref), caches, strict=True):
        variant.prefill(q[:, :, :3], k[:, :, :3], v[:, :, :3], cache)
    took = 0
    for t in range(3, n):
        took += caches[0].step_state.fast is not None
        got = lean.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[0])
        want = ref.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[1])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        mine, theirs = caches[0].positions[:, 0], caches[1].positions[:, 0]
        order = mine.argsort(-1)
        assert torch.equal(mine.gather(-1, order), theirs), t  # the same tokens held
        if spec == "selective-pruned":
            torch.testing.assert_close(caches[0].accumulated().gather(-1, order), caches[1].accumulated(),
                                       rtol=1e-10, atol=1e-10)
    assert took > n // 2  # the lean step was offered ...
    assert caches[0].lean_step_kind == lean_kind
    fast = caches[0].step_state.fast  # ... and it is the evictor's, ready to run again
    assert fast.name == caches[0].evictor.kind and fast.ready is {
        "selective-pruned": fast_steps.ready_selective, "streaming": fast_steps.ready_replacing}.get(
            spec, fast_steps.ready_scoring) and fast.ready(caches[0])
    assert caches[0].evicted == caches[1].evicted and caches[0].num_tokens == budget


def test_the_cache_boundary_refuses_what_it_cannot_compute_exactly():
    """Hostile or careless arguments to a decode cache get one line, never a wrong or NaN step."""
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    variant = attnzoo.compile("vanilla", backend="blocked")
    cache = variant.new_cache(1)
    variant.prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], cache)
    with pytest.raises(ValueError, match="only move forward"):  # it would make earlier keys look later
        cache.next_position = 2
    with pytest.raises(ValueError, match="1-based"):
        attnzoo.compile("ssa").new_cache(1).next_position = torch.tensor([0])
    with pytest.raises(ValueError, match="integers"):
        cache.next_position = torch.tensor([9.0])
    with pytest.raises(ValueError, match="an int"):
        cache.next_position = 9.5
    cache.next_position = 10  # forward is fine: a gap
    two = variant.new_cache(2)
    variant.prefill(torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), two)
    for bad in (torch.tensor([True, False]), torch.tensor([1.0, 0.0])):
        with pytest.raises(ValueError, match="integer row indices"):
            two.reorder(bad)
    for budget in (float("nan"), 4.0, True):
        with pytest.raises(ValueError, match="budget must be an int"):
            attnzoo.compile("selective-pruned").new_cache(1, budget=budget)
    h2o = attnzoo.compile("h2o")
    other = h2o.new_cache(1, budget=4)
    h2o.prefill(q[:, :, :3], k[:, :, :3], v[:, :, :3], other)
    with pytest.raises(ValueError, match="made by spec 'h2o'"):
        attnzoo.compile("selective").decode(q[:, :, 3:4], k[:, :, 3:4], v[:, :, 3:4], other)
    fox = attnzoo.compile("forgetting")
    gate = fox.new_cache(1)
    fox.prefill(q[:, :, :3], k[:, :, :3], v[:, :, :3], gate)
    with pytest.raises(ValueError, match="4 query heads") as caught:
        fox.decode(torch.randn(1, 2, 1, 8), k[:, :, 3:4], v[:, :, 3:4], gate)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("options, first", [({}, 1), ({}, 7), ({"protect_bos": False}, 1), ({"self_mask": True}, 1),
                                            ({"selector_head": 3}, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_many_lean_selective_steps_unread_equal_the_reference(options, first, dtype, lean_kind):
    """The lean selective step writes each new token into its victim's slot and never reorders: over many steps
    in a row (no view read between them, so the slots stay out of order), outputs equal the float64 reference's
    step by step; the views then show the same tokens and F, in position order. Selector head 3 of 4, BOS
    unprotected, self-masking, a cache starting at an offset (no BOS), ties (zero keys early on)."""
    torch.manual_seed(5)
    b, h, hkv, d, n, budget = 2, 4, 2, 8, 40, 6
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    k[:, :, 1:4] = 0.0  # equal logits: ties in F
    spec = {"name": "sel", "transforms": [{"kind": "selective_mask", **options}],
            "cache": {"evictor": "selective", "budget": budget}}
    lean, ref = attnzoo.compile(spec, backend="blocked"), attnzoo.compile(spec, backend="reference")
    caches = [lean.new_cache(b), ref.new_cache(b)]
    for variant, cache in zip((lean, ref), caches, strict=True):
        cache.next_position = first
        variant.prefill(q[:, :, :3].to(dtype if variant is lean else torch.float64), k[:, :, :3].to(
            dtype if variant is lean else torch.float64), v[:, :, :3].to(dtype if variant is lean else torch.float64),
            cache)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 5e-2}[dtype]  # bfloat16: its own lean step
    _decode_unread(lean, ref, caches, q, k, v, dtype, tol)
    assert torch.equal(caches[0].positions, caches[1].positions)  # read: back in position order
    torch.testing.assert_close(caches[0].accumulated().double(), caches[1].accumulated(), rtol=tol, atol=tol)
    torch.testing.assert_close(caches[0].keys.double(), caches[1].keys, rtol=0, atol=tol)
    assert caches[0].evicted == caches[1].evicted and not caches[0]._scrambled


@pytest.mark.parametrize("spec", [{"evictor": "h2o"}, {"evictor": "h2o", "recent": 0}, {"evictor": "tova"}])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_many_lean_scoring_steps_unread_equal_the_reference(spec, dtype, lean_kind):
    """H2O (per head, its recent window protected) and TOVA evict after attention: the lean step puts the new
    token in the spare slot, scores from the step's probabilities, and moves it into the victim's slot (or drops
    it). Many steps with no view read between them equal the float64 reference step by step; then the views hold
    the same tokens and scores in position order. Zero keys early on make ties."""
    torch.manual_seed(6)
    b, h, hkv, d, n, budget = 2, 4, 2, 8, 40, 6
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    k[:, :, 1:4] = 0.0
    spec = {"name": "scoring", "cache": {**spec, "budget": budget}}
    lean, ref = attnzoo.compile(spec, backend="blocked"), attnzoo.compile(spec, backend="reference")
    caches = [lean.new_cache(b), ref.new_cache(b)]
    lean.prefill(*(x[:, :, :3].to(dtype) for x in (q, k, v)), caches[0])
    ref.prefill(q[:, :, :3], k[:, :, :3], v[:, :, :3], caches[1])
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    _decode_unread(lean, ref, caches, q, k, v, dtype, tol)
    assert torch.equal(caches[0].positions, caches[1].positions)
    for name, held in caches[1].state.items():
        torch.testing.assert_close(caches[0].state[name].double(), held, rtol=tol, atol=tol)
    assert caches[0].evicted == caches[1].evicted and not caches[0]._scrambled


def _decode_unread(lean, ref, caches, q, k, v, dtype, tol):
    """Decode tokens 3.. through both caches, comparing each step's output with the float64 reference's and
    reading no view of the lean cache; the lean step must have run for nearly every step, leaving the slots
    out of position order."""
    n, took = q.shape[2], 0
    for t in range(3, n):
        took += caches[0].step_state.fast is not None
        got = lean.decode(*(x[:, :, t:t + 1].to(dtype) for x in (q, k, v)), caches[0])
        want = ref.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[1])
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=f"step {t}")
    assert took >= n - 6 and caches[0]._scrambled
    fused = fused_build.library() is not None and dtype in (torch.float32, torch.float64)
    assert caches[0].lean_step_kind == ("fused" if fused else "torch")


@pytest.mark.parametrize("spec", ["selective-pruned", "streaming", "h2o", "tova"])
def test_fused_steps_take_any_strides_odd_sizes_and_changes_of_buffers(spec, lean_kind):
    """The fused steps read q, k and v through their batch and head strides (here views of a (B, N, H, D)
    tensor, as transformers lays them out), at an odd head size with groups of 2 query heads; a step whose
    rows are not contiguous takes the torch step, a view read between steps (the slots put back in order) and
    a full step (a key mask) make the next fused step lay the buffers out again. Every output, the tokens held
    and their scores equal the float64 reference's."""
    torch.manual_seed(8)
    b, h, hkv, d, n, budget = 3, 6, 3, 7, 26, 5
    q = torch.randn(b, n, h, d, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(b, n, hkv, d, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    lean, ref = attnzoo.compile(spec, backend="blocked"), attnzoo.compile(spec, backend="reference")
    caches = [lean.new_cache(b, budget=budget), ref.new_cache(b, budget=budget)]
    for variant, cache in zip((lean, ref), caches, strict=True):
        variant.prefill(q[:, :, :4], k[:, :, :4], v[:, :, :4], cache)
    kinds = []
    for t in range(4, n):
        step = [x[:, :, t:t + 1] for x in (q, k, v)]
        if t == 14:  # rows with a stride of 2: not for the C code
            step[0] = torch.stack([step[0], step[0]], dim=-1)[..., 0]
        kinds.append(caches[0].lean_step_kind)
        got = lean.decode(*step, caches[0], key_mask=torch.ones(b, 1, dtype=torch.bool) if t == 18 else None)
        want = ref.decode(*(x[:, :, t:t + 1] for x in (q, k, v)), caches[1])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"step {t}")
        if t == 11:
            assert torch.equal(caches[0].positions, caches[1].positions)
        for name, held in caches[1].state.items():
            if name in caches[0].state:
                torch.testing.assert_close(caches[0].state[name], held, rtol=1e-10, atol=1e-10)
    assert torch.equal(caches[0].positions, caches[1].positions)
    assert kinds.count(lean_kind) >= n - 8 and caches[0].evicted == caches[1].evicted


def test_the_fused_steps_say_why_they_are_unavailable(monkeypatch):
    """No compiler, a compiler that fails, or the switch: one line each, and the torch lean steps run."""
    if fused_build.library() is not None:
        assert "decode steps at a budget: fused C steps" in attnzoo.explain("h2o", mode="decode")
    assert "decode steps" not in attnzoo.explain("h2o", mode="forward")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    lib, why = fused_build._compile()
    assert lib is None and "/nonexistent/cc could not compile fused_decode.cpp" in why and "\n" not in why
    monkeypatch.setenv("ATTNZOO_FUSED_DECODE", "0")
    assert fused_build._compile() == (None, "switched off (ATTNZOO_FUSED_DECODE=0)")
    monkeypatch.setattr(fused_build, "_LOADED", (None, "switched off (ATTNZOO_FUSED_DECODE=0)"))
    assert fused_build.status() == ("torch lean steps: the fused C steps are unavailable: switched off "
                                     "(ATTNZOO_FUSED_DECODE=0)")
    assert "torch lean steps" in attnzoo.explain("h2o", mode="decode")
    variant = attnzoo.compile("h2o", backend="blocked")
    cache = variant.new_cache(1, budget=3)
    x = torch.randn(1, 2, 6, 4)
    variant.prefill(x[:, :, :3], x[:, :, :3], x[:, :, :3], cache)
    variant.decode(x[:, :, 3:4], x[:, :, 3:4], x[:, :, 3:4], cache)
    assert cache.lean_step_kind == "torch"


@pytest.mark.parametrize("spec", ["vanilla", "selective-pruned", "streaming", "h2o", "tova"])
def test_lean_steps_decode_ragged_rows_once_their_padding_is_evicted(spec, lean_kind):
    """A left-padded batch of prompts of different lengths: once the padding is evicted (or, with no budget,
    from the first step), every row decodes at its own positions through the lean step, equal to the float64
    reference's batch step by step; the next positions a user set or read are copies, never moved under them."""
    torch.manual_seed(9)
    b, h, hkv, d, n, lengths = 3, 4, 2, 8, 30, (6, 3, 9)
    budget = None if spec == "vanilla" else 5
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    real = torch.zeros(b, 9, dtype=torch.bool)
    for row, length in enumerate(lengths):
        real[row, 9 - length:] = True
    lean, ref = attnzoo.compile(spec, backend="blocked"), attnzoo.compile(spec, backend="reference")
    caches = [lean.new_cache(b, budget=budget), ref.new_cache(b, budget=budget)]
    for variant, cache in zip((lean, ref), caches, strict=True):
        variant.prefill(q[:, :, :9], k[:, :, :9], v[:, :, :9], cache, key_mask=real)
    start = caches[0].next_position
    assert start.tolist() == [7, 4, 10]
    kinds = []
    for t in range(9, n):
        kinds.append(caches[0].lean_step_kind)
        got = lean.decode(*(x[:, :, t:t + 1] for x in (q, k, v)), caches[0])
        want = ref.decode(*(x[:, :, t:t + 1] for x in (q, k, v)), caches[1])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"step {t}")
    assert torch.equal(caches[0].positions, caches[1].positions)
    assert caches[0].next_position.tolist() == [28, 25, 31] and start.tolist() == [7, 4, 10]
    assert kinds.count(lean_kind) >= n - 9 - 3, kinds  # vanilla: the append fused, the attention torch's
    def same_padding():
        got, want = caches[0].valid, caches[1].valid
        return (got is None and want is None) or torch.equal(got, want)

    assert same_padding()  # vanilla: the prompts' padding, still held, and the real tokens the lean steps added
    pad = torch.tensor([[True], [False], [True]])  # then a padding token in row 1, through the full path
    step = [torch.randn(b, x, 1, d, dtype=torch.float64) for x in (h, hkv, hkv)]
    torch.testing.assert_close(lean.decode(*step, caches[0], key_mask=pad), ref.decode(*step, caches[1], key_mask=pad),
                               rtol=1e-10, atol=1e-10)
    assert torch.equal(caches[0].positions, caches[1].positions) and same_padding()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
def test_the_plain_lean_step_masks_padding_in_every_float_dtype(dtype, tol):
    """A left-padded batch with no budget keeps its padding: the plain lean step masks it (an additive bias in
    the accumulator dtype, SDPA's mask below 256 keys) and decodes what the float64 reference does; half precision
    takes the torch step, float32 the fused append."""
    torch.manual_seed(10)
    b, h, hkv, d, n = 2, 4, 2, 8, 20
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    real = torch.ones(b, 6, dtype=torch.bool)
    real[1, :4] = False
    lean, ref = attnzoo.compile("vanilla", backend="blocked"), attnzoo.compile("vanilla", backend="reference")
    caches = [lean.new_cache(b), ref.new_cache(b)]
    lean.prefill(*(x[:, :, :6].to(dtype) for x in (q, k, v)), caches[0], key_mask=real)
    ref.prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], caches[1], key_mask=real)
    kinds = []
    for t in range(6, n):
        kinds.append(caches[0].lean_step_kind)
        got = lean.decode(*(x[:, :, t:t + 1].to(dtype) for x in (q, k, v)), caches[0])
        want = ref.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], caches[1])
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=f"step {t}")
    fused = dtype == torch.float32 and fused_build.library() is not None
    assert kinds[1:] == ["fused" if fused else "torch"] * (n - 7) and torch.equal(caches[0].valid, caches[1].valid)

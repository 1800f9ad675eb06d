"""The blocked backend: the conformance suite at a small block size (so every path crosses blocks), memory."""

import math
import types

import pytest
import torch

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.builtin_specs import shipped_spec_files
from attnzoo.conformance import runner
from attnzoo.registry import new_registry

SHIPPED = sorted(p.stem for p in shipped_spec_files())


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("small_blocks")
    module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(16, "blocked16")))
    return new_registry(entry_points=False, extra_plugins=[("small_blocks", module)])


def test_every_shipped_spec_is_checked_with_16_query_blocks(registry):
    assert sorted(registry.specs) == sorted(SHIPPED)  # the test below covers them all, one item per spec


@pytest.mark.parametrize("spec", SHIPPED)
def test_conformance_with_16_query_blocks(registry, spec):
    """Many blocks (and forward spans) at the suite's small sizes: every check in float64, the outputs and
    gradients (the numerics) in float32 too. One item per spec, so that workers share them."""
    cases = [c for c in runner.build_cases(registry, [spec], ["blocked16"], (torch.float64, torch.float32))
             if c.dtype == "float64" or c.check.startswith(("outputs/", "gradients/", "packed/"))]
    assert cases
    results = runner.run_suite(cases)
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]


@pytest.mark.parametrize("spec", ["selective-ssa", "local", "softcap"])
def test_gradients_match_reference_across_blocks(registry, spec):
    ref = attnzoo.compile(spec, backend="reference", registry=registry)
    fast = attnzoo.compile(spec, backend="blocked16", registry=registry)
    params = {k: (v + 0.3 * torch.randn_like(v)).requires_grad_() for k, v in
              ref.init_params(num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64).items()}
    q = torch.randn(2, 4, 53, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 53, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    inputs = [q, k, v, *params.values()]
    cot = torch.randn(2, 4, 53, 8, dtype=torch.float64)
    want = torch.autograd.grad(ref(q, k, v, params=params), inputs, cot)
    got = torch.autograd.grad(fast(q, k, v, params=params), inputs, cot)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_selection_returned_blockwise_equals_reference(registry):
    q, k, v = torch.randn(3, 1, 2, 40, 8, dtype=torch.float64)
    _, f_ref = attnzoo.compile("selective", backend="reference", registry=registry)(q, k, v, return_accumulated=True)
    _, f = attnzoo.compile("selective", backend="blocked16", registry=registry)(q, k, v, return_accumulated=True)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "blocked16"])
def test_bfloat16_selection_is_summed_in_float32(registry, backend):
    """F (and the blocked carry across 10 query blocks) in at least float32 whatever the input dtype (numerics
    contract): bfloat16 inputs give F as accurate as their own rounding allows (measured 8e-4 of max F here;
    summed in bfloat16, 6e-3 with the carry and 3e-3 without)."""
    q, k, v = (torch.randn(1, 2, 160, 8).bfloat16() for _ in range(3))
    _, truth = attnzoo.compile("selective", backend="reference", registry=registry)(
        q.double(), k.double(), v.double(), return_accumulated=True)
    _, f = attnzoo.compile("selective", backend=backend, registry=registry)(q, k, v, return_accumulated=True)
    error = float((f.double() - truth).abs().max() / truth.abs().max())
    assert error < 2e-3, error
    assert f.dtype == torch.float32


def test_auto_prefers_blocked():
    variant = attnzoo.compile("selective")
    assert variant.backend_for("cpu", torch.float32, True).name == "blocked"


@pytest.mark.parametrize("options", [{"selector_head": 1}, {"protect_bos": False}, {"self_mask": True}])
@pytest.mark.parametrize("first_position", [1, 5])
def test_fused_selective_path_matches_reference(registry, options, first_position):
    spec = {"name": "s", "transforms": [{"kind": "selective_mask", **options}]}
    ref = attnzoo.compile(spec, backend="reference", registry=registry)
    fast = attnzoo.compile(spec, backend="blocked16", registry=registry)
    q = torch.randn(2, 4, 45, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 45, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    positions = torch.arange(first_position, first_position + 45)
    cot = torch.randn(2, 4, 45, 8, dtype=torch.float64)
    want = ref(q, k, v, positions=positions)
    got = fast(q, k, v, positions=positions)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for w, g in zip(torch.autograd.grad(want, (q, k, v), cot), torch.autograd.grad(got, (q, k, v), cot), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize("options", [{}, {"selector_head": 1}, {"protect_bos": False}, {"self_mask": True}])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_selective_prompt_into_an_empty_cache_takes_the_kernels_forward_exactly(registry, monkeypatch, options,
                                                                                  heads, dtype):
    """A prompt into an empty cache under a pointwise selection, no gradient wanted: selective_kernel's
    selective_prefill (blocks of 16 here), the same outputs, kept tokens and running F as the reference's prefill
    with eviction, then the same decode steps; with a gradient wanted, or in float16, it is not taken."""
    from attnzoo.backends import blocked, selective_kernel

    calls = []
    real = selective_kernel.selective_prefill
    monkeypatch.setattr(blocked, "selective_prefill", lambda *a: calls.append(a[-1]) or real(*a))
    spec = {"name": "s", "transforms": [{"kind": "selective_mask", **options}], "cache": {"evictor": "selective"}}
    h, hkv = heads
    ref = attnzoo.compile(spec, backend="reference", registry=registry)
    fast = attnzoo.compile(spec, backend="blocked16", registry=registry)
    q = torch.randn(2, h, 45, 8, dtype=torch.float64) * 2
    k, v = (torch.randn(2, hkv, 45, 8, dtype=torch.float64) * 2 for _ in range(2))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    tol = {"rtol": 0, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    want_cache, got_cache = ref.new_cache(batch=2, budget=12), fast.new_cache(batch=2, budget=12)
    with torch.no_grad():
        want = ref.prefill(q[:, :, :40], k[:, :, :40], v[:, :, :40], want_cache)
        got = fast.prefill(q[:, :, :40], k[:, :, :40], v[:, :, :40], got_cache)
        assert calls == [16]
        torch.testing.assert_close(got, want, **tol)
        assert torch.equal(got_cache.positions, want_cache.positions)
        torch.testing.assert_close(got_cache.accumulated(), want_cache.accumulated(), **tol)
        for i in range(40, 45):
            step = (t[:, :, i:i + 1] for t in (q, k, v))
            torch.testing.assert_close(fast.decode(*step, got_cache), ref.decode(
                *(t[:, :, i:i + 1] for t in (q, k, v)), want_cache), **tol)
        assert torch.equal(got_cache.positions, want_cache.positions)
    calls.clear()
    q.requires_grad_(True)
    out = fast.prefill(q[:, :, :40], k[:, :, :40], v[:, :, :40], fast.new_cache(batch=2, budget=12))
    assert out.requires_grad and not calls
    with torch.no_grad():
        fast.prefill(*(t[:, :, :40].half() for t in (q, k, v)), fast.new_cache(batch=2, budget=12))
    assert not calls


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_a_prompt_with_nan_or_inf_gives_what_the_reference_gives(registry, monkeypatch, bad, where):
    """A non-finite query (the selector head's: every later query's F) takes the selective prompt path; a
    non-finite key or value takes the eager blocks, since SDPA and the kernel would add it into queries before it
    (the reference masks those logits, and selects the values of allowed pairs): outputs, kept tokens and F as the
    reference's, NaN where it gives NaN; so does a prompt of ``streaming`` (no accumulator: otherwise one causal
    SDPA call)."""
    from attnzoo.backends import blocked, selective_kernel

    calls = []
    real = selective_kernel.selective_prefill
    monkeypatch.setattr(blocked, "selective_prefill", lambda *a: calls.append(a[-1]) or real(*a))
    q = torch.randn(1, 4, 37, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 37, 8, dtype=torch.float64) for _ in range(2))
    {"query": q[0, 0, 20], "key": k[0, 1, 9], "value": v[0, 1, 9]}[where][3] = bad
    for spec in ("selective-pruned", "streaming"):
        got = []
        for backend in ("reference", "blocked16"):
            variant = attnzoo.compile(spec, backend=backend, registry=registry)
            cache = variant.new_cache(batch=1, budget=12)
            with torch.no_grad():
                got.append((variant.prefill(q, k, v, cache), cache.positions, cache.accumulated()))
        torch.testing.assert_close(got[1][0], got[0][0], rtol=0, atol=1e-12, equal_nan=True)
        assert torch.equal(got[1][1], got[0][1])
        if spec == "selective-pruned":
            torch.testing.assert_close(got[1][2], got[0][2], rtol=0, atol=1e-12, equal_nan=True)
    assert calls == ([] if where in ("key", "value") else [16])


@pytest.mark.parametrize("spec", ["vanilla", "selective", "local", "alibi", "sigmoid", "diff"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_key_reaches_only_the_queries_that_see_it(registry, spec, bad):
    """SDPA with an additive mask adds -inf to q·k, so a NaN or infinite key would reach the queries the mask hides
    it from (the batch form's float-mask blocks did, for ``local``): blocked gives the reference's output, NaN
    exactly where it gives NaN, in the batch form, a prompt and the decode steps after it."""
    q = torch.randn(1, 4, 37, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 37, 8, dtype=torch.float64) for _ in range(2))
    k[0, 1, 9, 3] = bad
    ref = attnzoo.compile(spec, backend="reference", registry=registry)
    fast = attnzoo.compile(spec, backend="blocked16", registry=registry)
    torch.testing.assert_close(fast(q, k, v), ref(q, k, v), rtol=0, atol=1e-12, equal_nan=True)
    caches = ref.new_cache(batch=1), fast.new_cache(batch=1)
    with torch.no_grad():
        for lo, hi in ((0, 30), (30, 31), (31, 32)):
            want, got = (variant.prefill(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], cache)
                         for variant, cache in zip((ref, fast), caches, strict=True))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, equal_nan=True)


def test_private_flash_op_still_matches_its_contract():
    """torch.ops.aten._scaled_dot_product_flash_attention_for_cpu is private: notice if an upgrade changes it."""
    from attnzoo.backends import selective_kernel

    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    mask = torch.randn(1, 1, 20, 20)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=0.3)[:2]
    logits = q @ k.transpose(-1, -2) * 0.3 + mask
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
    selective_kernel.flash_block(q, k, v, mask, 0.3)
    assert selective_kernel.flash_available(torch.float32) is True


@pytest.fixture
def unprobed(monkeypatch):
    """The flash-op module (attnzoo.core.flash, which the selective kernel and the distributed pairs call) with no
    probe verdict yet (as in a fresh process); restored afterwards."""
    from attnzoo.core import flash

    monkeypatch.setattr(flash, "PROBED", {})
    return flash


def test_eager_equivalent_when_the_private_op_is_unusable(monkeypatch, unprobed):
    def broken(*args, **kwargs):
        raise RuntimeError("op changed")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", broken, raising=False)
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="private flash-attention CPU op is unusable.*op changed"):
        out = attnzoo.compile("selective", backend="blocked")(q, k, v)
    torch.testing.assert_close(out, attnzoo.compile("selective", backend="reference")(q, k, v))


def test_missing_private_op_falls_back_to_eager_with_a_warning(monkeypatch, unprobed):
    def missing(*args, **kwargs):  # what torch.ops.aten.<name> raises for an op this torch lacks
        raise AttributeError("'_OpNamespace' 'aten' object has no attribute '_scaled_dot_product_flash_...'")

    monkeypatch.setattr(unprobed, "flash_op", missing)
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    variant = attnzoo.compile("selective", backend="blocked")
    with pytest.warns(RuntimeWarning, match="unusable for float64 \\(AttributeError"):
        out = variant(q, k, v)
    assert unprobed.flash_available(torch.float64) is False
    torch.testing.assert_close(out, attnzoo.compile("selective", backend="reference")(q, k, v))


def test_an_error_in_a_real_flash_call_propagates_and_does_not_switch_to_eager(monkeypatch, unprobed):
    """One out-of-memory in the first real call must not send the whole process to the slow path for good."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    calls = {"fast": 0, "fail": 1}

    def flaky(q, *args, **kwargs):
        if q.shape[2] == 20 and calls["fail"]:  # a real call (the probe's inputs are smaller)
            calls["fail"] -= 1
            raise RuntimeError("out of memory")
        calls["fast"] += 1
        return op(q, *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", flaky, raising=False)
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    variant = attnzoo.compile("selective", backend="blocked")
    with pytest.raises(RuntimeError, match="out of memory"):
        variant(q, k, v)
    calls["fast"] = 0
    out = variant(q, k, v)
    assert calls["fast"] == 1  # the next call still runs the op (one block: 20 queries, blocks of 256)
    torch.testing.assert_close(out, attnzoo.compile("selective", backend="reference")(q, k, v))


def test_fused_selective_backward_in_half_precision(registry):
    """float16 / bfloat16: the backward recomputes in float32 (a float16 exp clamp once wrecked the gradients)."""
    cases = runner.build_cases(registry, ["selective", "selective-ssa"], ["blocked16"],
                               (torch.float16, torch.bfloat16))
    results = runner.run_suite([c for c in cases if c.check.startswith(("gradients/", "vectors/"))])
    failures = [f"{r.id}: {r.message}" for r in results if r.status != "pass"]
    assert not failures, failures[:3]


@pytest.mark.parametrize("mask", [{"kind": "sliding_window", "window": 5},
                                  {"kind": "local_global", "window": 3, "global_heads": 0},
                                  {"kind": "local_global", "window": 3, "global_heads": 1},
                                  {"kind": "causal"}, {"kind": "prefix", "length": 4},
                                  {"kind": "chunked", "chunk": 4}, {"kind": "chunked", "chunk": 1}])
def test_earliest_key_is_a_promise_the_mask_keeps(mask):
    """Keys the blocked backend skips must be keys the mask forbids for every later query."""
    spec = attnzoo.load_spec({"name": "m", "attention": {"causal": mask["kind"] != "prefix"}, "transforms": [mask]})
    plan = attnzoo.compile(spec).plan
    transform = plan.many(attnzoo.Slot.MASK)[0]
    pos = torch.arange(1, 30)
    ctx = plan.composition.context(pos.view(1, -1), pos.view(1, 1, -1), attnzoo.Dims(2, 4, 2))
    allowed = transform.allowed(ctx).expand(1, 2, 29, 29)
    for i in range(29):
        earliest = transform.earliest_key(int(pos[i]))
        if earliest is not None:
            assert not bool(allowed[:, :, i:, pos < earliest].any()), (mask, i)


@pytest.mark.parametrize("bias_shift, folded", [(0.0, True), (-7.0, False)])
def test_separable_key_terms_fold_into_one_sdpa_call_or_decline(monkeypatch, bias_shift, folded):
    """The forgetting gate is separable (D_i - D_j): blocked folds -D_j into the keys as one more dimension and
    runs one causal SDPA call; a gate whose D spans more than the folded range (float32's 256, here log sigmoid(-2)
    per token over 300 tokens, checked against it in float64) takes the blocks instead. Both equal the reference,
    outputs and every gradient (float64, GQA, positions from 4)."""
    from attnzoo.backends import blocked

    monkeypatch.setitem(blocked._FOLDED_RANGE, torch.float64, blocked._FOLDED_RANGE[torch.float32])
    seen = []
    fold = BlockedBackend._key_bias_sdpa

    def spy(self, *args):
        out = fold(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(BlockedBackend, "_key_bias_sdpa", spy)
    ref, fast = (attnzoo.compile("forgetting", backend=name) for name in ("reference", "blocked"))
    torch.manual_seed(0)
    params = {k: (v + bias_shift + 0.3 * torch.randn_like(v)).requires_grad_() for k, v in
              ref.init_params(num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64).items()}
    q = torch.randn(2, 4, 300, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 300, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    positions = torch.arange(4, 304).expand(2, -1)
    inputs = [q, k, v, *params.values()]
    cot = torch.randn(2, 4, 300, 8, dtype=torch.float64)
    want = torch.autograd.grad(ref(q, k, v, params=params, positions=positions), inputs, cot)
    got = torch.autograd.grad(fast(q, k, v, params=params, positions=positions), inputs, cot)
    assert seen == [folded]
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_selective_leaves_out_negligible_keys_exactly(registry, monkeypatch, dtype, tol):
    """Keys whose F is past the negligible bound for a whole block (selective_kernel.negligible_f) are left out
    of the forward and backward passes. Keys were in fact left out (large selector logits make F grow fast, as
    a trained selector does), and outputs and every gradient equal those of the same computation visiting every
    key (to rounding: what is left out weighs below e^-104) and the reference's."""
    from attnzoo.backends import selective_kernel

    pruned = []
    live = selective_kernel.Keys.live.__func__

    def spy(cls, carry, start, stop, limit, keep=0.8):
        keys = live(cls, carry, start, stop, limit, keep)
        if keys.index is not None:
            pruned.append(start - keys.before)
        return keys

    monkeypatch.setattr(selective_kernel.Keys, "live", classmethod(spy))
    gen = torch.Generator().manual_seed(3)
    q = (3 * torch.randn(2, 4, 300, 8, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    k, v = ((3 * torch.randn(2, 2, 300, 8, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
            for _ in range(2))
    cot = torch.randn(2, 4, 300, 8, generator=gen, dtype=torch.float64).to(dtype)
    variant = attnzoo.compile("selective", backend="blocked16", registry=registry)

    def run():
        out = variant(q, k, v)
        return [out, *torch.autograd.grad(out, (q, k, v), cot)]

    got = run()
    assert pruned and max(pruned) > 100, pruned
    monkeypatch.setattr(selective_kernel, "negligible_f", lambda *args: float("inf"))
    pruned.clear()
    every = run()
    assert not pruned
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = attnzoo.compile("selective", backend="reference")(q64, k64, v64)
    reference = [want, *torch.autograd.grad(want, (q64, k64, v64), cot.double())]
    for name, g, e, w in zip(["out", "q", "k", "v"], got, every, reference, strict=True):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(g.double(), w, rtol=1e-4 if dtype == torch.float32 else 1e-9,
                                   atol=1e-4 if dtype == torch.float32 else 1e-8, msg=name)


@pytest.mark.parametrize("accumulate", [False, True])
def test_off_diagonal_pair_with_the_bos_key_apart(accumulate):
    """An off-diagonal pair whose first key is the protected BOS (context parallelism's pairs against the first
    chunk) takes the BOS key in one product for every query and the other keys by blocks. Checked against the
    selective formula written out eagerly in float64: S = relu(q_sel k^T * scale) with BOS never selected,
    F = carry + the exclusive cumulative sum of S over the pair's queries, softmax(q k^T * scale - F) v; the
    output, log-sum-exp, column sums, and the gradients of q, k, v and the incoming carry."""
    from attnzoo.backends.selective_kernel import Pair, pair_backward, pair_colsums, pair_forward
    from attnzoo.transforms.base import PointwiseSelection

    gen = torch.Generator().manual_seed(11)
    b, h, nq, nk, d, scale = 2, 3, 13, 9, 5, 0.4
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for n in (nq, nk, nk, nq))
    carry = torch.rand(b, nk, generator=gen, dtype=torch.float64) * 3
    carry[:, 0] = 0.7  # 0 under attnzoo's sharding (BOS is never selected); any carry is exact
    pointwise = PointwiseSelection(torch.relu, lambda x: (x > 0).to(x.dtype), exclude_first=True,
                                   exclude_self=True)
    pair = Pair(scale, 1, pointwise, 4, float("inf"), diagonal=False, bos=True)

    qr, kr, vr, cr = (t.clone().requires_grad_() for t in (q, k, v, carry))
    s = torch.relu(qr[:, 1] @ kr[:, 1].transpose(-1, -2) * scale)  # (B, nq, nk), selector head 1
    s = s * (torch.arange(nk) > 0)  # BOS never selected
    f = cr[:, None, :] + torch.cumsum(s, dim=1) - s  # exclusive over the pair's queries
    logits = qr @ kr.transpose(-1, -2) * scale - f[:, None]
    lse_want = torch.logsumexp(logits, dim=-1)
    out_want = torch.softmax(logits, dim=-1) @ vr
    dq_want, dk_want, dv_want, dc_want = torch.autograd.grad(out_want, (qr, kr, vr, cr), g)

    out = torch.full_like(q, float("nan")) if not accumulate else torch.zeros_like(q)
    lse = torch.full((b, h, nq), float("nan") if not accumulate else float("-inf"), dtype=torch.float64)
    kept: list[torch.Tensor] = []
    pair_forward(pair, q, k, v, carry, out, lse, kept, accumulate=accumulate)
    torch.testing.assert_close(out, out_want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_want.detach(), rtol=1e-10, atol=1e-12)
    colsum = torch.zeros(b, nk, dtype=torch.float64)
    pair_colsums(pair, q[:, 1], k[:, 1], colsum)
    torch.testing.assert_close(colsum, s.detach().sum(1), rtol=1e-10, atol=1e-12)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dcarry = torch.zeros(b, nk, dtype=torch.float64)
    neg_delta = -(g * out).sum(-1, keepdim=True)
    pair_backward(pair, q, k, v, g, lse, neg_delta, kept, dq, dk, dv, dcarry)
    for got, want in ((dq, dq_want), (dk, dk_want), (dv, dv_want), (dcarry, dc_want)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def _pruned_pair_formula(q, k, v, carry, sel, scale, limit, diagonal, bos):
    """Selective attention of one pair, written out in float64 from the paper's formula with the kernel's
    pruning: S = relu(q_sel k^T * scale) where a query may select a key (on the diagonal strictly earlier keys;
    never BOS), F = carry + the exclusive cumulative sum of S over the pair's queries, and a key whose F has
    reached ``limit`` gets probability 0. Returns (out, lse, S)."""
    nq, nk = q.shape[2], k.shape[2]
    s = torch.relu(q[:, sel] @ k[:, sel].transpose(-1, -2) * scale)  # (B, nq, nk)
    may = torch.ones(nq, nk, dtype=torch.bool)
    if diagonal:
        may = torch.arange(nk)[None, :] < torch.arange(nq)[:, None]
    if bos:
        may[:, 0] = False
    s = s * may
    f = carry[:, None, :] + torch.cumsum(s, dim=1) - s
    logits = q @ k.transpose(-1, -2) * scale - f[:, None]
    dead = (f >= limit)[:, None]
    if diagonal:
        dead = dead | (torch.arange(nk)[None, :] > torch.arange(nq)[:, None])
    none = dead.all(dim=-1, keepdim=True)  # a query with no live key: output 0, log-sum-exp -inf
    logits = logits.masked_fill(dead & ~none, float("-inf")).masked_fill(none, 0.0)
    out = torch.where(none, 0.0, torch.softmax(logits, dim=-1) @ v)
    return out, torch.where(none[..., 0], float("-inf"), torch.logsumexp(logits, dim=-1)), s


def test_pruned_pairs_end_spans_early_and_return_their_final_carry(monkeypatch):
    """Off the diagonal, a forward span ends at a block where at most half of its live keys are left (keys past
    the negligible bound die as F grows); the output, log-sum-exp and gradients still follow the formula with
    those keys at probability 0, merged by log-sum-exp into attention over other keys (as under sharding, where
    every query also has its own chunk's keys: a query with no live key here gets weight 0). On the diagonal,
    ``final`` returns the pair's column sums of S (its carry in is 0). Checked against
    :func:`_pruned_pair_formula` in float64."""
    import attnzoo.backends.selective_kernel as kernel
    from attnzoo.backends.selective_kernel import Pair, pair_backward, pair_forward
    from attnzoo.transforms.base import PointwiseSelection

    ended = []
    dying = kernel._dying
    monkeypatch.setattr(kernel, "_dying", lambda *a: ended.append(dying(*a)) or ended[-1])
    gen = torch.Generator().manual_seed(5)
    b, h, nq, nk, d, scale, limit = 2, 2, 41, 23, 5, 0.4, 2.5
    pointwise = PointwiseSelection(torch.relu, lambda x: (x > 0).to(x.dtype), exclude_first=True,
                                   exclude_self=True)
    q, g = (torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, h, nk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    carry = torch.rand(b, nk, generator=gen, dtype=torch.float64) * 2.0
    pair = Pair(scale, 0, pointwise, 4, limit, diagonal=False, bos=False)
    out0, lse0 = torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64), torch.randn(b, h, nq, generator=gen,
                                                                                          dtype=torch.float64)
    qr, kr, vr, cr = (t.clone().requires_grad_() for t in (q, k, v, carry))
    o_pair, l_pair, _ = _pruned_pair_formula(qr, kr, vr, cr, 0, scale, limit, False, False)
    assert not torch.isfinite(l_pair).all()  # some queries have no live key left
    lse_want = torch.logaddexp(lse0, l_pair)
    out_want = (torch.exp(lse0 - lse_want)[..., None] * out0 + torch.exp(l_pair - lse_want)[..., None] * o_pair)
    grads = torch.autograd.grad(out_want, (qr, kr, vr, cr), g)

    out, lse = out0.clone(), lse0.clone()
    kept: list[torch.Tensor] = []
    pair_forward(pair, q, k, v, carry, out, lse, kept, accumulate=True)
    assert True in ended  # a span ended early
    assert len(kept) == -(-nq // pair.block)  # still one carry per block for the backward
    torch.testing.assert_close(out, out_want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_want.detach(), rtol=1e-10, atol=1e-12)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dcarry = torch.zeros(b, nk, dtype=torch.float64)
    pair_backward(pair, q, k, v, g, lse, -(g * out).sum(-1, keepdim=True), kept, dq, dk, dv, dcarry)
    for name, got, want in zip("q k v carry".split(), (dq, dk, dv, dcarry), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)

    # the diagonal: no carry in; the final carry is the column sums of S (limit inf: no key is left out)
    q, k, v = (torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) for _ in range(3))
    diag = Pair(scale, 1, pointwise, 4, float("inf"), diagonal=True, bos=True)
    final = torch.full((b, nq), float("nan"), dtype=torch.float64)
    out, lse = torch.zeros_like(q), torch.full((b, h, nq), float("-inf"), dtype=torch.float64)
    pair_forward(diag, q, k, v, torch.zeros(b, nq, dtype=torch.float64), out, lse, accumulate=True, final=final)
    out_want, _, s = _pruned_pair_formula(q, k, v, torch.zeros(b, nq, dtype=torch.float64), 1, scale, math.inf,
                                          True, True)
    torch.testing.assert_close(out, out_want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, s.sum(1), rtol=1e-10, atol=1e-12)

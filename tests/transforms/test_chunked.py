"""The ``chunked`` mask (chunked local attention: Llama 4's ``attention_chunk_size``, vLLM's chunked local attention):
its definition written out by hand in float64 against the reference and blocked (outputs and gradients), decoding
with a cache that never holds a whole chunk, and the conformance suite on every backend that runs on CPU."""

import json
import math
import types

import pytest
import torch

import attnzoo
from attnzoo.backends.blocked import BlockedBackend
from attnzoo.conformance import runner
from attnzoo.errors import SpecError
from attnzoo.registry import new_registry


def chunked(chunk: int, name: str = "chunked") -> dict:
    return {"name": name, "transforms": [{"kind": "chunked", "chunk": chunk}]}


def hand_allowed(positions: torch.Tensor, key_mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, N, N) bool from the definition, one pair at a time in Python ints: query at position i sees the real key
    at position j iff j <= i and (j - 1) // chunk == (i - 1) // chunk."""
    b, n = positions.shape
    allowed = torch.zeros(b, n, n, dtype=torch.bool)
    for r in range(b):
        for x in range(n):
            i = int(positions[r, x])
            for y in range(n):
                j = int(positions[r, y])
                allowed[r, x, y] = bool(key_mask[r, y]) and j <= i and (j - 1) // chunk == (i - 1) // chunk
    return allowed


def hand_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(D)) v over the allowed pairs, the softmax written out (exp of the logits less the
    row's largest allowed one, over their sum); GQA by repeating each key/value head for its query heads."""
    h, d = q.shape[1], q.shape[-1]
    group = h // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = (q @ kk.transpose(-1, -2)) / math.sqrt(d)
    mask = allowed[:, None]
    top = logits.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.where(mask, torch.exp(logits - top), torch.zeros_like(logits))
    total = weights.sum(-1, keepdim=True)
    return (weights @ vv) / torch.where(total > 0, total, torch.ones_like(total))


def batch_rows(b: int, n: int):
    """Row 0 at positions 1..N; row 1 left-padded by 6 (padding takes position 1, as the inputs contract says);
    row 2 from position 11 with gaps of 1 and 2 (chunk boundaries fall at other indices in every row)."""
    key_mask = torch.ones(b, n, dtype=torch.bool)
    key_mask[1, :6] = False
    positions = key_mask.long().cumsum(-1).clamp(min=1)
    steps = 1 + (torch.arange(n) % 3 == 1).long()
    steps[0] = 0
    positions[2] = 11 + steps.cumsum(-1)
    return positions, key_mask


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("small_blocks_chunked")
    module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(4, "blocked4")))
    return new_registry(entry_points=False, extra_plugins=[("small_blocks_chunked", module)])


def test_options_are_checked():
    assert attnzoo.load_spec(chunked(8)).transforms[0].chunk == 8
    for bad in (0, -3, 2.0, "8"):
        with pytest.raises(SpecError):
            attnzoo.load_spec({"name": "c", "transforms": [{"kind": "chunked", "chunk": bad}]})


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_the_mask_is_the_definition_and_earliest_key_its_exact_first_key(chunk):
    """allowed() is the definition pair by pair; earliest_key(i) is the first key the query at i sees (its chunk's
    first position), never decreases, and no later query sees a key before it (the contract blocked, triton,
    distributed and the cache's drop_expired rely on)."""
    plan = attnzoo.compile(chunked(chunk)).plan
    mask = plan.many(attnzoo.Slot.MASK)[0]
    n = 30
    pos = torch.arange(1, n + 1)
    ctx = plan.composition.context(pos.view(1, -1), pos.view(1, 1, -1), attnzoo.Dims(2, 4, 2))
    got = mask.allowed(ctx).expand(1, 2, n, n)
    want = hand_allowed(pos.view(1, -1), torch.ones(1, n, dtype=torch.bool), chunk)
    assert torch.equal(got, want[:, None].expand(1, 2, n, n))
    firsts = [mask.earliest_key(i) for i in range(1, n + 1)]
    assert firsts == [int(pos[want[0, i]].min()) for i in range(n)]
    assert firsts == sorted(firsts)
    for i in range(n):
        assert not bool(got[:, :, i:, pos < firsts[i]].any())
    assert plan.composition.earliest_key(1) == 1  # a bound exists: decoding caches get a horizon


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_hand_formula_equals_reference_and_blocked_outputs_and_gradients(registry, chunk):
    """float64, B = 3 (a plain row, a left-padded one, one from position 11 with gaps), H = 6 over H_kv = 2, N = 29,
    D = 5: outputs (real queries) and the gradients of q, k and v equal the hand-written formula on the reference,
    on blocked (one block) and on blocked with 4-query blocks (keys before each block's chunk skipped), for the
    batch and for its first and last rows alone (where the skipped keys are exactly those before the chunk). A
    chunk longer than every row is causal attention."""
    b, h, hkv, n, d = 3, 6, 2, 29, 5
    gen = torch.Generator().manual_seed(chunk)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    positions, key_mask = batch_rows(b, n)
    cot = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) * key_mask[:, None, :, None]
    if chunk == 64:
        causal = (positions[:, None, :] <= positions[:, :, None]) & key_mask[:, None, :]
        assert torch.equal(hand_allowed(positions, key_mask, chunk), causal)
    for rows in (slice(None), slice(0, 1), slice(2, 3)):
        pos, mask, g = positions[rows], key_mask[rows], cot[rows]
        real = mask[:, None, :, None]
        leaves = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        want = hand_attention(*leaves, hand_allowed(pos, mask, chunk))
        want_grads = torch.autograd.grad(want, leaves, g)
        for backend in ("reference", "blocked", "blocked4"):
            variant = attnzoo.compile(chunked(chunk), backend=backend, registry=registry)
            leaves = [t[rows].clone().requires_grad_() for t in (q, k, v)]
            got = variant(*leaves, positions=pos, key_mask=mask)
            where = f"{backend}, rows {rows}"
            torch.testing.assert_close(got * real, want.detach() * real, rtol=0, atol=1e-12, msg=where)
            for name, gg, w in zip("qkv", torch.autograd.grad(got, leaves, g), want_grads, strict=True):
                torch.testing.assert_close(gg, w, rtol=0, atol=1e-12, msg=f"{where}: d{name}")


@pytest.mark.parametrize("backend", ["reference", "blocked"])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_decoding_token_by_token_equals_the_batch_form_and_holds_less_than_a_chunk(backend, chunk):
    """Rows at different offsets (left padding of 0, 4 and 1 tokens, the padding decoded too): every step equals the
    float64 batch form, and between steps the cache holds at most chunk - 1 tokens per row (each row's tokens of
    its current chunk; padding and finished chunks dropped by drop_expired): exactly the most any row needs."""
    b, h, hkv, d, n = 3, 4, 2, 8, 23
    gen = torch.Generator().manual_seed(10 + chunk)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    key_mask = torch.ones(b, n, dtype=torch.bool)
    key_mask[1, :4] = False
    key_mask[2, :1] = False
    positions = key_mask.long().cumsum(-1).clamp(min=1)
    want = hand_attention(q, k, v, hand_allowed(positions, key_mask, chunk))
    variant = attnzoo.compile(chunked(chunk), backend=backend)
    cache = variant.new_cache(b)
    outs, held, needed = [], [], []
    for t in range(n):
        outs.append(variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache,
                                   key_mask=key_mask[:, t:t + 1]))
        held.append(cache.num_tokens)
        real = key_mask[:, :t + 1].sum(-1)  # each row's real tokens so far: it needs those of its open chunk
        needed.append(int((real % chunk).max()))
    got = torch.cat(outs, dim=2)
    real = key_mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)
    assert held == needed and max(held) == chunk - 1, held
    assert cache.evicted == 0 and cache.memory()["expired"] == n - held[-1]


@pytest.mark.parametrize("chunk", [1, 4, 6])
def test_the_lean_step_decodes_chunks_exactly(chunk):
    """Rows at one position and no padding: after a prefill, blocked's plain lean step (attend to every held token,
    then drop what no later query sees) is exact under a chunk, and the cache empties at every chunk's end."""
    b, h, hkv, d, n = 2, 4, 2, 8, 20
    gen = torch.Generator().manual_seed(20 + chunk)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    spec = {"name": "c", "attention": {"scale": 0.3}, "transforms": [{"kind": "chunked", "chunk": chunk}]}
    lean, ref = attnzoo.compile(spec, backend="blocked"), attnzoo.compile(spec, backend="reference")
    want = ref(q, k, v)
    cache = lean.new_cache(b)
    outs = [lean.prefill(q[:, :, :7], k[:, :, :7], v[:, :, :7], cache)]
    held = [cache.num_tokens]
    kinds = []
    for t in range(7, n):
        kinds.append(cache.lean_step_kind)
        outs.append(lean.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache))
        held.append(cache.num_tokens)
    assert kinds[1:] == ["torch"] * (len(kinds) - 1)  # the first decode is checked in full, then lean
    assert held == [p % chunk for p in range(7, n + 1)]
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=1e-12, atol=1e-12)


def test_sliding_window_and_chunk_together_decode_exactly():
    """Intersected with a sliding window (Plan.earliest_key takes the larger bound): still a span of keys per query,
    so the lean step and drop_expired stay exact; the cache holds min(window, chunk) - 1 tokens at most."""
    b, h, hkv, d, n = 2, 2, 1, 8, 26
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    spec = {"name": "wc", "transforms": [{"kind": "sliding_window", "window": 3}, {"kind": "chunked", "chunk": 5}]}
    variant = attnzoo.compile(spec, backend="blocked")
    pos = torch.arange(1, n + 1).expand(b, n)
    allowed = hand_allowed(pos, torch.ones(b, n, dtype=torch.bool), 5) & (pos[:, :, None] - pos[:, None, :] < 3)
    want = hand_attention(q, k, v, allowed)
    torch.testing.assert_close(variant(q, k, v), want, rtol=0, atol=1e-12)
    cache = variant.new_cache(b)
    outs, held = [], []
    for t in range(n):
        outs.append(variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache))
        held.append(cache.num_tokens)
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=0, atol=1e-12)
    assert held == [min(p % 5, 2) for p in range(1, n + 1)]


def test_conformance_on_the_cpu_backends(tmp_path):
    """A chunked spec (chunk 8: the suite's offset positions with gaps, its masked rows, its N = 45 decode and its
    packed documents cross several chunks) through the conformance suite's quick profile: reference and blocked
    with 4-query blocks, every check in float64 and outputs and gradients in float32; triton in the interpreter
    (float32: outputs and gradients on offset positions with gaps, causality, batch invariance; its decoding is in
    tests/backends/test_triton.py); flex forward (float32, offset positions with gaps). (xformers runs only on CUDA: its
    bias is checked on CPU in tests/backends/test_xformers.py.)"""
    path = tmp_path / "chunked8.json"
    path.write_text(json.dumps(chunked(8, "chunked8")))
    module = types.ModuleType("chunked_spec")
    module.register_specs = attnzoo.hookimpl(lambda register: register(path))
    module.register_backends = attnzoo.hookimpl(lambda register: register(BlockedBackend(4, "blocked4")))
    reg = new_registry(entry_points=False, extra_plugins=[("chunked_spec", module)])

    def quick(backend, dtype, keep=lambda check: True):
        return [c for c in runner.build_cases(reg, ["chunked8"], [backend], (dtype,), profile="quick")
                if keep(c.check)]

    numerics = ("outputs/", "gradients/")
    cases = quick("reference", torch.float64) + quick("blocked4", torch.float64)
    cases += quick("blocked4", torch.float32, lambda check: check.startswith(numerics))
    cases += quick("triton", torch.float32, lambda check: check in (
        "outputs/offset-gaps-n45", "gradients/offset-gaps-n45", "causality", "batch-invariance"))
    cases += quick("flex", torch.float32, lambda check: check == "outputs/offset-gaps-n45")
    results = runner.run_suite(cases)
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    passed = {(r.backend, r.check.split("/")[0]) for r in results if r.status == "pass"}
    for backend in ("reference", "blocked4"):
        assert {(backend, c) for c in ("outputs", "gradients", "decode", "causality", "packed")} <= passed, backend
    assert {("triton", "outputs"), ("triton", "gradients"), ("triton", "causality"), ("flex", "outputs")} <= passed

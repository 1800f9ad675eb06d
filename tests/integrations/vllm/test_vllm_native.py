"""A spec that is the layer's native attention over rows mapped token by token (vanilla, SSA, QK-norm, a plugin's
row map: ``spec.native_rows``) runs on vLLM's own CPU attention kernel: its queries mapped before the kernel, its
keys and values mapped as they are written, its outputs mapped after (docs/vllm.md, "Which kernel runs a layer").
Checked here without an engine: the impl's ``do_kv_cache_update`` and ``forward`` on the native path against the same
impl on attnzoo's own path over vLLM's pages (gather + blocked backend), which the engine tests check against
transformers + attnzoo, over steps that mix prompts in chunks and decoding requests."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

import attnzoo  # noqa: E402
from attnzoo.transforms.base import ParamSpec, RowMapTransform, Slot  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 32


class MixHeads(RowMapTransform):
    """A per-token output map that reads every head of its token and its position (a plugin's, not a built-in)."""

    kind = "mix_heads"
    slot = Slot.OUTPUT

    def parameters(self):
        return [ParamSpec("w", ("H",), 1.0)]

    def map(self, rows, positions, params):
        w = params["w"].reshape(1, -1, 1, 1)
        return rows * w + 0.1 * rows.roll(1, dims=1) * torch.log(positions.to(rows.dtype)).unsqueeze(-1)


SPECS = {
    "vanilla": "vanilla",
    "ssa": "ssa",
    "qk-norm": "qk-norm",
    "every-row-slot": {"name": "every-row-slot", "transforms": [
        {"kind": "query_temperature", "token_aware": True, "position_aware": True},
        {"kind": "key_norm", "gain": "shared"},
        {"kind": "key_temperature", "token_aware": True, "position_aware": True},
        {"kind": "value_temperature", "token_aware": True, "position_aware": True},
        {"kind": "mix_heads"}]},
}


def _impl(spec, native: bool):
    """An ``AttnzooCPUImpl`` as an engine makes it for one layer, its attnzoo layer given (random parameters) and its
    path chosen (``native``) rather than decided."""
    from vllm.v1.attention.backend import AttentionType

    from attnzoo.integrations.vllm.backend import AttnzooCPUImpl
    from attnzoo.integrations.vllm.layer import Layer
    from attnzoo.nn import Attention

    registry = attnzoo.new_registry(entry_points=False)
    registry.transforms["mix_heads"] = MixHeads
    registry._spec_model = None
    torch.manual_seed(5)
    core = Attention(spec, HEADS, DIM, KV_HEADS, backend="blocked", registry=registry)
    with torch.no_grad():
        for p in core.parameters():
            p.add_(0.3 * torch.randn_like(p))
    impl = object.__new__(AttnzooCPUImpl)
    impl.__dict__.update(num_heads=HEADS, head_size=DIM, scale=DIM ** -0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
                         sliding_window=-1, logits_soft_cap=0, kv_cache_dtype="auto", attn_type=AttentionType.DECODER,
                         sinks=None, use_zentorch_sdpa=False, is_fp8_kv_cache=False, record={"name": "test"},
                         ring=None, zoo=Layer(core, None, "test", native=native))
    return impl


def _step(counts, done, table):
    """vLLM's CPU metadata for a step of ``counts[i]`` new tokens of request ``i`` after ``done[i]``."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor([d + c for d, c in zip(done, counts, strict=True)], dtype=torch.int32)
    slots = torch.cat([table[i, (d + torch.arange(c)) // BLOCK].long() * BLOCK + (d + torch.arange(c)) % BLOCK
                       for i, (d, c) in enumerate(zip(done, counts, strict=True))])
    isa = _get_attn_isa(torch.float32, BLOCK, DIM, "auto")
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(counts), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_lens=lens,
        dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False, kv_cache_dtype="auto")
    meta = CPUAttentionMetadata(num_actual_tokens=int(starts[-1]), max_query_len=max(counts),
                                query_start_loc=starts, max_seq_len=int(lens.max()), seq_lens=lens,
                                block_table=table, slot_mapping=slots, scheduler_metadata=scheduler)
    return meta, types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="layers.0.attn")


@pytest.mark.parametrize("name", list(SPECS))
def test_the_native_path_gives_attnzoos_own_outputs(name):
    """Three requests (prompts of 37, 5 and 70 tokens) in chunks beside decoding requests, then decoding: the native
    path's outputs (vLLM's kernel on mapped rows) equal attnzoo's own path's at every step, float32."""
    spec = SPECS[name]
    native, own = _impl(spec, True), _impl(spec, False)
    caches = [torch.zeros(12, KV_HEADS, BLOCK, 2 * DIM) for _ in range(2)]
    table = torch.tensor([[3, 7, 0], [1, 2, 4], [5, 6, 8]], dtype=torch.int32)
    plan = [[16, 5, 40], [16, 1, 30], [5, 1, 1], [1, 1, 1], [1, 0, 1], [1, 1, 1]]
    done = [0, 0, 0]
    gen = torch.Generator().manual_seed(1)
    for counts in plan:
        active = [i for i, c in enumerate(counts) if c]
        meta, layer = _step([counts[i] for i in active], [done[i] for i in active], table[active])
        n = meta.num_actual_tokens
        q, k, v = (torch.randn(n, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
        outs = []
        for impl, cache in zip((native, own), caches, strict=True):
            out = torch.full((n, HEADS * DIM), float("nan"))
            impl.do_kv_cache_update(layer, k, v, cache, meta.slot_mapping)
            impl.forward(layer, q.clone(), k.clone(), v.clone(), cache, meta, out)
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)
        done = [d + c for d, c in zip(done, counts, strict=True)]


def test_which_specs_are_native():
    """vanilla, SSA's temperatures and QK-norm are native (row maps only); a mask, a logits transform, a cache,
    or a spec's own window (beside the model's) are not; a model's window and soft-capping stay native."""
    from attnzoo.integrations.transformers.native import NativeLayer, compose
    from attnzoo.integrations.vllm.spec import native_call, native_rows
    from attnzoo.spec import load_spec

    def native(name, window=None, softcap=None):
        call = native_call(0, HEADS, KV_HEADS, DIM, DIM ** -0.5, window, softcap, False)
        spec, _ = compose(NativeLayer(call, "llama"), load_spec(name), "spec")
        return native_rows(spec, call, "llama")

    assert all(native(n) for n in ("vanilla", "ssa", "ssa-key", "qk-norm"))
    assert native("ssa", window=16, softcap=30.0)
    assert not any(native(n) for n in ("alibi", "softcap", "yarn", "snapkv", "local", "sink", "off-by-one"))
    assert not native("local", window=16)

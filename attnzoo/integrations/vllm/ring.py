"""A fixed page per request and layer for a checkpoint whose spec evicts (docs/vllm.md, "KV pruning"): vLLM's KV
manager allocates it, one block per request for the request's whole life (vLLM 0.32's ``CircularBufferSpec`` and
``CircularBufferManager``), so the scheduler admits requests by their budget, not their length.

One page holds a layer's pruned cache of one request, ``S = budget + 1`` slots per key/value head (the spare slot is
where a decode step writes the new token before it evicts), in sections aligned to 64 bytes:

``hdr`` int64[8] (magic, tokens held, next position, generation, evicted, expired, scrambled, 0), ``keys`` and
``values`` (1, H_kv, S, D) in the model's dtype, ``positions`` (1, H_kv, S) int64, then one (1, H_kv, S) buffer per
score the spec keeps (the evictor's scores, selective attention's F) in the accumulator dtype.

vLLM never zeroes these pages: a prefill (nothing computed before, for the request) writes the header afresh, and a
decode step checks that the header continues where the request stands. The classes subclass vLLM's and are
module-level, because vLLM sends specs between its processes by pickle; this module imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import CircularBufferManager, register_all_kvcache_specs
from vllm.v1.kv_cache_interface import CircularBufferSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ...decode.paged import PageLayout
from .pages import EVICTED, EXPIRED, GENERATION, HEADER, HELD, MAGIC, NEXT, SCRAMBLED  # noqa: F401 (the header)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RingGeometry(PageLayout):
    """A ring page's layout (:class:`attnzoo.decode.paged.PageLayout`: ``budget + 1`` slots of ``kv_heads`` x
    ``head_dim`` keys and values in ``dtype``, the per-token scores ``state_names`` in ``state_dtype``) and
    ``block_size``: the tokens vLLM counts per block (the request's longest length, rounded up to 128, so vLLM's
    generic slot arithmetic stays inside the page's row of the block table); the page's bytes do not depend on it."""

    block_size: int


#: this process's page geometry, published by the attention impl while the worker builds the model (every layer
#: of a checkpoint shares one record, so one geometry); ``customize_spec`` reads it
GEOMETRY: RingGeometry | None = None


@dataclass(frozen=True, kw_only=True)
class AttnzooRingSpec(CircularBufferSpec):
    """vLLM's one-block-per-request spec with attnzoo's page: one head slot of ``page_bytes`` per block."""

    budget: int = 0

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        return 1  # the whole page is one state, whatever vLLM takes as its kernel block

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return all(isinstance(spec, AttnzooRingSpec) for spec in kv_cache_specs.values())


class AttnzooRingManager(CircularBufferManager):
    """vLLM's manager of one block per request for its whole life (no prefix-cache hits, no block ever added to a
    running request: nothing to preempt for)."""


_REGISTERED = False


def register() -> None:
    """Register the spec and its manager in this process (vLLM's registry fills itself with the built-in specs
    only while it is empty, so they are registered first)."""
    global _REGISTERED
    if _REGISTERED:
        return
    register_all_kvcache_specs(None)
    KVCacheSpecRegistry.register(AttnzooRingSpec, AttnzooRingManager, uniform_type_base_spec=AttnzooRingSpec)
    _REGISTERED = True


def block_size_for(max_model_len: int) -> int:
    return _align(max_model_len, 128)


def ring_spec(spec, geometry: RingGeometry) -> AttnzooRingSpec:
    """The ring spec that replaces a layer's full-attention ``spec`` (``AttentionBackend.customize_spec``)."""
    return AttnzooRingSpec(block_size=geometry.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                           head_size_v=spec.head_size_v, dtype=spec.dtype, num_head_slots=1,
                           state_content_bytes=geometry.page_bytes, budget=geometry.budget)

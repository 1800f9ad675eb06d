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

import torch
from vllm.v1.core.single_type_kv_cache_manager import CircularBufferManager, register_all_kvcache_specs
from vllm.v1.kv_cache_interface import CircularBufferSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .pages import EVICTED, EXPIRED, GENERATION, HEADER, HELD, MAGIC, NEXT, SCRAMBLED  # noqa: F401 (the header)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RingGeometry:
    """What a page holds: ``budget + 1`` slots of ``kv_heads`` x ``head_dim`` keys and values in ``dtype``, and the
    per-token scores ``state_names`` in ``state_dtype``. ``block_size``: the tokens vLLM counts per block (the
    request's longest length, rounded up to 128, so vLLM's generic slot arithmetic stays inside the page's row of
    the block table); the page's bytes do not depend on it."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    budget: int
    state_names: tuple[str, ...]
    state_dtype: torch.dtype
    block_size: int

    @property
    def slots(self) -> int:
        return self.budget + 1

    def layout(self) -> dict[str, tuple[int, int]]:
        """{section: (byte offset, bytes)}, and the page's size under ``"total"``."""
        h, s, d = self.kv_heads, self.slots, self.head_dim
        size = torch.empty((), dtype=self.dtype).element_size()
        score = torch.empty((), dtype=self.state_dtype).element_size()
        sections = [("hdr", HEADER * 8), ("keys", h * s * d * size), ("values", h * s * d * size),
                    ("positions", h * s * 8)] + [(f"state.{n}", h * s * score) for n in self.state_names]
        out, offset = {}, 0
        for name, nbytes in sections:
            out[name] = (offset, nbytes)
            offset = _align(offset + nbytes)
        out["total"] = (0, offset)
        return out

    @property
    def page_bytes(self) -> int:
        return self.layout()["total"][1]

    def views(self, page: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of one page (a contiguous tensor of ``page_bytes`` bytes, any dtype): ``hdr`` (8,),
        ``keys``/``values`` (1, H_kv, S, D), ``positions`` and ``state.<name>`` (1, H_kv, S)."""
        raw = page.reshape(-1).view(torch.uint8)
        if raw.numel() < self.page_bytes:
            raise ValueError(f"a ring page of {raw.numel()} bytes, the geometry needs {self.page_bytes}")
        out = self._sections(raw[:self.page_bytes].view(1, -1))
        out["hdr"] = out["hdr"][0]
        return out

    def all_views(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every page of a layer's cache tensor (blocks first, each block's bytes contiguous):
        ``hdr`` (blocks, 8), ``keys``/``values`` (blocks, H_kv, S, D), ``positions`` and ``state.<name>`` (blocks,
        H_kv, S). One page is ``{name: view[block:block + 1]}`` (``hdr``: ``view[block]``), the same bytes as
        :meth:`views` of ``kv_cache[block]``; a batch of pages is one ``index_select`` per section."""
        blocks = kv_cache.shape[0]
        if blocks == 0 or not kv_cache.is_contiguous():
            raise ValueError(f"ring pages need a contiguous cache tensor with blocks first, got shape "
                             f"{tuple(kv_cache.shape)} (contiguous: {kv_cache.is_contiguous()})")
        raw = kv_cache.view(blocks, -1).view(torch.uint8)
        if raw.shape[1] < self.page_bytes or raw.shape[1] % 8:  # every section starts 8-byte aligned
            raise ValueError(f"a ring block of {raw.shape[1]} bytes, the geometry needs {self.page_bytes} (a "
                             f"multiple of 8)")
        return self._sections(raw)

    def _sections(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The typed sections of pages given as bytes, ``raw`` (pages, bytes per page) uint8, pages first."""
        pages, layout = raw.shape[0], self.layout()
        h, s, d = self.kv_heads, self.slots, self.head_dim

        def section(name, dtype, shape):
            offset, nbytes = layout[name]
            return raw[:, offset:offset + nbytes].view(dtype).view((pages, *shape))

        out = {"hdr": section("hdr", torch.int64, (HEADER,)), "keys": section("keys", self.dtype, (h, s, d)),
               "values": section("values", self.dtype, (h, s, d)),
               "positions": section("positions", torch.int64, (h, s))}
        out.update({f"state.{n}": section(f"state.{n}", self.state_dtype, (h, s)) for n in self.state_names})
        return out

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

"""The vLLM attention backend: vLLM's CPU attention backend, whose layers run the checkpoint's attnzoo spec.

The paged KV cache, its layout (blocks of ``block_size`` tokens, keys and values side by side), the writes of new
keys and values (``do_kv_cache_update``) and the metadata are vLLM's CPU backend's, unchanged: the cache holds the
model's keys and values as the model computed them (after RoPE), and the spec's row maps are applied when they are
read, at their positions. Each layer's attention is a :class:`~.layer.Layer`, made by :func:`~.layer.load_layer`
(the checkpoint's parameters) at the layer's first step; an evicting spec's layers use a ring page per request
(``ring.py``), whose geometry this module publishes for vLLM's KV manager. A layer of a checkpoint without an
attnzoo record is vLLM's own. Installed by ``install.py``."""

from __future__ import annotations

from ...core.numerics import accumulator_dtype
from ...nn import Attention
from ...transforms.base import Slot
from ..transformers.base import IntegrationError
from .layer import Layer, load_layer
from .pages import write
from .spec import layer_spec, native_call, record_of
from .start import CHUNKED_REASON, chunk_size, page_budget
from .tp import rank_heads

#: the row slots mapped as keys and values are written (a native layer with either writes in ``forward``)
_KV = frozenset({Slot.KEY, Slot.VALUE})


def _backend_classes():
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        CPUAttentionMetadataBuilder,
    )

    class AttnzooCPUMetadataBuilder(CPUAttentionMetadataBuilder):
        """vLLM's CPU metadata, with which requests still prefill (``CommonAttentionMetadata.is_prefilling``, as
        ``attnzoo_prefilling``): an evicting spec's chunked prefill evicts a prompt at its first step that is not
        (``layer.Layer._chunks``)."""

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
            meta.attnzoo_prefilling = common_attn_metadata.is_prefilling
            return meta

    class AttnzooCPUImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention impl; with an attnzoo record, its forward runs the layer's spec (module doc)."""

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                     logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                     sinks=None, **extra):
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                             logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, **extra)
            config = get_current_vllm_config()
            self.record = record_of(config.model_config.hf_config, config.model_config.model)
            self.zoo: Layer | None = None
            self.ring = None
            if self.record is None:
                return
            self.model_dir = str(config.model_config.model)
            self.model_type = str(getattr(config.model_config.hf_config, "model_type", "model"))
            self.dtype = config.model_config.dtype
            self.max_rows = config.scheduler_config.max_num_seqs  # the most requests of a step
            #: an evicting spec's prompts in chunks (left on at start only where the evictor allows it)
            self.chunked = bool(config.scheduler_config.enable_chunked_prefill)
            self.native = dict(scale=scale, sliding_window=sliding_window, softcap=logits_soft_cap,
                               has_sinks=sinks is not None)
            where = f"{self.model_dir}: attnzoo spec '{self.record['name']}'"
            self.heads = _rank_heads(config, num_heads, num_kv_heads, where)
            if attn_type != AttentionType.DECODER:
                raise IntegrationError(f"{where}: a {attn_type} attention layer (attnzoo serves decoder layers)")
            if alibi_slopes is not None:
                raise IntegrationError(f"{where}: the model's own ALiBi slopes (alibi_slopes) are not composed "
                                       f"with attnzoo specs; put ALiBi in the spec instead")
            chunk = chunk_size(config.model_config)
            if chunk:  # also refused at start (check_config); an engine started another way is refused here
                raise IntegrationError(f"{where}: {CHUNKED_REASON.format(chunk=chunk)}")
            if kv_sharing_target_layer_name is not None:
                raise IntegrationError(f"{where}: layers sharing another layer's keys and values are not supported")
            if str(kv_cache_dtype) not in ("auto", "float32", "bfloat16", "float16"):
                raise IntegrationError(f"{where}: a quantized KV cache ({kv_cache_dtype}) is not supported")
            # the spec with this layer's native attention, checked now: declined specs fail at engine start
            spec, _ = layer_spec(self.record, native_call(-1, num_heads, num_kv_heads, head_size, **self.native),
                                 self.model_type, where)
            if spec.cache is not None:  # the page's geometry, for customize_spec (ring.py)
                self.ring = _geometry(spec, self.record, num_heads, head_size, num_kv_heads, self.dtype,
                                      config.model_config.max_model_len)

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            if self.record is None:
                return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            if self.ring is not None:  # an evicting spec's layer writes its page in forward
                return None
            zoo = self._layer(layer)
            if zoo.native is None:
                write(key, value, kv_cache, slot_mapping)
            elif not zoo.native.mapped & _KV:  # else written in forward, mapped at the tokens' positions
                super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return None

        def _layer(self, layer) -> Layer:
            if self.zoo is None:
                self.zoo = load_layer(self, layer.layer_name)
            return self.zoo

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if self.record is None:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                       output_block_scale)
            if output_scale is not None or output_block_scale is not None:
                raise IntegrationError("attnzoo's vLLM backend: fused output quantization is not supported")
            if attn_metadata is None:  # a warm-up or profiling run
                return output
            zoo = self._layer(layer)
            if self.ring is not None:
                zoo.attend_pruned(self.ring, query, key, value, kv_cache, attn_metadata, output)
            elif zoo.native is not None:  # vLLM's own kernel on rows the spec maps token by token (native.py)
                n = attn_metadata.num_actual_tokens
                query, key, value = zoo.native.inputs(query[:n], key[:n], value[:n], attn_metadata)
                if zoo.native.mapped & _KV:
                    super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping[:n])
                super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
                zoo.native.output(output, attn_metadata)
            else:
                zoo.attend(query, kv_cache, attn_metadata, output)
            return output

    class AttnzooCPUBackend(CPUAttentionBackend):
        """vLLM's CPU attention backend with :class:`AttnzooCPUImpl` (same cache, same metadata)."""

        @staticmethod
        def get_impl_cls():
            return AttnzooCPUImpl

        @staticmethod
        def get_builder_cls():
            return AttnzooCPUMetadataBuilder

        @classmethod
        def customize_spec(cls, spec):
            """An evicting spec's layers: vLLM's full-attention spec becomes the ring page (``ring.py``)."""
            from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

            from . import ring

            if ring.GEOMETRY is None or isinstance(spec, ring.AttnzooRingSpec) or not isinstance(
                    spec, (FullAttentionSpec, SlidingWindowSpec)):
                return spec
            return ring.ring_spec(spec, ring.GEOMETRY)

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            from vllm.v1.attention.backend import MultipleOf

            from . import ring

            if isinstance(kv_cache_spec, ring.AttnzooRingSpec):
                return [MultipleOf(1)]  # the page is one block, never split
            return CPUAttentionBackend.get_supported_kernel_block_sizes(kv_cache_spec)

    return AttnzooCPUBackend, AttnzooCPUImpl


def _rank_heads(config, num_heads: int, num_kv_heads: int, where: str):
    """This rank's heads under tensor parallelism (:func:`.tp.rank_heads`; vLLM's impl is given the rank's
    ``num_heads`` and ``num_kv_heads``), or None with one rank. Refused (one line) where vLLM's split is not the
    one :mod:`.tp` slices the parameters by."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return None
    try:
        heads = rank_heads(num_heads * size, config.model_config.get_total_num_kv_heads(), size,
                           get_tensor_model_parallel_rank())
    except IntegrationError as exc:
        raise IntegrationError(f"{where}: {exc}") from None
    if (len(heads.heads), len(heads.kv_heads)) != (num_heads, num_kv_heads):
        raise IntegrationError(f"{where}: vLLM gives tensor-parallel rank {heads.rank} {num_heads} query and "
                               f"{num_kv_heads} key/value heads, attnzoo's split {len(heads.heads)} and "
                               f"{len(heads.kv_heads)}")
    return heads


def _geometry(spec, record, num_heads, head_size, num_kv_heads, dtype, max_model_len):
    """The ring page of this process's layers, published as ``ring.GEOMETRY`` (budget: ``start.page_budget``)."""
    from . import ring

    budget = page_budget(record, max_model_len)
    probe = Attention(spec, num_heads, head_size, num_kv_heads, backend="blocked", dtype=dtype).new_cache(
        1, budget=budget)
    ring.GEOMETRY = ring.RingGeometry(num_kv_heads, head_size, dtype, budget, tuple(probe.state_names),
                                      accumulator_dtype(dtype), ring.block_size_for(max_model_len))
    return ring.GEOMETRY


def __getattr__(name):  # the classes subclass vLLM's: made on first use, so this module imports without vLLM
    if name in ("AttnzooCPUBackend", "AttnzooCPUImpl"):
        backend, impl = _backend_classes()
        globals().update(AttnzooCPUBackend=backend, AttnzooCPUImpl=impl)
        return globals()[name]
    raise AttributeError(name)

"""The vLLM attention backend: vLLM's CPU attention backend, whose layers run the checkpoint's attnzoo spec.

The paged KV cache, its layout (blocks of ``block_size`` tokens, keys and values side by side), the writes of new
keys and values (``do_kv_cache_update``) and the metadata are vLLM's CPU backend's, unchanged: the cache holds the
model's keys and values as the model computed them (after RoPE), and the spec's row maps are applied when they are
read, at their positions. Each step, every request's keys and values are gathered from its pages through the block
table and its new queries attend over them with the blocked backend (``blocks``: queries at their positions
against keys at theirs): decoding requests together, as one batch padded after their last key (causality hides
the padding), prefills one by one. A layer of a checkpoint without an attnzoo record is vLLM's own."""

from __future__ import annotations

import math
import sys

import torch

from ...backends.blocked import BlockedBackend
from ...core.numerics import accumulator_dtype
from ...nn import Attention
from ...transforms.base import Dims, Slot
from ..transformers.base import IntegrationError, is_core_key
from ..transformers.saving import ARCHITECTURE_PREFIX, guarded_architecture
from .spec import layer_index, layer_parameters, layer_spec, native_call, record_of
from .start import CHUNKED_REASON, ServeDeclined, budgets, check_config, chunk_size, page_budget

_INSTALLED = False


def install() -> None:
    """Register :class:`AttnzooCPUBackend` in place of vLLM's CPU attention and filter attnzoo's tensors out of
    vLLM's weight loading (they are read by the backend). Refuses, in one line, a vLLM whose hooks moved."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as exc:
        raise IntegrationError(f"attnzoo's vLLM plugin: this vLLM has no {exc.name} (written for vLLM "
                               f"{_tested()}): pip install 'attnzoo[vllm]'") from None
    if not hasattr(DefaultModelLoader, "get_all_weights"):
        raise IntegrationError(f"attnzoo's vLLM plugin: DefaultModelLoader.get_all_weights is gone from this vLLM "
                               f"(written for vLLM {_tested()})")
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.AttnzooCPUBackend")
    from . import ring  # the page of an evicting spec's layers, registered in every process

    ring.register()
    _register_guarded_architectures()
    original = DefaultModelLoader.get_all_weights

    def get_all_weights(self, model_config, model):
        ours = record_of(model_config.hf_config, model_config.model) is not None
        for name, tensor in original(self, model_config, model):
            if not (ours and is_core_key(name)):  # the tensors of attnzoo's cores: read by the backend
                yield name, tensor

    get_all_weights.__wrapped__ = original
    DefaultModelLoader.get_all_weights = get_all_weights
    _check_at_start()
    _INSTALLED = True


def _register_guarded_architectures() -> None:
    """A checkpoint saved by an applied model names its architectures with attnzoo's prefix
    (``AttnzooLlamaForCausalLM``: ``saving.guard_config``), so that vLLM without this plugin refuses it: here each
    of vLLM's architectures is registered under that name too, as the same model."""
    from vllm import ModelRegistry

    models = ModelRegistry.models
    for arch in list(models):
        if not arch.startswith(ARCHITECTURE_PREFIX):
            models.setdefault(guarded_architecture(arch), models[arch])


def _check_at_start() -> None:
    """Check a checkpoint's spec where vLLM checks its configuration, in the process that starts the engine (the
    user's): a declined spec, another platform than the CPU, or tensor/pipeline parallelism is refused there with
    one line, before any worker starts."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        try:
            check_config(vllm_config, current_platform.is_cpu())
        except ServeDeclined as exc:  # the one line first: vLLM's server ends it in a long traceback
            print(f"attnzoo: {exc}", file=sys.stderr, flush=True)
            raise

    platform.check_and_update_config = classmethod(check_and_update_config)


def _tested() -> str:
    from . import TESTED_VLLM

    return TESTED_VLLM


def _backend_classes():
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class AttnzooCPUImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention impl; with an attnzoo record, its forward runs the layer's spec (module doc)."""

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                     logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                     sinks=None, **extra):
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                             logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, **extra)
            config = get_current_vllm_config()
            self.record = record_of(config.model_config.hf_config, config.model_config.model)
            self.zoo: _Layer | None = None
            self.ring = None
            if self.record is None:
                return
            self.model_dir = str(config.model_config.model)
            self.model_type = str(getattr(config.model_config.hf_config, "model_type", "model"))
            self.dtype = config.model_config.dtype
            self.native = dict(scale=scale, sliding_window=sliding_window, softcap=logits_soft_cap,
                               has_sinks=sinks is not None)
            where = f"{self.model_dir}: attnzoo spec '{self.record['name']}'"
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
            if self.ring is None:  # an evicting spec's layer writes its page in forward
                _write(key, value, kv_cache, slot_mapping)
            return None

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if self.record is None:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                       output_block_scale)
            if output_scale is not None or output_block_scale is not None:
                raise IntegrationError("attnzoo's vLLM backend: fused output quantization is not supported")
            if attn_metadata is None:  # a warm-up or profiling run
                return output
            if self.zoo is None:
                self.zoo = _Layer(self, layer.layer_name)
            if self.ring is not None:
                self.zoo.attend_pruned(self.ring, query, key, value, kv_cache, attn_metadata, output)
                return output
            self.zoo.attend(query, kv_cache, attn_metadata, output)
            return output

    class AttnzooCPUBackend(CPUAttentionBackend):
        """vLLM's CPU attention backend with :class:`AttnzooCPUImpl` (same cache, same metadata)."""

        @staticmethod
        def get_impl_cls():
            return AttnzooCPUImpl

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


def _geometry(spec, record, num_heads, head_size, num_kv_heads, dtype, max_model_len):
    """The ring page of this process's layers (published as ``ring.GEOMETRY``, :func:`_page_budget`)."""
    from . import ring

    budget = page_budget(record, max_model_len)
    probe = Attention(spec, num_heads, head_size, num_kv_heads, backend="blocked", dtype=dtype).new_cache(
        1, budget=budget)
    ring.GEOMETRY = ring.RingGeometry(num_kv_heads, head_size, dtype, budget, tuple(probe.state_names),
                                      accumulator_dtype(dtype), ring.block_size_for(max_model_len))
    return ring.GEOMETRY


class _Layer:
    """One vLLM attention layer's attnzoo core: the composed spec, its parameters from the checkpoint, and the
    attention over the paged cache."""

    def __init__(self, impl, layer_name: str) -> None:
        index = layer_index(layer_name)
        where = f"{impl.model_dir}: attnzoo spec '{impl.record['name']}', layer {index}"
        call = native_call(index, impl.num_heads, impl.num_kv_heads, impl.head_size, **impl.native)
        spec, bound = layer_spec(impl.record, call, impl.model_type, where)
        core = Attention(spec, impl.num_heads, impl.head_size, impl.num_kv_heads, backend="blocked",
                         dtype=impl.dtype)
        for key, attribute in bound.items():
            core.bind_parameter(key, impl, attribute)
        found = layer_parameters(impl.model_dir, index)
        wanted = dict(core.state_dict(keep_vars=True))  # every tensor of the core, keyed as layer_parameters keys them
        missing = sorted(set(wanted) - set(found))
        extra = sorted(set(found) - set(wanted))
        if missing or extra:
            raise IntegrationError(f"{where}: the checkpoint's attnzoo parameters do not match the spec ("
                                   f"{'missing ' + missing[0] if missing else 'unexpected ' + extra[0]})")
        with torch.no_grad():
            for name, value in found.items():
                if tuple(value.shape) != tuple(wanted[name].shape):
                    raise IntegrationError(f"{where}: parameter {name} has shape {tuple(value.shape)} in the "
                                           f"checkpoint, the spec needs {tuple(wanted[name].shape)}")
                wanted[name].copy_(value)
        recorded = budgets(impl.record)
        self._adopt(core, recorded[index] if len(recorded) > 1 else recorded[0], where)

    def _adopt(self, core: Attention, budget: int | None, where: str) -> None:
        """Serve ``core`` (its parameters loaded), an evicting spec's pages holding ``budget`` tokens."""
        core.requires_grad_(False)
        self.core, self.plan = core, core.variant.plan
        self.blocked = BlockedBackend()
        self.heads, self.kv_heads, self.head_dim = core.num_heads, core.num_kv_heads, core.head_dim
        self.dims = Dims(self.heads, self.head_dim, self.kv_heads)
        self.budget = budget  # an evicting spec's, for its page
        self.where = where
        #: whether decoding requests with full pages may step as one batch (_full_pages): an evictor's budget and
        #: no window horizon, so each row's step evicts exactly one token
        self.batchable = self.budget is not None and core.new_cache(1, budget=self.budget).horizon is None
        #: what the last re-attached cache of each batch size validated: the next keeps its fast step
        self.states: dict[int, object] = {}
        #: ((data pointer, shape, dtype) of the cache tensor, its pages' typed views): see _pages
        self.page_views: tuple | None = None

    def attend(self, query, kv_cache, meta, output) -> None:
        n = meta.num_actual_tokens
        key_pages, value_pages = _pages(kv_cache)
        starts = meta.query_start_loc.tolist()
        lengths = meta.seq_lens.tolist()
        out = output[:n].view(n, self.heads, self.head_dim)
        decoding = [i for i in range(len(lengths)) if starts[i + 1] - starts[i] == 1]
        if decoding:
            self._decode(query, key_pages, value_pages, meta.block_table, starts, lengths, decoding, out)
        for i in range(len(lengths)):
            if starts[i + 1] - starts[i] > 1:
                rows = slice(starts[i], starts[i + 1])
                k, v = _gather(key_pages, value_pages, meta.block_table[i:i + 1], lengths[i], lengths[i])
                q = query[rows].transpose(0, 1).unsqueeze(0)
                kpos = torch.arange(1, lengths[i] + 1, device=q.device).unsqueeze(0)
                out[rows] = self._attend(q, k, v, kpos[:, lengths[i] - q.shape[2]:], kpos)[0].transpose(0, 1)

    def attend_pruned(self, geometry, query, key, value, kv_cache, meta, output) -> None:
        """An evicting spec: each request's pruned cache lives in its page (``ring.py``; block
        ``block_table[i, 0]``, the same for the request's whole life). A prompt (nothing computed before) runs the
        core's prefill with eviction (:meth:`_prefill`), as attnzoo's own prefill does, and stores what it keeps in
        its page; decoding requests whose pages are full step as one batch (:meth:`_decode_full`), the others one at
        a time (:meth:`_decode_one`). Refused before any page is written: two requests of the step on one page
        (:func:`_distinct_pages`)."""
        n = meta.num_actual_tokens
        pages = self._pages(geometry, kv_cache)
        starts_t = meta.query_start_loc.to(torch.int64)
        counts_t = starts_t[1:] - starts_t[:-1]
        lengths_t = meta.seq_lens.to(torch.int64)
        blocks_t = meta.block_table[:, 0].to(torch.int64)
        blocks = blocks_t.tolist()
        _distinct_pages(blocks, counts_t, self.where)
        out = output[:n].view(n, self.heads, self.head_dim)
        full = self._full_pages(pages, counts_t, lengths_t, blocks_t)
        if full.numel() > 1:  # one request alone takes the step below
            self._decode_full(pages, query, key, value, starts_t.index_select(0, full), blocks_t.index_select(0, full),
                              out)
            counts_t = counts_t.index_fill(0, full, 0)
        starts, lengths = starts_t.tolist(), lengths_t.tolist()
        prompts: dict[int, list[int]] = {}  # prompt length -> its requests
        for i in torch.nonzero(counts_t).flatten().tolist():
            count, length = starts[i + 1] - starts[i], lengths[i]
            if count == length:
                prompts.setdefault(count, []).append(i)
            elif count == 1:
                self._decode_one(pages, query, key, value, starts[i], blocks[i], length - 1, i, out)
            else:
                raise IntegrationError(f"{self.where}: {count} new tokens after {length - count} for request {i}: a "
                                       f"prompt in chunks (chunked prefill is turned off for an evicting spec at "
                                       f"start)")
        for count, rows in prompts.items():
            self._prefill(geometry, pages, query, key, value, [starts[i] for i in rows], count,
                          blocks_t.index_select(0, torch.tensor(rows)), out)

    def _prefill(self, geometry, pages, query, key, value, starts, count, blocks, out) -> None:
        """Prompts of ``count`` tokens each (from ``starts``, into the pages ``blocks``), as one batch: the core's
        prefill with eviction into a fresh cache (each row exactly as alone: the prompts are the same length), the
        kept tokens, in position order, into each page's first slots, the headers afresh (the generation counts a
        page's prefills). Prompts of one length in a step go together: 8 prompts of 512 tokens took 0.85x the time
        of one at a time (the selective prefill kernel, one thread)."""
        from . import ring

        rows = len(starts)
        if rows == 1:
            q, k, v = (t[starts[0]:starts[0] + count].view(count, -1, self.head_dim).transpose(0, 1).unsqueeze(0)
                       for t in (query, key, value))
        else:
            index = (torch.tensor(starts).unsqueeze(1) + torch.arange(count)).flatten()
            q, k, v = (t.index_select(0, index).view(rows, count, -1, self.head_dim).transpose(1, 2)
                       for t in (query, key, value))
        cache = self.core.new_cache(rows, budget=self.budget)
        o = self.core.prefill(q, k, v, cache)
        if cache.num_tokens > geometry.slots:
            raise IntegrationError(f"{self.where}: the cache holds {cache.num_tokens} tokens after the prompt, the "
                                   f"page {geometry.slots}")
        _store(pages, blocks, cache)
        headers = pages["hdr"].index_select(0, blocks)
        pages["hdr"].index_copy_(0, blocks, _headers(cache, torch.where(
            headers[:, 0] == ring.MAGIC, headers[:, ring.GENERATION] + 1, 1)))
        o = o.transpose(1, 2).to(out.dtype)  # (rows, count, H, D)
        if rows == 1:
            out[starts[0]:starts[0] + count] = o[0]
        else:
            out.index_copy_(0, index, o.reshape(rows * count, *o.shape[2:]))

    def _decode_one(self, pages, query, key, value, start, block, done, i, out) -> None:
        """One decode step of one request whose page is not full (or a request alone): a cache attached to its
        page's buffers, the core's decode step; whatever a step moved out of the page is copied back."""
        from . import ring

        header = pages["hdr"][block]
        page = {name: view[block:block + 1] for name, view in pages.items()}
        if int(header[0]) != ring.MAGIC or int(header[ring.NEXT]) != done + 1:
            raise IntegrationError(f"{self.where}: request {i}'s page (block {block}) does not continue at token "
                                   f"{done + 1} (header {header.tolist()})")
        q, k, v = (t[start:start + 1].view(1, -1, 1, self.head_dim) for t in (query, key, value))
        cache = self.core.new_cache(1, budget=self.budget)
        cache.attach(page["keys"], page["values"], page["positions"],
                     {name: page[f"state.{name}"] for name in cache.state_names}, int(header[ring.HELD]),
                     int(header[ring.NEXT]), evicted=int(header[ring.EVICTED]), expired=int(header[ring.EXPIRED]),
                     scrambled=bool(header[ring.SCRAMBLED]), step_state=self.states.get(1))
        o = self.core.decode(q, k, v, cache)
        self.states[1] = cache.step_state
        if _moved(cache, page):  # a step replaced a buffer: the page gets the settled tokens back
            _store(pages, torch.tensor([block]), cache)
        header.copy_(_headers(cache, header[ring.GENERATION])[0])
        out[start] = o[0, :, 0].to(out.dtype)

    def _pages(self, geometry, kv_cache) -> dict[str, torch.Tensor]:
        """The typed views of every page of this layer's cache tensor (``RingGeometry.all_views``), made once per
        cache tensor."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self.page_views is None or self.page_views[0] != key:
            self.page_views = (key, geometry.all_views(kv_cache))
        return self.page_views[1]

    def _full_pages(self, pages, counts, lengths, blocks) -> torch.Tensor:
        """The decoding requests (indices) whose page holds ``budget`` tokens (every request once its history
        reached the budget): one batch for their step. Only where each row's step evicts exactly one token (an
        evictor and no window horizon; the cache's state per row is then the page's)."""
        from . import ring

        if not self.batchable:
            return counts.new_zeros(0)
        headers = pages["hdr"].index_select(0, blocks)
        full = ((counts == 1) & (lengths > 1) & (headers[:, 0] == ring.MAGIC) & (headers[:, ring.HELD] == self.budget)
                & (headers[:, ring.NEXT] == lengths))
        return torch.nonzero(full).flatten()

    def _decode_full(self, pages, query, key, value, index, blocks, out) -> None:
        """One decode step of the requests whose tokens start at ``index`` (full pages in ``blocks``) as one batch,
        the core's decode step (the fused C step over the rows) on one cache holding the rows at their own
        positions. Pages in consecutive blocks (in any order: the rows then go in block order; vLLM hands out free
        blocks in order, so requests admitted together usually are) are that cache's buffers, strided views of the
        pages: the step reads and writes them in place.
        Otherwise each page section is gathered (one ``index_select``, the spare slot included) and the held slots
        scattered back as the step left them (in slot order: a page stays ``scrambled`` while the lean steps leave
        it so); so is whatever an in-place step moved out of the pages."""
        from . import ring

        m, rows = self.budget, blocks.shape[0]
        run = _consecutive(blocks)
        in_place = run is not None
        if in_place:  # the rows in block order
            first, order = run
            blocks, index = blocks.index_select(0, order), index.index_select(0, order)
        headers = pages["hdr"].index_select(0, blocks)
        cache = self.core.new_cache(rows, budget=m)
        names = ("keys", "values", "positions", *(f"state.{n}" for n in cache.state_names))
        home = {name: pages[name].narrow(0, first, rows) if in_place else pages[name].index_select(0, blocks)
                for name in names}
        cache.attach(home["keys"], home["values"], home["positions"],
                     {n: home[f"state.{n}"] for n in cache.state_names}, m, headers[:, ring.NEXT],
                     scrambled=bool(headers[:, ring.SCRAMBLED].any()), step_state=self.states.get(rows))
        q, k, v = (t.index_select(0, index).view(rows, -1, 1, self.head_dim) for t in (query, key, value))
        o = self.core.decode(q, k, v, cache)
        self.states[rows] = cache.step_state
        if cache.num_tokens != m:
            raise IntegrationError(f"{self.where}: a batched step left {cache.num_tokens} tokens, the pages {m}")
        buffers = cache.buffers()
        for name in names:
            held = buffers[name.replace("state.", "held.")]  # a state's held slots: the evictor's own tensor, maybe
            if in_place and held is not None and held.data_ptr() == home[name].data_ptr():
                continue  # the step wrote the page itself
            section = pages[name].narrow(2, 0, m)  # an evictor's own scores tensor may broadcast over heads
            section.index_copy_(0, blocks, held.narrow(2, 0, m).expand(rows, *section.shape[1:]))
        headers[:, ring.NEXT] += 1
        headers[:, ring.EVICTED] += 1
        headers[:, ring.SCRAMBLED] = int(cache.scrambled)
        pages["hdr"].index_copy_(0, blocks, headers)
        out.index_copy_(0, index, o[:, :, 0].to(out.dtype))

    def _decode(self, query, key_pages, value_pages, block_table, starts, lengths, rows, out) -> None:
        """One new token of each request in ``rows``: one batch, keys padded after each row's last (causality
        hides them: the padding's positions come after the query's)."""
        index = torch.tensor([starts[i] for i in rows], device=query.device)
        lens = [lengths[i] for i in rows]
        longest = max(lens)
        k, v = _gather(key_pages, value_pages, block_table[rows], longest, longest)
        q = query.index_select(0, index).unsqueeze(2)  # (B, H, 1, D)
        kpos = torch.arange(1, longest + 1, device=q.device).expand(len(rows), -1)
        qpos = torch.tensor(lens, device=q.device).unsqueeze(1)
        out.index_copy_(0, index, self._attend(q, k, v, qpos, kpos)[:, :, 0])

    def _attend(self, q, k, v, qpos, kpos):
        """q (B, H, T, D) at qpos (B, T), over k, v (B, H_kv, L, D) at kpos (B, L): the spec's row maps at those
        positions, the blocked backend's attention, the output row map."""
        plan = self.plan
        b, h, t, _ = q.shape
        grouped = plan.add_inputs(plan.split_params(self.core.params(), self.dims, q), None, b, h, t, q)
        qs = plan.composition.row_scale(Slot.QUERY, q, qpos.unsqueeze(1), grouped)
        ks = plan.composition.row_scale(Slot.KEY, k, kpos.unsqueeze(1), grouped)
        vs = plan.composition.row_scale(Slot.VALUE, v, kpos.unsqueeze(1), grouped)
        out = self.blocked.attend_rows(plan, qs, ks, vs, qpos, kpos.unsqueeze(1), grouped)
        return plan.composition.row_scale(Slot.OUTPUT, out, qpos.unsqueeze(1), grouped)


def _distinct_pages(blocks: list[int], counts: torch.Tensor, where: str) -> None:
    """Refuse, in one line, a step whose requests with new tokens (``counts`` > 0) do not each have their own page
    (``blocks``, one per request: the first column of vLLM's block table). A ring page is one request's for its
    whole life, so a shared block is a scheduler or KV-manager bug; stepped anyway, each request would read and
    write the other's tokens (and a batched write keeps one row's). Checked before anything is written, over every
    path (batched and lone steps, prefills) at once, by a set of the block ids the step lists anyway (0.2 us for 8
    requests, 0.9 us for 64: under 0.1% of a layer's batched step; a tensor sort took 8 us)."""
    if len(set(blocks)) == len(blocks):
        return
    live = counts.gt(0).tolist()  # a request without new tokens this step writes nothing
    owners: dict[int, list[str]] = {}
    for row, (block, writes) in enumerate(zip(blocks, live, strict=True)):
        if writes:
            owners.setdefault(block, []).append(str(row))
    for block, rows in owners.items():
        if len(rows) > 1:
            raise IntegrationError(f"{where}: vLLM's scheduler gave requests {', '.join(rows[:-1])} and {rows[-1]} of "
                                   f"this step (rows of its batch) the same ring page, block {block}: a page is one "
                                   f"request's for its whole life; nothing was written")


def _consecutive(blocks: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(the first block, the order that sorts ``blocks``) if ``blocks`` are consecutive once sorted (one strided
    view then holds their pages, in that order), else None."""
    ordered, order = blocks.sort()
    first = int(ordered[0])
    return (first, order) if bool((ordered == torch.arange(first, first + blocks.shape[0])).all()) else None


def _headers(cache, generation) -> torch.Tensor:
    """Each row's page header (B, 8) after a step of ``cache`` (ring.py: magic, tokens held, next position,
    generation (an int or a (B,) tensor), evicted, expired, scrambled, 0)."""
    from . import ring

    out = torch.tensor([ring.MAGIC, cache.num_tokens, 0, 0, cache.evicted, cache.expired, int(cache.scrambled), 0],
                       dtype=torch.int64).repeat(cache.batch, 1)
    out[:, ring.NEXT] = cache.next_position.to(torch.int64).reshape(cache.batch)
    out[:, ring.GENERATION] = generation
    return out


def _store(pages, blocks: torch.Tensor, cache) -> None:
    """Each row of ``cache``'s tokens, in position order, into the first slots of its page (``blocks``, one per
    row)."""
    held = cache.num_tokens
    if not held:
        return
    for name, got in (("keys", cache.keys), ("values", cache.values), ("positions", cache.positions),
                      *((f"state.{n}", cache.state[n]) for n in cache.state_names)):
        home = pages[name].narrow(2, 0, held)  # an evictor's own scores tensor may broadcast over heads
        home.index_copy_(0, blocks, got.to(home.dtype).expand(blocks.shape[0], *home.shape[1:]))


def _moved(cache, page) -> bool:
    """Whether a buffer of ``cache`` (attached to ``page``) is no longer the page's."""
    for name, buf in cache.buffers().items():
        home = page[name.replace("held.", "state.")]
        if buf is None or buf.data_ptr() != home.data_ptr():
            return True
    return False


def _pages(kv_cache):
    """(key pages, value pages), each (blocks, H_kv, block_size, D), of vLLM's CPU cache tensor (blocks, H_kv,
    block_size, 2 D): a page's keys, then its values, each token's row contiguous (attnzoo's layers write and read
    this layout themselves, whatever layout vLLM's kernels pick for the CPU's instruction set)."""
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    pages = kv_cache.view(blocks, kv_heads, 2 * block_size, two_d // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


def _write(key, value, kv_cache, slot_mapping) -> None:
    """The new tokens' keys and values (T, H_kv, D) into their slots (``slot_mapping`` (T,): page * block_size +
    offset; negative: a padding token, not written)."""
    key_pages, value_pages = _pages(kv_cache)
    block_size = key_pages.shape[2]
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    page, offset = slots // block_size, slots % block_size
    key_pages[page, :, offset] = key[:slots.shape[0]].to(key_pages.dtype)
    value_pages[page, :, offset] = value[:slots.shape[0]].to(value_pages.dtype)


def _gather(key_pages, value_pages, block_table, length: int, width: int):
    """Keys and values (B, H_kv, width, D) of the requests whose block-table rows are ``block_table`` (B, blocks),
    their first ``length`` tokens (the rest of the last page: whatever it holds, hidden by causality)."""
    block_size = key_pages.shape[2]
    count = math.ceil(width / block_size)
    ids = block_table[:, :count].to(torch.int64)
    b = ids.shape[0]

    def pages(p):
        got = p.index_select(0, ids.reshape(-1))  # (B * count, H_kv, block_size, D)
        got = got.view(b, count, p.shape[1], block_size, p.shape[3]).permute(0, 2, 1, 3, 4)
        return got.reshape(b, p.shape[1], count * block_size, p.shape[3])[:, :, :width]

    return pages(key_pages), pages(value_pages)


def __getattr__(name):  # the classes subclass vLLM's: made on first use, so this module imports without vLLM
    if name in ("AttnzooCPUBackend", "AttnzooCPUImpl"):
        backend, impl = _backend_classes()
        globals().update(AttnzooCPUBackend=backend, AttnzooCPUImpl=impl)
        return globals()[name]
    raise AttributeError(name)

"""The attention of one vLLM layer under an attnzoo spec (``backend.py``'s impl runs it): over vLLM's paged cache,
every request's keys and values gathered from its pages through the block table and its new queries attending over
them with the blocked backend (queries at their positions against keys at theirs): decoding requests together, as
one batch padded after their last key (causality hides the padding), prefills one by one; over an evicting spec's
ring pages (``ring.py``), the core's prefill with eviction and decode steps on a cache whose storage is the pages
(:mod:`attnzoo.decode.paged`: opened on them, committed after each step, their headers its state). The step's
requests are read from vLLM's metadata once per forward (``step.py``); vLLM's own pages' bytes are read and written
by ``pages.py``."""

from __future__ import annotations

import weakref

import torch

from ...backends.blocked import BlockedBackend
from ...decode.paged import NEXT, Pages
from ...nn import Attention
from ...transforms.base import Dims, Slot
from ..transformers.base import IntegrationError
from . import pages as pg
from .native import RowMaps
from .spec import layer_index, layer_parameters, layer_spec, native_call, native_rows
from .start import budgets
from .step import step_of
from .tp import slice_parameters

#: every serving layer of this process, for :func:`drop_staged` (vLLM's model runner tells of finished requests)
_LAYERS: weakref.WeakSet = weakref.WeakSet()


def drop_staged(blocks) -> None:
    """Forget the staged prompts of pages ``blocks`` in every layer of this process: their requests finished or
    were preempted (``install``'s wrap of the model runner's ``_update_states``), so no later step of theirs will
    evict them (a request that ends with its prompt, ``max_tokens=1``, never has a decode step)."""
    blocks = set(blocks)
    for layer in list(_LAYERS):
        for block in blocks & layer.staged.keys():
            del layer.staged[block]


class Layer:
    """One vLLM attention layer's attnzoo core (the composed spec, its parameters loaded) and the attention over the
    paged cache: vLLM's pages (:meth:`attend`) or an evicting spec's ring pages (:meth:`attend_pruned`)."""

    def __init__(self, core: Attention, budget: int | None, where: str, max_rows: int | None = None,
                 chunked: bool = False, native: bool = False) -> None:
        """Serve ``core`` (its parameters loaded: :func:`load_layer`), an evicting spec's pages holding ``budget``
        tokens; ``where`` names the layer in errors; ``max_rows``: the most requests of a step (vLLM's
        ``max_num_seqs``; None: the cache's blocks), the capacity of the pages a batched step gathers
        (:class:`attnzoo.decode.paged.Pages`); ``chunked``: an evicting spec's prompts are staged until their last chunk
        (:meth:`_stage`; vLLM's chunked prefill on, for an evictor that allows it: ``start.chunk_refusal``);
        ``native``: the spec is the layer's native attention over rows mapped token by token
        (:func:`.spec.native_rows`): vLLM's own kernel attends, on rows mapped by :attr:`native`
        (:class:`.native.RowMaps`)."""
        core.requires_grad_(False)
        self.core, self.plan = core, core.variant.plan
        self.blocked = BlockedBackend()
        self.heads, self.kv_heads, self.head_dim = core.num_heads, core.num_kv_heads, core.head_dim
        self.dims = Dims(self.heads, self.head_dim, self.kv_heads)
        self.budget = budget  # an evicting spec's, for its page
        #: a native layer's row maps around vLLM's own kernel (``native.py``), None for attnzoo's own attention
        self.native = RowMaps(self) if native else None
        self.where = where
        self.max_rows = max_rows
        #: whether decoding requests with full pages may step as one batch (_full_pages): an evictor's budget and
        #: no window horizon, so each row's step evicts exactly one token
        self.batchable = self.budget is not None and core.new_cache(1, budget=self.budget).horizon is None
        #: what the last cache opened on pages for each batch size validated: the next keeps its fast step
        self.states: dict[int, object] = {}
        #: ((data pointer, shape, dtype) of the cache tensor, its pages: :class:`attnzoo.decode.paged.Pages`): see
        #: :meth:`_pages`
        self.page_views: tuple | None = None
        #: the last batched step's cache on its pages (:class:`attnzoo.decode.paged.PagedKVCache`), stepped again
        #: while the pages are as its commit left them (:meth:`_decode_full`), else None
        self.running = None
        self.chunked = chunked
        #: a prompt's staging until its last chunk, by its page (block): (its keys, values (L, H_kv, D) as vLLM
        #: computed them, its last ``rows`` queries (R, H, D), L)
        self.staged: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        evictor = core.new_cache(1, budget=budget).evictor if budget is not None else None
        #: the prompt's last query rows the evictor reads at its prefill (``probability_rows``), staged with it
        self.rows = int(evictor.probability_rows or 0) if evictor is not None and evictor.needs_probabilities else 0
        _LAYERS.add(self)

    def attend(self, query, kv_cache, meta, output) -> None:
        """A spec without eviction, over vLLM's pages: the decoding requests as one batch (:meth:`_decode`), each
        prompt or chunk of one alone (the step's requests: :func:`.step.step_of`, once per forward)."""
        n = meta.num_actual_tokens
        key_pages, value_pages = pg.kv_pages(kv_cache)
        step = step_of(meta)
        starts, lengths = step.starts, step.lengths
        out = output[:n].view(n, self.heads, self.head_dim)
        if step.decoding:
            self._decode(query, key_pages, value_pages, meta.block_table, step, out)
        for i in range(len(lengths)):
            if starts[i + 1] - starts[i] > 1:
                rows = slice(starts[i], starts[i + 1])
                k, v = pg.gather(key_pages, value_pages, meta.block_table[i:i + 1], lengths[i], lengths[i])
                q = query[rows].transpose(0, 1).unsqueeze(0)
                kpos = torch.arange(1, lengths[i] + 1, device=q.device).unsqueeze(0)
                out[rows] = self._attend(q, k, v, kpos[:, lengths[i] - q.shape[2]:], kpos)[0].transpose(0, 1)

    def attend_pruned(self, geometry, query, key, value, kv_cache, meta, output) -> None:
        """An evicting spec: each request's pruned cache lives in its page (``ring.py``; block
        ``block_table[i, 0]``, the same for the request's whole life). A prompt (nothing computed before) runs the
        core's prefill with eviction (:meth:`_prefill`), as attnzoo's own prefill does, and stores what it keeps in
        its page; decoding requests whose pages are full step as one batch (:meth:`_decode_full`), the others one at
        a time (:meth:`_decode_one`). Refused before any page is written: two requests of the step on one page
        (:func:`.pages.distinct_pages`, once per forward). The step's requests are read from ``meta`` once per forward
        (:func:`.step.step_of`); which pages are full, from this layer's headers."""
        n = meta.num_actual_tokens
        pages = self._pages(geometry, kv_cache)
        step = step_of(meta)
        step.check_distinct(self.where)
        counts_t, blocks_t = step.counts_t, step.blocks_t
        starts, lengths, blocks = step.starts, step.lengths, step.blocks
        out = output[:n].view(n, self.heads, self.head_dim)
        if self.chunked:
            counts_t = self._chunks(pages, query, key, value, step, counts_t, out)
        full, full_starts, full_blocks, full_lengths = self._full_pages(step, counts_t)
        if full.numel() > 1:  # one request alone takes the step below
            self._decode_full(pages, query, key, value, full_starts, full_blocks, full_lengths, out)
            if full.numel() == step.active:  # every request of the step (the steady state of decoding)
                return
            counts_t = counts_t.index_fill(0, full, 0)  # a new tensor: the step's is the other layers' too
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
            self._prefill(pages, query, key, value, [starts[i] for i in rows], count,
                          blocks_t.index_select(0, torch.tensor(rows)), out)

    def _chunks(self, pages, query, key, value, step, counts_t, out) -> torch.Tensor:
        """Chunked prefill (``self.chunked``): each prefilling request's chunk (vLLM's ``is_prefilling``: its
        computed tokens below its prompt's before the step; :attr:`.step.Step.prefilling`) staged and attended
        (:meth:`_stage`); a request whose prompt is staged and which no longer prefills (its first decode step) has
        its prompt evicted into its page first (:meth:`_finish`), then steps as any decoding request. Returns
        ``counts_t`` with the staged chunks' requests at 0 (nothing left for them in this step)."""
        prefilling = step.prefilling
        if prefilling is None:
            raise IntegrationError(f"{self.where}: vLLM's metadata says not which requests still prefill "
                                   f"(is_prefilling): chunked prefill of an evicting spec needs it")
        staged = []
        for i, count in enumerate(step.counts):
            if count and prefilling[i]:
                self._stage(pages, query, key, value, step.starts[i], count, step.lengths[i],
                            step.blocks[i], out)
                staged.append(i)
            elif count and step.blocks[i] in self.staged:
                self._finish(pages, step.blocks[i], step.lengths[i] - count, query)
        return counts_t.index_fill(0, torch.tensor(staged, dtype=torch.int64), 0) if staged else counts_t

    def _stage(self, pages, query, key, value, start, count, length, block, out) -> None:
        """One chunk of a prompt (``count`` tokens ending at ``length``, page ``block``), its keys and values staged
        with the prompt's, the last ``rows`` queries kept for the evictor's prefill scoring. A prompt's first chunk
        (nothing computed before) runs the whole-prompt step (:meth:`_prefill`: its outputs, and its page as the
        whole prompt's when no other chunk follows, the ordinary case of a prompt that fits one step); a later
        chunk's queries attend over the staged prompt so far (causal: as the whole prompt's rows do), and its page
        holds no request's state until :meth:`_finish`."""
        done = length - count
        k, v = (t[start:start + count].view(count, -1, self.head_dim) for t in (key, value))
        q = query[start:start + count].view(count, -1, self.head_dim)
        if done == 0:
            self.staged[block] = (k.clone(), v.clone(), q[count - min(self.rows, count):].clone(), length)
            self._prefill(pages, query, key, value, [start], count, torch.tensor([block]), out)
            return
        held = self.staged.get(block)
        if held is None or held[3] != done:
            raise IntegrationError(f"{self.where}: a chunk of {count} tokens after {done} on page {block}, whose "
                                   f"staging holds {held[3] if held else 'nothing'}")
        pages.headers[block, NEXT] = 0  # no decode step may take the page before the prompt is evicted
        keys, values = torch.cat((held[0], k)), torch.cat((held[1], v))
        rows = torch.cat((held[2], q))[-self.rows:] if self.rows else held[2]
        self.staged[block] = (keys, values, rows, length)
        kpos = torch.arange(1, length + 1, device=q.device).unsqueeze(0)
        o = self._attend(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                         values.transpose(0, 1).unsqueeze(0), kpos[:, done:], kpos)
        out[start:start + count] = o[0].transpose(0, 1)

    def _finish(self, pages, block, length, query) -> None:
        """The staged prompt of page ``block`` (``length`` tokens) evicted into its page, unless it came in one
        chunk (the page holds it already: :meth:`_stage`), as the whole prompt's step (:meth:`_prefill`) evicts it,
        without attending the prompt again (each chunk's outputs were written by :meth:`_stage`): its first
        ``length - R`` tokens go into a fresh cache through the key and value slots, unattended and unevicted, and
        its last R tokens (R: the evictor's ``probability_rows``, at least 1) are the core's prefill with eviction over
        the whole prompt, the staged queries in their rows: the evictor reads those rows' probabilities (its
        ``probability_rows``: it reads no other) and the held tokens, as after the whole prompt's prefill."""
        keys, values, rows, staged = self.staged.pop(block)
        if staged != length:
            raise IntegrationError(f"{self.where}: page {block}'s staged prompt holds {staged} tokens, its request "
                                   f"{length}")
        if int(pages.headers[block, NEXT]) == length + 1:  # one chunk: evicted by the whole-prompt step
            return
        last = min(max(rows.shape[0], 1), length)
        head = length - last
        cache = self.core.new_cache(1, budget=None if head else self.budget)
        if head:
            plan = self.plan
            k, v = (t[:head].transpose(0, 1).unsqueeze(0) for t in (keys, values))  # (1, H_kv, head, D)
            grouped = self.grouped(k.new_zeros(1, self.heads, 1, self.head_dim))
            kpos = torch.arange(1, head + 1, device=k.device).view(1, 1, head)
            cache.append(plan.composition.row_scale(Slot.KEY, k, kpos, grouped).contiguous(),
                         plan.composition.row_scale(Slot.VALUE, v, kpos, grouped).contiguous())
            cache.budget = self.budget
            cache.step_state.forget()
        q = keys.new_zeros(last, self.heads, self.head_dim)
        if rows.shape[0]:
            q[last - min(rows.shape[0], last):] = rows[-last:]
        with torch.no_grad():
            self.core.prefill(q.transpose(0, 1).unsqueeze(0), *(t[head:].transpose(0, 1).unsqueeze(0)
                                                                 for t in (keys, values)), cache)
        self._into_pages(pages, torch.tensor([block]), cache)

    def _into_pages(self, pages, blocks, cache) -> None:
        """A cache's kept tokens after a prompt (one row per page ``blocks``), in position order, into each page's
        first slots, and the headers afresh (:meth:`attnzoo.decode.paged.Pages.write`)."""
        try:
            pages.write(blocks, cache)
        except ValueError as exc:
            raise IntegrationError(f"{self.where}: {exc}") from None

    def _prefill(self, pages, query, key, value, starts, count, blocks, out) -> None:
        """Prompts of ``count`` tokens each (from ``starts``, into the pages ``blocks``), as one batch: the core's
        prefill with eviction into a fresh cache (each row exactly as alone: the prompts are the same length), the
        kept tokens, in position order, into each page's first slots, the headers afresh (the generation counts a
        page's prefills). Prompts of one length in a step go together: 8 prompts of 512 tokens took 0.85x the time
        of one at a time (the selective prefill kernel, one thread)."""
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
        self._into_pages(pages, blocks, cache)
        o = o.transpose(1, 2).to(out.dtype)  # (rows, count, H, D)
        if rows == 1:
            out[starts[0]:starts[0] + count] = o[0]
        else:
            out.index_copy_(0, index, o.reshape(rows * count, *o.shape[2:]))

    def _decode_one(self, pages, query, key, value, start, block, done, i, out) -> None:
        """One decode step of one request whose page is not full (or a request alone): a cache opened on its page
        (:meth:`attnzoo.decode.paged.Pages.open`, the header checked: the request's next token is ``done + 1``), the
        core's decode step, the step committed to the page."""
        q, k, v = (t[start:start + 1].view(1, -1, 1, self.head_dim) for t in (query, key, value))
        cache = self._open(pages, torch.tensor([block]), None, torch.tensor([done + 1]), f"request {i}'s page")
        o = self.core.decode(q, k, v, cache)
        self.states[1] = cache.step_state
        cache.commit()
        out[start] = o[0, :, 0].to(out.dtype)

    def _open(self, pages, blocks, held, nexts, what):
        """A cache over ``pages``' ``blocks`` (:meth:`attnzoo.decode.paged.Pages.open`), or one line naming this
        layer and ``what`` where a page's header says otherwise."""
        try:
            return pages.open(self.core.new_cache(blocks.shape[0], budget=self.budget), blocks, held=held,
                              next_position=nexts, step_state=self.states.get(blocks.shape[0]))
        except ValueError as exc:
            raise IntegrationError(f"{self.where}: {what}: {exc}") from None

    def _pages(self, geometry, kv_cache) -> Pages:
        """This layer's cache tensor as pages (``RingGeometry.all_views``, :class:`attnzoo.decode.paged.Pages`),
        made once per cache tensor."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self.page_views is None or self.page_views[0] != key:
            self.page_views = (key, Pages(geometry.all_views(kv_cache), self.max_rows))
            self.running = None
        return self.page_views[1]

    def _full_pages(self, step, counts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoding requests (indices) whose page holds ``budget`` tokens: one batch for their step. Only where
        each row's step evicts exactly one token (an evictor and no window horizon), so a page holds ``min(prompt,
        budget)`` tokens after its prompt and one more per step up to the budget: a request with one new token and
        ``length - 1 >= budget`` before it (:meth:`.step.Step.full_rows`, once per forward for every layer of that
        budget); :meth:`_decode_full` checks it against each page's header before anything is written. ``counts``:
        the step's, with the staged chunks' requests at 0 (a one-token chunk of a prompt is not a decode step).
        Returns (the requests, their first query rows, blocks, lengths)."""
        if not self.batchable:
            none = counts.new_zeros(0)
            return none, none, none, none
        batch = step.full_rows(self.budget)
        full = batch[0]
        if self.chunked and full.numel():
            kept = full[counts.index_select(0, full) == 1]
            if kept.numel() != full.numel():
                batch = (kept, *(t.index_select(0, kept) for t in (step.starts_t, step.blocks_t, step.lengths_t)))
        return batch

    def _decode_full(self, pages, query, key, value, index, blocks, lengths, out) -> None:
        """One decode step of the requests whose tokens start at ``index`` (full pages in ``blocks``) as one batch,
        the core's decode step (the fused C step over the rows) on one cache over their pages
        (:class:`attnzoo.decode.paged.PagedKVCache`): in place where the blocks are consecutive (in any order: the
        rows then go in block order; vLLM hands out free blocks in order, so requests admitted together usually
        are), else gathered and written back by the cache's commit. The cache of the last batched step steps again
        while its pages are as its commit left them and the requests are the same (:meth:`PagedKVCache.current`:
        nothing opened, nothing laid out, no header gathered)."""
        m = self.budget
        cache = self.running
        if not (cache is not None and cache.given.shape == blocks.shape and torch.equal(cache.given, blocks)
                and cache.current(lengths)):
            self.running = None
            cache = self._open(pages, blocks, m, lengths, "a decoding request's page")
        if cache.order is not None:  # the rows in block order
            index = index.index_select(0, cache.order)
        q, k, v = (t.index_select(0, index).view(cache.batch, -1, 1, self.head_dim) for t in (query, key, value))
        o = self.core.decode(q, k, v, cache)
        self.states[cache.batch] = cache.step_state
        if cache.num_tokens != m:
            raise IntegrationError(f"{self.where}: a batched step left {cache.num_tokens} tokens, the pages {m}")
        self.running = cache if cache.commit() else None
        out.index_copy_(0, index, o[:, :, 0].to(out.dtype))

    def _decode(self, query, key_pages, value_pages, block_table, step, out) -> None:
        """One new token of each decoding request of ``step``: one batch, keys padded after each row's last
        (causality hides them: the padding's positions come after the query's)."""
        index, longest, qpos, kpos = step.decode_batch(query.device)
        k, v = pg.gather(key_pages, value_pages, block_table[step.decoding], longest, longest)
        q = query.index_select(0, index).unsqueeze(2)  # (B, H, 1, D)
        out.index_copy_(0, index, self._attend(q, k, v, qpos, kpos)[:, :, 0])

    def grouped(self, q):
        """The core's parameters as the plan's row maps take them, for queries ``q`` (B, H, T, D)."""
        b, h, t, _ = q.shape
        return self.plan.add_inputs(self.plan.split_params(self.core.params(), self.dims, q), None, b, h, t, q)

    def _attend(self, q, k, v, qpos, kpos):
        """q (B, H, T, D) at qpos (B, T), over k, v (B, H_kv, L, D) at kpos (B, L): the spec's row maps at those
        positions, the blocked backend's attention, the output row map."""
        plan = self.plan
        grouped = self.grouped(q)
        qs = plan.composition.row_scale(Slot.QUERY, q, qpos.unsqueeze(1), grouped)
        ks = plan.composition.row_scale(Slot.KEY, k, kpos.unsqueeze(1), grouped)
        vs = plan.composition.row_scale(Slot.VALUE, v, kpos.unsqueeze(1), grouped)
        out = self.blocked.attend_rows(plan, qs, ks, vs, qpos, kpos.unsqueeze(1), grouped)
        return plan.composition.row_scale(Slot.OUTPUT, out, qpos.unsqueeze(1), grouped)


def load_layer(impl, layer_name: str) -> Layer:
    """The :class:`Layer` of vLLM's attention impl ``impl`` (``backend.AttnzooCPUImpl``: its record, heads, native
    attention, dtype and checkpoint directory) for the layer ``layer_name``: the layer's spec composed with its
    native attention, the core built, its parameters bound to the impl's (the native scale, ...) and the rest read
    from the checkpoint's safetensors files (all of them, each of its shape, or one line naming the first that is
    not), under tensor parallelism sliced to the rank's heads (``impl.heads``: :func:`.tp.slice_parameters`), its
    budget from the record."""
    index = layer_index(layer_name)
    where = f"{impl.model_dir}: attnzoo spec '{impl.record['name']}', layer {index}"
    call = native_call(index, impl.num_heads, impl.num_kv_heads, impl.head_size, **impl.native)
    spec, bound = layer_spec(impl.record, call, impl.model_type, where)
    core = Attention(spec, impl.num_heads, impl.head_size, impl.num_kv_heads, backend="blocked",
                     dtype=impl.dtype)
    for key, attribute in bound.items():
        core.bind_parameter(key, impl, attribute)
    found = layer_parameters(impl.model_dir, index)
    heads = getattr(impl, "heads", None)  # tensor parallel: this rank's heads (tp.py), their parameters sliced
    if heads is not None:
        where = f"{where}, tensor-parallel rank {heads.rank} of {heads.size}"
        try:
            found = slice_parameters(found, core.variant.plan, heads)
        except IntegrationError as exc:
            raise IntegrationError(f"{where}: {exc}") from None
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
    return Layer(core, recorded[index] if len(recorded) > 1 else recorded[0], where, getattr(impl, "max_rows", None),
                 getattr(impl, "chunked", False), native_rows(spec, call, impl.model_type))

"""Pages as a cache's storage (docs/decoding.md, "Pages"): a serving engine keeps each request's pruned cache of a
layer in a fixed page of its own memory, and steps it there.

A page holds ``budget + 1`` slots per key/value head (the spare slot is where a decode step writes the new token
before it evicts one) in sections, each 64-byte aligned (:class:`PageLayout`): ``hdr`` int64[8], ``keys`` and
``values`` (1, H_kv, S, D) in the model's dtype, ``positions`` (1, H_kv, S) int64, then one (1, H_kv, S) buffer per
per-token score the spec keeps (the evictor's scores, selective attention's F) in the accumulator dtype. The header
is the cache's state between steps: magic, tokens held, next position, generation (a page's prefills), tokens
evicted, tokens expired, whether the slots are out of position order (a lean step's), 0.

- :class:`Pages`: one layer's pages (every page's sections, pages first): a prompt's kept tokens written into its
  page (:meth:`Pages.write`), and a :class:`PagedKVCache` opened over a batch of pages (:meth:`Pages.open`).
- :class:`PagedKVCache`: a :class:`~.storage.KVCache` whose buffers are the pages themselves when they are
  consecutive (strided views: a step reads and writes them in place), else a gathered copy written back after
  the step; its :meth:`~PagedKVCache.commit` makes the pages' headers its state after a step (in place), and
  :meth:`~PagedKVCache.current` tells whether it may step again on its pages (no one else wrote them since).

Pages are never zeroed by their host: a page's header is checked before a cache is opened on it, and a prompt writes
it afresh. Nothing here knows a host; ``attnzoo.integrations.vllm`` serves vLLM's pages with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .storage import KVCache

__all__ = ["EVICTED", "EXPIRED", "GENERATION", "HEADER", "HELD", "MAGIC", "NEXT", "SCRAMBLED", "PageLayout",
           "PagedKVCache", "Pages", "consecutive"]

#: a page's header: int64[HEADER] of magic, tokens held, next position, generation, evicted, expired, scrambled, 0
MAGIC = 0x5A4F4F52494E47  # "ZOORING"
HEADER = 8
HELD, NEXT, GENERATION, EVICTED, EXPIRED, SCRAMBLED = range(1, 7)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class PageLayout:
    """What a page holds: ``budget + 1`` slots of ``kv_heads`` x ``head_dim`` keys and values in ``dtype``, and the
    per-token scores ``state_names`` in ``state_dtype``, each section 64-byte aligned after the header."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    budget: int
    state_names: tuple[str, ...]
    state_dtype: torch.dtype

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
            raise ValueError(f"a page of {raw.numel()} bytes, the layout needs {self.page_bytes}")
        out = self._sections(raw[:self.page_bytes].view(1, -1))
        out["hdr"] = out["hdr"][0]
        return out

    def all_views(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every page of a tensor of pages (pages first, each page's bytes contiguous): ``hdr``
        (pages, 8), ``keys``/``values`` (pages, H_kv, S, D), ``positions`` and ``state.<name>`` (pages, H_kv, S). One
        page is ``{name: view[p:p + 1]}`` (``hdr``: ``view[p]``), the same bytes as :meth:`views` of ``pages[p]``."""
        count = pages.shape[0] if pages.dim() else 0
        if count == 0 or not pages.is_contiguous():
            raise ValueError(f"pages need a contiguous tensor with pages first, got shape {tuple(pages.shape)} "
                             f"(contiguous: {pages.is_contiguous()})")
        raw = pages.view(count, -1).view(torch.uint8)
        if raw.shape[1] < self.page_bytes or raw.shape[1] % 8:  # every section starts 8-byte aligned
            raise ValueError(f"a page of {raw.shape[1]} bytes, the layout needs {self.page_bytes} (a multiple of 8)")
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


def consecutive(blocks: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(the first page, the order that sorts ``blocks``) if ``blocks`` are consecutive once sorted (one strided
    view then holds their pages, in that order), else None."""
    ordered, order = blocks.sort()
    first = int(ordered[0])
    return (first, order) if bool((ordered == torch.arange(first, first + blocks.shape[0])).all()) else None


#: the gathered sections of batches whose pages are not consecutive (:meth:`Pages.open`): one buffer per section
#: shape for the whole process, shared by every layer's pages (a host steps its layers one after another; a cache's
#: gathered pages are written back by its commit before the next layer's step), its capacity the most pages a batch
#: can hold (set at the first gathered batch). A fresh gathered tensor per step kept one copy of the pages per batch
#: size and layer alive in a serving engine (the pruned server's memory grew round after round).
_GATHERED: dict[tuple, torch.Tensor] = {}
#: the cache whose batch each shared buffer holds (a weak reference, by the key of :data:`_GATHERED`): a cache opened
#: while another holds a buffer and has not committed gets buffers of its own, and a cache whose buffer another has
#: taken since is refused at its next step (:attr:`PagedKVCache.step_state`)
_HOLDER: dict[tuple, weakref.ref] = {}


def _key(name: str, section: torch.Tensor) -> tuple:
    return (name, section.dtype, tuple(section.shape[1:]))


def _in_use(key: tuple) -> bool:
    """Whether the shared buffer ``key`` holds the batch of a cache that has not committed yet."""
    ref = _HOLDER.get(key)
    holder = ref() if ref is not None else None
    return holder is not None and holder._pending  # noqa: SLF001 -- this module's own class


def _gathered(name: str, section: torch.Tensor, blocks: torch.Tensor, capacity: int, shared: bool) -> torch.Tensor:
    """The pages ``blocks`` of ``section`` (pages first), copied into the first rows of this process's buffer for
    that section (:data:`_GATHERED`; ``capacity`` rows, or ``blocks``' count if more), or into a buffer of their
    own (not ``shared``: another cache holds the process's)."""
    rows = blocks.shape[0]
    if not shared:
        return section.index_select(0, blocks)
    key = _key(name, section)
    buffer = _GATHERED.get(key)
    if buffer is None or buffer.shape[0] < rows:
        buffer = _GATHERED[key] = section.new_empty((max(rows, capacity), *section.shape[1:]))
    out = buffer.narrow(0, 0, rows)
    torch.index_select(section, 0, blocks, out=out)
    return out


class Pages:
    """One layer's pages: the typed sections of every page (``sections``, pages first, as
    :meth:`PageLayout.all_views` makes them, ``hdr`` (pages, 8) among them). ``capacity``: the most pages a batch
    holds (the host's most requests a step; its gathered copies are that big)."""

    def __init__(self, sections: dict[str, torch.Tensor], capacity: int | None = None) -> None:
        self.sections = sections
        self.count = sections["hdr"].shape[0]
        self.capacity = min(capacity or self.count, self.count)
        #: views of runs of consecutive pages by (first, count), handed out again: the same tensor objects each time,
        #: so that a fused step finds the buffers it laid out (it compares them by identity) and does not check and
        #: lay them out again (about 200 us a layer and step)
        self._runs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def headers(self) -> torch.Tensor:
        """(pages, 8) int64: every page's header."""
        return self.sections["hdr"]

    def run(self, first: int, count: int, names) -> dict[str, torch.Tensor]:
        """The views of sections ``names`` of pages ``first`` .. ``first + count - 1`` (at most 64 runs kept)."""
        key = (first, count)
        home = self._runs.get(key)
        if home is None or tuple(home) != tuple(names):
            if len(self._runs) >= 64:
                self._runs.clear()
            home = self._runs[key] = {name: self.sections[name].narrow(0, first, count) for name in names}
        return home

    def _check_blocks(self, what: str, blocks) -> None:
        """Refuse, in one line, ``blocks`` that are not a non-empty (B,) int64 tensor of distinct pages of these."""
        if (not isinstance(blocks, torch.Tensor) or blocks.dim() != 1 or blocks.dtype != torch.int64
                or blocks.numel() == 0):
            got = (f"{tuple(blocks.shape)} {blocks.dtype}" if isinstance(blocks, torch.Tensor)
                   else type(blocks).__name__)
            raise ValueError(f"{what}: blocks must be a non-empty (B,) int64 tensor, got {got}")
        ordered = blocks.sort().values
        if int(ordered[0]) < 0 or int(ordered[-1]) >= self.count or bool((ordered[1:] == ordered[:-1]).any()):
            raise ValueError(f"{what}: blocks {blocks.tolist()} must be distinct pages in [0, {self.count})")

    def write(self, blocks: torch.Tensor, cache: KVCache) -> None:
        """A cache's tokens after a prompt (its row r into page ``blocks[r]``), in position order, into each page's
        first slots, and each header afresh: the cache's tokens held, next position, evicted and expired counts,
        in position order, the generation one on (1 on a page never written). Refused (ValueError, one line, nothing
        written) if the cache holds more tokens than a page's slots, or holds padding, or ``blocks`` are not distinct
        pages (one per row)."""
        self._check_blocks("write", blocks)
        slots = self.sections["keys"].shape[2]
        held = cache.num_tokens
        if held > slots:
            raise ValueError(f"the cache holds {held} tokens, a page {slots} slots")
        if cache.valid is not None:
            raise ValueError("a page holds real tokens only: the cache holds padding")
        if blocks.shape != (cache.batch,):
            raise ValueError(f"{tuple(blocks.shape)} pages for a cache of {cache.batch} rows")
        if held:
            for name, got in (("keys", cache.keys), ("values", cache.values), ("positions", cache.positions),
                              *((f"state.{n}", cache.state[n]) for n in cache.state_names)):
                home = self.sections[name].narrow(2, 0, held)  # an evictor's own scores may broadcast over heads
                home.index_copy_(0, blocks, got.to(home.dtype).expand(blocks.shape[0], *home.shape[1:]))
        hdr = self.headers
        before = hdr.index_select(0, blocks)
        fresh = torch.tensor([MAGIC, held, 0, 0, cache.evicted, cache.expired, int(cache.scrambled), 0],
                             dtype=torch.int64).repeat(cache.batch, 1)
        fresh[:, NEXT] = cache.next_position.to(torch.int64).reshape(cache.batch)
        fresh[:, GENERATION] = torch.where(before[:, 0] == MAGIC, before[:, GENERATION] + 1, 1)
        hdr.index_copy_(0, blocks, fresh)

    def open(self, fresh: KVCache, blocks: torch.Tensor, *, held: int | None = None,
             next_position: torch.Tensor | None = None, step_state=None) -> PagedKVCache:
        """A cache over pages ``blocks`` (B,) int64, made like ``fresh`` (a new empty cache of the spec, B rows:
        ``Variant.new_cache``). Each page's header is checked first (ValueError, one line naming the page, nothing
        written): the magic, the same tokens held in every page (``held`` when given) and, when given, each
        page's next position ``next_position`` (B,) (the host's own count of its request's tokens). Pages in
        consecutive blocks (in any order) are the cache's buffers, in block order (:attr:`PagedKVCache.order`);
        others are gathered into this process's buffers (:data:`_GATHERED`) and written back by
        :meth:`PagedKVCache.commit`. ``step_state``: what an earlier cache of the spec and batch validated (its
        ``step_state``), so that it keeps its fast step."""
        self._check_blocks("open", blocks)
        rows = blocks.shape[0]
        if next_position is not None and (not isinstance(next_position, torch.Tensor)
                                          or next_position.shape != (rows,)):
            raise ValueError(f"open: next_position must be a ({rows},) tensor, one per page")
        if fresh.batch != rows or fresh.num_tokens:
            raise ValueError(f"open: a fresh cache of {rows} rows is needed, got one of {fresh.batch} rows holding "
                             f"{fresh.num_tokens} tokens")
        given, order = blocks, None
        run = consecutive(blocks)
        if run is not None:
            first, order = run
            blocks = blocks.index_select(0, order)
            if next_position is not None:
                next_position = next_position.index_select(0, order)
            if bool((order == torch.arange(rows)).all()):
                order = None
        headers = self.headers.index_select(0, blocks)
        held = int(headers[0, HELD]) if held is None else held
        wrong = (headers[:, 0] != MAGIC) | (headers[:, HELD] != held)
        if next_position is not None:
            wrong |= headers[:, NEXT] != next_position
        if bool(wrong.any()):
            bad = int(torch.nonzero(wrong)[0])
            row = headers[bad].tolist()
            if row[0] != MAGIC:
                reason = "holds no cache (no magic: never written by a prompt)"
            elif row[HELD] != held:
                reason = f"holds {row[HELD]} tokens, not {held}"
            else:
                reason = f"does not continue at token {int(next_position[bad])}"
            raise ValueError(f"the page of block {int(blocks[bad])} {reason} (header {row}); nothing was written")
        names = ("keys", "values", "positions", *(f"state.{n}" for n in fresh.state_names))
        missing = [name for name in names if name not in self.sections]
        if missing:
            raise ValueError(f"open: the pages hold no section {missing[0]!r} for the spec's per-token scores (they "
                             f"hold {', '.join(n for n in self.sections if n.startswith('state.')) or 'none'}): a page "
                             f"layout made for another spec")
        shared = False
        if run is not None:
            home = self.run(first, rows, names)
        else:
            keys = [_key(name, self.sections[name]) for name in names]
            shared = not any(_in_use(key) for key in keys)
            home = {name: _gathered(name, self.sections[name], blocks, self.capacity, shared) for name in names}
        header = self.headers.narrow(0, first, rows) if run is not None else headers
        cache = PagedKVCache(fresh, self, given, blocks, order, home, header, in_place=run is not None)
        if shared:
            cache._shared = keys  # noqa: SLF001 -- this module's own class
            for key in keys:
                _HOLDER[key] = weakref.ref(cache)
        cache.attach(home["keys"], home["values"], home["positions"],
                     {n: home[f"state.{n}"] for n in cache.state_names}, held, headers[:, NEXT],
                     scrambled=bool(headers[:, SCRAMBLED].any()), step_state=step_state)
        return cache


class PagedKVCache(KVCache):
    """A :class:`~.storage.KVCache` over pages (:meth:`Pages.open`): its buffers are the pages' sections (or a
    gathered copy of them), its state between steps their headers. After each step :meth:`commit` writes the step
    into the pages; :meth:`current` tells whether the pages are still as the last commit left them (then the host
    steps this cache again: nothing opened, nothing laid out, no header gathered).

    ``order``: None when the cache's rows are the pages in the order the host gave them, else the permutation
    (row r is the host's ``order[r]``: the pages in block order, one strided view). ``evicted`` and ``expired``
    count from the open; each page's header keeps its own totals. Not packed (a page holds full precision) and not
    copied (copy the pages, then open them)."""

    def __init__(self, fresh: KVCache, pages: Pages, given, blocks, order, home, header, *, in_place: bool) -> None:
        """Made by :meth:`Pages.open` (which then attaches the buffers ``home``): ``fresh``'s spec, evictor and
        budget; pages ``blocks`` (given as ``given``, rows in ``order``), their ``header`` rows (a view of the pages'
        headers ``in_place``, else a gathered copy)."""
        super().__init__(fresh.batch, fresh.budget, fresh.evictor, fresh.state_names, fresh.horizon,
                         (fresh.step_state.spec_hash, fresh.step_state.spec_name))
        self._pages, self.given, self.blocks, self.order = pages, given, blocks, order
        self._home, self.header, self._in_place = home, header, in_place
        #: the header as the last commit left it: another writer of a page (a prefill, another step) changes it
        self._expect = header.clone()
        #: whether the pages hold this cache's buffers (in place, nothing moved out of them at the last commit)
        self._holds = in_place
        self._counted = (0, 0)  # evicted, expired at the last commit
        self._delta: tuple[tuple[int, int], torch.Tensor] | None = None
        #: (tokens held, scrambled) as the last commit wrote them into every header (None: not yet; the headers'
        #: own may differ page by page, e.g. in slot order)
        self._marks: tuple[int, bool] | None = None
        #: whether a step may have run since the last commit (or the open): a shared gathered buffer stays this
        #: cache's until it commits
        self._pending = True
        #: the keys of the process's gathered buffers this cache holds (:data:`_HOLDER`), or () (in place, or its own)
        self._shared: list[tuple] = []

    @property
    def step_state(self):
        """What the full path validated for this cache (:class:`~.state.StepState`), read first by every step: a
        cache over gathered pages whose buffers another cache's open has taken since its commit is refused here, in
        one line, before the step reads them (open the pages afresh)."""
        for key in self.__dict__.get("_shared", ()):
            ref = _HOLDER.get(key)
            if ref is None or ref() is not self:
                raise ValueError("a paged cache over gathered pages was stepped after another cache over gathered "
                                 "pages was opened, which reuses this process's buffers: open the pages afresh for "
                                 "each step (PagedKVCache.current says no for gathered pages)")
        self._pending = True
        return self.__dict__["_step_state"]

    @step_state.setter
    def step_state(self, value) -> None:
        self.__dict__["_step_state"] = value

    def current(self, next_position: torch.Tensor) -> bool:
        """Whether the pages are as this cache's last commit left them and each page's next position is
        ``next_position`` (B,) (the host's count, in the host's order), and the pages hold this cache's buffers (in
        place, nothing moved out at the last commit): the host may step this cache again."""
        if not self._holds:
            return False
        if self.order is not None:
            next_position = next_position.index_select(0, self.order)
        return torch.equal(self.header, self._expect) and torch.equal(self._expect[:, NEXT], next_position)

    def commit(self) -> bool:
        """A step into the pages: whatever the step moved out of them (a buffer it replaced, an evictor's own scores
        tensor) copied back, every section of gathered pages written back, and the headers made this cache's state
        (tokens held, next position, evicted and expired counts, slot order) in place. Returns whether the pages
        hold this cache's buffers (in place, nothing moved), so that the host may step it again. Refused (ValueError,
        one line) where the cache holds more tokens than a page's slots (a prefill of several tokens onto a page) or
        padding (a step with a key mask): the headers are left as before the step, and with them the tokens they
        hold (an in-place step wrote past them only: such a step appends, evicting nothing)."""
        m, rows = self._m, self.batch
        slots = self._pages.sections["keys"].shape[2]
        if m > slots:
            raise ValueError(f"commit: the cache holds {m} tokens, a page {slots} slots (a page holds a budget: "
                             f"decode one token a step); the pages' headers are as before the step")
        if self.valid is not None:
            raise ValueError("commit: a page holds real tokens only, the cache holds padding (a step with a key "
                             "mask); the pages' headers are as before the step")
        buffers, moved = self.buffers(), False
        for name, page in self._home.items():
            held = buffers[name.replace("state.", "held.")]
            if self._in_place and held is not None and held.data_ptr() == page.data_ptr():
                continue
            moved = True
            if held is None:
                raise ValueError(f"commit: the cache holds no {name}")
            if self._in_place:
                section = page.narrow(2, 0, m)
                section.copy_(held.narrow(2, 0, m).expand_as(section))
            else:
                section = self._pages.sections[name].narrow(2, 0, m)
                section.index_copy_(0, self.blocks, held.narrow(2, 0, m).expand(rows, *section.shape[1:]))
        header = self.header
        nxt = self._next
        if isinstance(nxt, int):
            header.select(1, NEXT).fill_(nxt)
        else:
            header.select(1, NEXT).copy_(nxt)
        counted = (self.evicted - self._counted[0], self.expired - self._counted[1])
        if counted != (0, 0):
            if self._delta is None or self._delta[0] != counted:
                delta = torch.zeros(HEADER, dtype=torch.int64)
                delta[EVICTED], delta[EXPIRED] = counted
                self._delta = (counted, delta)
            header.add_(self._delta[1])
            self._counted = (self.evicted, self.expired)
        marks = (m, self._scrambled)
        if marks != self._marks:
            header.select(1, HELD).fill_(m)
            header.select(1, SCRAMBLED).fill_(int(self._scrambled))
            self._marks = marks
        if not self._in_place:
            self._pages.headers.index_copy_(0, self.blocks, header)
        self._expect.copy_(header)
        self._pending = False
        self._holds = self._in_place and not moved
        return self._holds

    def pack(self, bits: int, rotate: bool = True, recent: int = 0) -> None:
        raise ValueError("a paged cache holds its tokens at full precision in its pages: it cannot be packed")

    def copy(self) -> KVCache:
        raise ValueError("a paged cache is its pages: copy the pages, then open the copy")

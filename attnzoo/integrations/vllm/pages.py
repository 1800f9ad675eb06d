"""The pages of vLLM's CPU KV cache as attnzoo's layers read and write them (``layer.py``): vLLM's paged keys and
values in a plain layout (a page's keys, then its values: :func:`kv_pages`, :func:`write`, :func:`gather`), and an
evicting spec's ring pages (``ring.py``): a page's header (:func:`headers`), a cache's tokens stored into the pages
(:func:`store`), the checks of a step's pages (:func:`distinct_pages`, :func:`consecutive`, :func:`moved`)."""

from __future__ import annotations

import math

import torch

from ..transformers.base import IntegrationError

#: a ring page's header (``ring.py``): int64[HEADER] of magic, tokens held, next position, generation, evicted,
#: expired, scrambled, 0 (here, without vLLM, so that a step reads it without an import: ``ring`` re-exports it)
MAGIC = 0x5A4F4F52494E47  # "ZOORING"
HEADER = 8
HELD, NEXT, GENERATION, EVICTED, EXPIRED, SCRAMBLED = range(1, 7)


def distinct_pages(blocks: list[int], counts: torch.Tensor, where: str) -> None:
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


def consecutive(blocks: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(the first block, the order that sorts ``blocks``) if ``blocks`` are consecutive once sorted (one strided
    view then holds their pages, in that order), else None."""
    ordered, order = blocks.sort()
    first = int(ordered[0])
    return (first, order) if bool((ordered == torch.arange(first, first + blocks.shape[0])).all()) else None


def headers(cache, generation) -> torch.Tensor:
    """Each row's page header (B, 8) after a step of ``cache`` (ring.py: magic, tokens held, next position,
    generation (an int or a (B,) tensor), evicted, expired, scrambled, 0)."""
    out = torch.tensor([MAGIC, cache.num_tokens, 0, 0, cache.evicted, cache.expired, int(cache.scrambled), 0],
                       dtype=torch.int64).repeat(cache.batch, 1)
    out[:, NEXT] = cache.next_position.to(torch.int64).reshape(cache.batch)
    out[:, GENERATION] = generation
    return out


def store(pages, blocks: torch.Tensor, cache) -> None:
    """Each row of ``cache``'s tokens, in position order, into the first slots of its page (``blocks``, one per
    row)."""
    held = cache.num_tokens
    if not held:
        return
    for name, got in (("keys", cache.keys), ("values", cache.values), ("positions", cache.positions),
                      *((f"state.{n}", cache.state[n]) for n in cache.state_names)):
        home = pages[name].narrow(2, 0, held)  # an evictor's own scores tensor may broadcast over heads
        home.index_copy_(0, blocks, got.to(home.dtype).expand(blocks.shape[0], *home.shape[1:]))


#: the gathered sections of the full pages' batched steps whose pages are not consecutive (``Layer._decode_full``):
#: one buffer per section shape for the whole process, shared by its layers (a forward steps them one after
#: another; a step's gathered pages are scattered back before the next layer's), its capacity the most requests a
#: step can hold (vLLM's ``max_num_seqs``, at most the cache's blocks), set at the first gathered step. A step's
#: cache holds views of it, and so does the step state each layer keeps per batch size (a fused step keeps its
#: buffers); a fresh gathered tensor per step kept one copy of the pages per batch size and layer alive (issue 55:
#: the pruned server's memory grew round after round).
_GATHERED: dict[tuple, torch.Tensor] = {}


def gathered(name: str, section: torch.Tensor, blocks: torch.Tensor, capacity: int) -> torch.Tensor:
    """The pages ``blocks`` of ``section`` (pages first), copied into the first rows of this process's buffer for
    that section (:data:`_GATHERED`; ``capacity`` rows, or ``blocks``' count if more)."""
    rows = blocks.shape[0]
    key = (name, section.dtype, tuple(section.shape[1:]))
    buffer = _GATHERED.get(key)
    if buffer is None or buffer.shape[0] < rows:
        buffer = _GATHERED[key] = section.new_empty((max(rows, capacity), *section.shape[1:]))
    out = buffer.narrow(0, 0, rows)
    torch.index_select(section, 0, blocks, out=out)
    return out


def moved(cache, page) -> bool:
    """Whether a buffer of ``cache`` (attached to ``page``) is no longer the page's."""
    for name, buf in cache.buffers().items():
        home = page[name.replace("held.", "state.")]
        if buf is None or buf.data_ptr() != home.data_ptr():
            return True
    return False


def kv_pages(kv_cache):
    """(key pages, value pages), each (blocks, H_kv, block_size, D), of vLLM's CPU cache tensor (blocks, H_kv,
    block_size, 2 D): a page's keys, then its values, each token's row contiguous (attnzoo's layers write and read
    this layout themselves, whatever layout vLLM's kernels pick for the CPU's instruction set)."""
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    pages = kv_cache.view(blocks, kv_heads, 2 * block_size, two_d // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


def write(key, value, kv_cache, slot_mapping) -> None:
    """The new tokens' keys and values (T, H_kv, D) into their slots (``slot_mapping`` (T,): page * block_size +
    offset; negative: a padding token, not written)."""
    key_pages, value_pages = kv_pages(kv_cache)
    block_size = key_pages.shape[2]
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    page, offset = slots // block_size, slots % block_size
    key_pages[page, :, offset] = key[:slots.shape[0]].to(key_pages.dtype)
    value_pages[page, :, offset] = value[:slots.shape[0]].to(value_pages.dtype)


def gather(key_pages, value_pages, block_table, length: int, width: int):
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

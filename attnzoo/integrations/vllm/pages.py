"""The pages of vLLM's CPU KV cache as attnzoo's layers read and write them (``layer.py``): vLLM's paged keys and
values in a plain layout (a page's keys, then its values: :func:`kv_pages`, :func:`write`, :func:`gather`), and the
check of an evicting spec's ring pages before a step (:func:`distinct_pages`). A ring page's layout, header and the
cache stepped on it are the decode package's (:mod:`attnzoo.decode.paged`); its header's fields are re-exported here,
so that a step reads them without importing vLLM (``ring`` imports it)."""

from __future__ import annotations

import math

import torch

from ...decode.paged import EVICTED, EXPIRED, GENERATION, HEADER, HELD, MAGIC, NEXT, SCRAMBLED  # noqa: F401
from ..transformers.base import IntegrationError


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

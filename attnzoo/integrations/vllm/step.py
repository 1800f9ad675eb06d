"""A forward's step as attnzoo's layers read it from vLLM's attention metadata: each request's new tokens (where
they start, how many), its length after the step, its first block (an evicting spec's ring page), as tensors and as
Python lists. vLLM builds the metadata once per forward (its metadata builder, ``CPUAttentionMetadata``) and hands
the same object to every layer of a KV-cache group; :func:`step_of` derives the step from it once and hands the same
:class:`Step` to every layer of that forward."""

from __future__ import annotations

import torch

from . import pages

#: (the metadata object, its step): the last forward's. The object itself is held, so that no other object can take
#: its identity while the step is kept; vLLM's builder makes a new one every forward (whose tensors may be views of
#: the model runner's persistent buffers, rewritten for the next forward, never during one)
_LAST: tuple[object, Step] | None = None


class Step:
    """One forward's requests (module doc): ``starts`` (requests + 1) where each request's new tokens start in the
    batch, ``counts`` how many, ``lengths`` its tokens after the step, ``blocks`` its first block; each as an int64
    tensor (``*_t``) and a list."""

    def __init__(self, meta) -> None:
        self.starts_t = meta.query_start_loc.to(torch.int64)
        self.counts_t = self.starts_t[1:] - self.starts_t[:-1]
        self.lengths_t = meta.seq_lens.to(torch.int64)
        self.starts: list[int] = self.starts_t.tolist()
        self.lengths: list[int] = self.lengths_t.tolist()
        self.blocks_t = meta.block_table[:, 0].to(torch.int64)
        self.blocks: list[int] = self.blocks_t.tolist()
        self.counts: list[int] = self.counts_t.tolist()
        #: whether each request still prefills (vLLM's ``is_prefilling``: its computed tokens below its prompt's
        #: before the step, handed on by ``backend``'s metadata builder), or None where the metadata has none
        prefilling = getattr(meta, "attnzoo_prefilling", None)
        self.prefilling: list[bool] | None = (None if prefilling is None
                                              else prefilling[:len(self.lengths)].tolist())
        #: the requests with one new token (decoding): the full-cache path's batch (``Layer.attend``)
        self.decoding = [i for i in range(len(self.lengths)) if self.starts[i + 1] - self.starts[i] == 1]
        self._distinct = False
        self._decode_batch: tuple | None = None
        self._full: dict[int, tuple] = {}
        self._positions: torch.Tensor | None = None
        #: the requests with new tokens in this step
        self.active = sum(1 for c in self.counts if c)

    def decode_batch(self, device) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """The decoding requests' batch over vLLM's pages: their queries' rows (B,), the longest length, the
        queries' positions (B, 1) and the keys' (B, longest), on ``device``: keys padded after each row's last."""
        if self._decode_batch is None:
            index = torch.tensor([self.starts[i] for i in self.decoding], device=device)
            lens = [self.lengths[i] for i in self.decoding]
            longest = max(lens)
            kpos = torch.arange(1, longest + 1, device=device).expand(len(lens), -1)
            self._decode_batch = (index, longest, torch.tensor(lens, device=device).unsqueeze(1), kpos)
        return self._decode_batch

    def positions(self, device) -> torch.Tensor:
        """Each new token's position (1 for a sequence's first), (n,) int64 on ``device``: request i's tokens are its
        last ``counts[i]`` of ``lengths[i]``."""
        if self._positions is None:
            before = (self.lengths_t[:len(self.counts)] - self.counts_t).repeat_interleave(self.counts_t)
            first = self.starts_t[:-1].repeat_interleave(self.counts_t)
            index = torch.arange(int(self.starts_t[-1]), dtype=torch.int64)
            self._positions = (index - first + before + 1).to(device)
        return self._positions

    def full_rows(self, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The requests (indices, int64) with one new token and at least ``budget`` tokens before it, and their
        first query rows, blocks and lengths: under an evictor that evicts one token a step (no window), the requests
        whose ring page holds ``budget`` tokens (``Layer._full_pages``), once per forward for every layer of that
        budget."""
        batch = self._full.get(budget)
        if batch is None:
            full = torch.nonzero((self.counts_t == 1) & (self.lengths_t > budget)).flatten()
            batch = self._full[budget] = (full, *(t.index_select(0, full)
                                                  for t in (self.starts_t, self.blocks_t, self.lengths_t)))
        return batch

    def check_distinct(self, where: str) -> None:
        """:func:`.pages.distinct_pages` over this step's requests, once per step (a refusal is raised in every
        layer that asks)."""
        if not self._distinct:
            pages.distinct_pages(self.blocks, self.counts_t, where)
            self._distinct = True


def step_of(meta) -> Step:
    """The step of vLLM's attention metadata ``meta``, made by the forward's first layer, shared by the rest."""
    global _LAST
    if _LAST is None or _LAST[0] is not meta:
        _LAST = (meta, Step(meta))
    return _LAST[1]

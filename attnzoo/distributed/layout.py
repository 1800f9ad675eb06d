"""Where the tokens are: the sequence cut into chunks, which rank holds which, and the configuration of one
sharded call (:class:`ShardConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class Layout:
    """How ``seq_len`` tokens are split over ``world_size`` ranks: ``balanced`` (2R chunks, rank r holds chunks r
    and 2R-1-r, so causal work is even) or contiguous (R chunks, rank r holds chunk r). Chunk sizes differ by at
    most one token (the first ``seq_len % chunks`` are one longer); every chunk needs at least one token."""

    def __init__(self, seq_len: int, world_size: int, balanced: bool = True) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        count = 2 * world_size if balanced else world_size
        if not isinstance(seq_len, int) or seq_len < count:
            raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into the {count} chunks a "
                             f"{'balanced' if balanced else 'contiguous'} layout over {world_size} ranks needs "
                             f"(seq_len >= {count})")
        self.seq_len, self.world_size, self.balanced = seq_len, world_size, balanced
        base, extra = divmod(seq_len, count)
        sizes = [base + (1 if i < extra else 0) for i in range(count)]
        starts = [sum(sizes[:i]) for i in range(count)]
        #: global (start, stop) of every chunk, in sequence order
        self.bounds: list[tuple[int, int]] = [(s, s + n) for s, n in zip(starts, sizes, strict=True)]

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    def owned(self, rank: int) -> list[int]:
        """The chunks ``rank`` holds, in the order its local tokens hold them (ascending)."""
        self._check_rank(rank)
        if self.balanced:
            return [rank, 2 * self.world_size - 1 - rank]
        return [rank]

    def owner(self, chunk: int) -> int:
        return chunk if chunk < self.world_size else 2 * self.world_size - 1 - chunk

    def local_chunks(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(chunk, local start, local stop, global start) of each chunk ``rank`` holds."""
        out, at = [], 0
        for c in self.owned(rank):
            start, stop = self.bounds[c]
            out.append((c, at, at + stop - start, start))
            at += stop - start
        return out

    def local_size(self, rank: int) -> int:
        return sum(stop - start for start, stop in (self.bounds[c] for c in self.owned(rank)))

    def indices(self, rank: int) -> torch.Tensor:
        """The global 0-based indices of ``rank``'s tokens, in local order."""
        return torch.cat([torch.arange(*self.bounds[c]) for c in self.owned(rank)])

    def positions(self, rank: int, batch: int = 1, first: int = 1, device=None) -> torch.Tensor:
        """``rank``'s tokens' 1-based positions (B, n) when the sequence's positions are first, first + 1, ..."""
        return (self.indices(rank) + first).to(device).expand(batch, -1).contiguous()

    def shard(self, x: torch.Tensor, rank: int, dim: int = -2) -> torch.Tensor:
        """``rank``'s tokens of the full-sequence tensor ``x`` along ``dim`` (default -2: (B, H, N, D))."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"shard: dim {dim} of shape {tuple(x.shape)} is not the layout's {self.seq_len} tokens")
        return torch.cat([x.narrow(dim, start, stop - start) for start, stop in
                          (self.bounds[c] for c in self.owned(rank))], dim=dim)

    def unshard(self, shards: list[torch.Tensor], dim: int = -2) -> torch.Tensor:
        """The full-sequence tensor from every rank's shard (``shards[r]`` from rank r)."""
        if len(shards) != self.world_size:
            raise ValueError(f"unshard: {len(shards)} shards for a layout over {self.world_size} ranks")
        pieces: dict[int, torch.Tensor] = {}
        for rank, x in enumerate(shards):
            if x.shape[dim] != self.local_size(rank):
                raise ValueError(f"unshard: rank {rank}'s shard has {x.shape[dim]} tokens along dim {dim}, the "
                                 f"layout gives it {self.local_size(rank)}")
            for c, start, stop, _ in self.local_chunks(rank):
                pieces[c] = x.narrow(dim, start, stop - start)
        return torch.cat([pieces[c] for c in range(self.num_chunks)], dim=dim)

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank!r}")

    def __repr__(self) -> str:
        kind = "balanced" if self.balanced else "contiguous"
        return f"Layout(seq_len={self.seq_len}, world_size={self.world_size}, {kind})"


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = -2, balanced: bool = True) -> torch.Tensor:
    """``rank``'s tokens of ``x`` (the whole sequence along ``dim``) under :class:`Layout`."""
    return Layout(x.shape[dim], world_size, balanced).shard(x, rank, dim)


def unshard(shards: list[torch.Tensor], dim: int = -2, balanced: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` from rank r), the inverse of :func:`shard`."""
    total = sum(x.shape[dim] for x in shards)
    return Layout(total, len(shards), balanced).unshard(shards, dim)


def shard_positions(positions: torch.Tensor, rank: int, world_size: int, balanced: bool = True) -> torch.Tensor:
    """``rank``'s entries of the whole sequence's positions, (N,) or (B, N)."""
    return shard(positions, rank, world_size, dim=-1, balanced=balanced)


@dataclass
class ShardConfig:
    """The configuration of one sharded call, the same on every rank: the plan, the layout, the process group,
    this rank and the world size, ring or all-gather, the query block size, the feature and pair-parameter keys
    (the order of the autograd function's extra inputs), the logit scale, and which pairs compute it."""

    plan: Any
    layout: Layout
    group: Any
    rank: int
    world: int
    ring: bool
    block_size: int
    feature_keys: list[str]
    param_keys: list[tuple[str, str]]
    scale: float
    #: every pair is plain attention on torch's CPU flash kernel (``pairs.flash_pairs``), decided once per call
    flash: bool = False
    #: every pair is the blocked backend's fused selective kernel (``fused.fused_pairs``), decided once per call
    fused: bool = False
    #: the first token is the protected BOS (position 1) in every batch row (for ``fused``)
    bos: bool = False
    #: the forward keeps what the fused backward needs (a gradient may be asked for)
    keep: bool = True
    #: tokens per piece of another rank's keys and values in a forward without gradients (``KeyBlocks.pieces``)
    piece: int | None = None
    #: the triton backend whose generated kernels compute every pair (``kernel_pairs``), or None
    triton: Any = None

"""The decode-time KV cache: keys, values, absolute positions and per-token scores, evicting permanently.

Every (batch row, key/value head) holds the same number of tokens, so the cache stays dense: (B, H_kv, M, D).
Evictors that keep one set per layer drop the same token in every head; per-head evictors (H2O) may differ.

Numerics (docs/backends.md, "Numerics contract"): per-token scores (selective attention's F, evictor scores) are
accumulated over every decode step, so they are kept in :func:`accumulator_dtype` (at least float32), whatever the
dtype of the keys. Gradients: decoding is inference. Between steps the cache holds detached tensors, so a step's
output carries gradient into that step's own q, k, v and the transform parameters (through that step's
computation), never into earlier steps: the autograd graph does not grow with the number of tokens decoded.
"""

from __future__ import annotations

import torch

#: Name of the running per-token accumulator (selective attention's F) in ``KVCache.state``.
SELECTION_STATE = "selection"


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype accumulated quantities are computed and stored in for inputs of ``dtype``: float32, or float64
    for float64 inputs (float16/bfloat16 sums lose the small increments once the running total is large)."""
    return torch.promote_types(dtype, torch.float32)


class KVCache:
    """A cache for one attention layer. Create it with ``variant.new_cache(batch=B, budget=K)``.

    ``keys``/``values``: (B, H_kv, M, D) raw rows (transforms are applied when attending); ``positions``:
    (B, H_kv, M) int64; ``state[name]``: (B, H_kv, M) per-token scores kept by the accumulator and the evictor, in
    ``accumulator_dtype(keys.dtype)``. ``budget=None`` never evicts. Between decode steps every tensor is
    detached from autograd (:meth:`settle`); during a step the rows just appended may still carry gradient.
    """

    def __init__(self, batch: int, budget: int | None, evictor=None, state_names: tuple[str, ...] = ()) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be >= 1 or None, got {budget}")
        self.batch = batch
        self.budget = budget
        self.evictor = evictor
        self.state_names = tuple(state_names)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.next_position = 1
        self.evicted = 0

    # -- reporting -----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def num_tokens(self) -> int:
        """Tokens held per (batch row, key/value head)."""
        return len(self)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys, values, positions and per-token scores."""
        tensors = [self.keys, self.values, self.positions, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def over_budget(self) -> bool:
        return self.budget is not None and len(self) > self.budget

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, tokens={len(self)}, budget={self.budget}, "
                f"next_position={self.next_position}, bytes={self.nbytes})")

    # -- mutation -------------------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append T tokens: key, value (B, H_kv, T, D), at the next T positions. New per-token scores are 0 (in
        ``accumulator_dtype(key.dtype)``).

        The new rows are kept as given until :meth:`settle` (so the step's output can reach them); rows from
        earlier steps are detached here too, in case a backend never settled."""
        count = key.shape[2]
        new_pos = torch.arange(self.next_position, self.next_position + count, device=key.device)
        new_pos = new_pos.expand(*key.shape[:2], count)
        if self.keys is None:
            if key.shape[0] != self.batch:
                raise ValueError(f"cache was made for batch {self.batch}, got k of batch {key.shape[0]}")
            self.keys, self.values = key, value
            shape = key.shape[:3]
            self.positions = new_pos.clone()
            dtype = accumulator_dtype(key.dtype)
            self.state = {n: torch.zeros(shape, dtype=dtype, device=key.device) for n in self.state_names}
        else:
            if key.shape[:2] != self.keys.shape[:2] or key.shape[3] != self.keys.shape[3]:
                raise ValueError(f"k of shape {tuple(key.shape)} does not fit a cache of {tuple(self.keys.shape)}")
            if key.dtype != self.keys.dtype:
                raise ValueError(f"k has dtype {key.dtype} but the cache holds {self.keys.dtype}")
            self.keys = torch.cat([self.keys.detach(), key], dim=2)
            self.values = torch.cat([self.values.detach(), value], dim=2)
            self.positions = torch.cat([self.positions, new_pos], dim=2)
            for name, t in self.state.items():
                self.state[name] = torch.cat([t.detach(), t.new_zeros(*t.shape[:2], count)], dim=2)
        self.next_position += count

    def remove(self, victim: torch.Tensor) -> None:
        """Drop one token per (batch row, key/value head): ``victim`` (B, H_kv) holds slot indices."""
        m = len(self)
        keep = torch.arange(m - 1, device=victim.device).view(1, 1, -1)
        keep = keep + (keep >= victim.unsqueeze(-1)).long()
        self.keys = self.keys.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[3]))
        self.values = self.values.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[3]))
        self.positions = self.positions.gather(2, keep)
        self.state = {name: t.gather(2, keep) for name, t in self.state.items()}
        self.evicted += 1

    def evict(self) -> None:
        """Ask the evictor for one victim per row and drop it."""
        self.remove(self.evictor.victim(self))

    # -- one decoding step, the part every backend shares ------------------------------------------------------
    def admit(self, key: torch.Tensor, value: torch.Tensor, evict_first: bool) -> None:
        """Append T tokens; an evictor that works before attention (selective, sink + window) evicts now."""
        self.append(key, value)
        if evict_first and self.evictor is not None and not self.evictor.evict_after_attention:
            while self.over_budget():
                self.evict()

    def query_positions(self, count: int, batch: int) -> torch.Tensor:
        """Absolute positions of the ``count`` tokens just appended: (B, count)."""
        first = self.next_position - count
        return torch.arange(first, self.next_position, device=self.keys.device).expand(batch, count)

    def selection(self) -> torch.Tensor | None:
        """The running F of every cached token (B, M), or None without an accumulator."""
        return self.state[SELECTION_STATE][:, 0] if SELECTION_STATE in self.state else None

    def settle(self, selection: torch.Tensor | None, probs: torch.Tensor | None) -> None:
        """After attending: store the new running F (B, M), update the evictor's scores from the new queries'
        attention ``probs`` (B, H, T, M), evict down to the budget, and detach everything held.

        F is stored, and ``probs`` handed to the evictor, detached and in :func:`accumulator_dtype` of the keys
        (at least float32): a backend that computed either in half precision cannot round the running state."""
        wide = accumulator_dtype(self.keys.dtype)
        self.keys, self.values = self.keys.detach(), self.values.detach()
        if selection is not None:
            selection = selection.detach().to(wide)
            self.state[SELECTION_STATE] = selection.unsqueeze(1).expand_as(self.positions).clone()
        if self.evictor is not None:
            self.evictor.update(self, probs.detach().to(wide) if probs is not None else None)
            while self.over_budget():
                self.evict()

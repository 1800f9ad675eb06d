"""The decode-time KV cache: transformed keys and values, absolute positions and per-token scores, evicting
permanently.

Every (batch row, key/value head) holds the same number of tokens, so the cache stays dense: (B, H_kv, M, D).
Evictors that keep one set per layer drop the same token in every head; per-head evictors (H2O) may differ.

What is stored (docs/decoding.md): the keys and values *after* the key and value slots' row transforms (SSA's
temperatures), computed once per token when it is appended, never again; rows live in buffers that grow by
doubling, so appending a token copies one row, not the cache. The transforms' parameters are assumed constant
while a cache is in use: a cache remembers which parameter tensors (and versions) transformed its rows and refuses,
with one line, a step that brings different ones.

Padding (left-padded batches, per-row positions): ``prefill``/``decode`` take a key mask for the new tokens.
Positions are per row: the first real token of each row is position 1 (the protected BOS), padding tokens are
never attended and are the first tokens evicted; they take the position of the next real token of their row.

Numerics (docs/backends.md, "Numerics contract"): per-token scores (selective attention's F, evictor scores) are
accumulated over every decode step, so they are kept in :func:`accumulator_dtype` (at least float32), whatever the
dtype of the keys. Gradients: decoding is inference. Between steps the cache holds detached tensors, so a step's
output carries gradient into that step's own q, k, v and the transform parameters (through that step's
computation), never into earlier steps: the autograd graph does not grow with the number of tokens decoded.
"""

from __future__ import annotations

import operator
import warnings

import torch

#: Name of the running per-token accumulator (selective attention's F) in ``KVCache.state``.
ACCUMULATED_STATE = "accumulated"


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype accumulated quantities are computed and stored in for inputs of ``dtype``: float32, or float64
    for float64 inputs (float16/bfloat16 sums lose the small increments once the running total is large)."""
    return torch.promote_types(dtype, torch.float32)


def new_token_positions(start: torch.Tensor, count: int, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions (B, count) of ``count`` new tokens for rows whose next position is ``start`` (B,): consecutive,
    or with ``key_mask`` (B, count) real tokens consecutive and each padding token at the next real one's."""
    if key_mask is None:
        return start[:, None] + torch.arange(count, device=start.device)
    real = key_mask.to(torch.int64)
    return start[:, None] + real.cumsum(-1) - real


class KVCache:
    """A cache for one attention layer. Create it with ``variant.new_cache(batch=B, budget=K)``.

    ``keys``/``values``: (B, H_kv, M, D) rows after the key/value transforms; ``positions``: (B, H_kv, M) int64;
    ``valid``: (B, H_kv, M) bool, False for padding, or None when every token is real; ``state[name]``:
    (B, H_kv, M) per-token scores kept by the accumulator and the evictor, in ``accumulator_dtype(keys.dtype)``;
    ``next_position``: (B,) int64, the position the next real token of each row gets. ``budget=None`` never
    evicts. Between decode steps every tensor is detached from autograd (:meth:`settle`).
    """

    def __init__(self, batch: int, budget: int | None, evictor=None, state_names: tuple[str, ...] = ()) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be an int >= 1 or None, got {budget!r}")
        #: the lean steps write a new token into its victim's slot, leaving the slots out of position order
        #: until a public view (keys, values, positions, state) or a full step puts them back (_settle_order)
        self._scrambled = False
        self.batch = batch
        self.budget = budget
        self.evictor = evictor
        self.state_names = tuple(state_names)
        self.state: dict[str, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None
        #: (the valid tensor it was made from, (B, H_kv, slots) additive bias: -inf at padding, 0 past it) for
        #: the plain lean step, which attends over padded rows without growing ``valid`` (see :attr:`valid`)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.evicted = 0
        #: tokens dropped because no later query can see them (a window mask, :meth:`drop_expired`)
        self.expired = 0
        #: the spec's bound on the keys a query sees, ``earliest_key(query_position) -> int`` (a sliding window,
        #: a chunk), or None; set by ``Variant.new_cache``
        self.horizon = None
        self.params_key: tuple | None = None
        self._k: torch.Tensor | None = None  # buffers (B, H_kv, capacity, D); the first _m slots hold tokens
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._m = 0
        self._live: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's rows with gradient
        self._next: torch.Tensor | int = 1
        self._last: torch.Tensor | None = None  # positions of the tokens appended last
        # per-token scores live in growing buffers too; ``state[name]`` is a view of the first _m slots (a
        # tensor assigned to ``state[name]`` by an evictor is adopted into a buffer at the next append)
        self._state_buf: dict[str, torch.Tensor] = {}
        # per-token features of the logits transforms (LogitsTransform.features), stored per key token as
        # (B, H_kv, M, G) for the G query heads of each key/value head (so they follow their head's evictions);
        # cumulative ones are stored as running sums, their totals (B, H) through the last token appended
        self._feat: dict[str, torch.Tensor] = {}
        self._feat_live: dict[str, torch.Tensor] | None = None  # this step's (B, H, M) with gradient
        self.feature_totals: dict[str, torch.Tensor] = {}
        #: positions increase strictly along the slots of every row and head (kept by append and removal;
        #: padding ties with the next real token, and padding is never picked by an evictor's rule)
        self.ordered = True
        #: (variant, signature, step): a decoding step the full path has validated for this signature, taken
        #: while :meth:`lean_ready` holds (``Variant.decode``); None when there is none
        self._lean = None
        #: the per-token score tensors last found fit for the lean steps (:meth:`_lean_states`), by name: a tensor
        #: assigned to ``state[name]`` since is checked (and made a dense buffer's view) once
        self._lean_seen: dict[str, torch.Tensor] = {}
        #: the spec (hash, name) whose ``new_cache`` made this cache, and the (H, H_kv, D) of its steps: another
        #: spec's or geometry's steps are refused (``Variant.decode``)
        self.spec_hash: str | None = None
        self.spec_name: str | None = None
        self.geometry: tuple[int, int, int] | None = None

    # -- storage --------------------------------------------------------------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Per-token scores by name, (B, H_kv, M) each, in the slots' position order."""
        if self._scrambled:
            self._settle_order()
        return self._state

    @state.setter
    def state(self, value: dict[str, torch.Tensor]) -> None:
        self._state = value

    def _settle_order(self) -> None:
        """Put the slots back in position order after lean steps wrote new tokens into their victims' slots: one
        sort per row and head, paid only when a view is read or a full step runs (the lean steps never need it)."""
        self._scrambled = False
        m = self._m
        order = self._pos[:, :, :m].argsort(dim=-1)
        rows = order.unsqueeze(-1).expand(-1, -1, -1, self._k.shape[3])
        self._k[:, :, :m] = self._k[:, :, :m].gather(2, rows)
        self._v[:, :, :m] = self._v[:, :, :m].gather(2, rows)
        self._pos[:, :, :m] = self._pos[:, :, :m].gather(2, order)
        for t in self._state.values():
            t.copy_(t.gather(2, order))

    @property
    def valid(self) -> torch.Tensor | None:
        """(B, H_kv, M) bool, False for padding, or None when every token is real. The plain lean step appends
        real tokens without growing it; it catches up here, when read."""
        held = self._valid
        if held is not None and held.shape[2] < self._m:
            more = held.new_ones(*held.shape[:2], self._m - held.shape[2])
            self._valid = held = torch.cat([held, more], dim=2)
        return held

    @valid.setter
    def valid(self, value: torch.Tensor | None) -> None:
        self._valid = value
        if value is None:
            self._bias = None

    def padding_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, H_kv, M) in ``dtype``: -inf at padding, 0 at real tokens, for attention over padded rows with no
        evictor (the plain lean step). Kept with room for the buffers' slots (0 past the padding: every token
        appended after it is real), remade only when :attr:`valid` is replaced or the buffers grow."""
        made = self._bias
        if (made is None or made[0] is not self._valid or made[1].shape[2] < self._m
                or made[1].dtype != dtype):
            valid = self._valid
            bias = torch.zeros(*valid.shape[:2], max(self._k.shape[2], self._m), dtype=dtype, device=valid.device)
            bias[:, :, :valid.shape[2]].masked_fill_(~valid, float("-inf"))
            self._bias = made = (valid, bias)
        return made[1][:, :, :self._m]

    @property
    def keys(self) -> torch.Tensor | None:
        if self._scrambled:
            self._settle_order()
        if self._live is not None:
            return self._live[0]
        return None if self._k is None else self._k[:, :, :self._m]

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        if self._scrambled:
            self._settle_order()
        self._lean = None
        self._k = value.detach()
        self._m = value.shape[2]
        self._live = None

    @property
    def values(self) -> torch.Tensor | None:
        if self._scrambled:
            self._settle_order()
        if self._live is not None:
            return self._live[1]
        return None if self._v is None else self._v[:, :, :self._m]

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        if self._scrambled:
            self._settle_order()
        self._lean = None
        self._v = self._with_room(value.detach())
        self._live = None

    def _with_room(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (B, H_kv, M, ...) given for the values or positions, in a buffer with at least the key buffer's
        slots: appends and the lean steps write the next token into the slot after the held ones of all three."""
        if self._k is None or t.dim() < 3 or t.shape[2] >= self._k.shape[2]:
            return t
        room = t.new_empty(*t.shape[:2], self._k.shape[2], *t.shape[3:])
        room[:, :, :t.shape[2]] = t
        return room

    @property
    def positions(self) -> torch.Tensor | None:
        if self._scrambled:
            self._settle_order()
        return None if self._pos is None else self._pos[:, :, :self._m]

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        if self._scrambled:
            self._settle_order()
        self._lean = None
        self._pos = self._with_room(value)
        self.ordered = value.shape[-1] < 2 or bool((value[..., 1:] > value[..., :-1]).all())

    @property
    def next_position(self) -> torch.Tensor:
        """(B,) int64: the position the next real token of each row takes."""
        if isinstance(self._next, int):
            device = self._k.device if self._k is not None else None
            return torch.full((self.batch,), self._next, dtype=torch.int64, device=device)
        return self._next.clone()  # the cache moves its own on in place (the fused decoding steps)

    @next_position.setter
    def next_position(self, value) -> None:
        """An int (every row) or a (B,) tensor; set before the first token to start at an offset."""
        self._lean = None
        if isinstance(value, torch.Tensor):
            if value.shape != (self.batch,):
                raise ValueError(f"next_position must have shape ({self.batch},), got {tuple(value.shape)}")
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise ValueError(f"next_position must hold integers, got dtype {value.dtype}")
            value = value.to(torch.int64, copy=True).contiguous()  # the cache's own: moved on in place
            if bool((value < 1).any()):
                raise ValueError(f"positions are 1-based: next_position must be >= 1, got {value.tolist()}")
        else:
            try:
                value = operator.index(value) if not isinstance(value, bool) else None
            except TypeError:
                value = None
            if value is None:
                raise ValueError(f"next_position must be an int or a ({self.batch},) integer tensor") from None
            if value < 1:
                raise ValueError(f"positions are 1-based: next_position must be >= 1, got {value}")
        if self._m:
            pos = self._pos[:, :, :self._m]
            if self.valid is not None:  # padding takes the next real token's position: only real ones count
                pos = torch.where(self.valid, pos, 0)
            held = pos.amax(dim=(1, 2))  # the last position each row holds
            wanted = value.to(held.device) if isinstance(value, torch.Tensor) else torch.full_like(held, value)
            if bool((wanted <= held).any()):
                raise ValueError(f"next_position {wanted.tolist()} would go back to positions the cache holds (last "
                                 f"held {held.tolist()}): positions only move forward")
        self._next = value if isinstance(value, torch.Tensor) else int(value)

    def _grow(self, need: int) -> None:
        """Make room for ``need`` tokens, doubling the buffers (so appends cost one row, amortised)."""
        capacity = self._k.shape[2]
        if need <= capacity:
            return
        new_capacity = max(need, 2 * capacity, 16)
        if self.budget is not None and self.evictor is not None:
            new_capacity = max(need, min(new_capacity, self.budget + 1))

        def grown(buf: torch.Tensor) -> torch.Tensor:
            out = buf.new_empty(*buf.shape[:2], new_capacity, *buf.shape[3:])
            out[:, :, :self._m] = buf[:, :, :self._m]
            return out

        self._k, self._v, self._pos = grown(self._k), grown(self._v), grown(self._pos)

    # -- reporting -----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._m

    @property
    def num_tokens(self) -> int:
        """Tokens held per (batch row, key/value head), padding included."""
        return self._m

    @property
    def nbytes(self) -> int:
        """Bytes held by keys, values, positions, validity and per-token scores (the tokens held, not the spare
        capacity of the buffers: see :attr:`capacity_bytes`)."""
        tensors = [self.keys, self.values, self.positions, self.valid, *self.state.values(), *self._feat.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated, spare room of the growing buffers included (and the padding bias of the plain lean
        step, while it is kept)."""
        bias = self._bias[1] if self._bias is not None and self._bias[0] is self._valid else None
        tensors = [self._k, self._v, self._pos, self.valid, bias, *self.state.values(), *self._feat.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def memory(self) -> dict:
        """A report: tokens held per row and head, budget, tokens evicted, bytes held and allocated."""
        return {"tokens": self._m, "budget": self.budget, "evicted": self.evicted, "expired": self.expired,
                "bytes": self.nbytes, "allocated_bytes": self.capacity_bytes}

    def over_budget(self) -> bool:
        return self.budget is not None and self._m > self.budget

    def __repr__(self) -> str:
        nxt = self._next if isinstance(self._next, int) else self._next.tolist()
        return (f"KVCache(batch={self.batch}, tokens={self._m}, budget={self.budget}, "
                f"next_position={nxt}, bytes={self.nbytes})")

    # -- mutation -------------------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None,
               features: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Append T tokens: key, value (B, H_kv, T, D) as they are to be attended (already transformed), at the
        next positions of each row (see :func:`new_token_positions`), with their per-token features ``{name:
        (B, H, T)}`` (running sums already taken, :meth:`attnzoo.plan.Plan.admit`). Returns their positions
        (B, T). New per-token scores are 0 (in ``accumulator_dtype(key.dtype)``).

        Rows that carry gradient are attended as given during this step (:meth:`settle` drops them); the
        buffers only ever hold detached copies."""
        b, hkv, count, d = key.shape
        if b != self.batch:
            raise ValueError(f"cache was made for batch {self.batch}, got k of batch {b}")
        if self._k is not None:  # refused before anything moves: a refused step leaves the cache as it was
            if key.shape[1] != self._k.shape[1] or key.shape[3] != self._k.shape[3]:
                raise ValueError(f"k of shape {tuple(key.shape)} does not fit a cache of {tuple(self.keys.shape)}")
            if key.dtype != self._k.dtype:
                raise ValueError(f"k has dtype {key.dtype} but the cache holds {self._k.dtype}")
        if self._scrambled:
            self._settle_order()
        previous = self.valid  # caught up with the plain lean step's appends before the slot count changes
        if key_mask is not None and bool(key_mask.all()):
            key_mask = None
        if key_mask is None and isinstance(self._next, int):
            if count == 1:
                new_pos = torch.full((b, 1), self._next, dtype=torch.int64, device=key.device)
            else:
                new_pos = torch.arange(self._next, self._next + count, device=key.device).expand(b, count)
            self._next += count
        else:
            start = self.next_position.to(key.device)
            new_pos = new_token_positions(start, count, key_mask)
            self._next = start + (count if key_mask is None else key_mask.sum(-1))
        old = self._m
        if self._k is None:
            self._k = key.new_empty(b, hkv, 0, d)
            self._v = value.new_empty(b, hkv, 0, d)
            self._pos = torch.empty(b, hkv, 0, dtype=torch.int64, device=key.device)
            wide = accumulator_dtype(key.dtype)
            self.state = {n: torch.zeros(b, hkv, 0, dtype=wide, device=key.device) for n in self.state_names}
            self._state_buf = {}
        self._grow(old + count)
        with torch.no_grad():
            if count == 1:  # one row per head: select and copy (cheaper than slicing, which decoding feels)
                self._k.select(2, old).copy_(key.select(2, 0))
                self._v.select(2, old).copy_(value.select(2, 0))
                self._pos.select(2, old).copy_(new_pos)
            else:
                self._k[:, :, old:old + count] = key
                self._v[:, :, old:old + count] = value
                self._pos[:, :, old:old + count] = new_pos.unsqueeze(1)
        self._m = old + count
        self._last = new_pos
        for name, t in self.state.items():
            buf = self._state_room(name, t, old, count)
            buf[:, :, old:old + count] = 0
            self.state[name] = buf[:, :, :old + count]
        if key_mask is not None or previous is not None:
            new_valid = (key_mask if key_mask is not None else torch.ones(b, count, dtype=torch.bool,
                                                                          device=key.device))
            new_valid = new_valid.to(key.device).unsqueeze(1).expand(b, hkv, count)
            if previous is None:
                previous = torch.ones(b, hkv, old, dtype=torch.bool, device=key.device)
            self.valid = torch.cat([previous, new_valid], dim=2)
        if key.requires_grad or value.requires_grad:
            self._live = (torch.cat([self._k[:, :, :old], key], dim=2), torch.cat([self._v[:, :, :old], value], dim=2))
        else:
            self._live = None
        self._append_features(features or {}, b, hkv, old, count)
        return new_pos

    def _append_features(self, features: dict[str, torch.Tensor], b: int, hkv: int, old: int, count: int) -> None:
        if set(features) != set(self._feat) and old:
            raise ValueError(f"features {sorted(features)} do not match the cache's {sorted(self._feat)}")
        live = {}
        for name, value in features.items():
            h = value.shape[1]
            grouped = value.detach().reshape(b, hkv, h // hkv, count).transpose(2, 3)  # (B, H_kv, T, G)
            held = self._feat.get(name)
            self._feat[name] = grouped.clone() if held is None or not old else torch.cat([held, grouped], dim=2)
            if value.requires_grad:
                live[name] = torch.cat([self._heads_first(held), value], dim=2) if held is not None and old else value
        self._feat_live = live or None

    @staticmethod
    def _heads_first(grouped: torch.Tensor) -> torch.Tensor:
        b, hkv, m, g = grouped.shape
        return grouped.transpose(2, 3).reshape(b, hkv * g, m)

    def key_features(self) -> dict[str, torch.Tensor]:
        """The per-token features of every cached token, ``{"<kind>.<name>": (B, H, M)}`` (cumulative ones as
        running sums); empty for a spec without features."""
        out = {name: self._heads_first(t) for name, t in self._feat.items()}
        if self._feat_live is not None:
            out.update(self._feat_live)
        return out

    def _state_room(self, name: str, t: torch.Tensor, old: int, count: int) -> torch.Tensor:
        """The buffer behind ``state[name]`` with room for ``count`` more slots after the first ``old``. A state
        tensor that is not a plain view of the first slots of its buffer (an evictor assigned a new one; a user
        assigned an expanded, negated or subclass view) is copied into a new dense buffer."""
        buf = self._state_buf.get(name)
        ours = (buf is not None and type(t) is torch.Tensor and t.dim() == 3 and t.shape[:2] == buf.shape[:2]
                and t.shape[2] == old and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride()
                and t.dtype == buf.dtype and not t.is_neg() and not t.is_conj())
        if ours and buf.shape[2] >= old + count:
            return buf
        capacity = max(self._k.shape[2], old + count)
        new = torch.empty(*t.shape[:2], capacity, dtype=t.dtype, device=t.device)  # dense, plain, its own memory
        new[:, :, :old] = t.detach()
        self._state_buf[name] = new
        return new

    def key_mask(self) -> torch.Tensor | None:
        """(B, M) bool, False for padding tokens, or None when every cached token is real."""
        return None if self.valid is None else self.valid[:, 0]

    def remove(self, victim: torch.Tensor) -> None:
        """Drop one token per (batch row, key/value head): ``victim`` (B, H_kv) holds slot indices (of the slots
        in position order, as the views show them)."""
        if self._scrambled:
            self._settle_order()
        if victim.numel() == 1:
            self._remove_slot(int(victim))
            return
        first = victim.reshape(-1)[0]
        if bool((victim == first).all()):
            self._remove_slot(int(first))  # the same slot everywhere: shift the tail, no gather
            return
        keep = torch.arange(self._m - 1, device=victim.device).view(1, 1, -1)
        self._keep(keep + (keep >= victim.unsqueeze(-1)).long())

    def _remove_slot(self, slot: int) -> None:
        _ = self.valid  # caught up with the plain lean step's appends before the slot count changes
        m = self._m
        self._live = None
        for buf in (self._k, self._v, self._pos):
            if slot < m - 1:
                buf[:, :, slot:m - 1] = buf[:, :, slot + 1:m].clone()
        self._m = m - 1
        for name, t in self.state.items():
            buf = self._state_room(name, t, m, 0)
            if slot < m - 1:
                buf[:, :, slot:m - 1] = buf[:, :, slot + 1:m].clone()
            self.state[name] = buf[:, :, :m - 1]
        self._feat = {name: torch.cat([t[:, :, :slot], t[:, :, slot + 1:]], dim=2) for name, t in self._feat.items()}
        self._feat_live = None
        if self.valid is not None:
            self.valid = torch.cat([self.valid[:, :, :slot], self.valid[:, :, slot + 1:]], dim=2)
            if bool(self.valid.all()):
                self.valid = None
        self.evicted += 1

    def _keep(self, keep: torch.Tensor) -> None:
        """Keep the slots ``keep`` (B, H_kv, M') (ascending) of every row and head, in place."""
        _ = self.valid  # caught up with the plain lean step's appends before the slot count changes
        m, kept = self._m, keep.shape[-1]
        self._live = None
        idx = keep.unsqueeze(-1).expand(-1, -1, -1, self._k.shape[3])
        self._k[:, :, :kept] = self._k[:, :, :m].gather(2, idx)
        self._v[:, :, :kept] = self._v[:, :, :m].gather(2, idx)
        self._pos[:, :, :kept] = self._pos[:, :, :m].gather(2, keep)
        self._m = kept
        self.state = {name: t.gather(2, keep) for name, t in self.state.items()}
        self._feat = {name: t.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, t.shape[3]))
                      for name, t in self._feat.items()}
        self._feat_live = None
        if self.valid is not None:
            self.valid = self.valid.gather(2, keep)
            if bool(self.valid.all()):
                self.valid = None
        self.evicted += m - kept

    def evict(self) -> None:
        """Drop one token per row: a padding token first (the oldest), else the evictor's victim."""
        victim = self.evictor.victim(self) if self.evictor is not None else None
        if self.valid is not None:
            padding = ~self.valid
            first_pad = padding.to(torch.int8).argmax(-1)
            victim = first_pad if victim is None else torch.where(padding.any(-1), first_pad, victim)
        self.remove(victim)

    def evict_to_budget(self) -> None:
        """Evict until the budget holds: padding first, then by the evictor's rule. An evictor that declares
        ``independent_scores`` (removing a token changes no other token's score or protection) and keeps the
        default :meth:`~attnzoo.Evictor.victim` has all its victims chosen at once (the same tokens, in one
        gather instead of one per token); any other evicts one token at a time."""
        excess = self._m - self.budget if self.budget is not None else 0
        if excess <= 0:
            return
        if excess == 1:
            self.evict()
            self._compact()
            return
        evictor = self.evictor
        from .evictors.base import Evictor  # the cache is below the evictors in the import graph

        rule_only = getattr(getattr(evictor, "victim", None), "__func__", None) is Evictor.victim
        if not rule_only or not evictor.independent_scores:
            while self.over_budget():
                self.evict()
        else:
            positions = self.positions
            score = evictor.score(self)
            eligible = ~evictor.protected(self)
            if not evictor.largest:
                score = -score
            # victims first: padding, then eligible tokens by score (largest first), ties to the oldest position
            order = positions.argsort(dim=-1, stable=True)
            order = order.gather(-1, score.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
            order = order.gather(-1, eligible.gather(-1, order).to(torch.int8).argsort(dim=-1, descending=True,
                                                                                        stable=True))
            if self.valid is not None:
                pad = (~self.valid).gather(-1, order).to(torch.int8)
                order = order.gather(-1, pad.argsort(dim=-1, descending=True, stable=True))
            doomed = torch.zeros_like(eligible).scatter_(-1, order[..., :excess], True)
            self._keep(torch.argsort(doomed.to(torch.int8), dim=-1, stable=True)[..., :self._m - excess])
        self._compact()

    def _compact(self) -> None:
        """Give back the spare room of buffers that grew past what the budget needs (after a long prefill)."""
        if self.budget is None or self._k is None:
            return
        room = max(self.budget + 1, self._m)
        if self._k.shape[2] > 2 * room:
            self._k, self._v, self._pos = (t[:, :, :room].clone() for t in (self._k, self._v, self._pos))

    def _rows_only(self, padding: bool = False) -> bool:
        """Nothing per token but rows and positions: no padding (unless ``padding``), no features, no step's
        live rows. Rows may be at different positions (a left-padded batch)."""
        return (self._k is not None and (padding or self._valid is None) and not self._feat
                and self._live is None)

    @property
    def lean_step_kind(self) -> str | None:
        """Which lean step the next decode may take (docs/decoding.md): "fused" (one C call, on the CPU in
        float32/float64), "torch" (the blocked backend's torch operations), or None (the full path)."""
        if self._lean is None or not self._lean[2](self):
            return None
        return getattr(self._lean[3], "kind_name", "torch")

    def lean_ready(self) -> bool:
        """Whether the next token may take the plain lean step: rows only and no evictor. Padding is masked by
        :meth:`padding_bias`; under a window (the cache then holds only tokens the next query sees) there is
        none, and every row is at the same position."""
        return (self._rows_only(padding=self.horizon is None) and not self._state and self.evictor is None
                and (self.horizon is None or isinstance(self._next, int)))

    def lean_ready_selective(self) -> bool:
        """Whether the next token may take selective attention's lean step: rows and F only, at the budget."""
        return (self._rows_only() and self._m == self.budget and self.horizon is None and len(self._state) == 1
                and ACCUMULATED_STATE in self._state and self._lean_states(0))

    def lean_ready_scoring(self) -> bool:
        """Whether the next token may take the lean step of an evictor that scores after attention (H2O, TOVA):
        rows and the evictor's scores only, at the budget, with the spare slot the buffers keep for budget + 1.
        A score the full path left outside its buffer (an update() that assigned a new tensor, an eviction that
        gathered) is adopted into it here, once."""
        return (self._rows_only() and self._m == self.budget and self.horizon is None
                and self._k.shape[2] > self._m and set(self._state) == set(self.evictor.state_names)
                and self._lean_states(1))

    def _lean_states(self, spare: int) -> bool:
        """Make every per-token score what the lean steps write in place: the first M slots of a dense buffer of
        its own with room for ``spare`` more. A tensor the full path or a user assigned to ``state[name]`` (an
        evictor's new tensor, an expanded or negated view, one that shares memory between heads) is copied into
        such a buffer once, when it is first seen (by identity): not at every step."""
        seen = self._lean_seen
        for name, t in self._state.items():
            if seen.get(name) is not t:
                t = self._state[name] = self._state_room(name, t, self._m, spare)[:, :, :self._m]
                seen[name] = t
        return True

    def lean_ready_replacing(self) -> bool:
        """Whether the next token may take the lean step of an evictor without scores of its own (sink +
        window): rows only, at the budget."""
        return self._rows_only() and self._m == self.budget and self.horizon is None and not self._state

    def lean_slots(self, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The lean steps' view of the held tokens: keys, values (B, H_kv, M, D), positions (B, H_kv, M) and the
        per-token scores, as the slots hold them (out of position order after :meth:`replace_slot`; attention
        and the per-token scores do not depend on the order). ``spare=1``: first the step's key and value
        (:meth:`fill_spare`) in the slot after them, so the views hold M + 1 tokens."""
        m = self._m + spare
        return self._k[:, :, :m], self._v[:, :, :m], self._pos[:, :, :m], {
            name: t if not spare else self._state_buf[name][:, :, :m] for name, t in self._state.items()}

    def _write_next(self, slots: torch.Tensor) -> None:
        """Write the next position of every row into ``slots`` (B, H_kv), a slot of the position buffer."""
        if isinstance(self._next, int):
            slots.fill_(self._next)
        else:
            slots.copy_(self._next.view(-1, 1).expand(slots.shape))

    def fill_spare(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The lean step of an evictor that evicts after attention: the new token (B, H_kv, 1, D) goes into the
        spare slot after the held ones (the buffers keep room for budget + 1), at the next position, with every
        per-token score 0; :meth:`settle_spare` then evicts one token."""
        m = self._m
        with torch.no_grad():
            self._k.select(2, m).copy_(key.select(2, 0))
            self._v.select(2, m).copy_(value.select(2, 0))
            self._write_next(self._pos.select(2, m))
            for name in self._state:
                self._state_buf[name].select(2, m).zero_()

    def settle_spare(self, victim: torch.Tensor) -> None:
        """After :meth:`fill_spare` and attention: the token in slot ``victim`` (B, H_kv) leaves and the spare
        slot's token takes its place (nothing moves when the victim is the new token itself)."""
        m = self._m
        with torch.no_grad():
            at = victim.unsqueeze(-1)
            rows = at.unsqueeze(-1).expand(*victim.shape, 1, self._k.shape[3])
            for buf in (self._k, self._v):
                buf[:, :, :m + 1].scatter_(2, rows, buf.narrow(2, m, 1).clone())
            self._pos[:, :, :m + 1].scatter_(2, at, self._pos.narrow(2, m, 1).clone())
            for name in self._state:
                buf = self._state_buf[name]
                buf[:, :, :m + 1].scatter_(2, at, buf.narrow(2, m, 1).clone())
        self._scrambled = True
        self._next += 1
        self._last = None
        self.evicted += 1

    def replace_slot(self, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """The lean eviction: the token in ``slot`` ((B,) slot indices, one kept set per layer) leaves, and the new
        token (B, H_kv, 1, D) takes its slot at the next position with every per-token score 0: no slot moves.
        The lean steps choose ``slot`` by the evictor's own rule over :meth:`lean_slots` (ties to the oldest
        position, not the first slot); the views put the slots back in position order when read."""
        b, hkv, _, d = key.shape
        m = self._m
        with torch.no_grad():
            rows = slot.view(b, 1, 1, 1).expand(b, hkv, 1, d)
            self._k[:, :, :m].scatter_(2, rows, key)
            self._v[:, :, :m].scatter_(2, rows, value)
            at = slot.view(b, 1, 1).expand(b, hkv, 1)
            if isinstance(self._next, int):
                self._pos[:, :, :m].scatter_(2, at, self._next)
            else:
                self._pos[:, :, :m].scatter_(2, at, self._next.view(b, 1, 1).expand(b, hkv, 1))
            for t in self._state.values():
                t.scatter_(2, at, 0.0)
        self._scrambled = True
        self._next += 1
        self._last = None
        self.evicted += 1

    def append_one(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The lean step's append: one token per row (B, H_kv, 1, D), at the next position of every row, into the
        buffers; only valid while :meth:`lean_ready` holds and for the shapes and dtypes the full path checked."""
        old = self._m
        if old + 1 > self._k.shape[2]:
            self._grow(old + 1)
        with torch.no_grad():
            self._k.select(2, old).copy_(key.select(2, 0))
            self._v.select(2, old).copy_(value.select(2, 0))
            self._write_next(self._pos.select(2, old))
        self._m = old + 1
        self._next += 1
        self._last = None

    def drop_expired(self) -> None:
        """Drop the tokens that no later query can see: under a window mask (:attr:`horizon`), a token before the
        earliest key visible from a row's next position, and padding. Every row and head drops the same number
        (the fewest any of them can spare, oldest first), so the cache stays dense; what one row keeps beyond
        its window is masked as before. Between steps a window layer then holds at most ``window - 1`` tokens
        per row (once every row has seen that many, exactly that), as transformers' sliding-window cache does; a
        ``chunked`` layer holds each row's tokens of its current chunk, at most ``chunk - 1``."""
        if self.horizon is None or self._m == 0:
            return
        starts = self.next_position.tolist()
        firsts = [self.horizon(int(p)) for p in starts]
        earliest = torch.tensor(firsts, dtype=torch.int64, device=self._pos.device).view(-1, 1, 1)
        expired = self.positions < earliest
        if self.valid is not None:
            expired |= ~self.valid
        spare = int(expired.sum(-1).min())
        if spare == 0:
            return
        if bool(expired[..., :spare].all()):  # the oldest slots of every row and head: a shift, no gather
            keep = torch.arange(spare, self._m, device=self._pos.device).expand(*expired.shape[:2], -1)
        else:  # drop each row's first `spare` expired slots, keep the rest in order
            doomed = expired & (expired.cumsum(-1) <= spare)
            keep = torch.argsort(doomed.to(torch.int8), dim=-1, stable=True)[..., :self._m - spare]
        before = self.evicted
        self._keep(keep.contiguous())
        self.evicted = before
        self.expired += spare

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (LongTensor (B',)) in that order: beam search's reorder, batch selection
        and repetition all reduce to it. The batch size becomes B'."""
        self._lean = None
        given = torch.as_tensor(index)
        if given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
            raise ValueError(f"reorder takes integer row indices, got dtype {given.dtype} (for a boolean selection, "
                             f"pass mask.nonzero().flatten())")
        index = given.to(torch.int64)
        if self._scrambled:
            self._settle_order()
        if index.dim() != 1 or index.numel() < 1:
            raise ValueError(f"reorder takes a non-empty 1-D index of rows, got shape {tuple(index.shape)}")
        if bool(((index < 0) | (index >= self.batch)).any()):
            raise ValueError(f"reorder index out of range for a cache of batch {self.batch}: {index.tolist()}")
        self._live = self._feat_live = None
        if self._k is not None:
            index = index.to(self._k.device)
            self._k, self._v, self._pos = (t.index_select(0, index) for t in (self._k, self._v, self._pos))
            self.state = {name: t.index_select(0, index) for name, t in self.state.items()}
            self._feat = {name: t.index_select(0, index) for name, t in self._feat.items()}
            self.feature_totals = {name: t.index_select(0, index) for name, t in self.feature_totals.items()}
            if self.valid is not None:
                self.valid = self.valid.index_select(0, index)
        if isinstance(self._next, torch.Tensor):
            self._next = self._next.index_select(0, index.to(self._next.device))
        if self._last is not None:
            self._last = self._last.index_select(0, index.to(self._last.device))
        self.batch = int(index.numel())

    # -- one decoding step, the part every backend shares ------------------------------------------------------
    def admit(self, key: torch.Tensor, value: torch.Tensor, evict_first: bool,
              key_mask: torch.Tensor | None = None, features: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Append T (transformed) tokens with their features; an evictor that works before attention
        (selective, sink + window) evicts now. Returns the new tokens' positions (B, T)."""
        positions = self.append(key, value, key_mask, features)
        if evict_first and self.evictor is not None and not self.evictor.evict_after_attention:
            self.evict_to_budget()
        return positions

    def upcoming_positions(self, count: int, key_mask: torch.Tensor | None, device) -> torch.Tensor:
        """The positions (B, count) that the next ``count`` tokens will take (see :func:`new_token_positions`)."""
        if key_mask is None and isinstance(self._next, int):
            return torch.arange(self._next, self._next + count, device=device).expand(self.batch, count)
        return new_token_positions(self.next_position.to(device), count, key_mask)

    def query_positions(self, count: int, batch: int) -> torch.Tensor:
        """Absolute positions of the ``count`` tokens just appended (the new queries' positions): (B, count)."""
        return self._last[:, -count:]

    def accumulated(self) -> torch.Tensor | None:
        """The running F (the accumulated selection) of every cached token (B, M), or None without an
        accumulator."""
        return self.state[ACCUMULATED_STATE][:, 0] if ACCUMULATED_STATE in self.state else None

    def selection(self) -> torch.Tensor | None:
        """Deprecated name of :meth:`accumulated`."""
        warnings.warn("KVCache.selection() is deprecated: use KVCache.accumulated()", DeprecationWarning,
                      stacklevel=2)
        return self.accumulated()

    def settle(self, accumulated: torch.Tensor | None, probs: torch.Tensor | None) -> None:
        """After attending: store the new running F (B, M), update the evictor's scores from the new queries'
        attention ``probs`` (B, H, T, M), evict down to the budget, and detach everything held.

        F is stored, and ``probs`` handed to the evictor, detached and in :func:`accumulator_dtype` of the keys
        (at least float32): a backend that computed either in half precision cannot round the running state."""
        wide = accumulator_dtype(self._k.dtype)
        self._live = self._feat_live = None
        if accumulated is not None:
            accumulated = accumulated.detach().to(wide)
            held = self.state.get(ACCUMULATED_STATE)
            buf = self._state_buf.get(ACCUMULATED_STATE)
            if (held is not None and buf is not None and held.data_ptr() == buf.data_ptr()
                    and held.shape == self.positions.shape):
                held.copy_(accumulated.unsqueeze(1))  # in place: the buffer keeps its room for the next append
            else:
                self.state[ACCUMULATED_STATE] = accumulated.unsqueeze(1).expand_as(self.positions).clone()
        if self.evictor is not None:
            if not self.evictor.needs_probabilities:
                probs = None
            elif probs is None:
                raise ValueError(f"evictor '{self.evictor.kind}' needs the attention probabilities, and the backend "
                                 "passed none to settle()")
            self.evictor.update(self, probs.detach().to(wide) if probs is not None else None)
        if self.evictor is not None or self.valid is not None:
            self.evict_to_budget()

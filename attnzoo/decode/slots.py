"""The cache's buffers: growth, slot order, removal by slot, and the in-place writes of the fast decoding steps
(docs/decoding.md, "A step validated once"). A base class of :class:`attnzoo.decode.storage.KVCache`, which adds the
public views, the appends, reordering and accounting; together they are the only writers of the cache's fields.

A fast step writes the new token into a slot without moving the others: into the slot after the held ones
(:meth:`SlotStore.append_one`, :meth:`SlotStore.fill_spare`) or into its victim's slot
(:meth:`SlotStore.replace_slot`, :meth:`SlotStore.settle_spare`). The slots are then out of position order
(``_scrambled``) until a view is read or a full step runs (:meth:`SlotStore._settle_order`). The fused C steps write
the buffers themselves and tell the storage what they did (:meth:`SlotStore.kernel_stepped`,
:meth:`SlotStore.kernel_appended`).
"""

from __future__ import annotations

import torch


class SlotStore:
    """The buffers behind a :class:`~.storage.KVCache` (whose ``__init__`` makes the fields): keys, values and
    positions (B, H_kv, capacity, ...) whose first ``_m`` slots hold tokens, per-token scores in buffers of their
    own (``_state_buf``), and the writes of single slots the fast steps make."""

    _k: torch.Tensor | None
    _v: torch.Tensor | None
    _pos: torch.Tensor | None
    _m: int
    _next: torch.Tensor | int
    _state: dict[str, torch.Tensor]
    _state_buf: dict[str, torch.Tensor]

    def rows_only(self, padding: bool = False) -> bool:
        """Nothing per token but rows and positions: no padding (unless ``padding``), no features, no step's
        live rows. Rows may be at different positions (a left-padded batch)."""
        return (self._k is not None and (padding or self._valid is None) and not self._feat
                and self._live is None)

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

    def dense_scores(self, spare: int) -> bool:
        """Make every per-token score what the lean steps write in place: the first M slots of a dense buffer of
        its own with room for ``spare`` more. A tensor the full path or a user assigned to ``state[name]`` (an
        evictor's new tensor, an expanded or negated view, one that shares memory between heads) is copied into
        such a buffer once, when it is first seen (by identity): not at every step."""
        seen = self._dense_seen
        for name, t in self._state.items():
            if seen.get(name) is not t:
                t = self._state[name] = self._state_room(name, t, self._m, spare)[:, :, :self._m]
                seen[name] = t
        return True

    def held_slots(self, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
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
        The lean steps choose ``slot`` by the evictor's own rule over :meth:`held_slots` (ties to the oldest
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
        """The plain fast step's append: one token per row (B, H_kv, 1, D), at the next position of every row, into
        the buffers; only valid while ``attnzoo.decode.fast.ready_plain`` holds and for the shapes and dtypes the
        full path checked."""
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

    def kernel_stepped(self, rows_moved: bool) -> None:
        """A fused C step wrote the new token into its victim's slot (and the scores): the slots are out of
        position order, one token was evicted, and the next position moved on (the C step moved each row's
        own when ``rows_moved``)."""
        self._scrambled = True
        if not rows_moved:
            self._next += 1
        self._last = None
        self.evicted += 1

    def kernel_appended(self, rows_moved: bool) -> None:
        """A fused C append wrote the new token into the slot after the held ones."""
        self._m += 1
        if not rows_moved:
            self._next += 1
        self._last = None

    def attach(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               state: dict[str, torch.Tensor], held: int, next_position, *, evicted: int = 0, expired: int = 0,
               scrambled: bool = False, step_state=None) -> None:
        """Hold tokens in buffers the caller owns (a serving engine's page), without copying: ``keys``/``values``
        (B, H_kv, S, D), ``positions`` (B, H_kv, S) int64 and one (B, H_kv, S) buffer per name of
        :attr:`state_names` (in ``accumulator_dtype(keys.dtype)``), whose first ``held`` slots hold the tokens (in
        slot order: ``scrambled`` when a fast step left them out of position order), the next token at
        ``next_position`` (an int, or a (B,) tensor: per row). A step writes into these buffers while they have
        room (S = budget + 1 is enough for an evicting cache); a step that needs more replaces them, so the caller
        compares ``buffers()`` after the step and copies back what moved. A fresh cache only (nothing appended);
        every row real (no padding). ``step_state``: what an earlier cache of the same spec validated (its
        ``step_state``), so that a cache re-attached every step keeps the fast step it chose; the spec, geometry,
        parameters and call signature are still checked at the step, and the fast step's own preconditions on these
        buffers."""
        if self._k is not None:
            raise ValueError("attach: the cache already holds tokens")
        slots = keys.shape[2]
        if not 0 <= held <= slots or values.shape != keys.shape or positions.shape != keys.shape[:3]:
            raise ValueError(f"attach: keys {tuple(keys.shape)}, values {tuple(values.shape)}, positions "
                             f"{tuple(positions.shape)} with {held} held do not fit together")
        if keys.shape[0] != self.batch:
            raise ValueError(f"attach: cache was made for batch {self.batch}, got buffers of batch {keys.shape[0]}")
        missing = [n for n in self.state_names if n not in state]
        if missing:
            raise ValueError(f"attach: no buffer for the per-token scores {missing}")
        self._k, self._v, self._pos, self._m = keys, values, positions, held
        self._state_buf = {n: state[n] for n in self.state_names}
        self._state = {n: state[n][:, :, :held] for n in self.state_names}
        if isinstance(next_position, torch.Tensor):  # per row (rows at different offsets)
            self._next = next_position.to(torch.int64).reshape(self.batch).clone()
        else:
            self._next = int(next_position)
        self._scrambled = bool(scrambled)
        self.evicted, self.expired = int(evicted), int(expired)
        self.ordered = True  # strictly increasing positions in position order; scrambled slots are settled first
        if step_state is not None:
            if step_state.spec_hash != self.step_state.spec_hash:
                raise ValueError(f"attach: a step state of spec '{step_state.spec_name}', not of this cache's "
                                 f"'{self.step_state.spec_name}'")
            if step_state.signature is not None and step_state.signature[0][0] != self.batch:
                raise ValueError(f"attach: a step state validated for batch {step_state.signature[0][0]}, not "
                                 f"{self.batch}")
            self.step_state = step_state

    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the tokens live in (``keys``, ``values``, ``positions``, ``state.<name>``), spare slots
        included, in slot order (see :meth:`attach`), and ``held.<name>``: the scores of the held slots (a view of
        ``state.<name>`` unless an evictor assigned a tensor of its own)."""
        out = {"keys": self._k, "values": self._v, "positions": self._pos}
        out.update({f"state.{n}": self._state_buf.get(n) for n in self.state_names})
        out.update({f"held.{n}": self._state.get(n) for n in self.state_names})  # the held slots' scores
        return out

    @property
    def scrambled(self) -> bool:
        """True while a fast step has left the slots out of position order (the public views settle it)."""
        return self._scrambled

    def _settle_order(self) -> None:
        """Put the slots back in position order after lean steps wrote new tokens into their victims' slots: one
        sort per row and head, paid only when a view is read or a full step runs (the lean steps never need it)."""
        self._scrambled = False
        m = self._m
        order = self._pos[:, :, :m].argsort(dim=-1)
        if self._packed is not None:  # keys and values in 8, 4, 3 or 2 bits (attnzoo.decode.quant): their codes move
            self._packed = self._packed.gather_tokens(order)
        else:
            rows = order.unsqueeze(-1).expand(-1, -1, -1, self._k.shape[3])
            self._k[:, :, :m] = self._k[:, :, :m].gather(2, rows)
            self._v[:, :, :m] = self._v[:, :, :m].gather(2, rows)
        self._pos[:, :, :m] = self._pos[:, :, :m].gather(2, order)
        for t in self._state.values():
            t.copy_(t.gather(2, order))

    def _with_room(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (B, H_kv, M, ...) given for the values or positions, in a buffer with at least the key buffer's
        slots: appends and the lean steps write the next token into the slot after the held ones of all three."""
        if self._k is None or t.dim() < 3 or t.shape[2] >= self._k.shape[2]:
            return t
        room = t.new_empty(*t.shape[:2], self._k.shape[2], *t.shape[3:])
        room[:, :, :t.shape[2]] = t
        return room

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

    def _remove_slot(self, slot: int) -> None:
        """Drop slot ``slot`` of every row and head: the tail shifts down by one (no gather)."""
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

    def keep(self, keep: torch.Tensor, expired: bool = False) -> None:
        """Keep the slots ``keep`` (B, H_kv, M') (ascending, of the slots in position order) of every row and
        head, in place; the others count as evicted, or as ``expired`` (out of every later query's sight)."""
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
        if expired:
            self.expired += m - kept
        else:
            self.evicted += m - kept

    def compact(self) -> None:
        """Give back the spare room of buffers that grew past what the budget needs (after a long prefill)."""
        if self.budget is None or self._pos is None or self._packed is not None:
            return  # (packed: the codes hold the tokens and nothing more)
        room = max(self.budget + 1, self._m)
        if self._k.shape[2] > 2 * room:
            self._k, self._v, self._pos = (t[:, :, :room].clone() for t in (self._k, self._v, self._pos))

    def held_positions(self) -> torch.Tensor:
        """The positions held, (B, H_kv, M) sorted along M, read from the slots as they are: unlike the public
        ``positions`` view, this does not put slots that fast steps left out of order back in order (which would
        change what the next step starts from)."""
        if self._pos is None:
            return torch.empty(self.batch, 0, 0, dtype=torch.int64)
        return self._pos[:, :, :self._m].sort(dim=-1).values

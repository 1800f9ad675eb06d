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

Who writes what (docs/decoding.md, "Who owns what"): this module (and :mod:`.slots`, its in-place slot writes) is
the only writer of the cache's fields; the decode step (:mod:`.step`) admits, settles, evicts and expires through
the methods below, and the fast steps (:mod:`.fast`, :mod:`.fused`) read the buffers and write single slots
through :class:`~.slots.SlotStore`.
"""

from __future__ import annotations

import operator

import torch

from ..core.numerics import ACCUMULATED_STATE, accumulator_dtype
from . import quant
from .slots import SlotStore
from .state import StepState

__all__ = ["ACCUMULATED_STATE", "KVCache", "accumulator_dtype", "new_token_positions"]


def new_token_positions(start: torch.Tensor, count: int, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions (B, count) of ``count`` new tokens for rows whose next position is ``start`` (B,): consecutive,
    or with ``key_mask`` (B, count) real tokens consecutive and each padding token at the next real one's."""
    if key_mask is None:
        return start[:, None] + torch.arange(count, device=start.device)
    real = key_mask.to(torch.int64)
    return start[:, None] + real.cumsum(-1) - real



class KVCache(SlotStore):
    """A cache for one attention layer. Create it with ``variant.new_cache(batch=B, budget=K)``.

    ``keys``/``values``: (B, H_kv, M, D) rows after the key/value transforms; ``positions``: (B, H_kv, M) int64;
    ``valid``: (B, H_kv, M) bool, False for padding, or None when every token is real; ``state[name]``:
    (B, H_kv, M) per-token scores kept by the accumulator and the evictor, in ``accumulator_dtype(keys.dtype)``;
    ``next_position``: (B,) int64, the position the next real token of each row gets. ``budget=None`` never
    evicts. Between decode steps every tensor is detached from autograd (:func:`attnzoo.decode.step.settle`).

    :meth:`pack` holds the keys and values in 8, 4, 3 or 2 bits until the next step (:mod:`attnzoo.decode.quant`).
    """

    # the float buffers: plain attributes of the instance, absent while packed, when reading one unpacks
    _k = quant.HeldRows("_k")
    _v = quant.HeldRows("_v")

    def __init__(self, batch: int, budget: int | None, evictor=None, state_names: tuple[str, ...] = (),
                 horizon=None, spec=None) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be an int >= 1 or None, got {budget!r}")
        #: the fast steps write a new token into its victim's slot, leaving the slots out of position order
        #: until a public view (keys, values, positions, state) or a full step puts them back (_settle_order)
        self._scrambled = False
        self.batch = batch
        self.budget = budget
        self.evictor = evictor
        self.state_names = tuple(state_names)
        self.state: dict[str, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None
        #: (the valid tensor it was made from, (B, H_kv, slots) additive bias: -inf at padding, 0 past it) for
        #: the plain fast step, which attends over padded rows without growing ``valid`` (see :attr:`valid`)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.evicted = 0
        #: tokens dropped because no later query can see them (a window mask, ``attnzoo.decode.step.drop_expired``)
        self.expired = 0
        #: the spec's bound on the keys a query sees, ``earliest_key(query_position) -> int`` (a sliding window,
        #: a chunk), or None
        self.horizon = horizon
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
        self._totals: dict[str, torch.Tensor] = {}
        #: positions increase strictly along the slots of every row and head (kept by append and removal;
        #: padding ties with the next real token, and padding is never picked by an evictor's rule)
        self.ordered = True
        #: the per-token score tensors last found fit for the fast steps (:meth:`dense_scores`), by name: a tensor
        #: assigned to ``state[name]`` since is checked (and made a dense buffer's view) once
        self._dense_seen: dict[str, torch.Tensor] = {}
        #: what the full path validated, and the fast step it chose (``spec``: the (hash, name) of the spec whose
        #: ``new_cache`` made this cache: another spec's steps are refused)
        self.step_state = StepState(*(spec or (None, None)))
        #: the keys and values in 8, 4, 3 or 2 bits while packed (:meth:`pack`), else None; the codes of the last pack
        #: until the next (so that tokens still held keep them)
        self._packed: quant.PackedKV | None = None
        self._quant_earlier = None

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
        if value is not None and value.dim() == 3 and value.shape[1] > 1 and not bool((value == value[:, :1]).all()):
            # the backends mask held keys by one row per batch row (key_mask(): valid[:, 0]); a head holding padding
            # where another holds a token would be attended with the first head's mask
            raise ValueError("KVCache.valid must be the same in every key/value head (padding is per batch row; "
                             "attention masks held keys by the row's validity, valid[:, 0]), got validity that "
                             "differs between heads")
        self._valid = value
        if value is None:
            self._bias = None

    @property
    def keys(self) -> torch.Tensor | None:
        """(B, H_kv, M, D). While packed: the rows dequantized, a new tensor each read (the cache stays packed)."""
        if self._scrambled:
            self._settle_order()
        if self._packed is not None:
            return quant.dequantized(self)[0]
        if self._live is not None:
            return self._live[0]
        return None if self._k is None else self._k[:, :, :self._m]

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        self.unpack()
        self._quant_earlier = None  # rows set: the next pack quantizes every token
        if self._scrambled:
            self._settle_order()
        self.step_state.forget()
        self._k = value.detach()
        self._m = value.shape[2]
        self._live = None

    @property
    def values(self) -> torch.Tensor | None:
        if self._scrambled:
            self._settle_order()
        if self._packed is not None:
            return quant.dequantized(self)[1]
        if self._live is not None:
            return self._live[1]
        return None if self._v is None else self._v[:, :, :self._m]

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self.unpack()
        self._quant_earlier = None
        if self._scrambled:
            self._settle_order()
        self.step_state.forget()
        self._v = self._with_room(value.detach())
        self._live = None

    @property
    def positions(self) -> torch.Tensor | None:
        if self._scrambled:
            self._settle_order()
        return None if self._pos is None else self._pos[:, :, :self._m]

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self.unpack()
        self._quant_earlier = None
        if self._scrambled:
            self._settle_order()
        self.step_state.forget()
        self._pos = self._with_room(value)
        self.ordered = value.shape[-1] < 2 or bool((value[..., 1:] > value[..., :-1]).all())

    @property
    def next_position(self) -> torch.Tensor:
        """(B,) int64: the position the next real token of each row takes."""
        if isinstance(self._next, int):
            device = self._pos.device if self._pos is not None else None
            return torch.full((self.batch,), self._next, dtype=torch.int64, device=device)
        return self._next.clone()  # the cache moves its own on in place (the fused decoding steps)

    @property
    def uniform_next_position(self) -> int | None:
        """The position the next real token of every row takes, when every row takes the same one (an int), else
        None: a cheap check for a host's one-token step (no tensor made)."""
        return self._next if isinstance(self._next, int) else None

    @next_position.setter
    def next_position(self, value) -> None:
        """An int (every row) or a (B,) tensor; set before the first token to start at an offset."""
        self.step_state.forget()
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

    def attach(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               state: dict[str, torch.Tensor], held: int, next_position, *, evicted: int = 0, expired: int = 0,
               scrambled: bool = False, step_state=None) -> None:
        """Hold tokens in buffers the caller owns (:meth:`.slots.SlotStore.attach`), every buffer and header value
        checked first, each refusal one line naming it: ``keys`` and ``values`` (B, H_kv, S, D) of one floating
        dtype, ``positions`` (B, H_kv, S) int64, one per-token score buffer (B, H_kv, S) in
        ``accumulator_dtype(keys.dtype)`` for each name of :attr:`state_names` and none other, all on one device
        and none requiring grad (the cache holds detached tokens); ``held`` in [0, S]; ``next_position`` an int
        after the held tokens' positions (>= held + 1: they are distinct and >= 1) or a (B,) integer tensor (its
        values are the step's to check, which reads them); ``evicted`` and ``expired`` >= 0. A buffer that does not
        fit is refused here, not by the next step."""
        held = _attach_checked(self, keys, values, positions, state, held, next_position, evicted, expired)
        super().attach(keys, values, positions, state, held, next_position, evicted=evicted, expired=expired,
                       scrambled=scrambled, step_state=step_state)

    # -- copies (attnzoo.decode.rewind) -------------------------------------------------------------------------
    def copy(self) -> KVCache:
        """A deep copy (:func:`attnzoo.decode.rewind.copy_cache`): every tensor held copied once (tokens, packed
        codes, positions, per-token scores and features), the evictor shared; the copy and this cache then step
        independently (one compressed context, several continuations)."""
        from .rewind import copy_cache

        return copy_cache(self)

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
        rows = (self.keys, self.values) if self._packed is None else ()
        tensors = [*rows, self.positions, self.valid, *self.state.values(), *self._feat.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + self._packed_bytes()

    def _packed_bytes(self) -> int:
        return 0 if self._packed is None else self._packed.nbytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated, spare room of the growing buffers included (and the padding bias of the plain lean
        step, while it is kept)."""
        bias = self._bias[1] if self._bias is not None and self._bias[0] is self._valid else None
        rows = (self._k, self._v) if self._packed is None else ()
        tensors = [*rows, self._pos, self.valid, bias, *self.state.values(), *self._feat.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + self._packed_bytes()

    def memory(self) -> dict:
        """A report: tokens held per row and head, budget, tokens evicted, bytes held and allocated, and the bits
        the keys and values are held in (``kv_bits``: 8, 4, 3 or 2 while packed, None in full precision)."""
        return {"tokens": self._m, "budget": self.budget, "evicted": self.evicted, "expired": self.expired,
                "bytes": self.nbytes, "allocated_bytes": self.capacity_bytes, "kv_bits": self.packed_bits}

    # -- quantized between steps (attnzoo.decode.quant) ------------------------------------------------------------
    def pack(self, bits: int, rotate: bool = True, recent: int = 0) -> None:
        """Hold the keys and values in ``bits`` (8, 4, 3 or 2) with a float16 scale and zero point per token and head,
        until they are next read: the float buffers are released (:attr:`nbytes` counts the codes), and the next
        step, or anything else that reads the buffers, dequantizes them back first (:meth:`unpack`). Call it after
        each step: that step's new tokens were attended in full precision and are quantized now; tokens packed
        before keep their codes (quantized once). :attr:`keys` and :attr:`values` read while packed are the
        dequantized rows (new tensors; the cache stays packed). A no-op on an empty cache. ``rotate`` (the
        default): each token's rows are quantized in Hadamard-rotated coordinates (``attnzoo.decode.quant.rotate``:
        outlier channels no longer set a token's scale), rotated back when dequantized. ``recent``: each row's newest
        ``recent`` tokens (by position) are held at full precision as well, and read in place of their codes (counted
        in :attr:`nbytes`); a token read from its codes once it is no longer among them."""
        quant.pack(self, bits, rotate, recent)

    def unpack(self) -> None:
        """Dequantize packed keys and values back into float buffers (a no-op unless packed)."""
        quant.unpack(self)

    @property
    def packed_bits(self) -> int | None:
        """8, 4, 3 or 2 while the keys and values are packed (:meth:`pack`), else None."""
        return None if self._packed is None else self._packed.bits

    def over_budget(self) -> bool:
        return self.budget is not None and self._m > self.budget

    def __repr__(self) -> str:
        nxt = self._next if isinstance(self._next, int) else self._next.tolist()
        return (f"KVCache(batch={self.batch}, tokens={self._m}, budget={self.budget}, "
                f"next_position={nxt}, bytes={self.nbytes})")

    @property
    def lean_step_kind(self) -> str | None:
        """Which fast step the next decode may take (docs/decoding.md): "fused" (one C call, on the CPU in
        float32/float64), "torch" (torch operations), or None (the full path)."""
        fast = self.step_state.fast
        return None if fast is None or not fast.ready(self) else fast.kind

    @property
    def feature_totals(self) -> dict[str, torch.Tensor]:
        """The running totals (B, H) of the cumulative per-token features through the last token appended, by
        name (set by :meth:`append`)."""
        return self._totals

    # -- mutation -------------------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None,
               features: dict[str, torch.Tensor] | None = None,
               totals: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Append T tokens: key, value (B, H_kv, T, D) as they are to be attended (already transformed), at the
        next positions of each row (see :func:`new_token_positions`), with their per-token features ``{name:
        (B, H, T)}`` (running sums already taken, :func:`attnzoo.decode.step.admit`) and the new running ``totals``
        of the cumulative ones (:attr:`feature_totals`). Returns their positions (B, T). New per-token scores are 0
        (in ``accumulator_dtype(key.dtype)``).

        Rows that carry gradient are attended as given during this step (:meth:`end_step` drops them); the
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
            held_k, held_v = key, value
            if key_mask is not None:
                # a padding token is held as zeros: it is never attended, and whatever its key or value held (HF
                # pads with any embedding, NaN included) cannot reach a real query through a step that masks by a
                # weight of 0 or an additive -inf (0 × NaN and NaN + -inf are NaN)
                real = key_mask.to(key.device)[:, None, :, None]
                held_k = torch.where(real, key, torch.zeros((), dtype=key.dtype, device=key.device))
                held_v = torch.where(real, value, torch.zeros((), dtype=value.dtype, device=value.device))
            if count == 1:  # one row per head: select and copy (cheaper than slicing, which decoding feels)
                self._k.select(2, old).copy_(held_k.select(2, 0))
                self._v.select(2, old).copy_(held_v.select(2, 0))
                self._pos.select(2, old).copy_(new_pos)
            else:
                self._k[:, :, old:old + count] = held_k
                self._v[:, :, old:old + count] = held_v
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
        if totals is not None:
            self._totals = totals
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
        self.keep(keep + (keep >= victim.unsqueeze(-1)).long())

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (LongTensor (B',)) in that order: beam search's reorder, batch selection
        and repetition all reduce to it. The batch size becomes B'."""
        self.step_state.forget()
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
        if self._pos is not None:
            index = index.to(self._pos.device)
            if quant.reorder(self, index):  # packed: the codes move, there are no float buffers
                self._pos = self._pos.index_select(0, index)
            else:
                self._k, self._v, self._pos = (t.index_select(0, index) for t in (self._k, self._v, self._pos))
            self.state = {name: t.index_select(0, index) for name, t in self.state.items()}
            self._feat = {name: t.index_select(0, index) for name, t in self._feat.items()}
            self._totals = {name: t.index_select(0, index) for name, t in self._totals.items()}
            if self.valid is not None:
                self.valid = self.valid.index_select(0, index)
        if isinstance(self._next, torch.Tensor):
            self._next = self._next.index_select(0, index.to(self._next.device))
        if self._last is not None:
            self._last = self._last.index_select(0, index.to(self._last.device))
        self.batch = int(index.numel())

    # -- what one decoding step reads and writes (attnzoo.decode.step) ------------------------------------------
    def upcoming_positions(self, count: int, key_mask: torch.Tensor | None, device) -> torch.Tensor:
        """The positions (B, count) that the next ``count`` tokens will take (see :func:`new_token_positions`)."""
        if key_mask is None and isinstance(self._next, int):
            return torch.arange(self._next, self._next + count, device=device).expand(self.batch, count)
        return new_token_positions(self.next_position.to(device), count, key_mask)

    def query_positions(self, count: int, batch: int) -> torch.Tensor:
        """Absolute positions of the ``count`` tokens just appended (the new queries' positions): (B, count)."""
        return self._last[:, -count:]

    def query_mask(self) -> torch.Tensor | None:
        """(B, T) bool for the T tokens appended last (a step's new tokens, its queries): False for padding; None
        when every one is real. Read off their positions (:func:`new_token_positions`): a padding token takes the
        position of the next real token of its row, a real one the position before it, so a token is padding
        exactly where its position equals the next token's (for the last one, the row's next position)."""
        last = self._last
        if last is None or isinstance(self._next, int):  # an int: the last append had no padding
            return None
        following = torch.cat([last[:, 1:], self._next.to(last.device).unsqueeze(1)], dim=1)
        real = last < following
        return None if bool(real.all()) else real

    def accumulated(self) -> torch.Tensor | None:
        """The running F (the accumulated selection) of every cached token (B, M), or None without an
        accumulator."""
        return self.state[ACCUMULATED_STATE][:, 0] if ACCUMULATED_STATE in self.state else None

    def store_accumulated(self, accumulated: torch.Tensor) -> None:
        """Store the new running F (B, M), detached and in :func:`accumulator_dtype` of the keys: in place when
        the held F is its buffer's view (the buffer keeps its room for the next append)."""
        accumulated = accumulated.detach().to(accumulator_dtype(self._k.dtype))
        held = self.state.get(ACCUMULATED_STATE)
        buf = self._state_buf.get(ACCUMULATED_STATE)
        if (held is not None and buf is not None and held.data_ptr() == buf.data_ptr()
                and held.shape == self.positions.shape):
            held.copy_(accumulated.unsqueeze(1))
        else:
            self.state[ACCUMULATED_STATE] = accumulated.unsqueeze(1).expand_as(self.positions).clone()

    def end_step(self) -> None:
        """The step's rows and features with gradient are no longer attended: only the detached buffers stay."""
        self._live = self._feat_live = None

    # -- what the fast steps read (attnzoo.decode.fast, .fused): the slots as they are, nothing put in order --------
    def slot_buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int,
                                    torch.Tensor | int]:
        """The raw buffers a fast step reads and writes: keys, values (B, H_kv, capacity, D) and positions
        (B, H_kv, capacity), whose first ``held`` slots hold tokens in slot order (out of position order after a
        fast step: :attr:`scrambled`), ``held``, and the next position as held: an int (every row alike) or the
        cache's own (B,) int64 tensor, which the fused steps move on in place. One call, read at every step."""
        return self._k, self._v, self._pos, self._m, self._next

    @property
    def held_scores(self) -> dict[str, torch.Tensor]:
        """The per-token scores of the held slots by name, as the slots hold them (:attr:`state` without putting
        the slots back in position order): views of :attr:`score_buffers` once :meth:`dense_scores` ran."""
        return self._state

    @property
    def score_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the per-token scores live in by name, spare slots included (the spare slot's score is the
        step's to write: H2O, TOVA)."""
        return self._state_buf

    @property
    def padded(self) -> bool:
        """Whether any held token is padding (:attr:`valid` is not None), read without catching ``valid`` up."""
        return self._valid is not None

    def make_room(self, need: int) -> None:
        """Room in the buffers for ``need`` tokens (doubling them when they have less)."""
        self._grow(need)


def _attach_count(name: str, value, low: int) -> int:
    """``value`` (an int, or anything with ``__index__`` but a bool) as an int >= ``low``, else one line."""
    if type(value) is not int:  # the common case spelled out first: attach runs at every step of every layer
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise ValueError(f"attach: {name} must be an int, got {value!r}") from None
    if value < low:
        raise ValueError(f"attach: {name} must be >= {low}, got {value}")
    return value


_WIDE: dict[torch.dtype, torch.dtype] = {}  # accumulator_dtype by dtype (attach runs at every step)
_INTEGERS = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_INT64 = torch.int64


def _attach_checked(cache: KVCache, keys, values, positions, state, held, next_position, evicted,
                    expired) -> int:
    """The checks of :meth:`KVCache.attach`, before anything is adopted; returns ``held`` as an int. A serving
    engine attaches at every step of every layer, so what fits is told in one pass, each tensor's metadata read
    once (about 2 us warm, 3 to 4 us between decode steps); anything else goes to :func:`_attach_refused`, which
    names what does not fit."""
    try:
        shape, per_token, dtype = keys.shape, positions.shape, keys.dtype
        cpu = keys.is_cpu
        device = None if cpu else keys.device
        names = cache.state_names
        fits = (type(held) is int and 0 <= held and len(shape) == 4 and held <= shape[2] and shape[0] == cache.batch
                and values.shape == shape and per_token == shape[:3] and dtype.is_floating_point
                and values.dtype == dtype and positions.dtype == _INT64
                and (values.is_cpu and positions.is_cpu if cpu else
                     values.device == device and positions.device == device)
                and not (keys.requires_grad or values.requires_grad or positions.requires_grad)
                and type(state) is dict and len(state) == len(names)
                and type(evicted) is int and evicted >= 0 and type(expired) is int and expired >= 0)
        if fits and names:
            wide = _WIDE.get(dtype)
            if wide is None:
                wide = _WIDE[dtype] = accumulator_dtype(dtype)
            for name in names:
                t = state.get(name)
                if (type(t) is not torch.Tensor or t.shape != per_token or t.dtype != wide
                        or (not t.is_cpu if cpu else t.device != device) or t.requires_grad):
                    fits = False
                    break
        if fits:
            if type(next_position) is int:
                fits = next_position >= held + 1
            else:
                fits = (type(next_position) is torch.Tensor and next_position.dtype in _INTEGERS
                        and next_position.shape == (cache.batch,))
    except (AttributeError, TypeError):  # not tensors, not a mapping: named below
        fits = False
    if fits:
        return held
    return _attach_refused(cache, keys, values, positions, state, held, next_position, evicted, expired)


def _attach_refused(cache: KVCache, keys, values, positions, state, held, next_position, evicted,
                    expired) -> int:
    """The checks of :meth:`KVCache.attach` one by one: a ValueError of one line naming the first buffer or header
    value that does not fit (or ``held`` as an int, for what the one pass of :func:`_attach_checked` left to these:
    a mapping other than a dict, a subclass of torch.Tensor, ints given as other integer types)."""
    for name, t in (("keys", keys), ("values", values), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"attach: {name} must be a tensor, got {type(t).__name__}")
    if not isinstance(state, dict):
        from collections.abc import Mapping

        if not isinstance(state, Mapping):
            raise ValueError(f"attach: state must be a mapping of per-token score buffers by name, got "
                             f"{type(state).__name__}")
    held = _attach_count("held", held, 0)
    shape, per_token = keys.shape, positions.shape
    if len(shape) != 4 or not held <= shape[2] or values.shape != shape or per_token != shape[:3]:
        raise ValueError(f"attach: keys {tuple(shape)}, values {tuple(values.shape)}, positions "
                         f"{tuple(per_token)} with {held} held do not fit together")
    if shape[0] != cache.batch:
        raise ValueError(f"attach: cache was made for batch {cache.batch}, got buffers of batch {shape[0]}")
    dtype, device = keys.dtype, keys.device
    if not keys.is_floating_point() or values.dtype != dtype:
        raise ValueError(f"attach: keys and values must have one floating dtype, got {dtype} and {values.dtype}")
    if positions.dtype != torch.int64:
        raise ValueError(f"attach: positions must be int64, got {positions.dtype}")
    names = cache.state_names
    if len(state) != len(names) or any(n not in state for n in names):
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"attach: no buffer for the per-token scores {missing}")
        raise ValueError(f"attach: buffers for per-token scores this cache does not keep: "
                         f"{sorted(str(n) for n in state if n not in names)} (it keeps {list(names)})")
    wide = _WIDE.get(dtype)
    if wide is None:
        wide = _WIDE[dtype] = accumulator_dtype(dtype)
    buffers = [("keys", keys), ("values", values), ("positions", positions)]
    for name in names:
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"attach: the per-token scores {name!r} must be a tensor, got {type(t).__name__}")
        if t.shape != per_token:
            raise ValueError(f"attach: the per-token scores {name!r} of shape {tuple(t.shape)} do not fit positions "
                             f"{tuple(per_token)} (one score per slot of every row and head)")
        if t.dtype != wide:
            raise ValueError(f"attach: the per-token scores {name!r} must be {wide} (accumulator_dtype of the keys' "
                             f"{dtype}), got {t.dtype}")
        buffers.append((f"the per-token scores {name!r}", t))
    for name, t in buffers:
        if t.requires_grad or t.device != device:
            if t.device != device:
                raise ValueError(f"attach: {name} is on {t.device}, keys on {device}: one device for every buffer")
            raise ValueError(f"attach: {name} requires grad: the cache holds detached tokens (pass a tensor that "
                             f"does not require grad, e.g. .detach())")
    if isinstance(next_position, torch.Tensor):  # its values are the step's to check (the fused op: >= 1)
        if next_position.shape != (cache.batch,):
            raise ValueError(f"attach: next_position must be an int or a ({cache.batch},) tensor, got shape "
                             f"{tuple(next_position.shape)}")
        if next_position.is_floating_point() or next_position.is_complex() or next_position.dtype == torch.bool:
            raise ValueError(f"attach: next_position must hold integers, got dtype {next_position.dtype}")
    elif _attach_count("next_position", next_position, 1) < held + 1:
        raise ValueError(f"attach: next_position {next_position} does not come after {held} held tokens (their "
                         f"positions are distinct and >= 1: the next is >= {held + 1})")
    _attach_count("evicted", evicted, 0)
    _attach_count("expired", expired, 0)
    return held

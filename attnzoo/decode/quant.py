"""Keys and values held in 8, 4, 3 or 2 bits between decoding steps (docs/decoding.md, "Quantized keys and values").

Rows (B, H_kv, M, D) are quantized **per token**: each (batch row, key/value head, token) has its own asymmetric
scale ``s`` and zero point ``z``, both stored in float16, and its D elements become codes ``c`` in [0, 2**bits - 1]
(rounded to nearest, ties to even) with ``x ~ z + c * s``. A token's codes are one little-endian bit string of
``D * bits`` bits in (B, H_kv, M, D * bits // 8) uint8 bytes: element ``j`` holds bits ``j * bits`` to
``j * bits + bits - 1`` of it, and byte ``k`` bits ``8k`` (its least significant bit) to ``8k + 7``
(:func:`pack_codes`). So:

- 8 bits: one code per byte, (B, H_kv, M, D);
- 4 bits: two codes per byte, (B, H_kv, M, D // 2), element 2i in the low nibble and 2i + 1 in the high one
  (D must be even);
- 3 bits: eight codes in three bytes, (B, H_kv, M, 3 * D // 8): elements 8i to 8i + 7 are the 24-bit number
  ``c0 + c1 * 2**3 + ... + c7 * 2**21`` held in bytes 3i (its low byte), 3i + 1 and 3i + 2 (D a multiple of 8);
- 2 bits: four codes per byte, (B, H_kv, M, D // 4), element 4i + j in bits 2j and 2j + 1 of byte i (D a
  multiple of 4).

A head size the packing cannot hold whole (D * bits not a multiple of 8) is refused with one line.

``z`` is the row's minimum rounded *down* to a float16, ``s`` is ``(max - z) / (2**bits - 1)`` rounded *up* to a
float16, so ``[z, z + (2**bits - 1) * s]`` covers the row and every element is within ``s / 2`` of its dequantized
value (plus float32's rounding of ``z + c * s``; and the float dtype's own rounding when the rows are bfloat16 or
float16). A row whose minimum or scale does not fit float16 (|min| or (max - min) / (2**bits - 1) beyond 65504) is
refused with one line. A row holding a NaN or an infinity is held as NaN: its scale and zero point are NaN, so every
element of that token dequantizes to NaN (attention over a NaN key or value gives NaN, as the full-precision cache
does for a NaN); the other tokens keep their own scales, untouched.

A :class:`~attnzoo.decode.storage.KVCache` holds its rows this way between steps (:func:`pack`): the float
buffers are dropped (``KVCache._k``/``_v`` leave the instance), and the first read of ``_k`` or ``_v`` (the next
step, any evictor, :func:`unpack`) dequantizes them back into float buffers (:class:`HeldRows`). A step's new tokens
are attended in full precision during their own step and quantized at its end (transformers' ``QuantizedCache``
keeps a full-precision residual of recent tokens in the same spirit). Tokens already held are *not* quantized again:
:func:`pack` finds each held token's earlier codes (same row, head and position) and keeps them, so a token's error
is that of its first quantization however many steps it stays.

**Rotated** (``rotate=True``, what a cache does unless told otherwise): a row is multiplied by an orthonormal
Hadamard matrix before it is quantized and by the same matrix after it is dequantized (:func:`rotate`; the matrix is
symmetric and its own inverse). A few outlier channels (pretrained keys have them) no longer set the whole token's
scale: the rotation spreads every channel over all of them, so the scale shrinks towards the row's typical size.
The bound above holds in the rotated coordinates; in the head's own, a token's error has the same Euclidean norm
(at most ``sqrt(D) * s / 2``). The matrix is the Sylvester Hadamard matrix of the largest power of two dividing D,
applied to each block of that many elements (D = 64: one 64 x 64 block; D = 80: five of 16; D odd: no rotation).
On SmolLM2-135M (docs/quality.md) 4-bit keys and values cost +9.2% perplexity unrotated and +2.3% rotated.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["BITS", "QuantizedRows", "check_bits", "check_head_dim", "code_bytes", "dequantize", "hadamard", "pack",
           "pack_codes", "pack_nibbles", "quantize", "quantized_nbytes", "rotate", "rotation_block", "unpack",
           "unpack_codes", "unpack_nibbles"]

#: the bit widths offered
BITS = (8, 4, 3, 2)
_FP16_MAX = 65504.0
#: codes a packing group holds, and its bytes: 8 bits one code a byte, 4 two, 3 eight in three bytes, 2 four a byte
_GROUP = {8: (1, 1), 4: (2, 1), 3: (8, 3), 2: (4, 1)}
_PACKS = {4: "two codes a byte", 3: "eight codes in three bytes", 2: "four codes a byte"}


def check_bits(bits, name: str = "kv_bits") -> int:
    """``bits`` if it is 8, 4, 3 or 2 (an int, not a bool), else a ValueError of one line naming ``name``."""
    if type(bits) is not int or bits not in BITS:
        raise ValueError(f"{name} must be 8, 4, 3 or 2 (or None: full precision), got {bits!r}")
    return bits


def check_head_dim(head_dim: int, bits: int, name: str = "kv_bits") -> None:
    """A ValueError of one line unless ``bits`` packs rows of ``head_dim`` codes whole (``head_dim * bits`` a
    multiple of 8: even for 4 bits, a multiple of 8 for 3, of 4 for 2)."""
    per, _ = _GROUP[bits]
    if head_dim % per:
        multiple = "even" if per == 2 else f"a multiple of {per}"
        raise ValueError(f"{name}={bits} packs {_PACKS[bits]}: the head size must be {multiple}, got {head_dim}")


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one token's codes (one head, keys or values): ``head_dim * bits / 8``."""
    return head_dim * bits // 8


def rotation_block(head_dim: int) -> int:
    """The size of the Hadamard blocks :func:`rotate` applies to rows of ``head_dim`` elements: the largest power of
    two dividing it (1, no rotation, for an odd or zero size)."""
    return head_dim & -head_dim if head_dim > 0 else 1


_HADAMARD: dict = {}


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two): entries +-1 / sqrt(n), symmetric,
    its own inverse. Built in float64 and cached per (n, dtype, device)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two, got {n}")
    key = (n, dtype, torch.device(device) if device is not None else torch.device("cpu"))
    h = _HADAMARD.get(key)
    if h is None:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        h = (h / math.sqrt(n)).to(dtype=dtype, device=key[2])
        _HADAMARD[key] = h
    return h


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., D) times the block-diagonal Hadamard matrix of :func:`rotation_block` (a new tensor; ``x``
    itself when the block is 1). Orthonormal and symmetric: ``rotate(rotate(x)) == x`` up to rounding."""
    d = x.shape[-1]
    n = rotation_block(d)
    if n == 1:
        return x
    h = hadamard(n, x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], d // n, n) @ h).reshape(x.shape)


_rotate = rotate  # quantize's and pack's argument of that name hides the function


class QuantizedRows(NamedTuple):
    """Rows (B, H_kv, M, D) in ``bits``: ``codes`` uint8 (B, H_kv, M, D * bits // 8) (:func:`pack_codes`);
    ``scale`` and ``zero`` float16 (B, H_kv, M); ``head_dim`` D; ``rotated``: the codes hold :func:`rotate` of the
    rows (dequantizing rotates them back)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    head_dim: int
    rotated: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, m = self.scale.shape
        return b, h, m, self.head_dim

    def index_select(self, dim: int, index: torch.Tensor) -> QuantizedRows:
        """The rows ``index`` along ``dim`` (0: batch rows, 1: heads, 2: tokens)."""
        return self._replace(codes=self.codes.index_select(dim, index), scale=self.scale.index_select(dim, index),
                             zero=self.zero.index_select(dim, index))

    def gather_tokens(self, slot: torch.Tensor) -> QuantizedRows:
        """The tokens ``slot`` (B, H_kv, M') of each row and head."""
        b, h, m = self.scale.shape
        rows = (torch.arange(b * h, device=slot.device).view(b, h, 1) * m + slot).view(-1)
        codes = self.codes.reshape(b * h * m, -1).index_select(0, rows).view(*slot.shape, -1)  # whole rows
        return self._replace(codes=codes, scale=self.scale.gather(2, slot), zero=self.zero.gather(2, slot))


def quantized_nbytes(batch: int, heads: int, tokens: int, head_dim: int, bits: int) -> int:
    """Bytes :func:`quantize` holds for rows (batch, heads, tokens, head_dim) in ``bits``: the codes
    (head_dim * bits / 8 bytes a token and head) and a float16 scale and zero point (4 bytes)."""
    check_bits(bits, "bits")
    check_head_dim(head_dim, bits, "bits")
    return batch * heads * tokens * (code_bytes(head_dim, bits) + 4)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] (..., D), D even, as (..., D // 2) bytes: element 2i low nibble, 2i + 1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: (..., D // 2) bytes as (..., D) codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2**bits - 1] (..., D) as the little-endian bit string of the module's docstring,
    (..., D * bits // 8) bytes (D * bits a multiple of 8; 8 bits: ``codes`` itself)."""
    if bits == 8:
        return codes
    if bits == 4:
        return pack_nibbles(codes)
    per, nbytes = _GROUP[bits]
    groups = codes.reshape(*codes.shape[:-1], -1, per)
    if bits == 2:
        return (groups[..., 0] | (groups[..., 1] << 2) | (groups[..., 2] << 4) | (groups[..., 3] << 6))
    shifts = torch.arange(0, 3 * per, 3, dtype=torch.int32, device=codes.device)  # 3 bits: a 24-bit number
    word = (groups.to(torch.int32) << shifts).sum(-1)
    out = torch.stack([(word >> (8 * i)) & 255 for i in range(nbytes)], dim=-1).to(torch.uint8)
    return out.flatten(-2)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: (..., D * bits // 8) bytes as (..., D) uint8 codes."""
    if bits == 8:
        return packed
    if bits == 4:
        return unpack_nibbles(packed)
    if bits == 2:
        return torch.stack([packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6], dim=-1).flatten(-2)
    per, nbytes = _GROUP[bits]
    b = packed.reshape(*packed.shape[:-1], -1, nbytes).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, 3 * per, 3, dtype=torch.int32, device=packed.device)
    return ((word.unsqueeze(-1) >> shifts) & 7).to(torch.uint8).flatten(-2)


def _down16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as the largest float16 <= x."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _up16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as the smallest float16 >= x."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize(x: torch.Tensor, bits: int, rotate: bool = False) -> QuantizedRows:
    """Rows ``x`` (B, H_kv, M, D) of a floating dtype in ``bits`` (8, 4, 3 or 2), one scale and zero point per (row,
    head, token) (the module's docstring: the rule, the bound, non-finite and too-large rows); ``rotate``: the rows
    times the Hadamard matrix are quantized (:func:`rotate`), and :func:`dequantize` rotates them back."""
    check_bits(bits, "bits")
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"quantize takes floating rows (B, H_kv, M, D), got {x.dtype} of shape {tuple(x.shape)}")
    d = x.shape[-1]
    check_head_dim(d, bits, "bits")
    levels = (1 << bits) - 1
    with torch.no_grad():
        xf = x.detach().float()
        if rotate:  # a NaN or infinity spreads over its block: the token is held as NaN, as unrotated
            xf = _rotate(xf)
        if d:
            lo, hi = xf.amin(-1), xf.amax(-1)  # NaN if the row holds one
        else:
            lo = hi = xf.new_zeros(x.shape[:3])
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        lo, hi = torch.where(finite, lo, 0.0), torch.where(finite, hi, 0.0)
        zero = _down16(lo)
        scale = _up16((hi - zero.float()) / levels)
        fits = (lo.abs() <= _FP16_MAX) & torch.isfinite(zero) & torch.isfinite(scale)
        if not bool(fits.all()):
            where_ = tuple(int(i) for i in (~fits).nonzero()[0].tolist())
            rows_ = "rotated rows" if rotate else "rows"
            raise ValueError(f"a token's {rows_} span [{float(lo[where_]):.6g}, {float(hi[where_]):.6g}] (batch row, "
                             f"head, slot {where_}): beyond float16's range (65504) for the {bits}-bit scale and "
                             f"zero point; hold these keys and values in full precision (kv_bits=None)")
        zf, sf = zero.float().unsqueeze(-1), scale.float().unsqueeze(-1)
        codes = ((xf - zf) / torch.where(sf > 0, sf, 1.0)).round_().clamp_(0, levels)
        codes = torch.where(finite.unsqueeze(-1), codes, 0.0).to(torch.uint8)
        nan = torch.tensor(float("nan"), dtype=torch.float16, device=x.device)
        scale = torch.where(finite, scale, nan)
        zero = torch.where(finite, zero, nan)
        codes = pack_codes(codes, bits)
    return QuantizedRows(codes, scale, zero, bits, d, bool(rotate) and rotation_block(d) > 1)


def dequantize(q: QuantizedRows, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows ``z + c * s`` (B, H_kv, M, D), rotated back when ``q.rotated``, computed in float32 (float64 for
    float64 rows), in ``dtype`` (or written into ``out``, a float tensor of that shape)."""
    codes = unpack_codes(q.codes, q.bits)
    scale, zero = q.scale.unsqueeze(-1), q.zero.unsqueeze(-1)
    target = dtype if out is None else out.dtype
    if q.rotated:  # z + c * s in the rotated coordinates, then back (a temporary of the rows' size)
        work = torch.float64 if target == torch.float64 else torch.float32
        rows = _rotate(torch.addcmul(zero.to(work), codes.to(work), scale.to(work)))
        return rows.to(dtype) if out is None else out.copy_(rows)
    if target in (torch.float32, torch.float64):  # in place, no temporary of the rows' size
        rows = torch.empty(codes.shape, dtype=target, device=codes.device) if out is None else out
        return rows.copy_(codes).mul_(scale).add_(zero)
    rows = torch.addcmul(zero.float(), codes.float(), scale.float())
    return rows.to(dtype) if out is None else out.copy_(rows)


# -- a KVCache held quantized between steps ---------------------------------------------------------------------------
class PackedKV(NamedTuple):
    """What a packed cache holds in place of its float buffers: keys and values, their float dtype and device, and
    ``exact``: the newest tokens' rows at full precision (``pack(..., recent=N)``: their slots (B, H_kv, N) int64,
    keys and values (B, H_kv, N, D) in ``dtype``), read in place of their codes, or None."""

    keys: QuantizedRows
    values: QuantizedRows
    dtype: torch.dtype
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def bits(self) -> int:
        return self.keys.bits

    @property
    def rotated(self) -> bool:
        return self.keys.rotated

    @property
    def recent(self) -> int:
        """How many of each row's newest tokens are held at full precision as well."""
        return 0 if self.exact is None else self.exact[0].shape[-1]

    @property
    def nbytes(self) -> int:
        rows = 0 if self.exact is None else sum(t.numel() * t.element_size() for t in self.exact[1:])
        return self.keys.nbytes + self.values.nbytes + rows

    def index_select(self, dim: int, index: torch.Tensor) -> PackedKV:
        """Batch rows (``dim`` 0) or key/value heads (1)."""
        if dim not in (0, 1):
            raise ValueError(f"PackedKV.index_select selects rows or heads (dim 0 or 1), not dim {dim}")
        exact = None if self.exact is None else tuple(t.index_select(dim, index) for t in self.exact)
        return self._replace(keys=self.keys.index_select(dim, index), values=self.values.index_select(dim, index),
                             exact=exact)

    def gather_tokens(self, slot: torch.Tensor) -> PackedKV:
        """Slot j of each row and head takes slot ``slot[..., j]``'s token. The exact rows follow their tokens when
        ``slot`` reorders every slot (a permutation: the slots settled in position order); otherwise they are let go
        (the tokens are read from their codes)."""
        exact = self.exact
        if exact is not None:
            if slot.shape == self.keys.scale.shape:  # every slot once, in a new order (its inverse finds the tokens)
                exact = (slot.argsort(dim=-1).gather(-1, exact[0]), exact[1], exact[2])
            else:
                exact = None
        return self._replace(keys=self.keys.gather_tokens(slot), values=self.values.gather_tokens(slot), exact=exact)

    def dequantized(self, which: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Keys (``which`` 0) or values (1) in ``dtype``, the exact rows in their slots."""
        rows = dequantize(self.keys if which == 0 else self.values, self.dtype, out=out)
        if self.exact is not None:
            slots, held = self.exact[0], self.exact[1 + which]
            rows.scatter_(2, slots.unsqueeze(-1).expand(*slots.shape, rows.shape[-1]), held)
        return rows


class _Earlier(NamedTuple):
    """The codes a cache held before :func:`unpack`, the positions of their slots (in position order: :func:`pack`
    settles the slots first) and each row's next position then (B, 1, 1): :func:`pack` keeps the codes of the
    tokens still held (every token before that position), so no token is quantized twice."""

    packed: PackedKV
    positions: torch.Tensor
    next: torch.Tensor


class HeldRows:
    """``KVCache._k`` / ``_v`` while the cache is packed. A non-data descriptor: while the float buffer is in the
    instance's ``__dict__`` (unpacked, the normal case) it is read as a plain attribute at no cost; once :func:`pack`
    removes it, the first read dequantizes the rows back (:func:`unpack`) and returns the buffer."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        if cache.__dict__.get("_packed") is None:
            raise AttributeError(self.name)
        unpack(cache)
        return cache.__dict__[self.name]


def check_recent(recent, name: str = "kv_recent") -> int:
    """``recent`` as an int >= 0, or one line naming ``name``."""
    if isinstance(recent, bool) or not isinstance(recent, int) or recent < 0:
        raise ValueError(f"{name} must be an int >= 0 (the newest tokens held at full precision too), got {recent!r}")
    return recent


def pack(cache, bits: int, rotate: bool = True, recent: int = 0) -> None:
    """Hold ``cache``'s keys and values in ``bits`` until the next step (:meth:`KVCache.pack`), rotated
    (:func:`rotate`) unless ``rotate`` is False, each row's newest ``recent`` tokens (by position) held at full
    precision as well and read in place of their codes (every token still gets its codes when first packed: one that
    leaves the newest is read from them). Refused, before anything changes, for a head size ``bits`` cannot pack
    whole (:func:`check_head_dim`) or a token beyond float16's scale range."""
    check_bits(bits, "kv_bits")
    check_recent(recent)
    held = cache.__dict__
    packed = held.get("_packed")
    if packed is not None:
        if ((packed.bits, packed.rotated, packed.recent) ==
                (bits, bool(rotate) and rotation_block(packed.keys.head_dim) > 1, min(recent, cache._m))):
            return
        unpack(cache)
    k = held.get("_k")
    if k is None or cache._m == 0:
        return
    rotate = bool(rotate) and rotation_block(k.shape[-1]) > 1
    check_head_dim(k.shape[-1], bits, "kv_bits")
    if cache._live is not None:
        raise ValueError("pack: a step is in progress (rows with gradient are attended): pack after it")
    m = cache._m  # the slots as the step left them (out of position order after a fast step: it needs no order)
    rows = (held["_k"][:, :, :m], held["_v"][:, :, :m])
    earlier = held.get("_quant_earlier")
    if (earlier is None or (earlier.packed.bits, earlier.packed.rotated) != (bits, rotate)
            or earlier.positions.shape[:2] != rows[0].shape[:2] or earlier.positions.shape[2] == 0):
        keys, values = (quantize(r, bits, rotate) for r in rows)
    else:
        keys, values = _keep_earlier(rows, cache._pos[:, :, :m].contiguous(), cache.valid, earlier, bits, rotate)
    fast = cache.step_state.fast
    if getattr(fast, "held", None):  # a fused step keeps the buffers it checked and its op's arguments: let them
        fast.held = fast.fixed = ()  # go (attnzoo/decode/fused.py: the next step lays the new buffers out anew)
    exact = None
    if recent:
        slots = cache._pos[:, :, :m].topk(min(recent, m), dim=-1).indices  # each row's newest positions
        index = slots.unsqueeze(-1).expand(*slots.shape, rows[0].shape[-1])
        exact = (slots, rows[0].gather(2, index), rows[1].gather(2, index))
    cache._packed = PackedKV(keys, values, k.dtype, exact)
    cache._quant_earlier = None
    cache._bias = None
    del held["_k"], held["_v"]


def _keep_earlier(rows, positions, valid, earlier: _Earlier, bits: int, rotate: bool) -> list[QuantizedRows]:
    """The codes of ``rows`` (keys, values (B, H_kv, M, D)) at ``positions`` (B, H_kv, M): a token held before the
    step keeps its earlier codes, found by position (rows never change once held: it is that token; rows set drop
    the earlier codes, and a rewind, which gives positions out again, moves ``earlier.next`` back to its mark:
    :func:`forget_from`); a token of the step (at or past the row's next position then, not found
    among the earlier positions, or another row) is quantized now. Padding shares its position with the next real
    token (and is held as zeros): a real token takes the last earlier slot of its position, padding the first."""
    old = earlier.packed._replace(exact=None)  # the codes only: every earlier token has its own
    order = earlier.positions.argsort(dim=-1, stable=True)  # the earlier slots may be out of position order
    before = earlier.positions.gather(-1, order)
    last = before.shape[-1] - 1
    at = (torch.searchsorted(before, positions, right=True) - 1).clamp_(0, last)
    if valid is not None:
        at = torch.where(valid, at, torch.searchsorted(before, positions).clamp_(0, last))
    fresh = (positions >= earlier.next) | (before.gather(-1, at) != positions)
    kept = [q.gather_tokens(order.gather(-1, at)) for q in (old.keys, old.values)]
    if bool(fresh.any()):  # the step's tokens, keys and values in one call
        n = int(fresh.sum())
        new = quantize(torch.cat([rows[0][fresh], rows[1][fresh]]).view(1, 2, n, -1), bits, rotate)
        for i, q in enumerate(kept):
            q.codes[fresh] = new.codes[0, i]
            q.scale[fresh] = new.scale[0, i]
            q.zero[fresh] = new.zero[0, i]
    return kept


def unpack(cache) -> None:
    """Dequantize ``cache``'s keys and values back into float buffers (as many slots as the positions' buffer, and
    room for the next token: budget + 1 slots under an evicting budget, where the lean steps put it), keeping the
    codes until the next :func:`pack`. Nothing to do unless packed."""
    held = cache.__dict__
    packed = held.get("_packed")
    if packed is None:
        return
    b, h, m, d = packed.keys.shape
    pos = cache._pos
    room = max(m + 1, pos.shape[2])  # the slots the positions keep (appends write all three buffers), and a spare
    if cache.budget is not None and cache.evictor is not None:
        room = max(room, cache.budget + 1)
    if pos.shape[2] < room:
        cache._pos = pos.new_empty(b, h, room)
        cache._pos[:, :, :m] = pos[:, :, :m]
    device = packed.keys.codes.device
    bufs = []
    for which in (0, 1):
        buf = torch.empty(b, h, room, d, dtype=packed.dtype, device=device)
        packed.dequantized(which, out=buf[:, :, :m])
        bufs.append(buf)
    held["_k"], held["_v"] = bufs
    cache._packed = None
    cache._quant_earlier = _Earlier(packed, cache._pos[:, :, :m].clone(), cache.next_position.view(b, 1, 1))


def forget_from(cache, next_position) -> None:
    """Positions from ``next_position`` on (an int, or (B,) per row) will be given out again (a rewind): the codes
    kept for the next :func:`pack` count only for the tokens before it, so a later token at a reused position is
    quantized anew."""
    earlier = cache.__dict__.get("_quant_earlier")
    if earlier is None:
        return
    again = torch.as_tensor(next_position, device=earlier.next.device).view(-1, 1, 1)
    cache._quant_earlier = earlier._replace(next=torch.minimum(earlier.next, again))


def dequantized(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a packed cache, dequantized, in slot order, without unpacking it (new tensors)."""
    packed = cache._packed
    return packed.dequantized(0), packed.dequantized(1)


def reorder(cache, index: torch.Tensor) -> bool:
    """Keep the batch rows ``index`` of the codes a cache holds (packed, or kept for the next :func:`pack`); True
    when it is packed (its float buffers are absent: :meth:`KVCache.reorder` moves only the rest)."""
    held = cache.__dict__
    earlier = held.get("_quant_earlier")
    if earlier is not None:
        cache._quant_earlier = _Earlier(earlier.packed.index_select(0, index), earlier.positions.index_select(0, index),
                                        earlier.next.index_select(0, index))
    packed = held.get("_packed")
    if packed is None:
        return False
    cache._packed = packed.index_select(0, index.to(packed.keys.codes.device))
    return True

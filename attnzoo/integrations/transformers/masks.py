"""The mask transformers builds for each layer, read as attnzoo transforms (docs/transformers.md: "The mask is
part of the layer").

transformers builds every layer's mask from a *mask function* ``f(batch, head, q_idx, kv_idx) -> bool`` handed to
the mask function registered for the model's ``attn_implementation`` (``create_causal_mask``,
``create_sliding_window_causal_mask``, ``create_chunked_causal_mask``, or a model's own). A window or chunk may
live only there (qwen2_moe's ``max_window_layers``, phimoe's ``sliding_window``, llama4's
``attention_chunk_size``): the module never says so in the keyword arguments of the attention call. So:

- at probe time, the probe's mask function hands the layers real masks and remembers each one's mask function
  (:class:`Issued`); :func:`read_mask` evaluates a layer's function over enough queries to cross every window and
  chunk the configuration names, and says what it is (:class:`MaskShape`: causal, a sliding window, chunked
  causal attention), or refuses it with one line;
- at call time, attnzoo's mask function records the mask function of every mask it hands out, and the attention
  function checks that the layer's mask is still the one probed (:func:`fingerprint` at a fixed set of query/key
  pairs), refusing another (a layer type, window or chunk changed since ``apply()``), never replacing it. A
  fingerprint is taken once per mask and reused for the next step's mask function of the same
  :func:`structure` (transformers makes a new closure per forward).

Indices in transformers' mask functions are 0-based token indices; a left-padded row's chunks start at its first
real token (transformers shifts them by the row's left padding, which :func:`fingerprint` undoes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .base import IntegrationError, ProbeError

#: Longest probe (key indices) a mask is read over; windows or chunks a configuration names beyond it are refused.
MAX_PROBE = 1 << 20
#: How many masks handed out recently are remembered (a forward pass hands out one per mask type).
REMEMBERED = 64


@dataclass(frozen=True)
class MaskShape:
    """What a layer's mask allows, as attnzoo says it: ``kind`` ``"causal"``, ``"window"`` (keys
    ``i - size < j <= i``) or ``"chunk"`` (keys ``j <= i`` of the query's chunk of ``size`` tokens)."""

    kind: str
    size: int | None = None

    def __str__(self) -> str:
        return {"causal": "causal", "window": f"a sliding window of {self.size}",
                "chunk": f"chunked attention of {self.size}"}[self.kind]


@dataclass(frozen=True, eq=False)
class Pairs:
    """Query/key index pairs at which masks are fingerprinted (one set per model, shared by its layers)."""

    q: torch.Tensor
    kv: torch.Tensor


@dataclass
class Issued:
    """A mask handed to the model: the tensor, the mask function it was built from, the 2-D padding mask it was
    given, how many token indices the call has (a mask function may close over tensors of that length), and the
    fingerprints already taken of it (by :class:`Pairs`, so layers of one type evaluate it once)."""

    tensor: torch.Tensor
    function: object
    padding: torch.Tensor | None
    total: int
    taken: dict


_issued: deque = deque(maxlen=REMEMBERED)


def remember(tensor: torch.Tensor, function, padding: torch.Tensor | None, total: int) -> torch.Tensor:
    """Remember that ``tensor`` was built from ``function`` (None: transformers passed no mask function) for a call
    over ``total`` token indices."""
    _issued.append(Issued(tensor, function, padding, int(total), {}))
    return tensor


def issued(mask) -> Issued | None:
    """The record of a mask handed out (or a view of one: a layer may slice it), or None."""
    if not isinstance(mask, torch.Tensor):
        return None
    storage = mask.untyped_storage()
    for entry in reversed(_issued):
        if entry.tensor.untyped_storage() is storage:
            return entry
    return None


def forget() -> None:
    _issued.clear()


def _evaluate(function, q: torch.Tensor, kv: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """``function`` at batch 0, head 0 over broadcast query/key indices, as a bool tensor of their broadcast
    shape; ``shift`` is added to both (a left-padded row's first real token)."""
    zero = torch.zeros((), dtype=torch.long)
    out = function(zero, zero, q + shift, kv + shift)
    out = torch.as_tensor(out)
    if out.device.type == "meta":
        raise ProbeError("its mask function computes on the meta device (it closes over meta tensors)")
    return out.to(torch.bool).cpu().expand(torch.broadcast_shapes(q.shape, kv.shape))


def evaluate(function, q: torch.Tensor, kv: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """:func:`_evaluate`, or transformers' vmap form for a mask function that does not broadcast."""
    try:
        return _evaluate(function, q, kv, shift)
    except IntegrationError:
        raise
    except Exception:  # noqa: BLE001 - a function written for vmap; tried that way below
        pass
    from transformers.masking_utils import TransformGetItemToIndex

    qq, kk = torch.broadcast_tensors(q + shift, kv + shift)
    zero = torch.zeros((), dtype=torch.long)
    one = torch.func.vmap(lambda a, b: torch.as_tensor(function(zero, zero, a, b)))
    with TransformGetItemToIndex():
        return one(qq.reshape(-1), kk.reshape(-1)).to(torch.bool).cpu().view(qq.shape)


def hints(config, window: int | None) -> list[int]:
    """Window and chunk sizes the configuration names (every int field whose name says window or chunk, in it and
    in its sub-configurations) and the window the layer passes: a probe must cross each of them."""
    found = {window} if isinstance(window, int) else set()
    seen: set[int] = set()

    def walk(cfg, depth: int) -> None:
        if id(cfg) in seen or depth > 3:
            return
        seen.add(id(cfg))
        for name, value in vars(cfg).items():
            if isinstance(value, bool):
                continue
            if isinstance(value, int) and 0 < value and ("window" in name or "chunk" in name):
                found.add(value)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
                walk(value, depth + 1)

    walk(config, 0)
    return sorted(found)


def probe_rows(sizes: list[int]) -> tuple[torch.Tensor, int]:
    """Query indices to read a mask at (all of the first 64, and around one and two of every size) and the key
    length (past twice the largest size)."""
    longest = 2 * max(sizes, default=0) + 8
    if longest > MAX_PROBE:
        raise IntegrationError(f"a window or chunk of {max(sizes)} tokens in its configuration is longer than "
                               f"attnzoo reads a mask over ({MAX_PROBE // 2 - 4})")
    length = max(64, longest)
    rows = set(range(64)) | {length - 1}
    for size in sizes:
        for k in (1, 2):
            rows.update(r for r in range(k * size - 2, k * size + 3) if 0 <= r < length)
    return torch.tensor(sorted(rows), dtype=torch.long), length


def read_mask(function, sizes: list[int], here: str, meta: bool = False) -> MaskShape:
    """What a layer's mask function allows, read over :func:`probe_rows`; refuses one line for a mask attnzoo cannot
    express as causal, a sliding window or chunked causal attention. ``meta``: the model is on the meta device (a
    function that closes over its tensors cannot be evaluated there: :class:`ProbeError`)."""
    rows, length = probe_rows(sizes)
    try:
        grid = evaluate(function, rows[:, None], torch.arange(length)[None, :])
    except IntegrationError as exc:
        raise type(exc)(f"{here}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a model's own mask function, named in one line
        text = (str(exc).strip().splitlines() or [""])[0][:120]
        if meta:
            raise ProbeError(f"{here}: its mask function cannot be evaluated on the meta device ({text})") from None
        raise IntegrationError(f"{here}: its mask function cannot be evaluated to read what it allows "
                               f"({type(exc).__name__}: {text})") from None
    cols = torch.arange(length)[None, :]
    q = rows[:, None]
    if bool((grid & (cols > q)).any()):
        raise IntegrationError(f"{here}: the mask transformers builds for it lets queries see later keys (not causal): "
                               f"attnzoo cannot express it")
    seen = grid.sum(-1)
    earliest = rows + 1 - seen
    if not bool((seen > 0).all()) or not bool((grid == ((cols >= earliest[:, None]) & (cols <= q))).all()):
        raise IntegrationError(f"{here}: the mask transformers builds for it is not a contiguous run of keys ending "
                               f"at each query (a custom mask): attnzoo cannot express it")
    if not bool((earliest > 0).any()):
        return MaskShape("causal")
    first = int(torch.nonzero(earliest > 0)[0, 0])
    at, start = int(rows[first]), int(earliest[first])
    window = at - start + 1
    if bool((earliest == (rows - window + 1).clamp(min=0)).all()):
        return MaskShape("window", window)
    if start > 0 and bool((earliest == torch.div(rows, start, rounding_mode="floor") * start).all()):
        return MaskShape("chunk", start)
    raise IntegrationError(f"{here}: the mask transformers builds for it bounds the keys queries see in a way that is "
                           f"neither a sliding window nor chunked attention: attnzoo cannot express it")


def fingerprint_pairs(shapes: list[MaskShape], sizes: list[int]) -> Pairs:
    """Query/key pairs that tell every shape (and every size the configuration names) apart: for queries at and
    around each size and twice it, the keys at each shape's boundary and either side of it."""
    qs, ks = [], []
    bounds = {s.size for s in shapes if s.size} | set(sizes)
    rows = {0, 1, 2, 3} | {r for b in bounds for k in (1, 2, 3) for r in (k * b - 1, k * b, k * b + 1) if r >= 0}
    for r in sorted(rows):
        cols = {0, max(r - 1, 0), r, r + 1}
        for b in bounds:
            cols.update(c for c in (r - b, r - b + 1, (r // b) * b - 1, (r // b) * b) if c >= 0)
        for c in sorted(cols):
            qs.append(r)
            ks.append(c)
    return Pairs(torch.tensor(qs, dtype=torch.long), torch.tensor(ks, dtype=torch.long))


def fingerprint(function, pairs: Pairs, shift: int = 0) -> torch.Tensor:
    """``function`` at ``pairs``, as a bool tensor."""
    return evaluate(function, pairs.q, pairs.kv, shift)


def left_padding(padding: torch.Tensor | None) -> int:
    """Padding tokens before row 0's first real token (transformers' chunks start at a row's first real token)."""
    if padding is None or padding.dim() != 2 or padding.shape[0] == 0:
        return 0
    row = padding[0].to(torch.bool)
    real = torch.nonzero(row)
    return int(real[0, 0]) if real.numel() else 0


class _Unknown(Exception):
    pass


def structure(function, depth: int = 0):
    """A hashable description of a mask function that two functions share only if they compute the same thing: its
    code and, recursively, what it closes over (ints, floats, strings, small CPU tensors' values, other functions,
    tuples of them); None when it closes over anything else. transformers makes a new closure for every mask (a
    window's, ``and_masks``' ...): this is what lets a decoding step reuse the last step's fingerprint."""
    try:
        return _structure(function, depth)
    except _Unknown:
        return None


def _structure(obj, depth: int):
    if depth > 12:
        raise _Unknown
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return (type(obj).__name__, obj)
    if isinstance(obj, (tuple, list)):
        return ("seq", tuple(_structure(o, depth + 1) for o in obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.numel() > 256 or obj.is_floating_point() or type(obj) is not torch.Tensor:
            raise _Unknown
        return ("tensor", tuple(obj.shape), tuple(obj.flatten().tolist()))
    code = getattr(obj, "__code__", None)
    if code is None:
        raise _Unknown
    cells = tuple(_structure(c.cell_contents, depth + 1) for c in (obj.__closure__ or ()))
    defaults = tuple(_structure(d, depth + 1) for d in (obj.__defaults__ or ()))
    return ("function", code, cells, defaults)


#: fingerprints already taken, by (the function's :func:`structure`, shift, pairs): a decoding step's mask
#: functions are new closures of the same structure as the last step's
_known: dict = {}


def _fingerprint_of(entry: Issued, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fingerprint, which pairs it covers: None for all) of an issued mask. A mask function that closes over
    tensors of the call's length (position ids of packed sequences) is evaluated at the pairs inside the call."""
    function = entry.function
    if function is None:
        from transformers.masking_utils import causal_mask_function as function
    shift = left_padding(entry.padding)
    shape = structure(function)
    key = (shape, shift, pairs) if shape is not None else None
    known = _known.get(key) if key is not None else None
    if known is not None:
        return known
    try:
        found = (fingerprint(function, pairs, shift), None)
    except IntegrationError:
        raise
    except Exception:  # noqa: BLE001 - indices past the call's tensors: the pairs inside it
        inside = (pairs.q < entry.total) & (pairs.kv < entry.total)
        found = (evaluate(function, pairs.q[inside], pairs.kv[inside], shift), inside)
        key = None
    if key is not None:
        if len(_known) >= 256:
            _known.clear()
        _known[key] = found
    return found


def check_call(entry: Issued | None, mask, pairs: Pairs | None, want: torch.Tensor | None, here: str) -> None:
    """At call time: the mask the layer was handed is still the one probed (the same mask function at the
    fingerprint pairs), or the call is refused."""
    if pairs is None:  # not a layer apply() probed (e.g. built by hand): nothing to compare
        return
    if entry is None:
        if mask is None:
            if want is None:
                return
            raise IntegrationError(f"{here} was handed no mask, but apply() read a mask from transformers for it: run "
                                   f"apply() again")
        raise IntegrationError(f"{here} was handed a mask that transformers' mask function for attnzoo did not build "
                               f"(a custom mask or bias): attnzoo cannot compute it")
    if want is None:
        raise IntegrationError(f"{here} was handed a mask, but apply() read none for it: run apply() again")
    verdict = entry.taken.get(id(want))
    if verdict is None:  # once per mask and layer kind: the layers of one type share both
        got, inside = _fingerprint_of(entry, pairs)
        verdict = entry.taken[id(want)] = torch.equal(got, want if inside is None else want[inside])
    if not verdict:
        raise IntegrationError(f"{here} was handed a mask other than the one apply() read for it (another layer type, "
                               f"window or chunk): run apply() again")

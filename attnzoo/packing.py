"""Packed sequences: several documents in one row of q, k, v (docs/packing.md).

A packed row holds documents back to back, as training pipelines pack them (FlexAttention's document mask,
xformers' ``BlockDiagonalCausalMask.from_seqlens``, flash-attn's ``cu_seqlens``). Each document is attended as if it
were alone: its tokens see only its own tokens, its positions restart at 1 (its first token is the one selective
attention and StreamingLLM protect), and every transform acts per document: masks and windows, row maps, per-token
features (the forgetting gate's running sum restarts), and the selective accumulator (F resets, since no query of
one document selects a key of another).

The documents may be given three ways, all turned into :class:`Documents`:

- ``cu_seqlens``: a 1-D integer tensor of offsets ``[0, l_1, l_1 + l_2, ...]`` into the row's tokens (into the
  batch's tokens flattened, ``B * N``, when B > 1; no document may straddle two rows), or a list of lengths;
- document ids: a (B, N) integer tensor, each document's tokens contiguous, ``-1`` for padding;
- an xformers attention bias: ``BlockDiagonalCausalMask`` (for a causal spec) or ``BlockDiagonalMask`` (for a
  non-causal one), e.g. ``BlockDiagonalCausalMask.from_seqlens([1, 63, 200])``; it needs no GPU.

Tokens in no document (after the last offset, or with id -1) are padding: their outputs are 0 and they are never
attended. A batch with no document at all (every id -1) gives outputs of 0 (and an F of 0) that stay in the inputs'
graph, with gradients of exactly 0 (:class:`_Padding`).

How it runs: the documents of equal length are stacked into one batch and handed to the backend's batch form (so
every backend's fast path applies, no key block of another document is ever visited, and each document's positions
are consecutive); the outputs are written back into the packed layout. The backend sees ordinary batches: packing
needs nothing from it, so it holds for every backend and plugin that passes the conformance suite.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from .inputs import positions_tensor

_XFORMERS_CAUSAL = {"BlockDiagonalCausalMask": True, "BlockDiagonalMask": False}
#: the dtypes cu_seqlens and document ids may have (torch's integer dtypes that hold values)
_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                             torch.uint32, torch.uint64})


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch: ``ids`` (B, N) int64 (-1 for padding) and ``segments``, one
    ``(row, start, stop)`` per document, in row order."""

    ids: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]

    def lengths(self) -> list[int]:
        return [stop - start for _, start, stop in self.segments]


def _from_offsets(offsets: list[int], batch: int, n: int, device, what: str) -> Documents:
    if len(offsets) < 2 or offsets[0] != 0:
        raise ValueError(f"{what} must start at 0 and hold at least one document, got {offsets[:8]}")
    if any(b <= a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"{what} must increase strictly (every document has at least one token), got {offsets[:8]}")
    if offsets[-1] > batch * n:
        raise ValueError(f"{what} ends at {offsets[-1]}, past the {batch * n} tokens of a ({batch}, N = {n}) batch")
    ids = torch.full((batch * n,), -1, dtype=torch.int64)
    segments = []
    for doc, (start, stop) in enumerate(zip(offsets, offsets[1:], strict=False)):
        row = start // n
        if (stop - 1) // n != row:
            raise ValueError(f"{what}: document {doc} (tokens {start}..{stop - 1}) straddles rows {row} and "
                             f"{(stop - 1) // n} of N = {n}")
        ids[start:stop] = doc
        segments.append((row, start - row * n, stop - row * n))
    return Documents(ids.view(batch, n).to(device), tuple(segments))


def _from_ids(ids: torch.Tensor, batch: int, n: int, device) -> Documents:
    if ids.shape != (batch, n):
        raise ValueError(f"document ids must have shape (B, N) = ({batch}, {n}), got {tuple(ids.shape)}")
    ids = ids.to(torch.int64).cpu()
    if bool((ids < -1).any()):
        raise ValueError("document ids must be >= 0, or -1 for padding")
    segments = []
    for row in range(batch):
        values = ids[row]
        change = torch.nonzero(values[1:] != values[:-1]).flatten().tolist()
        starts = [0] + [c + 1 for c in change]
        stops = starts[1:] + [n]
        seen = set()
        for start, stop in zip(starts, stops, strict=True):
            doc = int(values[start])
            if doc < 0:
                continue
            if doc in seen:
                raise ValueError(f"document id {doc} appears in two separate runs of row {row}: a document's "
                                 f"tokens must be contiguous")
            seen.add(doc)
            segments.append((row, start, stop))
    return Documents(ids.to(device), tuple(segments))


def _from_xformers(bias: Any, batch: int, n: int, device, causal: bool) -> Documents:
    name = type(bias).__name__
    if name not in _XFORMERS_CAUSAL:
        raise ValueError(f"xformers bias {name} is not supported as packing input (supported: "
                         f"{', '.join(_XFORMERS_CAUSAL)})")
    if _XFORMERS_CAUSAL[name] != causal:
        want = "BlockDiagonalCausalMask" if causal else "BlockDiagonalMask"
        raise ValueError(f"xformers bias {name} is {'' if _XFORMERS_CAUSAL[name] else 'not '}causal but the spec "
                         f"is {'' if causal else 'not '}causal: use {want}")
    q_starts, k_starts = list(bias.q_seqinfo.seqstart_py), list(bias.k_seqinfo.seqstart_py)
    if q_starts != k_starts:
        raise ValueError(f"xformers bias {name}: the query and key documents differ ({q_starts[:6]} and "
                         f"{k_starts[:6]}); packing is self-attention, one set of documents")
    return _from_offsets(q_starts, batch, n, device, f"xformers bias {name}'s sequence starts")


def _check_device(documents: torch.Tensor, device, what: str) -> None:
    """The offsets or ids are read on the host: they may be on q's device or on the CPU, never on the meta device
    (it holds no values) nor on another accelerator."""
    here, want = documents.device, torch.device(device)
    if here.type == "meta":
        raise ValueError(f"{what}: on the meta device, which holds no values; put it on the CPU or on q's device "
                         f"({want})")
    if here != want and here.type != "cpu":
        raise ValueError(f"{what}: on {here} but q is on {want}; put it on q's device or on the CPU")


def as_documents(documents: Any, batch: int, n: int, device, causal: bool) -> Documents:
    """Turn any of the accepted forms (module docstring) into :class:`Documents`; one clear error line otherwise."""
    if isinstance(documents, Documents):
        if documents.ids.shape != (batch, n):
            raise ValueError(f"documents were made for shape {tuple(documents.ids.shape)}, not ({batch}, {n})")
        return documents
    if type(documents).__module__.startswith("xformers."):
        return _from_xformers(documents, batch, n, device, causal)
    if isinstance(documents, (list, tuple)):
        if not documents or not all(isinstance(x, int) and not isinstance(x, bool) for x in documents):
            raise ValueError("documents given as a list must be document lengths (positive ints)")
        if any(x < 1 for x in documents):
            raise ValueError(f"document lengths must be >= 1, got {list(documents)[:8]}")
        offsets = [0]
        for length in documents:
            offsets.append(offsets[-1] + length)
        return _from_offsets(offsets, batch, n, device, "document lengths")
    if isinstance(documents, torch.Tensor):
        if documents.dtype not in _INTEGER_DTYPES:
            raise ValueError(f"documents must be an integer tensor (cu_seqlens or document ids), got "
                             f"{str(documents.dtype).removeprefix('torch.')}")
        if documents.dim() not in (1, 2):
            raise ValueError(f"documents: a 1-D cu_seqlens or (B, N) document ids, got shape "
                             f"{tuple(documents.shape)}")
        what = "cu_seqlens" if documents.dim() == 1 else "document ids"
        _check_device(documents, device, what)
        if documents.dim() == 1:
            return _from_offsets([int(x) for x in documents.tolist()], batch, n, device, what)
        return _from_ids(documents, batch, n, device)
    raise ValueError(f"documents must be cu_seqlens, (B, N) document ids, a list of lengths or an xformers "
                     f"BlockDiagonal(Causal)Mask, got {type(documents).__name__}")


def document_positions(docs: Documents, positions: torch.Tensor | None, device) -> torch.Tensor:
    """Positions (B, N) int64: 1..L in each document by default; given ones must be >= 1 and increase strictly
    within each document. Padding tokens get position 1 (they are never attended)."""
    batch, n = docs.ids.shape
    out = torch.ones(batch, n, dtype=torch.int64, device=device)
    if positions is None:
        for row, start, stop in docs.segments:
            out[row, start:stop] = torch.arange(1, stop - start + 1, device=device)
        return out
    positions = positions_tensor(positions, batch, n, device)
    for doc, (row, start, stop) in enumerate(docs.segments):
        seg = positions[row, start:stop]
        if bool((seg < 1).any()):
            raise ValueError(f"positions are 1-based: document {doc} (row {row}) has a position below 1")
        if stop - start > 1 and bool((seg[1:] <= seg[:-1]).any()):
            raise ValueError(f"positions must increase strictly within each document: document {doc} (row {row}, "
                             f"tokens {start}..{stop - 1}) does not")
        out[row, start:stop] = seg
    return out


def run_packed(forward, q, k, v, grouped, positions, docs: Documents, token_inputs: list[tuple[str, str]],
               return_accumulated: bool, *, f_dtype: torch.dtype | None):
    """Run ``forward(q, k, v, params, positions, return_accumulated)`` (a backend's batch form) on the documents,
    those of equal length stacked into one batch, and write the results back into the packed layout: out
    (B, H, N, D), 0 at padding; F (B, N, N), block-diagonal, when ``return_accumulated``. ``token_inputs``: the
    (kind, name) of the per-token inputs (B, H, N) in ``grouped``, gathered per document like q. ``f_dtype``: the
    dtype of F (``accumulator_dtype(q.dtype)``), None for a spec without an accumulator; needed only when there is
    no document at all (then no backend call gives F).

    Gathering and scattering copy each token once, forward and backward (:class:`_Gather`, :class:`_Scatter`:
    their gradients are the scatter and the gather, not one full-size tensor per document)."""
    b, h, n, d = q.shape
    if not docs.segments:  # every token is padding: nothing to attend, but the outputs stay in the inputs' graph
        inputs = (q, k, v, *(t for group in grouped.values() for t in group.values()))
        out = _Padding.apply((b, h, n, d), q.dtype, *inputs)
        if not return_accumulated:
            return out
        return out, (_Padding.apply((b, n, n), f_dtype, *inputs) if f_dtype is not None else None)
    by_length: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for segment in docs.segments:
        by_length[segment[2] - segment[1]].append(segment)
    groups = list(by_length.values())
    outputs, f_parts = [], []
    for segments in groups:
        key = tuple(segments)
        params = {kind: dict(group) for kind, group in grouped.items()}
        for kind, name in token_inputs:  # (B, H, N) -> (G, H, L)
            params[kind][name] = _Gather.apply(grouped[kind][name], key)
        pos = torch.stack([positions[row, start:stop] for row, start, stop in segments])
        result = forward(*(_Gather.apply(t, key) for t in (q, k, v)), params, pos, return_accumulated)
        group_out, group_f = result if return_accumulated else (result, None)
        outputs.append(group_out)
        if group_f is not None:
            f_parts.append((segments, group_f))
    out = _Scatter.apply((b, h, n, d), tuple(tuple(g) for g in groups), *outputs)
    if not return_accumulated:
        return out
    accumulated = None
    for segments, f in f_parts:
        if accumulated is None:
            accumulated = f.new_zeros(b, n, n)
        for i, (row, start, stop) in enumerate(segments):
            accumulated[row, start:stop, start:stop] = f[i]
    return out, accumulated


class _Gather(torch.autograd.Function):
    """The documents ``segments`` ((row, start, stop), all of one length L) of t (B, X, N[, D]), stacked along a
    new batch dim: (G, X, L[, D]); the gradient scatters back into one zero tensor."""

    @staticmethod
    def forward(ctx, t, segments):
        ctx.shape, ctx.segments = t.shape, segments
        row, first, stop = segments[0]
        length = stop - first
        if all(r == row and s == first + i * length for i, (r, s, _) in enumerate(segments)):
            # documents back to back in one row: a strided view, no copy
            span = t[row, :, first:first + len(segments) * length]
            return span.unflatten(1, (len(segments), length)).transpose(0, 1)
        return torch.stack([t[row, :, start:stop] for row, start, stop in segments])

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros(ctx.shape)
        for i, (row, start, stop) in enumerate(ctx.segments):
            out[row, :, start:stop] = grad[i]
        return out, None


class _Scatter(torch.autograd.Function):
    """Each group's outputs (G, H, L, D) written into a zero (B, H, N, D) at their documents; the gradient of each
    group is the gather of its documents."""

    @staticmethod
    def forward(ctx, shape, groups, *outputs):
        ctx.groups = groups
        out = outputs[0].new_zeros(shape)
        for segments, values in zip(groups, outputs, strict=True):
            for i, (row, start, stop) in enumerate(segments):
                out[row, :, start:stop] = values[i]
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *(torch.stack([grad[row, :, start:stop] for row, start, stop in segments])
                              for segments in ctx.groups))


class _Padding(torch.autograd.Function):
    """Zeros of ``shape`` in ``dtype`` that depend on none of ``inputs``: the output of a packed batch whose tokens
    are all padding. It is a node of the inputs' graph, so ``backward()`` works, and each input that needs a
    gradient gets an exact zero tensor (not None: a leaf's ``.grad`` is then 0, as for padding in a batch with
    documents, rather than unset). No arithmetic on the inputs: a NaN or inf in a padding token cannot leak."""

    @staticmethod
    def forward(ctx, shape, dtype, *inputs):
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs]
        return inputs[0].new_zeros(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        zeros = (torch.zeros(shape, dtype=dtype, device=device) if wanted else None
                 for wanted, (shape, dtype, device) in zip(ctx.needs_input_grad[2:], ctx.like, strict=True))
        return (None, None, *zeros)

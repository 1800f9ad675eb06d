"""Context-parallel attention: one sequence sharded over the ranks of a ``torch.distributed`` process group
(gloo on CPU, NCCL on GPU), for any spec the path accepts (docs/distributed.md).

Layout: the sequence is cut into 2R chunks and rank r holds chunks r and 2R-1-r (``balanced``, so that every rank
has the same causal work), or into R contiguous chunks. :func:`shard` and :func:`unshard` move tensors between the
two forms, :meth:`Layout.positions` gives each rank its tokens' true 1-based positions, which every transform sees
(SSA's log(i), ALiBi's distances, windows and the selective BOS are exact).

Keys and values (after the key and value row maps) go around the ring, one rank's block per step, sent while the
previous one is attended (``method="ring"``: O(N / R) attention state per rank), or are all-gathered
(``"allgather"``; ``"auto"`` all-gathers when the gathered keys and values are under ``gather_limit`` bytes). Each
(query chunk, key chunk) pair is computed in query blocks of ``block_size`` and merged flash-style by log-sum-exp;
the normaliser's sink joins at the end. The backward pass recomputes every pair and sends the key and value
gradients around the ring with the blocks, home at the end.

The selective accumulator: the carry of a key at the start of query chunk c is the sum of the selection S over
every earlier query chunk, an exclusive scan in sequence order of the per-chunk column sums (a selector-only ring
first, then a chain through the chunks' owners). Backward, the reverse carry: the gradient reaching F of the
chunks after c is scanned back (a suffix sum in sequence order) into c's column sums, so the selector's query and
key rows of early chunks get the gradient of every later chunk's F. Cumulative per-token features (the forgetting
gate's running sum) are offset by the same kind of scan of per-chunk totals.

Gradients: q, k, v and per-token inputs get this rank's tokens' gradients. The transforms' parameters are
replicated; each rank's gradient is its own queries' contribution, and the sum over the ranks is the full
gradient: :func:`sum_gradients` (or the data-parallel wrapper that sums the model's other replicated weights)
adds them up, exactly as for the model's q/k/v projections.

Declined (:class:`attnzoo.UnsupportedError`, one line naming spec and cause): an accumulator whose selection is
not declared pointwise (``AccumulatorTransform.pointwise``: S is computed one key block at a time), ``key_mask``,
``documents`` and ``return_accumulated`` (F is (B, N, N)). Decoding is not sharded (evictors act in decoding only).

This module never imports the reference backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .backends.composition import checked_logits
from .cache import accumulator_dtype
from .dispatch import Variant, renamed_flag
from .errors import UnsupportedError
from .inputs import check_positions, check_qkv
from .nn import Attention
from .transforms.base import Dims, Slot, TokenRows

__all__ = ["CommCounter", "ContextParallel", "Layout", "ShardedAttention", "counting", "shard", "shard_positions",
           "sum_gradients", "unshard", "unsupported"]

#: slots whose transforms act inside the (query, key) pairs, so their parameters enter the sharded kernel
_PAIR_SLOTS = (Slot.LOGITS, Slot.MASK, Slot.ACCUMULATOR, Slot.NORMALISER)
_METHODS = ("auto", "ring", "allgather")


# -- layout ------------------------------------------------------------------------------------------------------
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


# -- communication accounting --------------------------------------------------------------------------------------
@dataclass
class CommCounter:
    """Bytes this rank hands to the network: point-to-point sends as sent, collectives as their ring algorithm
    sends them (all-gather: (R-1) x the local piece; all-reduce: 2 (R-1) / R x the buffer)."""

    bytes_sent: int = 0
    messages: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes


_COUNTERS: list[CommCounter] = []


@contextmanager
def counting():
    """Count what the context-parallel calls inside send from this rank: ``with counting() as c: ...``."""
    counter = CommCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _count(kind: str, nbytes: int) -> None:
    for counter in _COUNTERS:
        counter.add(kind, int(nbytes))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- what the path accepts -----------------------------------------------------------------------------------------
def unsupported(spec, registry=None) -> list[str]:
    """The reasons context-parallel attention cannot run ``spec`` (a name, path, Spec, Variant or Plan); empty when
    it can."""
    plan = spec.plan if isinstance(spec, Variant) else spec if hasattr(spec, "by_slot") else \
        Variant(spec, "auto", registry).plan
    reasons = []
    acc = plan.one(Slot.ACCUMULATOR)
    if acc is not None and acc.pointwise() is None:
        reasons.append(f"transform '{acc.kind}' (accumulator) does not declare its selection pointwise "
                       f"(AccumulatorTransform.pointwise): the sharded path computes S one key block at a time")
    return reasons


def _decline(spec_name: str, reason: str):
    return UnsupportedError(spec_name, {"context-parallel": [reason]}, mode="context-parallel")


# -- the sharded call ----------------------------------------------------------------------------------------------
@dataclass
class _Config:
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


class ContextParallel:
    """Context-parallel attention of ``spec`` over ``group`` (None: the default group); call it on every rank
    with that rank's shard: ``cp(q, k, v, params=None, positions=None, inputs=None)`` with q (B, H, n, D), k and v
    (B, H_kv, n, D) the rank's tokens in :class:`Layout` order, ``positions`` their true 1-based positions ((n,) or
    (B, n); default: the layout's, 1..N), ``inputs`` their per-token inputs (B, H, n). Returns the rank's outputs
    (B, H, n, D). ``balanced``: the layout; ``method``: ``"ring"``, ``"allgather"`` or ``"auto"`` (all-gather when
    the whole sequence's keys and values take at most ``gather_limit`` bytes); ``block_size``: queries per block
    inside a pair (the attention state per rank is O(block_size x N / R + N / R x H x D))."""

    def __init__(self, spec, group=None, *, balanced: bool = True, method: str = "auto", block_size: int = 256,
                 gather_limit: int = 64 * 2**20, registry=None) -> None:
        self.variant = spec if isinstance(spec, Variant) else Variant(spec, "auto", registry)
        self.plan = self.variant.plan
        reasons = unsupported(self.plan)
        if reasons:
            raise _decline(self.variant.spec.name, reasons[0])
        if method not in _METHODS:
            raise ValueError(f"method must be one of {', '.join(_METHODS)}, got {method!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.group, self.balanced, self.method = group, balanced, method
        self.block_size, self.gather_limit = block_size, gather_limit
        self.last_method: str | None = None

    def __repr__(self) -> str:
        return f"ContextParallel(spec='{self.variant.spec.name}', method='{self.method}')"

    def __call__(self, q, k, v, params=None, positions=None, inputs=None, key_mask=None, documents=None,
                 return_accumulated: bool = False):
        name = self.variant.spec.name
        if key_mask is not None:
            raise _decline(name, "key_mask is not supported across shards (pad with tokens the loss ignores, or "
                                 "run unsharded)")
        if documents is not None:
            raise _decline(name, "documents (packed sequences) are not supported across shards")
        if return_accumulated:
            raise _decline(name, "return_accumulated: F is (B, N, N), the memory that sharding avoids")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("context-parallel attention needs torch.distributed initialised "
                             "(torch.distributed.init_process_group, e.g. under torchrun)")
        group = self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dims, layout, pos = self._agree(q, k, v, positions, world, rank, group)
        b, h, n, d = q.shape
        grouped = self.plan.add_inputs(self.plan.split_params(params, dims, q), inputs, b, h, n, q)
        plan = self.plan
        qs = plan.row_scale(Slot.QUERY, q, pos.unsqueeze(1), grouped)
        ks = plan.row_scale(Slot.KEY, k, pos.unsqueeze(1), grouped)
        vs = plan.row_scale(Slot.VALUE, v, pos.unsqueeze(1), grouped)
        features = _features(plan, qs, ks, vs, pos, grouped, layout, rank, group)
        kv_bytes = 2 * b * k.shape[1] * layout.seq_len * d * k.element_size()
        ring = self.method == "ring" or (self.method == "auto" and kv_bytes > self.gather_limit)
        self.last_method = "ring" if ring else "allgather"
        token_keys = set(plan.token_inputs())
        kinds = [t.kind for t in plan.transforms if t.slot in _PAIR_SLOTS]
        param_keys = [(kind, short) for kind in kinds for short in grouped[kind]
                      if f"{kind}.{short}" not in token_keys]
        cfg = _Config(plan, layout, group, rank, world, ring, self.block_size, list(features), param_keys,
                      plan.logit_scale(d))
        out = _ShardedAttend.apply(cfg, qs, ks, vs, pos, *features.values(),
                                   *(grouped[kind][short] for kind, short in param_keys))
        return plan.row_scale(Slot.OUTPUT, out, pos.unsqueeze(1), grouped)

    def _agree(self, q, k, v, positions, world, rank, group):
        """Every rank's inputs, sizes and positions checked together (one all-gather of a few integers, one of the
        chunk boundaries' positions), so that every rank raises the same error rather than one rank hanging."""
        problem, pos, dims = "", None, None
        try:
            dims = check_qkv(q, k, v)
            self.plan.check_dims(dims)
            b, h, n, d = q.shape
            pos = check_positions(positions, b, n, q.device).contiguous() if positions is not None else None
        except ValueError as exc:
            problem = str(exc)
        device = q.device if isinstance(q, torch.Tensor) else "cpu"
        if problem:
            b = h = n = d = hkv = 0
        else:
            hkv = k.shape[1]
        codes = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
        meta = torch.tensor([n, b, h, hkv, d, codes.get(getattr(q, "dtype", None), 0), int(bool(problem))],
                            dtype=torch.int64, device=device)
        everyone = _all_gather(meta, group, world, "meta")
        if problem:
            raise ValueError(f"rank {rank}: {problem}")
        bad = [r for r in range(world) if int(everyone[r, 6])]
        if bad:
            raise ValueError(f"rank {bad[0]}'s inputs are invalid (its error says why)")
        for r in range(world):
            if not torch.equal(everyone[r, 1:6], meta[1:6]):
                raise ValueError(f"ranks disagree on (B, H, H_kv, D, dtype): rank {rank} has "
                                 f"{tuple(meta[1:6].tolist())}, rank {r} {tuple(everyone[r, 1:6].tolist())}")
        sizes = [int(x) for x in everyone[:, 0]]
        layout = Layout(sum(sizes), world, self.balanced)  # every rank raises the same error for too few tokens
        for r, size in enumerate(sizes):
            if size != layout.local_size(r):
                raise ValueError(f"rank {r} holds {size} tokens but the {'balanced' if self.balanced else 'contiguous'}"
                                 f" layout of {layout.seq_len} tokens over {world} ranks gives it "
                                 f"{layout.local_size(r)} (shard with attnzoo.distributed.shard)")
        if pos is None:
            return dims, layout, layout.positions(rank, b, device=q.device)
        # positions must increase along the whole sequence: compare the chunks' first and last positions
        ends = torch.stack([torch.stack([pos[:, start], pos[:, stop - 1]], dim=-1)
                            for _, start, stop, _ in layout.local_chunks(rank)])  # (chunks, B, 2)
        every_end = _all_gather(ends, group, world, "meta")
        by_chunk = {c: every_end[r, i] for r in range(world) for i, c in enumerate(layout.owned(r))}
        for c in range(1, layout.num_chunks):
            back = (by_chunk[c][:, 0] <= by_chunk[c - 1][:, 1]).nonzero()
            if len(back):
                row = int(back[0])
                raise ValueError(f"positions must increase strictly along the whole sequence: in row {row}, chunk "
                                 f"{c} (rank {layout.owner(c)}) starts at {int(by_chunk[c][row, 0])} but chunk "
                                 f"{c - 1} (rank {layout.owner(c - 1)}) ends at {int(by_chunk[c - 1][row, 1])}")
        return dims, layout, pos


def sum_gradients(parameters, group=None) -> None:
    """Sum the ``.grad`` of replicated ``parameters`` over ``group`` in place (all-reduce): after a sharded
    backward, each rank holds its own queries' contribution, and this makes every rank's the full gradient. A
    data-parallel wrapper over the same ranks that sums does the same (one that averages divides it by R)."""
    for p in parameters:
        if p.grad is not None:
            _count("allreduce", _allreduce_bytes(p.grad, dist.get_world_size(group)))
            dist.all_reduce(p.grad, group=group)


class ShardedAttention(Attention):
    """:class:`attnzoo.nn.Attention` whose forward runs context-parallel over ``group``: the same parameters (and
    parameter names), the same forward signature on the rank's shard (q (B, H, n, D), k and v (B, H_kv, n, D),
    ``positions`` its tokens' true positions, default the layout's, ``x`` (B, n, E) its layer input), so a model's
    attention layer runs sharded without other changes. ``from_attention(layer)`` shares an existing layer's
    parameters. Decoding (``prefill``, ``decode``) is not sharded. Parameter gradients are this rank's
    contribution: see :func:`sum_gradients`."""

    def __init__(self, spec, num_heads: int, head_dim: int, num_kv_heads: int | None = None, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device=None, registry=None, input_dim: int | None = None, *,
                 group=None, balanced: bool = True, method: str = "auto", block_size: int = 256,
                 gather_limit: int = 64 * 2**20) -> None:
        super().__init__(spec, num_heads, head_dim, num_kv_heads, backend, dtype, device, registry, input_dim)
        self.parallel = ContextParallel(self.variant, group, balanced=balanced, method=method,
                                        block_size=block_size, gather_limit=gather_limit)

    @classmethod
    def from_attention(cls, layer: Attention, group=None, **options) -> ShardedAttention:
        """A sharded layer sharing ``layer``'s parameters and token projections (options as for the
        constructor: ``balanced``, ``method``, ``block_size``, ``gather_limit``)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.variant, new.num_heads, new.head_dim, new.num_kv_heads = (layer.variant, layer.num_heads,
                                                                      layer.head_dim, layer.num_kv_heads)
        new.transform_params, new.token_projections = layer.transform_params, layer.token_projections
        new._recording = None
        new.parallel = ContextParallel(layer.variant, group, **options)
        return new

    def forward(self, q, k, v, positions=None, key_mask=None, return_accumulated: bool = False,
                return_selection: bool | None = None, x: torch.Tensor | None = None, documents=None):
        """The rank's shard of the batch form; ``return_accumulated`` and recording F for the memory loss are
        declined (F is (B, N, N))."""
        return_accumulated = renamed_flag(return_accumulated, return_selection)
        if self._recording is not None and self.has_accumulator:
            raise _decline(self.spec.name, "recording_accumulated (the memory loss) needs F, (B, N, N), the "
                                           "memory that sharding avoids")
        return self.parallel(q, k, v, params=self.params(), positions=positions, key_mask=key_mask,
                             documents=documents, return_accumulated=return_accumulated,
                             inputs=self.token_inputs(x, q.shape[2]))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method='{self.parallel.method}'"


# -- collectives ---------------------------------------------------------------------------------------------------
def _all_gather(t: torch.Tensor, group, world: int, kind: str) -> torch.Tensor:
    """(world, *t.shape): every rank's ``t`` (the same shape everywhere)."""
    t = t.contiguous()
    if world == 1:
        return t.unsqueeze(0)
    out = [torch.empty_like(t) for _ in range(world)]
    _count(kind, (world - 1) * _nbytes(t))
    dist.all_gather(out, t, group=group)
    return torch.stack(out)


def _allreduce_bytes(t: torch.Tensor, world: int) -> int:
    return 2 * (world - 1) * _nbytes(t) // max(world, 1)


def _all_reduce(t: torch.Tensor, group, world: int, kind: str) -> torch.Tensor:
    if world > 1:
        _count(kind, _allreduce_bytes(t, world))
        dist.all_reduce(t, group=group)
    return t


class _GatherChunks(torch.autograd.Function):
    """All-gather with a gradient: backward sums the gradient over the ranks and keeps this rank's piece."""

    @staticmethod
    def forward(ctx, t, group, world, rank):
        ctx.group, ctx.world, ctx.rank = group, world, rank
        return _all_gather(t, group, world, "features")

    @staticmethod
    def backward(ctx, grad):
        grad = _all_reduce(grad.contiguous().clone(), ctx.group, ctx.world, "features")
        return grad[ctx.rank], None, None, None


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group, kind: str,
              tag: int = 0):
    """Post sends (tensor, group rank) and receives together (batched: NCCL needs it for a ring), the i-th of
    each tagged ``tag + i``; returns the requests to wait on."""
    ops = []
    for i, (t, peer) in enumerate(sends):
        _count(kind, _nbytes(t))
        ops.append(dist.P2POp(dist.isend, t, _global_rank(group, peer), group, tag + i))
    for i, (t, peer) in enumerate(recvs):
        ops.append(dist.P2POp(dist.irecv, t, _global_rank(group, peer), group, tag + i))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests) -> None:
    for req in requests:
        req.wait()


# -- blocks of keys moving between ranks ---------------------------------------------------------------------------
#: token dimension of each kind of tensor in a block: keys/values (B, H_kv, n, D) -> 2, positions (B, n) and
#: features/carries (B, H, n) -> the last
def _token_dim(name: str) -> int:
    return 2 if name in ("k", "v") else -1


def _like(mine: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like ``mine`` with ``size`` tokens."""
    out = {}
    for name, t in mine.items():
        shape = list(t.shape)
        shape[_token_dim(name)] = size
        out[name] = torch.empty(shape, dtype=t.dtype, device=t.device)
    return out


class _Blocks:
    """Every rank's block of keys, one at a time, in ring order (this rank's own first): passed around the ring
    (the next block is received while the current one is attended) or all-gathered once."""

    def __init__(self, cfg: _Config, kind: str) -> None:
        self.cfg, self.kind = cfg, kind
        self.returned: dict[str, torch.Tensor] | None = None

    def sources(self) -> list[int]:
        return [(self.cfg.rank - step) % self.cfg.world for step in range(self.cfg.world)]

    def __call__(self, mine: dict[str, torch.Tensor]):
        cfg = self.cfg
        if cfg.world == 1:
            yield cfg.rank, mine
            return
        if not cfg.ring:
            gathered = self._gather(mine)
            for src in self.sources():
                yield src, gathered[src]
            return
        current = {name: t.contiguous() for name, t in mine.items()}
        for step, src in enumerate(self.sources()):
            requests, incoming = self._pass_on(mine, current, step, src)
            yield src, current
            _wait(requests)
            current = incoming

    def _pass_on(self, mine, current, step: int, src: int):
        """Start sending ``current`` (the block of rank ``src``) to the next rank and receiving the previous rank's
        block, unless this is the last step: (the requests to wait for, the incoming block or None)."""
        cfg = self.cfg
        if step >= cfg.world - 1:
            return [], None
        nxt, prev = (cfg.rank + 1) % cfg.world, (cfg.rank - 1) % cfg.world
        incoming = _like(mine, cfg.layout.local_size((src - 1) % cfg.world))
        requests = _exchange([(t, nxt) for t in current.values()], [(t, prev) for t in incoming.values()],
                             cfg.group, self.kind)
        return requests, incoming

    def with_grads(self, mine: dict[str, torch.Tensor], grad_names: list[str]):
        """Like iterating, with a zeroed gradient dict per block (``grad_names`` of the block's tensors) to add
        into; the gradients of this rank's own block are in ``self.returned`` afterwards."""
        cfg = self.cfg
        if cfg.world == 1:
            grads = {name: torch.zeros_like(mine[name]) for name in grad_names}
            yield cfg.rank, mine, grads
            self.returned = grads
            return
        if not cfg.ring:
            gathered = self._gather(mine)
            every = {src: {name: torch.zeros_like(gathered[src][name]) for name in grad_names}
                     for src in range(cfg.world)}
            for src in self.sources():
                yield src, gathered[src], every[src]
            self.returned = {name: self._reduce([every[s][name] for s in range(cfg.world)], name)
                             for name in grad_names}
            return
        nxt, prev = (cfg.rank + 1) % cfg.world, (cfg.rank - 1) % cfg.world
        current = {name: t.contiguous() for name, t in mine.items()}
        grads = {name: torch.zeros_like(mine[name]) for name in grad_names}
        for step, src in enumerate(self.sources()):
            requests, incoming = self._pass_on(mine, current, step, src)
            yield src, current, grads
            # the gradients follow their block: after the last step they reach its owner, the next rank
            size = cfg.layout.local_size((src - 1) % cfg.world) if step < cfg.world - 1 else \
                cfg.layout.local_size(cfg.rank)
            arriving = _like({name: mine[name] for name in grad_names}, size)
            _wait(requests)
            _wait(_exchange([(grads[name].contiguous(), nxt) for name in grad_names],
                            [(arriving[name], prev) for name in grad_names], cfg.group, self.kind + "-grad",
                            tag=1000))
            current, grads = incoming, arriving
        self.returned = grads

    def _gather(self, mine):
        cfg = self.cfg
        most = max(cfg.layout.local_size(r) for r in range(cfg.world))
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.world)]
        for name, t in mine.items():
            dim = _token_dim(name) % t.dim()
            padded = F.pad(t, _pad_spec(t.dim(), dim, most - t.shape[dim]))
            every = _all_gather(padded, cfg.group, cfg.world, self.kind)
            for r in range(cfg.world):
                out[r][name] = every[r].narrow(dim, 0, cfg.layout.local_size(r))
        return out

    def _reduce(self, pieces: list[torch.Tensor], name: str) -> torch.Tensor:
        cfg = self.cfg
        most = max(cfg.layout.local_size(r) for r in range(cfg.world))
        dim = _token_dim(name) % pieces[0].dim()
        stacked = torch.stack([F.pad(p, _pad_spec(p.dim(), dim, most - p.shape[dim])) for p in pieces])
        _all_reduce(stacked, cfg.group, cfg.world, self.kind + "-grad")
        return stacked[cfg.rank].narrow(dim, 0, cfg.layout.local_size(cfg.rank))


def _pad_spec(ndim: int, dim: int, extra: int) -> tuple[int, ...]:
    spec = [0] * (2 * (ndim - dim))
    spec[-1] = extra
    return tuple(spec)


def _scan(cfg: _Config, table: dict[int, torch.Tensor], reverse: bool) -> dict[int, torch.Tensor]:
    """Exclusive scan of per-chunk tensors in sequence order (``reverse``: from the end), through the chunks'
    owners in turn: ``out[c] = sum of table[c']`` over the chunks c' before c (after c when reversed)."""
    layout, rank = cfg.layout, cfg.rank
    order = list(range(layout.num_chunks))
    if reverse:
        order.reverse()
    like = next(iter(table.values()))
    running = torch.zeros_like(like)
    out = {}
    for i, c in enumerate(order):
        if layout.owner(c) != rank:
            continue
        if i > 0 and layout.owner(order[i - 1]) != rank:
            running = torch.empty_like(like)
            dist.recv(running, _global_rank(cfg.group, layout.owner(order[i - 1])), group=cfg.group)
        out[c] = running.clone()
        running = running + table[c]
        if i < len(order) - 1 and layout.owner(order[i + 1]) != rank:
            _count("carry", _nbytes(running))
            dist.send(running.contiguous(), _global_rank(cfg.group, layout.owner(order[i + 1])), group=cfg.group)
    return out


# -- per-token features ---------------------------------------------------------------------------------------------
def _features(plan, qs, ks, vs, pos, grouped, layout: Layout, rank: int, group) -> dict[str, torch.Tensor]:
    """The spec's per-token features of this rank's tokens, (B, H, n) each in at least float32; cumulative ones
    summed along the whole sequence: within each chunk, plus the totals of every earlier chunk (all-gathered,
    with a gradient back to the ranks that own them)."""
    out: dict[str, torch.Tensor] = {}
    b, h, n, _ = qs.shape
    rows = TokenRows(qs, ks, vs, pos, None, Dims(h, qs.shape[3], ks.shape[1]))
    chunks = layout.local_chunks(rank)
    for t in plan.feature_transforms():
        for name, value in (t.features(rows, grouped[t.kind]) or {}).items():
            if tuple(value.shape) != (b, h, n):
                raise ValueError(f"transform '{t.kind}': feature '{name}' has shape {tuple(value.shape)}, "
                                 f"expected (B, H, N) = {(b, h, n)}")
            value = value.to(torch.promote_types(value.dtype, torch.float32))
            if name in t.cumulative:
                pieces = [value[..., start:stop].cumsum(-1) for _, start, stop, _ in chunks]
                totals = torch.stack([p[..., -1] for p in pieces])  # (chunks held, B, H)
                every = _GatherChunks.apply(totals, group, layout.world_size, rank)  # (R, chunks held, B, H)
                by_chunk = {c: every[r, i] for r in range(layout.world_size) for i, c in enumerate(layout.owned(r))}
                ordered = torch.stack([by_chunk[c] for c in range(layout.num_chunks)])
                before = F.pad(ordered.cumsum(0)[:-1], (0, 0, 0, 0, 1, 0))  # exclusive, sequence order
                value = torch.cat([p + before[c][..., None] for p, (c, *_) in zip(pieces, chunks, strict=True)],
                                  dim=-1)
            out[f"{t.kind}.{name}"] = value
    return out


# -- one (query block, key range) pair ------------------------------------------------------------------------------
def _key_range(plan, qpos: torch.Tensor, kpos: torch.Tensor) -> tuple[int, int] | None:
    """The keys (a slice of kpos, ascending) some query at qpos may see under causality and the masks' bounds, or
    None when there is none. The same rule in every pass, so forward and backward visit the same pairs."""
    nk = kpos.shape[-1]
    stop = int((kpos <= qpos.max()).sum(-1).max()) if plan.causal else nk
    earliest = plan.earliest_key(int(qpos.min()))
    start = int((kpos < earliest).sum(-1).min()) if earliest is not None else 0
    return (start, stop) if start < stop else None


def _selection(plan, acc, qs, ksel, qpos, kpos, dims, qfeat, kfeat, params, scale):
    """S (B, 1, nq, nk) from the queries (B, H, nq, D) and the selector's key rows ksel (B, len(heads), nk, D),
    the logits of the selector heads alone through the logits slot (as ``Composition.selection``)."""
    ctx = plan.context(qpos, kpos.unsqueeze(1), dims, None, qfeat, kfeat)
    allowed = plan.allowed(ctx, None)
    index, sel_allowed, sel_ctx = plan.selector_view(acc, allowed, ctx)
    logits = (qs.index_select(1, index) @ ksel.transpose(-1, -2)) * scale
    for t in plan.many(Slot.LOGITS):
        logits = checked_logits(t, t.apply(logits, sel_ctx, params[t.kind]), logits)
    return acc.selection(logits, sel_allowed, sel_ctx, params[acc.kind])


def _selector_kv(plan, acc, dims: Dims, device) -> torch.Tensor:
    group = dims.num_heads // dims.num_kv_heads
    return torch.tensor([i // group for i in acc.heads()], device=device)


def _pair(plan, params, q, k, v, qpos, kpos, qfeat, kfeat, carry, scale):
    """Queries (B, H, nq, D) at qpos (B, nq) against keys and values (B, H_kv, nk, D) at kpos (B, nk), with the
    features of each and the accumulator's carry (B, nk) into this query block (None without one). Returns (the
    output normalised over these keys (B, H, nq, D), its log-sum-exp (B, H, nq), -inf for a row with no key here,
    the column sums of S (B, nk) or None)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = h // hkv
    dims = Dims(h, d, hkv)
    ctx = plan.context(qpos, kpos.unsqueeze(1), dims, None, qfeat, kfeat)
    allowed = plan.allowed(ctx, None).expand(b, -1, nq, nk)
    logits = (q.reshape(b, hkv, group * nq, d) @ k.transpose(-1, -2)).reshape(b, h, nq, nk) * scale
    for t in plan.many(Slot.LOGITS):
        logits = checked_logits(t, t.apply(logits, ctx, params[t.kind]), logits)
    colsum = None
    acc = plan.one(Slot.ACCUMULATOR)
    if acc is not None:
        ksel = k.index_select(1, _selector_kv(plan, acc, dims, k.device))
        s = _selection(plan, acc, q, ksel, qpos, kpos, dims, qfeat, kfeat, params, scale)
        s = s.to(accumulator_dtype(s.dtype))
        f = F.pad(s[:, :, :-1].cumsum(dim=2), (0, 0, 1, 0)) + carry[:, None, None, :]
        colsum = s.sum(dim=2)[:, 0]
        logits = (logits.to(f.dtype) - f).to(logits.dtype)  # subtract in F's (wider) dtype, round once
    has = allowed.any(-1, keepdim=True)
    masked = logits.masked_fill(~allowed, float("-inf")).masked_fill(~has, 0.0)
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    p = torch.exp(masked - lse).masked_fill(~allowed, 0.0)
    out = (p.reshape(b, hkv, group * nq, nk) @ v).reshape(b, h, nq, d)
    return out, lse[..., 0].masked_fill(~has[..., 0], float("-inf")), colsum


def _merge(out, lse, o, l) -> None:
    """Flash-style merge of a partial result (o, l) into (out, lse), in place."""
    new = torch.logaddexp(lse, l)
    finite = torch.isfinite(new)
    old_w = torch.where(finite, torch.exp(lse - new), 0.0)
    new_w = torch.where(finite, torch.exp(l - new), 0.0)
    out.mul_(old_w.unsqueeze(-1).to(out.dtype)).add_(o * new_w.unsqueeze(-1).to(out.dtype))
    lse.copy_(new)


def _weight(l: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """exp(l - total), 0 where the partial row had no key."""
    return torch.where(torch.isfinite(l), torch.exp(l - total), 0.0)


# -- the sharded kernel ----------------------------------------------------------------------------------------------
class _Walk:
    """The work of one rank: every (local query block, key range of a source chunk) pair the masks leave."""

    def __init__(self, cfg: _Config, pos: torch.Tensor) -> None:
        self.cfg, self.pos = cfg, pos

    def query_blocks(self, start: int, stop: int) -> list[slice]:
        step = self.cfg.block_size
        return [slice(s, min(s + step, stop)) for s in range(start, stop, step)]

    def pairs(self, src: int, kpos: torch.Tensor):
        """(query chunk, source chunk, its global start, its local slice in the block, [(query block, key
        slice within the chunk)]) for the pairs with at least one visible key."""
        layout = self.cfg.layout
        for c, qstart, qstop, _ in layout.local_chunks(self.cfg.rank):
            for cb, kstart, kstop, gstart in layout.local_chunks(src):
                if self.cfg.plan.causal and cb > c:
                    continue  # positions increase along the sequence (checked): every key is after every query
                chunk_pos = kpos[:, kstart:kstop]
                blocks = []
                for qb in self.query_blocks(qstart, qstop):
                    keys = _key_range(self.cfg.plan, self.pos[:, qb], chunk_pos)
                    if keys is not None:
                        blocks.append((qb, slice(*keys)))
                if blocks:
                    yield c, cb, gstart, slice(kstart, kstop), blocks


def _unpack(cfg: _Config, rest):
    nf = len(cfg.feature_keys)
    features = dict(zip(cfg.feature_keys, rest[:nf], strict=True))
    params: dict[str, dict[str, torch.Tensor]] = {t.kind: {} for t in cfg.plan.transforms}
    for (kind, short), t in zip(cfg.param_keys, rest[nf:], strict=True):
        params[kind][short] = t
    return features, params


def _block(ks, vs, pos, features) -> dict[str, torch.Tensor]:
    return {"k": ks, "v": vs, "pos": pos, **{f"f:{name}": t for name, t in features.items()}}


def _key_features(block, keys: slice, chunk: slice) -> dict[str, torch.Tensor]:
    return {name[2:]: t[..., chunk][..., keys] for name, t in block.items() if name.startswith("f:")}


def _colsums(cfg: _Config, qs, pos, ks, features, params) -> dict[int, torch.Tensor]:
    """The selector pass: the column sums of S of every local query chunk over the whole sequence's keys, (B, N)
    per chunk (a ring of the selector's key rows alone)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    dims = Dims(h, d, ks.shape[1])
    wide = accumulator_dtype(qs.dtype)
    table = {c: qs.new_zeros(b, cfg.layout.seq_len, dtype=wide) for c in cfg.layout.owned(cfg.rank)}
    mine = _block(ks.index_select(1, _selector_kv(plan, acc, dims, ks.device)), None, pos, features)
    del mine["v"]
    walk = _Walk(cfg, pos)
    for src, blk in _Blocks(cfg, "selector")(mine):
        for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            kchunk, pchunk = blk["k"][:, :, chunk], blk["pos"][:, chunk]
            for qb, keys in blocks:
                s = _selection(plan, acc, qs[:, :, qb], kchunk[:, :, keys], pos[:, qb], pchunk[:, keys], dims,
                               {k: t[..., qb] for k, t in features.items()}, _key_features(blk, keys, chunk),
                               params, cfg.scale)
                table[c][:, gstart + keys.start:gstart + keys.stop] += s.to(wide).sum(dim=2)[:, 0]
    return table


def _forward(cfg: _Config, qs, ks, vs, pos, features, params):
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    carries = _scan(cfg, _colsums(cfg, qs, pos, ks, features, params), reverse=False) if acc is not None else {}
    out = torch.zeros_like(qs)
    lse = torch.full((b, h, n), float("-inf"), dtype=qs.dtype, device=qs.device)
    walk = _Walk(cfg, pos)
    for src, blk in _Blocks(cfg, "kv")(_block(ks, vs, pos, features)):
        for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            kchunk, vchunk, pchunk = blk["k"][:, :, chunk], blk["v"][:, :, chunk], blk["pos"][:, chunk]
            carry = carries[c][:, gstart:gstart + pchunk.shape[-1]].clone() if acc is not None else None
            for qb, keys in blocks:
                o, l, colsum = _pair(plan, params, qs[:, :, qb], kchunk[:, :, keys], vchunk[:, :, keys], pos[:, qb],
                                     pchunk[:, keys], {k: t[..., qb] for k, t in features.items()},
                                     _key_features(blk, keys, chunk), carry[:, keys] if carry is not None else None,
                                     cfg.scale)
                _merge(out[:, :, qb], lse[:, :, qb], o, l)
                if colsum is not None:
                    carry[:, keys] += colsum
    sink = plan.sink(torch.arange(h, device=qs.device).view(1, -1, 1, 1), params, qs)
    if sink is not None:
        total = torch.logaddexp(lse, sink[..., 0].expand_as(lse))
        out.mul_(_weight(lse, total).unsqueeze(-1))
        lse = total
    return out, lse, carries


class _ShardedAttend(torch.autograd.Function):
    """The sharded attention of the transformed rows (row maps and features are applied outside, with autograd):
    inputs qs, ks, vs (this rank's), positions, the features (B, H, n), the pair slots' parameters."""

    @staticmethod
    def forward(ctx, cfg, qs, ks, vs, pos, *rest):
        features, params = _unpack(cfg, rest)
        out, lse, carries = _forward(cfg, qs, ks, vs, pos, features, params)
        ctx.cfg = cfg
        ctx.chunks = list(carries)
        ctx.save_for_backward(qs, ks, vs, pos, out, lse, *rest, *carries.values())
        return out

    @staticmethod
    def backward(ctx, d_out):
        cfg = ctx.cfg
        saved = ctx.saved_tensors
        qs, ks, vs, pos, out, lse = saved[:6]
        count = len(cfg.feature_keys) + len(cfg.param_keys)
        rest = saved[6:6 + count]
        carries = dict(zip(ctx.chunks, saved[6 + count:], strict=True))
        grads = _backward(cfg, qs, ks, vs, pos, out, lse, rest, carries, d_out, ctx.needs_input_grad[5:])
        return (None, *grads[:3], None, *grads[3:])


def _leaf(t: torch.Tensor, wanted: bool) -> torch.Tensor:
    return t.detach().requires_grad_(wanted)


def _backward(cfg: _Config, qs, ks, vs, pos, out, lse, rest, carries, d_out, rest_wanted):
    """Gradients of qs, ks, vs, then of each feature and parameter (None where not wanted)."""
    plan = cfg.plan
    acc = plan.one(Slot.ACCUMULATOR)
    b, h, n, d = qs.shape
    qs, ks, vs, out = qs.detach(), ks.detach(), vs.detach(), out.detach()
    rest = [t.detach() for t in rest]
    features, params = _unpack(cfg, rest)
    nf = len(cfg.feature_keys)
    feature_wanted = dict(zip(cfg.feature_keys, rest_wanted[:nf], strict=True))
    param_wanted = list(rest_wanted[nf:])
    d_out = d_out.contiguous()
    delta = (d_out * out).sum(-1)  # (B, H, n)
    walk = _Walk(cfg, pos)
    wide = accumulator_dtype(qs.dtype)

    d_q = torch.zeros_like(qs)
    d_feat_q = {name: torch.zeros_like(t) for name, t in features.items()}
    d_params = [torch.zeros_like(t) for t in rest[nf:]]

    def pair_grads(o, l, qb):
        w = _weight(l.detach(), lse[:, :, qb])
        g_o = w.unsqueeze(-1).to(o.dtype) * d_out[:, :, qb]
        g_l = w * ((d_out[:, :, qb] * o.detach()).sum(-1) - delta[:, :, qb])
        return g_o, g_l

    # the sink: one more partial result, of log-sum-exp sink[h] and output 0
    sink_leaves = [_leaf(t, wanted) for t, wanted in zip(rest[nf:], param_wanted, strict=True)]
    if plan.one(Slot.NORMALISER) is not None and any(param_wanted):
        with torch.enable_grad():
            _, sink_params = _unpack(cfg, [*rest[:nf], *sink_leaves])
            sink = plan.sink(torch.arange(h, device=qs.device).view(1, -1, 1, 1), sink_params, qs)
            w = torch.exp(sink[..., 0].expand_as(lse) - lse)
            g = (-w * delta).sum(dim=(0, 2)).view_as(sink)
            wrt = [t for t, wanted in zip(sink_leaves, param_wanted, strict=True) if wanted]
            got = torch.autograd.grad(sink, wrt, g, allow_unused=True)
        it = iter(got)
        for i, wanted in enumerate(param_wanted):
            if wanted:
                g_i = next(it)
                if g_i is not None:
                    d_params[i] += g_i

    # the reverse carry: the gradient reaching each chunk's carries (Pass A), scanned back over the chunks
    later: dict[int, torch.Tensor] = {}
    if acc is not None:
        reach = {c: torch.zeros_like(t) for c, t in carries.items()}
        for src, blk in _Blocks(cfg, "kv")(_block(ks, vs, pos, features)):
            for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
                width = blk["pos"][:, chunk].shape[-1]
                carry = carries[c][:, gstart:gstart + width].clone()
                for qb, keys in blocks:
                    leaf = _leaf(carry[:, keys], True)
                    with torch.enable_grad():
                        o, l, colsum = _pair(plan, params, qs[:, :, qb], blk["k"][:, :, chunk][:, :, keys],
                                             blk["v"][:, :, chunk][:, :, keys], pos[:, qb],
                                             blk["pos"][:, chunk][:, keys],
                                             {k: t[..., qb] for k, t in features.items()},
                                             _key_features(blk, keys, chunk), leaf, cfg.scale)
                        g_o, g_l = pair_grads(o, l, qb)
                        (g_carry,) = torch.autograd.grad((o, l), (leaf,), (g_o, g_l), allow_unused=True)
                    if g_carry is not None:
                        reach[c][:, gstart + keys.start:gstart + keys.stop] += g_carry
                    carry[:, keys] += colsum.detach()
        later = _scan(cfg, reach, reverse=True)

    # Pass C: every pair's gradients; key-side gradients travel with their block
    kv_names = ["k", "v"] + [f"f:{name}" for name in cfg.feature_keys]
    blocks_of = _Blocks(cfg, "kv")
    for src, blk, g_blk in blocks_of.with_grads(_block(ks, vs, pos, features), kv_names):
        for c, _, gstart, chunk, blocks in walk.pairs(src, blk["pos"]):
            kchunk, vchunk, pchunk = blk["k"][:, :, chunk], blk["v"][:, :, chunk], blk["pos"][:, chunk]
            width = pchunk.shape[-1]
            carry_in = []
            if acc is not None:  # the carry into each query block, from a selector-only sweep
                carry = carries[c][:, gstart:gstart + width].clone()
                dims = Dims(h, d, ks.shape[1])
                index = _selector_kv(plan, acc, dims, ks.device)
                for qb, keys in blocks:
                    carry_in.append(carry[:, keys].clone())
                    s = _selection(plan, acc, qs[:, :, qb], kchunk[:, :, keys].index_select(1, index), pos[:, qb],
                                   pchunk[:, keys], dims, {k: t[..., qb] for k, t in features.items()},
                                   _key_features(blk, keys, chunk), params, cfg.scale)
                    carry[:, keys] += s.to(wide).sum(dim=2)[:, 0]
                g_colsum = later[c][:, gstart:gstart + width].clone()
            for i in reversed(range(len(blocks))):
                qb, keys = blocks[i]
                q_l = _leaf(qs[:, :, qb], True)
                k_l, v_l = _leaf(kchunk[:, :, keys], True), _leaf(vchunk[:, :, keys], True)
                qf_l = {name: _leaf(t[..., qb], feature_wanted[name]) for name, t in features.items()}
                kf_l = {name: _leaf(t, feature_wanted[name])
                        for name, t in _key_features(blk, keys, chunk).items()}
                p_l = [_leaf(t, wanted) for t, wanted in zip(rest[nf:], param_wanted, strict=True)]
                c_l = _leaf(carry_in[i], True) if acc is not None else None
                _, pair_params = _unpack(cfg, [*rest[:nf], *p_l])
                with torch.enable_grad():
                    o, l, colsum = _pair(plan, pair_params, q_l, k_l, v_l, pos[:, qb], pchunk[:, keys], qf_l, kf_l,
                                         c_l, cfg.scale)
                    g_o, g_l = pair_grads(o, l, qb)
                    outs, cots = [o, l], [g_o, g_l]
                    if colsum is not None:
                        outs.append(colsum)
                        cots.append(g_colsum[:, keys])
                    wrt = [q_l, k_l, v_l]
                    wrt += [qf_l[name] for name in cfg.feature_keys if feature_wanted[name]]
                    wrt += [kf_l[name] for name in cfg.feature_keys if feature_wanted[name]]
                    wrt += [p for p, wanted in zip(p_l, param_wanted, strict=True) if wanted]
                    if c_l is not None:
                        wrt.append(c_l)
                    got = list(torch.autograd.grad(outs, wrt, cots, allow_unused=True))
                g_q, g_k, g_v = got[:3]
                _add(d_q[:, :, qb], g_q)
                _add(g_blk["k"][:, :, chunk][:, :, keys], g_k)
                _add(g_blk["v"][:, :, chunk][:, :, keys], g_v)
                at = 3
                wanted_names = [name for name in cfg.feature_keys if feature_wanted[name]]
                for name in wanted_names:
                    _add(d_feat_q[name][..., qb], got[at])
                    at += 1
                for name in wanted_names:
                    _add(g_blk[f"f:{name}"][..., chunk][..., keys], got[at])
                    at += 1
                for j, wanted in enumerate(param_wanted):
                    if wanted:
                        _add(d_params[j], got[at])
                        at += 1
                if c_l is not None and got[at] is not None:
                    g_colsum[:, keys] += got[at]  # this block's carry came from the column sums before it
    returned = blocks_of.returned
    d_feats = [d_feat_q[name] + returned[f"f:{name}"] if feature_wanted[name] else None
               for name in cfg.feature_keys]
    d_params_out = [g if wanted else None for g, wanted in zip(d_params, param_wanted, strict=True)]
    return [d_q, returned["k"], returned["v"], *d_feats, *d_params_out]


def _add(target: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None:
        target.add_(grad.to(target.dtype))

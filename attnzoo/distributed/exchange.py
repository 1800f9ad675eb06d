"""What crosses between ranks: the communication accounting (:func:`counting`), the collectives and
point-to-point exchanges (every send counted), and the blocks of keys moving around the ring or all-gathered
(:class:`KeyBlocks`)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layout import ShardConfig


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


def count_sent(kind: str, nbytes: int) -> None:
    """Add ``nbytes`` sent by this rank, as one message of ``kind``, to every open :func:`counting`."""
    for counter in _COUNTERS:
        counter.add(kind, int(nbytes))


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


# -- through host memory ---------------------------------------------------------------------------------------------
def _staged(t: torch.Tensor, group) -> bool:
    """Whether ``t`` crosses through host memory: a tensor off the CPU on a gloo group. Gloo's transport reads
    and writes host memory (it would be handed a device pointer otherwise); several ranks sharing one GPU, which
    NCCL refuses, run this way."""
    return t.device.type != "cpu" and dist.get_backend(group) == "gloo"


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (always a copy, also of a CPU tensor: the tests stage CPU tensors)."""
    return t.to("cpu", copy=True)


class _CopyBack:
    """The last "request" of a staged exchange: once the others are done, the received host buffers are copied
    into their device tensors."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.copies = copies

    def wait(self) -> None:
        for host, target in self.copies:
            target.copy_(host)
        self.copies = []


def send(t: torch.Tensor, peer: int, group) -> None:
    """Blocking send to group rank ``peer`` (through host memory when :func:`_staged`)."""
    dist.send(_host(t) if _staged(t, group) else t.contiguous(), _global_rank(group, peer), group=group)


def recv(t: torch.Tensor, peer: int, group) -> None:
    """Blocking receive into ``t`` from group rank ``peer``."""
    if _staged(t, group):
        host = torch.empty(t.shape, dtype=t.dtype)
        dist.recv(host, _global_rank(group, peer), group=group)
        t.copy_(host)
    else:
        dist.recv(t, _global_rank(group, peer), group=group)


# -- collectives ---------------------------------------------------------------------------------------------------
def all_gather(t: torch.Tensor, group, world: int, kind: str) -> torch.Tensor:
    """(world, *t.shape): every rank's ``t`` (the same shape everywhere)."""
    t = t.contiguous()
    if world == 1:
        return t.unsqueeze(0)
    staged = _staged(t, group)
    src = _host(t) if staged else t
    out = [torch.empty_like(src) for _ in range(world)]
    count_sent(kind, (world - 1) * tensor_bytes(t))
    dist.all_gather(out, src, group=group)
    return torch.stack(out).to(t.device) if staged else torch.stack(out)


def _allreduce_bytes(t: torch.Tensor, world: int) -> int:
    return 2 * (world - 1) * tensor_bytes(t) // max(world, 1)


def all_reduce(t: torch.Tensor, group, world: int, kind: str) -> torch.Tensor:
    """Sum ``t`` over the ranks, in place."""
    if world > 1:
        count_sent(kind, _allreduce_bytes(t, world))
        if _staged(t, group):
            host = _host(t)
            dist.all_reduce(host, group=group)
            t.copy_(host)
        else:
            dist.all_reduce(t, group=group)
    return t


class GatherChunks(torch.autograd.Function):
    """All-gather with a gradient: backward sums the gradient over the ranks and keeps this rank's piece."""

    @staticmethod
    def forward(ctx, t, group, world, rank):
        ctx.group, ctx.world, ctx.rank = group, world, rank
        return all_gather(t, group, world, "features")

    @staticmethod
    def backward(ctx, grad):
        grad = all_reduce(grad.contiguous().clone(), ctx.group, ctx.world, "features")
        return grad[ctx.rank], None, None, None


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group, kind: str,
              tag: int = 0):
    """Post sends (tensor, group rank) and receives together (batched: NCCL needs it for a ring), the i-th of
    each tagged ``tag + i``; returns the requests to wait on (:func:`_wait`: in order; when staged through host
    memory, the last one copies what arrived into its tensors)."""
    ops, copies = [], []
    for i, (t, peer) in enumerate(sends):
        count_sent(kind, tensor_bytes(t))
        ops.append(dist.P2POp(dist.isend, _host(t) if _staged(t, group) else t, _global_rank(group, peer), group,
                              tag + i))
    for i, (t, peer) in enumerate(recvs):
        if _staged(t, group):
            host = torch.empty(t.shape, dtype=t.dtype)
            copies.append((host, t))
            t = host
        ops.append(dist.P2POp(dist.irecv, t, _global_rank(group, peer), group, tag + i))
    requests = dist.batch_isend_irecv(ops) if ops else []
    return [*requests, _CopyBack(copies)] if copies else requests


def _wait(requests) -> None:
    for req in requests:
        req.wait()


# -- blocks of keys moving between ranks ---------------------------------------------------------------------------
def token_dim(name: str) -> int:
    """The token dimension of the tensor ``name`` of a block: keys/values (B, H_kv, n, D) -> 2, positions (B, n)
    and features/carries (B, H, n) -> the last."""
    return 2 if name in ("k", "v") else -1


def _like(mine: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like ``mine`` with ``size`` tokens."""
    out = {}
    for name, t in mine.items():
        shape = list(t.shape)
        shape[token_dim(name)] = size
        out[name] = torch.empty(shape, dtype=t.dtype, device=t.device)
    return out


class KeyBlocks:
    """Every rank's block of keys, one at a time, in ring order (this rank's own first): passed around the ring
    (the next block is received while the current one is attended) or all-gathered once."""

    def __init__(self, cfg: ShardConfig, kind: str, sizes: list[int] | None = None) -> None:
        self.cfg, self.kind = cfg, kind
        self.sizes = sizes  # tokens of each rank's block (None: its local tokens), the same on every rank
        self.returned: dict[str, torch.Tensor] | None = None

    def size(self, rank: int) -> int:
        return self.cfg.layout.local_size(rank) if self.sizes is None else self.sizes[rank]

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

    def pieces(self, mine: dict[str, torch.Tensor], piece: int | None):
        """Like iterating, but another rank's block arrives in pieces of about ``piece`` tokens, each straight from
        its owner (at step s, rank r receives from r - s and sends its own pieces to r + s, two pieces in flight),
        yielding (source rank, block piece, the piece's first token in the source's local order): a rank holds
        one piece of another's keys and values at a time, plus the one arriving. For a forward without gradients
        (the backward's gradients travel with whole blocks). ``piece`` None, one rank or the all-gather: whole
        blocks (first token 0)."""
        cfg = self.cfg
        if piece is None or cfg.world == 1 or not cfg.ring:
            for src, blk in self(mine):
                yield src, blk, 0
            return
        yield cfg.rank, mine, 0
        count = max(1, -(-max(self.size(r) for r in range(cfg.world)) // piece))  # the same on every rank
        own = _cuts(self.size(cfg.rank), count)
        for step in range(1, cfg.world):
            src, dst = (cfg.rank - step) % cfg.world, (cfg.rank + step) % cfg.world
            theirs = _cuts(self.size(src), count)

            def post(i, _src=src, _dst=dst, _theirs=theirs):
                lo, hi = own[i]
                sends = [(_narrow(name, t, lo, hi).contiguous(), _dst) for name, t in mine.items()]
                incoming = _like(mine, _theirs[i][1] - _theirs[i][0])
                requests = _exchange(sends, [(t, _src) for t in incoming.values()], cfg.group, self.kind,
                                     tag=2000 + (len(mine) + 1) * i)
                return requests, incoming, sends

            pending = post(0)
            for i in range(count):
                requests, incoming, sends = pending
                _wait(requests)
                del sends
                pending = post(i + 1) if i + 1 < count else None
                yield src, incoming, theirs[i][0]
                del incoming

    def _pass_on(self, mine, current, step: int, src: int):
        """Start sending ``current`` (the block of rank ``src``) to the next rank and receiving the previous rank's
        block, unless this is the last step: (the requests to wait for, the incoming block or None)."""
        cfg = self.cfg
        if step >= cfg.world - 1:
            return [], None
        nxt, prev = (cfg.rank + 1) % cfg.world, (cfg.rank - 1) % cfg.world
        incoming = _like(mine, self.size((src - 1) % cfg.world))
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
        own = {name: torch.zeros_like(mine[name]) for name in grad_names}
        grads = own
        for step, src in enumerate(self.sources()):
            requests, incoming = self._pass_on(mine, current, step, src)
            yield src, current, grads
            _wait(requests)
            size = self.size((src - 1) % cfg.world if step < cfg.world - 1 else cfg.rank)
            arriving = _like({name: mine[name] for name in grad_names}, size)
            if step == 0:  # this rank's own share stays here; the next block's owner kept its own
                for t in arriving.values():
                    t.zero_()
            else:  # the other ranks' shares follow their block: after the last step they reach its owner
                _wait(_exchange([(grads[name].contiguous(), nxt) for name in grad_names],
                                [(arriving[name], prev) for name in grad_names], cfg.group, self.kind + "-grad",
                                tag=1000))
            current, grads = incoming, arriving
        self.returned = {name: own[name].add_(grads[name]) for name in grad_names}

    def _gather(self, mine):
        cfg = self.cfg
        most = max(self.size(r) for r in range(cfg.world))
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.world)]
        for name, t in mine.items():
            dim = token_dim(name) % t.dim()
            padded = F.pad(t, _pad_spec(t.dim(), dim, most - t.shape[dim]))
            every = all_gather(padded, cfg.group, cfg.world, self.kind)
            for r in range(cfg.world):
                out[r][name] = every[r].narrow(dim, 0, self.size(r))
        return out

    def _reduce(self, pieces: list[torch.Tensor], name: str) -> torch.Tensor:
        cfg = self.cfg
        most = max(self.size(r) for r in range(cfg.world))
        dim = token_dim(name) % pieces[0].dim()
        stacked = torch.stack([F.pad(p, _pad_spec(p.dim(), dim, most - p.shape[dim])) for p in pieces])
        all_reduce(stacked, cfg.group, cfg.world, self.kind + "-grad")
        return stacked[cfg.rank].narrow(dim, 0, self.size(cfg.rank))


def _cuts(size: int, count: int) -> list[tuple[int, int]]:
    """``count`` near-equal (start, stop) ranges covering ``size`` tokens (empty ones when size < count)."""
    base, extra = divmod(size, count)
    out, at = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        out.append((at, at + n))
        at += n
    return out


def _narrow(name: str, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    dim = token_dim(name) % t.dim()
    return t.narrow(dim, lo, hi - lo)


def _pad_spec(ndim: int, dim: int, extra: int) -> tuple[int, ...]:
    spec = [0] * (2 * (ndim - dim))
    spec[-1] = extra
    return tuple(spec)

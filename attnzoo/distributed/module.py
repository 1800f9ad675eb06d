"""The public entry points: :class:`ContextParallel` (a spec sharded over a process group),
:class:`ShardedAttention` (an ``attnzoo.nn.Attention`` layer that runs it), :func:`sum_gradients` and
:func:`unsupported`; the inputs of every rank checked together before any work."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..dispatch import Variant, renamed_flag
from ..errors import UnsupportedError
from ..inputs import check_positions, check_qkv
from ..nn import Attention
from ..transforms.base import Slot
from .attend import _ShardedAttend
from .carry import _features
from .exchange import _all_gather, _all_reduce
from .fused import fused_pairs
from .kernel_pairs import triton_reasons
from .layout import Layout, _Config
from .pairs import flash_pairs

#: slots whose transforms act inside the (query, key) pairs, so their parameters enter the sharded kernel
_PAIR_SLOTS = (Slot.LOGITS, Slot.MASK, Slot.ACCUMULATOR, Slot.NORMALISER)
_METHODS = ("auto", "ring", "allgather")
#: (spec, reason) pairs already warned about: the triton pairs could not run them on a GPU
_WARNED: set[tuple[str, str]] = set()


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


class ContextParallel:
    """Context-parallel attention of ``spec`` over ``group`` (None: the default group); call it on every rank
    with that rank's shard: ``cp(q, k, v, params=None, positions=None, inputs=None)`` with q (B, H, n, D), k and v
    (B, H_kv, n, D) the rank's tokens in :class:`Layout` order, ``positions`` their true 1-based positions ((n,) or
    (B, n); default: the layout's, 1..N), ``inputs`` their per-token inputs (B, H, n). Returns the rank's outputs
    (B, H, n, D). ``balanced``: the layout; ``method``: ``"ring"``, ``"allgather"`` or ``"auto"`` (all-gather when
    the whole sequence's keys and values take at most ``gather_limit`` bytes); ``block_size``: queries per block
    inside a pair (the attention state per rank is O(block_size x N / R + N / R x H x D)); ``piece_size``: in a
    forward without gradients on the ring, another rank's keys and values arrive in pieces of about this many
    tokens, straight from their owner, so a rank holds one piece of them at a time (None: whole blocks);
    ``backend``: what computes the pairs: ``"triton"`` (the spec's generated kernels; declined in one line when
    they cannot run the call), ``"auto"`` (the triton kernels on CUDA when they can, else the CPU pairs below),
    or another backend's name (the CPU pairs: torch's flash kernel, the blocked backend's fused selective kernel,
    or the eager pairs); None: the Variant's backend (``"auto"`` for a spec)."""

    def __init__(self, spec, group=None, *, balanced: bool = True, method: str = "auto", block_size: int = 256,
                 gather_limit: int = 64 * 2**20, piece_size: int | None = 1024, backend: str | None = None,
                 registry=None) -> None:
        self.variant = spec if isinstance(spec, Variant) else Variant(spec, backend or "auto", registry)
        self.backend = backend if backend is not None else self.variant.backend_name
        if self.backend != "auto" and self.backend not in self.variant.registry.backends:
            known = ", ".join(sorted(self.variant.registry.backends))
            raise ValueError(f"unknown backend '{self.backend}' (registered: {known})")
        self.plan = self.variant.plan
        reasons = unsupported(self.plan)
        if reasons:
            raise _decline(self.variant.spec.name, reasons[0])
        if method not in _METHODS:
            raise ValueError(f"method must be one of {', '.join(_METHODS)}, got {method!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if piece_size is not None and (isinstance(piece_size, bool) or not isinstance(piece_size, int)
                                       or piece_size < 1):
            raise ValueError(f"piece_size must be a positive int or None, got {piece_size!r}")
        self.piece_size = piece_size
        self.group, self.balanced, self.method = group, balanced, method
        self.block_size, self.gather_limit = block_size, gather_limit
        self.last_method: str | None = None
        #: how the last call computed each pair of chunks: "flash" (torch's CPU flash-attention kernel, forward and
        #: backward: plain attention in float32/float64 on the CPU), "fused" (the blocked backend's fused
        #: selective kernel, forward and backward: selective-style specs on the CPU), "triton" (the spec's generated
        #: kernels, forward and backward) or "eager" (the pair's maths with autograd)
        self.last_pairs: str | None = None

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
        dims, layout, pos, firsts = self._agree(q, k, v, positions, world, rank, group)
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
        pair_params = [grouped[kind][short] for kind, short in param_keys]
        cfg.keep = torch.is_grad_enabled() and any(t.requires_grad for t in (qs, ks, vs, *features.values(),
                                                                             *pair_params))
        cfg.piece = self.piece_size
        if self.backend == "triton" or (self.backend == "auto" and qs.device.type == "cuda"):
            triton = self.variant.registry.backends.get("triton")
            why = triton_reasons(triton, cfg, qs, cfg.keep)
            if not why:
                cfg.triton = triton
            elif self.backend == "triton":
                raise _decline(name, f"backend 'triton': {why[0]}")
            elif (name, why[0]) not in _WARNED:  # on a GPU the eager pairs are exact but slow: say so, once
                _WARNED.add((name, why[0]))
                warnings.warn(f"attnzoo context parallel: spec '{name}' runs on the eager pairs, not the triton "
                              f"kernels ({why[0]})", RuntimeWarning, stacklevel=2)
        cfg.flash = cfg.triton is None and flash_pairs(cfg, qs)
        bos_rows = firsts == 1
        cfg.fused = cfg.triton is None and not cfg.flash and fused_pairs(cfg, qs, bos_rows)
        cfg.bos = bool(bos_rows.all())
        self.last_pairs = ("triton" if cfg.triton is not None else "flash" if cfg.flash else
                           "fused" if cfg.fused else "eager")
        out = _ShardedAttend.apply(cfg, qs, ks, vs, pos, *features.values(), *pair_params)
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
            return dims, layout, layout.positions(rank, b, device=q.device), torch.ones(b, dtype=torch.int64)
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
        return dims, layout, pos, by_chunk[0][:, 0].cpu()


def sum_gradients(parameters, group=None) -> None:
    """Sum the ``.grad`` of replicated ``parameters`` over ``group`` in place (all-reduce): after a sharded
    backward, each rank holds its own queries' contribution, and this makes every rank's the full gradient. A
    data-parallel wrapper over the same ranks that sums does the same (one that averages divides it by R)."""
    world = dist.get_world_size(group)
    for p in parameters:
        if p.grad is not None:
            _all_reduce(p.grad, group, world, "allreduce")


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
                 gather_limit: int = 64 * 2**20, piece_size: int | None = 1024) -> None:
        super().__init__(spec, num_heads, head_dim, num_kv_heads, backend, dtype, device, registry, input_dim)
        self.parallel = ContextParallel(self.variant, group, balanced=balanced, method=method,
                                        block_size=block_size, gather_limit=gather_limit, piece_size=piece_size)

    @classmethod
    def from_attention(cls, layer: Attention, group=None, **options) -> ShardedAttention:
        """A sharded layer sharing ``layer``'s parameters and token projections (options as for the
        constructor: ``balanced``, ``method``, ``block_size``, ``gather_limit``)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.variant, new.num_heads, new.head_dim, new.num_kv_heads = (layer.variant, layer.num_heads,
                                                                      layer.head_dim, layer.num_kv_heads)
        new.transform_params, new.token_projections = layer.transform_params, layer.token_projections
        new._bound = dict(layer.bound_parameters)  # parameters the host model owns (gpt-oss's sinks)
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

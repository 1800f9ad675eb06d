"""The public entry points: :class:`ContextParallel` (a spec sharded over a process group),
:class:`ShardedAttention` (an ``attnzoo.nn.Attention`` layer that runs it), :func:`sum_gradients` and
:func:`unsupported`; the inputs of every rank checked together before any work: one all-gather of a fixed-size
fingerprint of the call (:class:`_Fingerprint`) before any collective whose shape or sequence depends on it."""

from __future__ import annotations

import hashlib
import warnings
import zlib

import torch
import torch.distributed as dist

from ..dispatch import Variant
from ..errors import RankDisagreementError, UnsupportedError
from ..inputs import check_positions, check_qkv
from ..nn import Attention
from ..transforms.base import Slot
from .attend import ShardedAttend
from .carry import sharded_features
from .exchange import all_gather, all_reduce
from .fused import fused_pairs
from .kernel_pairs import triton_reasons
from .layout import Layout, ShardConfig
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
    mapped = plan.one(Slot.PROBABILITY)
    if mapped is not None:
        reasons.append(f"transform '{mapped.kind}' (probability) replaces the softmax: the sharded pairs merge "
                       "softmax partial results by their log-sum-exp")
    return reasons


def _decline(spec_name: str, reason: str):
    return UnsupportedError(spec_name, {"context-parallel": [reason]}, mode="context-parallel")


# -- what every rank must agree on -----------------------------------------------------------------------------------
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_DEVICES = {"cpu": 1, "cuda": 2}
_METHOD_CODES = {"ring": 1, "allgather": 2, "auto": 3}
#: the fingerprint's fields, one int64 each, in the order a disagreement is reported; "invalid" (this rank's own
#: inputs are malformed: its error says why) and "tokens" (local lengths differ by design: the layout checks them)
#: are checked apart, "name" only shows the spec's name (its hash is compared)
_FIELDS = ("invalid", "tokens", "spec", "name", "name+", "backend", "device", "dtype", "batch", "heads", "kv_heads",
           "head_dim", "parameters", "parameters+", "balanced", "method", "gather_limit", "piece_size",
           "gradients", "positions")
_AT = {name: i for i, name in enumerate(_FIELDS)}
_COMPARED = [name for name in _FIELDS if name not in ("invalid", "tokens", "name", "name+")]
_LABELS = {"spec": "the spec", "device": "the device type", "batch": "the batch size (B)", "heads": "heads (H)",
           "kv_heads": "key/value heads (H_kv)", "head_dim": "head_dim (D)", "parameters": "the transform parameters",
           "parameters+": "the transform parameters",
           "gradients": "the gradients wanted (grad mode, requires_grad)"}


def _int63(x) -> int:
    """``x`` as a fingerprint field (an int64): at most 2^62 (an infinite limit included)."""
    return int(x) if x < 2**62 else 2**62


def _hash63(text: str) -> int:
    """A short text (a backend's name, a long bit set) as a fingerprint field."""
    return int.from_bytes(zlib.crc32(text.encode()).to_bytes(4, "little") * 2, "little") & (2**63 - 1)


def _bytes_digest(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Two 63-bit halves of a blake2b digest of the tensors' bytes (as the call uses them): exact, so any change
    of a value changes it, and independent of thread counts and devices (a few microseconds for per-head
    parameters, about a millisecond per MiB). Tensors off the CPU cross to the host in one copy."""
    flat = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors]
    away = [t.device for t in flat if t.device.type != "cpu"]
    if away:
        flat = [torch.cat([t.to(away[0]) for t in flat]).cpu()]
    digest = hashlib.blake2b(digest_size=16)
    for t in flat:
        digest.update(t.numel().to_bytes(8, "little"))
        digest.update(t.numpy())
    raw = digest.digest()
    return (int.from_bytes(raw[:8], "little") & (2**63 - 1), int.from_bytes(raw[8:], "little") & (2**63 - 1))


class _Fingerprint:
    """What a rank's call must share with every other rank's, as a fixed-size int64 vector (:data:`_FIELDS`): the
    spec (a hash of its canonical form, and its name to show), the transform parameters (:func:`_bytes_digest` of
    their values, as the call uses them), the options (backend, balanced, method, gather_limit under "auto",
    piece_size), the grad mode (which of q, k, v, the parameters and the per-token inputs want a gradient), the
    dtype and device type, B, H, H_kv, D, whether positions were given, and the local length. All-gathered once per
    call, first: its size never depends on the call, so the all-gather itself cannot mismatch."""

    def __init__(self, cp: ContextParallel, q, k, v, grouped, inputs, positions, problem: str) -> None:
        self.cp = cp
        self.names: list[str] = []  # the tensors whose gradient bit is in "gradients", in bit order
        values = dict.fromkeys(_FIELDS, 0)
        values["invalid"] = int(bool(problem))
        device = q.device if isinstance(q, torch.Tensor) else "cpu"
        if not problem:
            b, h, n, d = q.shape
            name = cp.variant.spec.name.encode()[:16].ljust(16, bytes(1))
            params = [(f"{kind}.{short}", t) for kind, group in grouped.items() for short, t in group.items()]
            given = sorted((inputs or {}).items())
            tensors = [t for _, t in params]
            self.names = ["q", "k", "v", *(key for key, _ in params), *(key for key, _ in given)]
            wanted = [t.requires_grad for t in (q, k, v, *tensors, *(t for _, t in given))]
            bits = sum(1 << i for i, w in enumerate(wanted) if w) if torch.is_grad_enabled() else 0
            values.update(
                tokens=n, spec=cp.spec_hash, name=int.from_bytes(name[:8], "little") & (2**63 - 1),
                backend=_hash63(cp.backend), device=_DEVICES.get(q.device.type, 3), dtype=_DTYPES.get(q.dtype, 5),
                batch=b, heads=h, kv_heads=k.shape[1], head_dim=d, balanced=int(bool(cp.balanced)),
                method=_METHOD_CODES[cp.method], gather_limit=_int63(cp.gather_limit) if cp.method == "auto" else 0,
                piece_size=cp.piece_size or 0, positions=int(positions is not None),
                gradients=bits if bits < 2**62 else 2**62 | _hash63(f"{bits:x}"))
            values["name+"] = int.from_bytes(name[8:], "little") & (2**63 - 1)
            values["parameters"], values["parameters+"] = _bytes_digest(tensors) if tensors else (0, 0)
        self.mine = torch.tensor([values[f] for f in _FIELDS], dtype=torch.int64, device=device)

    def disagreement(self, everyone: torch.Tensor) -> str:
        """The one line every rank raises for the gathered fingerprints (world, fields), or "" when the ranks
        agree: the same text on every rank, made from the gathered fingerprints alone."""
        table = everyone.cpu().tolist()
        differ = [f for f in _COMPARED if any(row[_AT[f]] != table[0][_AT[f]] for row in table)]
        if not differ:
            return ""
        if "spec" in differ:  # the rest may follow from the spec (parameter names, gradients): that alone
            differ = ["spec"]
        parts: dict[str, str] = {}
        for field in differ:
            label = _LABELS.get(field, field)
            if label in parts:
                continue
            shown = [self._show(field, row) for row in table]
            ranks = [0] + [r for r in range(1, len(table)) if shown[r] != shown[0]]
            more = f", and {len(ranks) - 4} more ranks" if len(ranks) > 4 else ""
            parts[label] = f"{label} ({', '.join(f'rank {r}: {shown[r]}' for r in ranks[:4])}{more})"
        return (f"context parallel: ranks disagree on {'; '.join(parts.values())}; every rank must call with the "
                f"same spec, transform parameters, options, dtype, sizes and grad mode")

    def _show(self, field: str, row: list[int]) -> str:
        """A field's value in the error (a hash as hex digits, a name where every rank can decode it)."""
        value = row[_AT[field]]
        if field == "spec":
            raw = row[_AT["name"]].to_bytes(8, "little") + row[_AT["name+"]].to_bytes(8, "little")
            return f"'{raw.rstrip(bytes(1)).decode(errors='replace')}' {value:015x}"[:-7]
        if field in ("parameters", "parameters+"):
            pair = f"{row[_AT['parameters']]},{row[_AT['parameters+']]}"
            return f"hash {zlib.crc32(pair.encode()):08x}"
        if field == "backend":
            known = {_hash63(name): name for name in ("auto", *self.cp.variant.registry.backends)}
            return known.get(value, f"{value:016x}")
        if field == "device":
            return {code: name for name, code in _DEVICES.items()}.get(value, "other")
        if field == "dtype":
            return {code: str(t).removeprefix("torch.") for t, code in _DTYPES.items()}.get(value, "other")
        if field == "method":
            return {code: name for name, code in _METHOD_CODES.items()}.get(value, "?")
        if field == "balanced":
            return str(bool(value))
        if field == "piece_size":
            return str(value or None)
        if field == "positions":
            return "given" if value else "default"
        if field == "gradients":
            if value >= 2**62:
                return f"{value:016x}"
            wanted = [name for i, name in enumerate(self.names) if value >> i & 1]
            return "+".join(wanted) or "none"
        return str(value)


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
        #: the spec's identity in the fingerprint every call all-gathers (60 bits of the sha256 of its canonical form)
        self.spec_hash = int(self.variant.spec.hash[:15], 16)  # the spec in a 63-bit int (the fingerprint)
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
        dims, layout, pos, firsts, grouped = self._agree(q, k, v, params, positions, inputs, world, rank, group)
        b, h, n, d = q.shape
        plan = self.plan
        qs = plan.composition.row_scale(Slot.QUERY, q, pos.unsqueeze(1), grouped)
        ks = plan.composition.row_scale(Slot.KEY, k, pos.unsqueeze(1), grouped)
        vs = plan.composition.row_scale(Slot.VALUE, v, pos.unsqueeze(1), grouped)
        features = sharded_features(plan, qs, ks, vs, pos, grouped, layout, rank, group)
        kv_bytes = 2 * b * k.shape[1] * layout.seq_len * d * k.element_size()
        ring = self.method == "ring" or (self.method == "auto" and kv_bytes > self.gather_limit)
        self.last_method = "ring" if ring else "allgather"
        token_keys = set(plan.token_inputs())
        kinds = [t.kind for t in plan.transforms if t.slot in _PAIR_SLOTS]
        param_keys = [(kind, short) for kind in kinds for short in grouped[kind]
                      if f"{kind}.{short}" not in token_keys]
        cfg = ShardConfig(plan, layout, group, rank, world, ring, self.block_size, list(features), param_keys,
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
        out = ShardedAttend.apply(cfg, qs, ks, vs, pos, *features.values(), *pair_params)
        return plan.composition.row_scale(Slot.OUTPUT, out, pos.unsqueeze(1), grouped)

    def _agree(self, q, k, v, params, positions, inputs, world, rank, group):
        """Every rank's call checked together before any other collective, so that every rank raises the same
        one-line error rather than one rank hanging, aborting or computing with other values: one all-gather of
        each rank's :class:`_Fingerprint` (this rank's malformed inputs, then any disagreement on the spec,
        parameters, options, grad mode, dtype or sizes, then the shard lengths against the layout), then one of
        the chunk boundaries' positions when positions are given. Returns (dims, layout, positions, the first
        position of each batch row, the parameters and per-token inputs grouped per transform)."""
        problem, pos, dims, grouped, split = "", None, None, None, None
        try:
            dims = check_qkv(q, k, v)
            self.plan.check_dims(dims)
            b, h, n, d = q.shape
            pos = check_positions(positions, b, n, q.device).contiguous() if positions is not None else None
            split = self.plan.split_params(params, dims, q)
            grouped = self.plan.add_inputs(split, inputs, b, h, n, q)
        except (ValueError, TypeError) as exc:
            problem = str(exc)
        mine = _Fingerprint(self, q, k, v, split, inputs, positions, problem)
        everyone = all_gather(mine.mine, group, world, "meta")
        if problem:
            raise ValueError(f"rank {rank}: {problem}")
        bad = [r for r in range(world) if int(everyone[r, _AT["invalid"]])]
        if bad:
            raise ValueError(f"rank {bad[0]}'s inputs are invalid (its error says why)")
        differ = mine.disagreement(everyone)
        if differ:
            raise RankDisagreementError(differ)
        sizes = [int(x) for x in everyone[:, _AT["tokens"]]]
        layout = Layout(sum(sizes), world, self.balanced)  # every rank raises the same error for too few tokens
        wrong = [r for r, size in enumerate(sizes) if size != layout.local_size(r)]
        if wrong:
            r = wrong[0]
            held = ", ".join(f"rank {i}: {size}" for i, size in enumerate(sizes[:4])) + (", ..." if world > 4 else "")
            raise RankDisagreementError(
                f"context parallel: ranks disagree on the sequence length: rank {r} holds {sizes[r]} tokens but the "
                f"{'balanced' if self.balanced else 'contiguous'} layout of {layout.seq_len} tokens over {world} "
                f"ranks gives it {layout.local_size(r)} (tokens held: {held}; shard with attnzoo.distributed.shard)")
        if pos is None:
            return dims, layout, layout.positions(rank, b, device=q.device), torch.ones(b, dtype=torch.int64), grouped
        # positions must increase along the whole sequence: compare the chunks' first and last positions
        ends = torch.stack([torch.stack([pos[:, start], pos[:, stop - 1]], dim=-1)
                            for _, start, stop, _ in layout.local_chunks(rank)])  # (chunks, B, 2)
        every_end = all_gather(ends, group, world, "meta")
        by_chunk = {c: every_end[r, i] for r in range(world) for i, c in enumerate(layout.owned(r))}
        for c in range(1, layout.num_chunks):
            back = (by_chunk[c][:, 0] <= by_chunk[c - 1][:, 1]).nonzero()
            if len(back):
                row = int(back[0])
                raise ValueError(f"positions must increase strictly along the whole sequence: in row {row}, chunk "
                                 f"{c} (rank {layout.owner(c)}) starts at {int(by_chunk[c][row, 0])} but chunk "
                                 f"{c - 1} (rank {layout.owner(c - 1)}) ends at {int(by_chunk[c - 1][row, 1])}")
        return dims, layout, pos, by_chunk[0][:, 0].cpu(), grouped


def sum_gradients(parameters, group=None) -> None:
    """Sum the ``.grad`` of replicated ``parameters`` over ``group`` in place (all-reduce): after a sharded
    backward, each rank holds its own queries' contribution, and this makes every rank's the full gradient. A
    data-parallel wrapper over the same ranks that sums does the same (one that averages divides it by R)."""
    world = dist.get_world_size(group)
    for p in parameters:
        if p.grad is not None:
            all_reduce(p.grad, group, world, "allreduce")


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
        # this class's own fields on the instance it builds (no __init__ ran)
        new._bound = dict(layer.bound_parameters)  # noqa: SLF001 -- parameters the host model owns (gpt-oss's sinks)
        new._recording = None  # noqa: SLF001
        new.parallel = ContextParallel(layer.variant, group, **options)
        return new

    def forward(self, q, k, v, positions=None, key_mask=None, return_accumulated: bool = False,
                x: torch.Tensor | None = None, documents=None):
        """The rank's shard of the batch form; ``return_accumulated`` and recording F for the memory loss are
        declined (F is (B, N, N))."""
        if self._recording is not None and self.has_accumulator:
            raise _decline(self.spec.name, "recording_accumulated (the memory loss) needs F, (B, N, N), the "
                                           "memory that sharding avoids")
        return self.parallel(q, k, v, params=self.params(), positions=positions, key_mask=key_mask,
                             documents=documents, return_accumulated=return_accumulated,
                             inputs=self.token_inputs(x, q.shape[2]))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method='{self.parallel.method}'"

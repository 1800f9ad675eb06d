"""The triton backend: runs the kernels generated from a spec (``codegen.py``), built and cached by
:mod:`attnzoo.backends.triton.build`.

Row-scale slots (query/key/value/output temperatures, gates) run as a torch prologue/epilogue with the
transforms' own maths (O(N·D); autograd gives their parameter gradients); everything per tile (logits, masks,
the selective accumulator, softmax, P·V) runs in the generated kernels, forward and backward, with the
logits-parameter gradients reduced deterministically (per-program partial sums, no atomics).

On CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``), a checking mode: correct, slow,
and ranked below every other backend by ``auto``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...core.numerics import accumulator_dtype, all_finite, f_from_s, mark_reached
from ...transforms.base import Dims, Slot
from ..base import Backend, HeldAttention, Mode
from ..softmax_maps import joined, softmax_map_combine, softmax_map_rows, value_slices
from . import codegen
from .build import SOURCES, build, interpreting, kernel_module_name, load_kernels, triton_version


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _increasing(positions: torch.Tensor) -> bool:
    return positions.shape[-1] < 2 or bool((positions[:, 1:] > positions[:, :-1]).all())


@dataclass
class _Run:
    """One call's launch configuration: everything but q, k, v and the packed parameters."""

    kernels: object  # the forward module
    backward_kernels: object  # () -> the backward module (loaded on the first backward pass)
    layout: codegen.Layout
    qpos: torch.Tensor          # (B, NQ) int64
    kpos: torch.Tensor          # (B, KPH, NK) int64
    key_mask: torch.Tensor | None  # (B, NK) int8
    init_carry: torch.Tensor | None  # (B, NK) float32: F of earlier queries (decoding)
    causal_skip: bool
    scale: float
    block_m: int
    block_n: int
    write_logits: bool = False
    launch: dict = field(default_factory=dict)  # compile options passed at launch (GPU only)
    bounds: torch.Tensor | None = None  # int32 (NMB + NNB,): first key index per query block, end query block per
    #                                     key block, from the masks' earliest visible key (None: no skipping)
    carry: torch.Tensor | None = None  # filled by forward, read by backward
    sink: torch.Tensor | None = None  # (H,) float32: the normaliser's sink logits (None: no normaliser)
    qt: torch.Tensor | None = None  # (NT, B, H, NQ) float32: per-token query terms (None: no host-termed transform)
    kt: torch.Tensor | None = None  # (NT, B, H, NK) float32: per-token key terms
    want_dcarry: bool = False  # backward: also the gradient of init_carry (sharded pairs, attnzoo.distributed)
    dcarry: torch.Tensor | None = None  # (B, NK) float32: filled by backward when want_dcarry

    def _common(self, q, k):
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        kph = self.kpos.shape[1]
        return dict(H=h, HKV=hkv, NQ=nq, NK=nk, D=d, KPB=kph * nk, KPHS=nk if kph > 1 else 0, TQS=b * h * nq,
                    TKS=b * h * nk)

    def _term_args(self, dummy):
        """QT and KT as kernel arguments (a dummy pointer each without per-token terms)."""
        return (self.qt, self.kt) if self.qt is not None else (dummy, dummy)

    def _stats(self, b, h, nq, device) -> torch.Tensor:
        """The per-row statistics the forward writes, NaN-filled: the softmax's log-sum-exp (B, H, NQ), or with a
        probability map in the kernels its shift and denominator, interleaved (B, H, NQ, 2)."""
        mapped = self.layout.probability in ("pointwise", "ratio")
        shape = (b, h, nq, 2) if mapped else (b, h, nq)
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)

    def _meta(self, q):
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_D=max(16, _pow2(q.shape[-1])), **self.launch)

    @property
    def sel(self) -> int:
        return self.layout.selector if self.layout.selector is not None else 0

    def select(self, q, k, prm) -> torch.Tensor | None:
        """The accumulator's pre-pass alone: sets the carry before each query block (what the forward and
        backward kernels read) and returns the carry after every query, init_carry plus the column sums of S
        (B, NK) float32; None without an accumulator."""
        b, nq, nk = q.shape[0], q.shape[2], k.shape[2]
        if self.layout.selector is None:
            self.carry = None
            return None
        dims, meta = self._common(q, k), self._meta(q)
        nmb = triton_cdiv(nq, self.block_m)
        dummy = q.new_empty(1, dtype=torch.float32)
        carry = torch.full((b, nmb, nk), float("nan"), dtype=torch.float32, device=q.device)
        total = torch.full((b, nk), float("nan"), dtype=torch.float32, device=q.device)
        init = self.init_carry if self.init_carry is not None else dummy
        sel_dims = {key: value for key, value in dims.items() if key not in ("TQS", "TKS")}
        self.kernels._sel_carry[(triton_cdiv(nk, self.block_n), b)](
            q, k, self.qpos, self.kpos, self.key_mask if self.key_mask is not None else dummy, init, carry, total,
            prm, **sel_dims, NMB=nmb, scale=self.scale, SEL=self.sel, **meta, CAUSAL_SKIP=self.causal_skip,
            HAS_KMASK=self.key_mask is not None, HAS_INIT=self.init_carry is not None)
        self.carry = carry
        return total

    def forward(self, q, k, v, prm):
        """Returns (out, lse (B, H, NQ) float32, total F per key (B, NK) or None, logits or None)."""
        b, h, nq, _ = q.shape
        nk = k.shape[2]
        dims, meta = self._common(q, k), self._meta(q)
        nmb = triton_cdiv(nq, self.block_m)
        dummy = q.new_empty(1, dtype=torch.float32)
        kmask = self.key_mask if self.key_mask is not None else dummy
        has_acc = self.layout.selector is not None
        total = self.select(q, k, prm)
        carry = self.carry
        out = torch.full_like(q, float("nan"))  # every element must be written: a missed one stays NaN
        lse = self._stats(b, h, nq, q.device)
        logits = (torch.full((b, h, nq, nk), float("nan"), dtype=torch.float32, device=q.device)
                  if self.write_logits else dummy)
        bounds = self.bounds if self.bounds is not None else dummy
        self.kernels._fwd[(nmb, b * h)](
            q, k, v, out, lse, self.qpos, self.kpos, kmask, carry if has_acc else dummy, logits, prm, bounds,
            self.sink if self.sink is not None else dummy, *self._term_args(dummy),
            **dims, NMB=nmb, scale=self.scale, SEL=self.sel, **meta, CAUSAL_SKIP=self.causal_skip,
            HAS_KMASK=self.key_mask is not None, HAS_ACC=has_acc, WRITE_LOGITS=self.write_logits,
            HAS_BOUNDS=self.bounds is not None, HAS_SINK=self.sink is not None)
        return out, lse, total, (logits if self.write_logits else None)

    def backward(self, q, k, v, prm, out, lse, dout):
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        dims, meta = self._common(q, k), self._meta(q)
        nmb, nnb = triton_cdiv(nq, self.block_m), triton_cdiv(nk, self.block_n)
        n_params = len(self.layout.params)
        n_terms = len(self.layout.terms)
        npp = _pow2(max(1, n_params))
        dummy = q.new_empty(1, dtype=torch.float32)
        kmask = self.key_mask if self.key_mask is not None else dummy
        has_acc = self.layout.selector is not None
        carry = self.carry if has_acc else dummy
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        f32 = dict(dtype=torch.float32, device=q.device)
        dq = torch.full((b, h, nq, d), float("nan"), **f32)
        dk = torch.full((b, hkv, nk, d), float("nan"), **f32)
        dv = torch.full((b, hkv, nk, d), float("nan"), **f32)
        pg = torch.full((b, h, nnb, npp), float("nan"), **f32)
        dqt = torch.full((n_terms, b, h, nq), float("nan"), **f32) if n_terms else dummy
        dkt = torch.full((n_terms, b, h, nk), float("nan"), **f32) if n_terms else dummy
        flags = dict(CAUSAL_SKIP=self.causal_skip, HAS_KMASK=self.key_mask is not None)
        terms = dict(NT=n_terms, NTP=_pow2(max(1, n_terms)))
        bounds = self.bounds if self.bounds is not None else dummy
        kernels = self.backward_kernels()
        kernels._bwd_dkdv[(nnb, b * hkv)](
            q, k, v, dout, lse, delta, dk, dv, pg, self.qpos, self.kpos, kmask, carry, prm, bounds,
            *self._term_args(dummy), dkt, **dims, NMB=nmb, NNB=nnb, scale=self.scale, SEL=self.sel, **meta, NPP=npp,
            **terms, **flags, HAS_ACC=has_acc, HAS_BOUNDS=self.bounds is not None)
        kernels._bwd_dq[(nmb, b * h)](
            q, k, v, dout, lse, delta, dq, self.qpos, self.kpos, kmask, carry, prm, bounds, *self._term_args(dummy),
            dqt, **dims, NMB=nmb, scale=self.scale, SEL=self.sel, **meta, NPP=npp, **terms, **flags,
            HAS_ACC=has_acc, HAS_BOUNDS=self.bounds is not None)
        dprm = pg.sum(dim=(0, 2))[:, :n_params].t()  # (NP, H)
        if has_acc:
            sel, skvh = self.sel, self.sel // (h // hkv)
            for name in ("TQS", "TKS"):
                dims.pop(name)
            rcarry = torch.full((b, nmb, nk), float("nan"), **f32)
            dks = torch.full((b, nk, d), float("nan"), **f32)
            dqs = torch.full((b, nq, d), float("nan"), **f32)
            pgs = torch.full((b, nnb, npp), float("nan"), **f32)
            rtotal = torch.full((b, nk), float("nan"), **f32) if self.want_dcarry else dummy
            kernels._sel_bwd_dk[(nnb, b)](
                q, k, v, dout, lse, delta, dks, pgs, rcarry, rtotal, self.qpos, self.kpos, kmask, carry, prm,
                **dims, NMB=nmb, NNB=nnb, scale=self.scale, SEL=sel, **meta, NPP=npp, **flags,
                HAS_RTOTAL=self.want_dcarry)
            self.dcarry = -rtotal if self.want_dcarry else None
            kernels._sel_bwd_dq[(nmb, b)](
                q, k, v, dout, lse, delta, dqs, rcarry, self.qpos, self.kpos, kmask, carry, prm, **dims,
                NMB=nmb, scale=self.scale, SEL=sel, **meta, NPP=npp, **flags)
            dq[:, sel] += dqs
            dk[:, skvh] += dks
            if n_params:
                dprm = dprm.clone()
                dprm[:, sel] += pgs.sum(dim=(0, 1))[:n_params]
        dsink = None
        if self.sink is not None:  # d sink_h = -sum over rows of p_sink * delta, p_sink = exp(sink_h - lse)
            dsink = -(torch.exp(self.sink.view(1, -1, 1) - lse) * delta).sum(dim=(0, 2))
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), (dprm if n_params else None), dsink,
                (dqt, dkt) if n_terms else (None, None))

    def decode(self, q, k, v, prm):
        """One query per batch row (q (B, H, 1, D)) against the cache. Returns (out, lse, the selector's S row
        (B, NK) or None, logits or None)."""
        b, h, _, _ = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        dims, meta = self._common(q, k), self._meta(q)
        dims.pop("NQ")
        dims["TQS"] = b * h
        meta["BLOCK_M"] = max(16, _pow2(h // hkv))
        dummy = q.new_empty(1, dtype=torch.float32)
        has_acc = self.layout.selector is not None
        out = torch.full_like(q, float("nan"))
        lse = self._stats(b, h, 1, q.device)
        srow = torch.full((b, nk), float("nan"), dtype=torch.float32, device=q.device) if has_acc else None
        logits = (torch.full((b, h, 1, nk), float("nan"), dtype=torch.float32, device=q.device)
                  if self.write_logits else None)
        self.kernels._decode[(b * hkv,)](
            q, k, v, out, lse, self.qpos, self.kpos, self.init_carry if has_acc else dummy,
            srow if has_acc else dummy, logits if logits is not None else dummy, prm,
            self.sink if self.sink is not None else dummy, *self._term_args(dummy), **dims, scale=self.scale,
            SEL=self.sel, **meta, HAS_ACC=has_acc, WRITE_LOGITS=self.write_logits, HAS_SINK=self.sink is not None)
        return out, lse, srow, logits


#: largest shared memory per block, by CUDA compute capability (bytes, opt-in maximum)
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def gpu_blocks(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """Query and key block sizes on a GPU, a fixed table reasoned from shared memory, on every architecture: 64×64
    while a row of the head fits 256 bytes (bf16/fp16 up to D = 128: at most 100,096 B with the accumulator, under
    every limit in :data:`SHARED_MEMORY_LIMIT`), else 32×32. Float32 at D = 128 and 64×64 needs up to 329,472 B
    (measured with ``attnzoo build --compile-for 90``, the accumulator's backward): more than even sm_90's
    232,448 B. A table chosen by measured speed waits for a GPU (benchmarks/gpu_check.py)."""
    return (64, 64) if torch.finfo(dtype).bits // 8 * max(16, _pow2(head_dim)) <= 256 else (32, 32)


def gpu_options(dtype: torch.dtype) -> dict:
    options = dict(num_warps=4, num_stages=2)
    if dtype == torch.float32:
        options["default_dot_input_precision"] = "ieee"  # float32 means float32 (Triton's default is TF32)
    return options


def _window_bounds(plan, positions: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor | None:
    """For increasing positions shared by queries and keys (the batch form): the first key index each query block
    can see under every mask (``Plan.earliest_key``, rounded down to a key block) and, per key block, the end of
    the query blocks that see it. None when no mask bounds the keys."""
    if plan.composition.earliest_key(1) is None:  # no mask bounds the keys (the bound is a property of the masks)
        return None
    n = positions.shape[1]
    nmb, nnb = triton_cdiv(n, block_m), triton_cdiv(n, block_n)
    firsts = positions.min(dim=0).values[::block_m].tolist()  # smallest position of each query block
    earliest = [plan.composition.earliest_key(int(p)) for p in firsts]
    if any(e is None for e in earliest):
        return None
    want = torch.tensor(earliest, device=positions.device).expand(positions.shape[0], nmb).contiguous()
    lo = torch.searchsorted(positions.contiguous(), want).min(dim=0).values  # keys before: hidden in every row
    lo = torch.div(lo, block_n, rounding_mode="floor") * block_n
    if not bool((lo > 0).any()):
        return None
    m_end = torch.searchsorted(lo, torch.arange(nnb, device=lo.device) * block_n, right=True)
    return torch.cat([lo, m_end]).to(torch.int32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Attention(torch.autograd.Function):
    """The generated forward and backward kernels as one autograd node over the scaled q, k, v and the packed
    per-head logits parameters."""

    @staticmethod
    def forward(ctx, run: _Run, q, k, v, prm, sink, qt, kt):
        run.sink = sink.detach() if sink is not None else None
        run.qt = qt.detach().contiguous() if qt is not None else None
        run.kt = kt.detach().contiguous() if kt is not None else None
        out, lse, _, _ = run.forward(q, k, v, prm)
        ctx.run = run
        ctx.save_for_backward(q, k, v, prm, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, prm, out, lse = ctx.saved_tensors
        dq, dk, dv, dprm, dsink, (dqt, dkt) = ctx.run.backward(q, k, v, prm, out, lse, dout)
        return None, dq, dk, dv, dprm, dsink, dqt, dkt


class TritonBackend(Backend):
    name = "triton"
    summary = "kernels generated from the spec: forward, backward, decode, fused selective accumulator"
    deterministic = True

    def __init__(self, root=None) -> None:
        self.root = root  # artifact cache directory (None: build.cache_dir())
        self._kernels: dict[tuple[str, bool, str], object] = {}
        self._aot: tuple[int, object] | None = None  # (arch, recorder factory) while aot.capture records launches
        self._installed: set[tuple[str, int]] = set()  # (spec hash, arch) whose build-time kernels are installed

    @property
    def priority(self) -> int:  # type: ignore[override]
        # Priorities come from measurements, and no GPU has measured these kernels yet: below blocked (whose GPU
        # path for vanilla and SSA is SDPA's flash kernel) until benchmarks/gpu_check.py has run; above flex. In
        # the interpreter (the CPU checking mode) below everything.
        return -1 if interpreting() else 8

    modes = frozenset(Mode)
    #: the decode step hands the row maps float32 rows for half-precision inputs, as the batch form does
    admit_widen = True
    #: the decode kernels have no backward: the decode step refuses a step with gradients before the cache changes
    decodes_with_gradients = False

    def supports(self, plan, device, dtype, mode):
        if triton_version() is None:
            return ["triton is not installed (pip install 'attnzoo[triton]')"]
        reasons = []
        if device.type == "cpu" and not interpreting():
            reasons.append("on CPU the Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1, "
                           "a checking mode)")
        elif device.type not in ("cpu", "cuda"):
            reasons.append(f"device '{device.type}': the Triton kernels run on CUDA GPUs")
        if dtype == torch.float64:
            reasons.append("float64: the kernels accumulate in float32")
        elif dtype == torch.bfloat16 and interpreting():
            reasons.append("bfloat16: Triton's interpreter computes bfloat16 wrongly")
        elif dtype not in (torch.float32, torch.float16, torch.bfloat16):
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')}: the kernels take float32, float16 or bfloat16")
        return reasons + codegen.problems(plan)

    # -- plumbing -------------------------------------------------------------------------------------------------
    def kernels(self, plan, part: str = "forward"):
        memo = (plan.spec.hash, interpreting(), part)
        if memo not in self._kernels:
            self._kernels[memo] = load_kernels(plan.spec, root=self.root, plan=plan, part=part)
        if self._aot is not None:
            return self._aot[1](self._kernels[memo], part)
        return self._kernels[memo]

    @contextmanager
    def aot_target(self, arch: int, recorder):
        """Within the block, launches are made as on an sm_``arch`` GPU (its block sizes and options) but on the
        kernels ``recorder(module, part)`` returns (:func:`aot.capture`)."""
        if interpreting():
            raise ValueError("compiling for a GPU needs a process without TRITON_INTERPRET=1")
        self._aot = (arch, recorder)
        try:
            yield
        finally:
            self._aot = None

    def _on_gpu(self, q) -> bool:
        return self._aot is not None or (q.device.type == "cuda" and not interpreting())

    def _blocks(self, q) -> tuple[int, int]:
        if not self._on_gpu(q):
            return 32, 32
        return gpu_blocks(q.dtype, q.shape[-1])

    def _install_compiled(self, plan, q) -> None:
        """Before the first launch of ``plan``'s kernels on this GPU's architecture: make the kernels compiled
        at build time visible to Triton (:func:`aot.install`), so it loads rather than compiles them."""
        from . import aot

        aot.CALL.case = (q.dtype, q.shape[-1])
        major, minor = torch.cuda.get_device_capability(q.device)
        arch = major * 10 + minor
        if (plan.spec.hash, arch) in self._installed:
            return
        artifact = build(plan.spec, root=self.root, plan=plan)
        modules = [kernel_module_name(artifact.key, part, False) for part in SOURCES]
        aot.install(artifact.directory, arch, modules, plan.spec.name)
        self._installed.add((plan.spec.hash, arch))

    def packed_params(self, plan, params, heads: int, like: torch.Tensor) -> torch.Tensor:
        """The spec's per-head parameters as the kernels read them: (P, heads) float32 in the layout's order
        (``codegen.layout(plan).params``); a (1, heads) zero block where the spec has none. Context parallel's
        kernel pairs (``attnzoo/distributed/kernel_pairs.py``) pack them once per call."""
        keys = codegen.layout(plan).params
        if not keys:
            return torch.zeros((1, heads), dtype=torch.float32, device=like.device)
        rows = [params[key.split(".", 1)[0]][key.split(".", 1)[1]] for key in keys]
        return torch.stack(rows).to(torch.float32).contiguous()

    @staticmethod
    def _sink(plan, params, heads: int, like: torch.Tensor) -> torch.Tensor | None:
        """The normaliser's sink logits (H,) in float32 (autograd reaches its parameters), or None."""
        index = torch.arange(heads, device=like.device).view(1, -1, 1, 1)
        sink = plan.composition.sink(index, params, like.float())
        return None if sink is None else sink.reshape(heads).contiguous()

    @staticmethod
    def _terms(plan, params, qpos, kpos, dims, key_mask, query_features, key_features):
        """The per-token terms (QT (NT, B, H, NQ), KT (NT, B, H, NK), float32, with autograd) of the logits
        transforms the kernels add as host-computed terms (``codegen.host_termed``), or (None, None)."""
        kinds = codegen.layout(plan).terms
        if not kinds:
            return None, None
        b, nq, nk = qpos.shape[0], qpos.shape[1], kpos.shape[-1]
        ctx = plan.composition.context(qpos, kpos, dims, key_mask, query_features, key_features)
        rows, cols = [], []
        for t in plan.many(Slot.LOGITS):
            if t.kind in kinds:
                row, col = t.separable(ctx, params[t.kind], torch.float32)
                rows.append(row.float().expand(b, dims.num_heads, nq, 1)[..., 0])
                cols.append(col.float().expand(b, dims.num_heads, 1, nk)[:, :, 0])
        return torch.stack(rows).contiguous(), torch.stack(cols).contiguous()

    def _launch_options(self, q) -> dict:
        if not self._on_gpu(q):
            return {}
        return gpu_options(q.dtype)

    # -- ahead of time -------------------------------------------------------------------------------------------
    def compile_for(self, plan, arch: int, dtype: torch.dtype, head_dim: int = 128, registry=None) -> list[dict]:
        """Compile ``plan``'s kernels for CUDA compute capability ``arch`` (e.g. 90) as a GPU run of ``dtype`` and
        ``head_dim`` launches them (:mod:`aot`), into the spec's artifact, where the runtime loads them without
        compiling. Triton's GPU lowering down to a cubin (its bundled ptxas), no GPU needed. One row per compiled
        kernel variant: kernel, variant, cases, hash, shared memory in bytes, the architecture's limit, seconds,
        and an error or None."""
        from . import aot

        if interpreting():
            # Triton defines its own library functions for the interpreter when it is imported in that mode
            raise ValueError("compiling for a GPU needs a process without TRITON_INTERPRET=1")
        artifact = build(plan.spec, root=self.root, plan=plan)
        return aot.compile_for(self, plan, artifact.directory, arch, dtype, head_dim,
                               SHARED_MEMORY_LIMIT.get(arch), registry)

    def prepare_run(self, plan, q, qpos, kpos, key_mask, init_carry, causal_skip, write_logits=False) -> _Run:
        """One kernel launch's settings (kernels, layout, positions, key mask, incoming carry, block sizes, key
        skipping bounds), for the batch and cache forms here and for context parallel's kernel pairs."""
        if self._aot is None and q.device.type == "cuda" and not interpreting():
            self._install_compiled(plan, q)
        bm, bn = self._blocks(q)
        bounds = _window_bounds(plan, qpos, bm, bn) if causal_skip else None
        return _Run(self.kernels(plan), lambda: self.kernels(plan, "backward"), codegen.layout(plan),
                    qpos.contiguous(), kpos.contiguous(),
                    key_mask.to(torch.int8).contiguous() if key_mask is not None else None,
                    init_carry.float().contiguous() if init_carry is not None else None,
                    causal_skip, plan.logit_scale(q.shape[-1]), bm, bn, write_logits, self._launch_options(q),
                    bounds)

    # -- batch form ---------------------------------------------------------------------------------------------
    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        pos = positions.unsqueeze(1)
        qs = plan.composition.row_scale(Slot.QUERY, q, pos, params, widen=True).contiguous()
        ks = plan.composition.row_scale(Slot.KEY, k, pos, params, widen=True).contiguous()
        vs = plan.composition.row_scale(Slot.VALUE, v, pos, params, widen=True).contiguous()
        causal_skip = plan.causal and _increasing(positions)
        features = plan.composition.token_features(qs, ks, vs, positions, key_mask, params)
        qt, kt = self._terms(plan, params, positions, pos, Dims(q.shape[1], q.shape[3], k.shape[1]), key_mask,
                             features, features)
        prm, sink = self.packed_params(plan, params, q.shape[1], q), self._sink(plan, params, q.shape[1], q)
        softmax_map = codegen.layout(plan).probability == "softmax"
        kr, read, _ = softmax_map_rows(plan, ks, vs, None, q.shape[1], params) if softmax_map else (ks, vs, None)
        # the kernels weigh every value of a block, a masked pair's by 0 (0 × NaN is NaN): non-finite values go in
        # as 0, and the outputs an allowed pair brings them to are marked after (core.numerics.mark_reached)
        finite = all_finite(read)
        rows = read if finite else torch.where(torch.isfinite(read), read, torch.zeros((), dtype=read.dtype,
                                                                                         device=read.device))
        if softmax_map:  # the softmax kernels over each slice of values(v)
            kr = kr.contiguous()
            outs = [_Attention.apply(self.prepare_run(plan, q, positions, pos, key_mask, None, causal_skip),
                                     qs, kr, piece, prm, sink, qt, kt) for piece in value_slices(rows, q.shape[-1])]
            out = joined(outs, read.shape[-1])
        else:
            out = _Attention.apply(self.prepare_run(plan, q, positions, pos, key_mask, None, causal_skip), qs, ks,
                                   rows.contiguous(), prm, sink, qt, kt)
        if not finite:
            dims = Dims(q.shape[1], q.shape[3], k.shape[1])
            out = mark_reached(out, read, _allowed_blocks(plan, positions, dims, key_mask, features))
        if softmax_map:
            out = softmax_map_combine(plan, out, qs.shape, params)
        out = plan.composition.row_scale(Slot.OUTPUT, out, pos, params, widen=True)
        if not return_accumulated:
            return out
        return out, _accumulated_matrix(plan, qs, ks, positions, key_mask, params)

    # -- decoding -------------------------------------------------------------------------------------------------
    def attend_held(self, plan, step, cache, params, *, want_probs=False):
        qs, qpos, query_features = step
        q = qs  # the launch settings read its shape, dtype and device: the query slot keeps them
        count = q.shape[2]
        qs = qs.contiguous()
        ks, vs, mask = cache.keys.contiguous(), cache.values.contiguous(), cache.key_mask()
        want_probs = want_probs is not False  # every row's (the step packs what the evictor reads)
        mapped = plan.one(Slot.PROBABILITY)
        if want_probs and mapped is not None:  # spec validation refuses this pair; never hand weights as probabilities
            raise ValueError(f"transform '{mapped.kind}' (probability) has no attention probabilities to hand to an "
                             "evictor")
        carry = cache.accumulated()
        kpos, pieces = cache.positions, [vs]
        sink = self._sink(plan, params, q.shape[1], q)
        qt, kt = self._terms(plan, params, qpos, cache.positions, Dims(q.shape[1], q.shape[3], ks.shape[1]), mask,
                             query_features, cache.key_features())
        prm = self.packed_params(plan, params, q.shape[1], q)
        with torch.no_grad():
            softmax_map = codegen.layout(plan).probability == "softmax"
            if softmax_map:  # the softmax kernels over each slice of values(v)
                ks, read, kpos = softmax_map_rows(plan, ks, vs, kpos, q.shape[1], params)
                ks, pieces = ks.contiguous(), value_slices(read, vs.shape[-1])
            outs = []
            for piece in pieces:
                run = self.prepare_run(plan, q, qpos, kpos, mask, carry, False, want_probs)
                run.sink, run.qt, run.kt = sink, qt, kt
                if count == 1 and mask is None:  # the decode kernel has no key mask: padding goes the general way
                    out, lse, srow, logits = run.decode(qs, ks, piece, prm)
                    total = carry.float() + srow if srow is not None else None
                else:
                    out, lse, total, logits = run.forward(qs, ks, piece, prm)
                outs.append(out)
            out = softmax_map_combine(plan, joined(outs, read.shape[-1]), qs.shape, params) if softmax_map else outs[0]
        # F and the evictor's probabilities stay in float32: the cache keeps running sums in at least float32
        # (numerics contract), rounding them to a half-precision q every step would lose the small increments
        probs = torch.exp(logits - lse[..., None]) if want_probs else None
        return HeldAttention(out, total, probs)


def _allowed_blocks(plan, positions, dims, key_mask, features, block: int = 256):
    """(queries, allowed pairs (B, 1 or H, Bq, N)) by blocks of ``block`` queries, for :func:`mark_reached`."""
    kpos = positions.unsqueeze(1)
    for start in range(0, positions.shape[1], block):
        queries = slice(start, start + block)
        ctx = plan.composition.context(positions[:, queries], kpos, dims, key_mask,
                                       {n: f[:, :, queries] for n, f in features.items()}, features)
        yield queries, plan.composition.allowed(ctx, key_mask)


def _accumulated_matrix(plan, qs, ks, positions, key_mask, params):
    """F (B, N, N) for ``return_accumulated``: an N×N output by definition, computed with the transforms' torch
    maths on the selector head alone (autograd flows through it into the selector's q and k)."""
    acc = plan.one(Slot.ACCUMULATOR)
    if acc is None:
        return None
    b, h, n, d = qs.shape
    dims = Dims(h, d, ks.shape[1])
    ctx = plan.composition.context(positions, positions.unsqueeze(1), dims, key_mask)
    wide = accumulator_dtype(qs.dtype)  # F is accumulated state: float32 or wider (numerics contract)
    wide_params = {kind: {name: p.to(wide) for name, p in group.items()} for kind, group in params.items()}
    allowed = plan.composition.allowed(ctx, key_mask)
    selection = plan.composition.selection(acc, qs.to(wide), ks.to(wide), allowed, ctx, wide_params,
                                           plan.logit_scale(d))
    return f_from_s(selection)[:, 0]

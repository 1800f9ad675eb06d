"""compile(), the Variant it returns, the one-shot attention() and explain(): choosing a backend per case."""

from __future__ import annotations

from typing import Any

import torch

from .core.contract import Mode, batch_mode
from .core.numerics import accumulator_dtype
from .decode.create import UNSET, new_cache
from .decode.step import extend
from .decode.storage import KVCache
from .errors import UnsupportedError
from .inputs import check_key_mask, check_positions, check_qkv
from .packing import as_documents, document_positions, run_packed
from .plan import Plan
from .registry import get_registry
from .spec import load_spec
from .transforms.base import Dims, Slot

_UNSET: Any = object()


class NotFloatingError(UnsupportedError, ValueError):
    """The UnsupportedError of q, k, v that are not floating point (integers, bool, complex): also a ValueError,
    which the input checks raised for them before the backends were asked."""


def _case(device, dtype) -> tuple[torch.device, torch.dtype]:
    return torch.device(device if device is not None else "cpu"), dtype if dtype is not None else torch.float32


def verdicts(plan: Plan, registry, device, dtype, mode: Mode) -> dict[str, list[str]]:
    """Every backend's reasons for not running the case in ``mode`` (empty list: it can), best priority first."""
    ordered = sorted(registry.backends.values(), key=lambda b: (-b.priority, b.name))
    return {b.name: verdict(b, plan, device, dtype, mode) for b in ordered}


def verdict(backend, plan: Plan, device, dtype, mode: Mode) -> list[str]:
    """One backend's reasons (:meth:`Backend.verdict`). q, k and v are floating point (``check_qkv``): a backend
    that accepts another dtype (integers, bool, complex: a plugin's ``supports`` that never looked at the dtype)
    is declined here with that reason, so that explain says what a call raises."""
    reasons = backend.verdict(plan, device, dtype, mode)
    if not reasons and not dtype.is_floating_point:
        reasons = [f"dtype {str(dtype).removeprefix('torch.')} is not a floating-point dtype: q, k and v must be "
                   f"floating point"]
    return reasons


class Variant:
    """A spec bound to a backend choice. Call it like an attention function; decode with a cache."""

    def __init__(self, spec, backend: str = "auto", registry=None) -> None:
        self.registry = registry or get_registry()
        self.spec = load_spec(spec, registry=self.registry)
        self.plan = Plan.from_spec(self.spec, self.registry)
        if backend != "auto" and backend not in self.registry.backends:
            known = ", ".join(sorted(self.registry.backends))
            raise ValueError(f"unknown backend '{backend}' (registered: {known})")
        self.backend_name = backend
        self._chosen: dict[tuple, Any] = {}
        self._initial: dict[tuple, dict[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"Variant(spec='{self.spec.name}', backend='{self.backend_name}')"

    # -- backend choice -----------------------------------------------------------------------------------------
    def backend_for(self, device, dtype, mode: Mode | str | bool):
        """The backend that runs this case in ``mode`` (a :class:`Mode`, or a bool: gradients wanted in the batch
        form); raises UnsupportedError with every backend's reasons."""
        device, dtype = _case(device, dtype)
        mode = batch_mode(mode) if isinstance(mode, bool) else Mode(mode)
        key = (device.type, dtype, mode)
        if key not in self._chosen:
            reasons = verdicts(self.plan, self.registry, device, dtype, mode)
            if self.backend_name != "auto":
                reasons = {self.backend_name: reasons[self.backend_name]}
            chosen = next((name for name, why in reasons.items() if not why), None)
            if chosen is None:
                error = UnsupportedError if dtype.is_floating_point else NotFloatingError
                raise error(self.spec.name, reasons, mode=str(mode))
            self._chosen[key] = self.registry.backends[chosen]
        return self._chosen[key]

    # -- parameters ---------------------------------------------------------------------------------------------
    def init_params(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                    dtype: torch.dtype = torch.float32, device=None) -> dict[str, torch.Tensor]:
        """The transforms' learnable parameters at their initial values, keyed ``"<kind>.<name>"``."""
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or head_dim < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"need num_heads % num_kv_heads == 0 and positive sizes, got "
                             f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
        return self.plan.init_params(Dims(num_heads, head_dim, num_kv_heads), dtype=dtype, device=device)

    def parameter_names(self) -> list[str]:
        return list(self.plan.param_specs())

    # -- batch form ---------------------------------------------------------------------------------------------
    def __call__(self, q, k, v, params=None, positions=None, key_mask=None, return_accumulated: bool = False,
                 inputs=None, documents=None):
        """Attention over the whole sequence.

        q (B, H, N, D); k, v (B, H_kv, N, D) with H % H_kv == 0; params as from :meth:`init_params` (None: the
        initial values); positions (N,) or (B, N) 1-based (default 1..N); key_mask (B, N) bool, True where a key
        may be attended (padding: the positions given for padding tokens are ignored, see
        ``check_positions``). Returns (B, H, N, D); with ``return_accumulated`` also the accumulated F
        (B, N, N), or None for a spec without an accumulator.
        ``inputs``: the per-token inputs the transforms declare (``Transform.token_inputs``), ``{"<kind>.<name>":
        (B, H, N)}``, e.g. the forgetting gate's logits from the layer input (``source: input``).
        ``documents``: packed input, several documents per row (``cu_seqlens``, (B, N) document ids, a list of
        lengths or an xformers ``BlockDiagonal(Causal)Mask``; docs/packing.md): each document is attended alone,
        positions restart at 1 in each (given ``positions`` must increase within each document), padding tokens
        (in no document) output 0.
        """
        self._case_first(q, batch_mode(_grad_given(q, k, v, params, inputs)))
        if documents is not None:
            return self._packed(q, k, v, params, positions, key_mask, return_accumulated, inputs, documents)
        pos, mask, grouped = self._batch_inputs(q, k, v, params, positions, key_mask, inputs)
        backend = self.backend_for(q.device, q.dtype, batch_mode(_needs_grad(q, k, v, grouped)))
        return backend.forward(self.plan, q, k, v, grouped, pos, mask, return_accumulated=return_accumulated)

    def _case_first(self, q, mode: Mode) -> None:
        """Choose the backend for q's device and dtype before the inputs are checked or the parameters made: a
        dtype no backend takes (integers, complex, float8; ``explain`` lists each backend's reason) raises
        UnsupportedError with those reasons, never an error from inside torch. (Cached: the call's own
        ``backend_for`` then finds the same choice.)"""
        if isinstance(q, torch.Tensor):
            self.backend_for(q.device, q.dtype, mode)

    def _batch_inputs(self, q, k, v, params, positions, key_mask, inputs):
        """The batch form's checked positions (B, N), key mask and per-transform parameters and inputs."""
        dims = check_qkv(q, k, v)
        b, _, n, _ = q.shape
        mask = check_key_mask(key_mask, b, n, q.device)
        pos = check_positions(positions, b, n, q.device, mask)
        self.plan.check_dims(dims)
        grouped = self.plan.add_inputs(self.plan.split_params(params, dims, q), inputs, b, q.shape[1], n, q)
        return pos, mask, grouped

    def probabilities(self, q, k, v, params=None, positions=None, key_mask=None, inputs=None) -> torch.Tensor:
        """The attention probabilities (B, H, N, N) of the batch form, materialised by the reference backend (for
        inspection, such as transformers' ``output_attentions``; it costs the N x N the fast backends avoid); with a
        probability transform, its weights (``ProbabilityTransform.weights``: for ``diff``, each head's own softmax,
        before the pairs are combined). Arguments as in ``__call__``."""
        if isinstance(q, torch.Tensor):
            reference = self.registry.backends["reference"]
            why = verdict(reference, self.plan, q.device, q.dtype, Mode.FORWARD)
            if why:
                raise UnsupportedError(self.spec.name, {"reference": why}, mode="probabilities")
        pos, mask, grouped = self._batch_inputs(q, k, v, params, positions, key_mask, inputs)
        _, probs, _, _ = self.registry.backends["reference"].attend(self.plan, q, k, v, pos, pos.unsqueeze(1),
                                                                    grouped, mask)
        return probs

    def _packed(self, q, k, v, params, positions, key_mask, return_accumulated, inputs, documents):
        dims = check_qkv(q, k, v)
        b, h, n, _ = q.shape
        if key_mask is not None:
            raise ValueError("documents and key_mask together: mark padding tokens as document id -1 (or leave "
                             "them after the last cu_seqlens offset) instead")
        docs = as_documents(documents, b, n, q.device, self.plan.causal)
        pos = document_positions(docs, positions, q.device)
        self.plan.check_dims(dims)
        grouped = self.plan.add_inputs(self.plan.split_params(params, dims, q), inputs, b, h, n, q)
        backend = self.backend_for(q.device, q.dtype, batch_mode(_needs_grad(q, k, v, grouped)))

        def forward(qg, kg, vg, pg, posg, want):
            return backend.forward(self.plan, qg, kg, vg, pg, posg, None, return_accumulated=want)

        token_inputs = [(t.kind, declared.name) for t, declared in self.plan.token_inputs().values()]
        f_dtype = accumulator_dtype(q.dtype) if self.plan.one(Slot.ACCUMULATOR) is not None else None
        return run_packed(forward, q, k, v, grouped, pos, docs, token_inputs, return_accumulated, f_dtype=f_dtype)

    # -- decoding -------------------------------------------------------------------------------------------------
    def new_cache(self, batch: int, budget: int | None = UNSET) -> KVCache:
        """A decode-time KV cache with the spec's evictor. ``budget`` defaults to the spec's ``cache.budget``;
        None never evicts (:func:`attnzoo.decode.create.new_cache`)."""
        return new_cache(self.plan, batch, budget)

    def initial_params_for(self, dims: Dims, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The initial parameter values for ``dims`` in ``like``'s dtype and device, made once per case (a decode
        step without ``params`` uses them)."""
        key = (dims, like.dtype, like.device)
        if key not in self._initial:
            self._initial[key] = self.plan.init_params(dims, dtype=like.dtype, device=like.device)
        return self._initial[key]

    def decode(self, q_t, k_t, v_t, cache: KVCache, params=None, key_mask=None, inputs=None):
        """One new token: q_t (B, H, 1, D), k_t and v_t (B, H_kv, 1, D). Appends to ``cache``, evicts when over
        budget, returns the output (B, H, 1, D). Positions come from the cache; ``key_mask`` (B, 1) bool marks
        padding (False) as in :meth:`prefill`; ``inputs``: the new token's per-token inputs (B, H, 1) by name."""
        if q_t.dim() == 4 and q_t.shape[2] != 1:
            raise ValueError(f"decode takes one token (N = 1), got q of shape {tuple(q_t.shape)}; use prefill")
        return extend(self, q_t, k_t, v_t, cache, params, key_mask, True, inputs)  # attnzoo/decode/step.py

    def prefill(self, q, k, v, cache: KVCache, params=None, key_mask=None, inputs=None, documents=None):
        """Several new tokens at once (B, H, T, D): they attend over the cache and each other, then the cache
        is evicted down to its budget. With no eviction this equals T calls of :meth:`decode`.

        ``key_mask`` (B, T) bool, False for padding (a left-padded batch): positions are per row, the first real
        token of each row is position 1 (the protected BOS), padding tokens are never attended and are evicted
        first (docs/decoding.md). ``inputs``: the new tokens' per-token inputs (B, H, T) by name.

        ``documents``: a packed prefill (docs/packing.md): the prompts of several requests packed in the rows of
        q, k, v, one cache row per document (``new_cache(batch=number of documents)``, empty), each filled as if
        prefilled alone (positions from 1, its own budget); returns the packed outputs, and decoding goes on with
        one batch row per document."""
        if documents is not None:
            return self._packed_prefill(q, k, v, cache, params, key_mask, inputs, documents)
        return extend(self, q, k, v, cache, params, key_mask, False, inputs)

    def _packed_prefill(self, q, k, v, cache, params, key_mask, inputs, documents):
        self._case_first(q, Mode.DECODE)
        check_qkv(q, k, v)
        b, h, n, d = q.shape
        if key_mask is not None:
            raise ValueError("documents and key_mask together: mark padding tokens as document id -1 instead")
        docs = as_documents(documents, b, n, q.device, self.plan.causal)
        count = len(docs.segments)
        if not isinstance(cache, KVCache) or cache.batch != count or cache.num_tokens:
            got = f"batch {cache.batch} holding {cache.num_tokens} tokens" if isinstance(cache, KVCache) else \
                type(cache).__name__
            raise ValueError(f"a packed prefill fills one row of an empty cache per document: make it with "
                             f"new_cache(batch={count}), got {got}")
        # the documents as a left-padded batch (the cache keeps per-row positions; padding is never attended and
        # is evicted first), then the outputs back into the packed layout
        width = max(docs.lengths())
        mask = torch.zeros(count, width, dtype=torch.bool, device=q.device)

        qp, kp, vp = (_left_pad(t, docs.segments, width) for t in (q, k, v))
        for i, (_, start, stop) in enumerate(docs.segments):
            mask[i, width - (stop - start):] = True
        token_inputs = None
        if inputs:
            token_inputs = {key: _left_pad(t.unsqueeze(-1), docs.segments, width).squeeze(-1)
                            for key, t in inputs.items()}
        out_padded = extend(self, qp, kp, vp, cache, params, mask, False, token_inputs)
        out = q.new_zeros(b, h, n, d)
        for i, (row, start, stop) in enumerate(docs.segments):
            out[row, :, start:stop] = out_padded[i, :, width - (stop - start):]
        return out


def _grad_given(q, k, v, params, inputs) -> bool:
    """Whether a gradient is wanted of q, k, v, a given parameter or a per-token input (as ``_needs_grad`` finds
    once they are checked and grouped: the initial parameters need none)."""
    tensors = [q, k, v]
    for given in (params, inputs):
        if hasattr(given, "values"):
            tensors += list(given.values())
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _needs_grad(q, k, v, grouped) -> bool:
    tensors = [q, k, v, *(p for group in grouped.values() for p in group.values())]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def compile(spec, backend: str = "auto", registry=None) -> Variant:  # noqa: A001 - the public name
    """Bind a spec (path, registered name, mapping or Spec) to a backend (``"auto"`` picks per call).

    A named backend that cannot run the spec at all (on CPU, float32, forward) raises UnsupportedError now.
    """
    variant = Variant(spec, backend, registry)
    if backend != "auto":
        variant.backend_for("cpu", torch.float32, Mode.FORWARD)
    return variant


_compiled: dict[tuple[str, str, int], Variant] = {}


def attention(q, k, v, spec, params=None, backend: str = "auto", positions=None, key_mask=None):
    """One-shot functional form of ``compile(spec, backend)(q, k, v, ...)`` (compiled variants are reused)."""
    registry = get_registry()
    loaded = load_spec(spec, registry=registry)
    key = (loaded.hash, backend, id(registry))
    if key not in _compiled:
        _compiled[key] = compile(loaded, backend, registry)
    return _compiled[key](q, k, v, params=params, positions=positions, key_mask=key_mask)


def explain(spec, device="cpu", dtype=torch.float32, requires_grad: bool = False, registry=None,
            mode: Mode | str | None = None) -> str:
    """Every backend's verdict on a case, one line each, and which one ``auto`` picks.

    ``mode``: ``"forward"``, ``"backward"`` (forward and backward) or ``"decode"`` (decode and prefill with a
    cache); default: backward when ``requires_grad``, else forward. The verdicts are those a call gets, for any
    dtype torch has: one that every backend declines (integers, complex, float8) raises UnsupportedError with
    these reasons before torch computes anything (tests/backends/test_dtypes.py)."""
    registry = registry or get_registry()
    loaded = load_spec(spec, registry=registry)
    plan = Plan.from_spec(loaded, registry)
    dev, dt = _case(device, dtype)
    mode = batch_mode(requires_grad) if mode is None else Mode(mode)
    result = verdicts(plan, registry, dev, dt, mode)
    what = {Mode.FORWARD: "forward", Mode.BACKWARD: "forward+backward", Mode.DECODE: "decode"}[mode]
    lines = [f"spec '{loaded.name}' ({loaded.hash[:12]}) on {dev.type}, {str(dt).removeprefix('torch.')}, "
             f"{what}:"]
    for name, why in result.items():
        priority = registry.backends[name].priority
        lines.append(f"  {name:<10} yes (priority {priority})" if not why else f"  {name:<10} no: {'; '.join(why)}")
    chosen = next((name for name, why in result.items() if not why), None)
    lines.append(f"  auto -> {chosen}" if chosen else "  auto -> none can run this case")
    if mode == Mode.DECODE and dev.type == "cpu" and not result.get("blocked", ["absent"]):
        from .decode import fused_build  # compiles the fused steps (once per process) to say whether they run

        lines.append(f"  blocked's decode steps at a budget: {fused_build.status()}")
    return "\n".join(lines)


def _left_pad(t: torch.Tensor, segments, width: int) -> torch.Tensor:
    """The documents ``segments`` of t (B, X, N, D) as rows of a left-padded (len(segments), X, width, D)."""
    out = t.new_zeros(len(segments), t.shape[1], width, t.shape[3])
    for i, (row, start, stop) in enumerate(segments):
        out[i, :, width - (stop - start):] = t[row, :, start:stop]
    return out

"""The checks every backend (and every plugin's transforms) is held to. Each raises AssertionError with one line
on failure and :class:`Unsupported` when a check does not apply or the backend declines the case (with its reason).

What a green run proves, and what it cannot, is written in docs/conformance.md.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import Mode, batch_mode
from ..dispatch import Variant
from ..inputs import check_positions, check_qkv
from ..transforms.base import Dims, Slot
from . import eviction
from .tolerance import check_close
from .trace import culprit
from .vectors import VectorCase, inputs_of, load, make_inputs, params_of, run_batch, run_case

HALF = (torch.float16, torch.bfloat16)
#: First position of the offset shapes: past float16's largest finite value (65,504).
OFFSET = 69_990


class Unsupported(Exception):
    """The check does not apply to this spec, or the backend declined the case; the message says why."""


class Declined(Unsupported):
    """The backend declined the case. ``spec_level``: it declines the spec itself (forward, float32, on the
    target's device), not just this dtype or mode: when the user named the backend, that counts as a failure."""

    def __init__(self, message: str, spec_level: bool) -> None:
        super().__init__(message)
        self.spec_level = spec_level


@dataclass(frozen=True)
class Shape:
    id: str
    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    masked_rows: bool = False
    offset: bool = False  # positions from OFFSET on, with gaps that grow and differ per batch row


DIFFERENTIAL_SHAPES = (
    Shape("n1", 1, 2, 1, 1, 8),
    Shape("gqa-n63", 2, 4, 2, 63, 8),
    Shape("n127", 1, 2, 2, 127, 16),
    Shape("masked-rows-n33", 2, 2, 1, 33, 8, masked_rows=True),
    Shape("offset-gaps-n45", 2, 4, 2, 45, 8, masked_rows=True, offset=True),  # and a row with no key
    # GQA over several blocks of every backend (blocked 256 queries, flex 128, triton <= 64)
    Shape("gqa-n1030", 1, 2, 1, 1030, 8),
)
#: The shapes checked in float16 and bfloat16: one that has GQA, a masked row and positions past float16's range
#: (each shape costs a compilation per dtype in the compiling backends, so the default run stays short).
HALF_SHAPES = ("offset-gaps-n45",)
#: The shapes of the quick profile (``attnzoo conformance --quick``): N = 1 (a row of one key), an odd size with GQA
#: and a masked row, and GQA with a masked row and offset positions, all small; every other check runs as in the
#: full profile. Not the N = 1,030 shape, which takes minutes in Triton's interpreter.
QUICK_SHAPES = ("n1", "masked-rows-n33", "offset-gaps-n45")
#: The profiles: the differential shapes each one checks (float16 and bfloat16 keep to :data:`HALF_SHAPES`).
PROFILES = {"full": tuple(s.id for s in DIFFERENTIAL_SHAPES), "quick": QUICK_SHAPES}


@dataclass
class Target:
    """What a check runs: a spec on a backend in a dtype on a device, and the reference to compare with.

    The reference (the truth in float64, and the reference in the tested dtype) always runs on CPU."""

    spec: Any
    backend: str
    dtype: torch.dtype
    registry: Any
    seed: int = 0
    device: str = "cpu"

    def variant(self, backend: str | None = None) -> Variant:
        return Variant(self.spec, backend or self.backend, self.registry)

    def reference(self) -> Variant:
        return Variant(self.spec, "reference", self.registry)

    def require(self, *, grad: bool = False, decode: bool = False) -> None:
        backend = self.registry.backends[self.backend]
        mode = Mode.DECODE if decode else batch_mode(grad)
        plan = self.variant().plan
        device = torch.device(self.device)
        reasons = backend.verdict(plan, device, self.dtype, mode)
        if reasons:
            spec_level = bool(backend.verdict(plan, device, torch.float32, Mode.FORWARD))
            raise Declined("; ".join(reasons), spec_level)

    def generator(self, label: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}/{self.spec.name}/{label}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


# -- inputs, runs and the memo of reference results -----------------------------------------------------------------
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memo(target: Target, key: tuple, compute):
    """Reference results are the same for every backend under test: compute each once per registry."""
    table = _MEMO.setdefault(target.registry, {})
    full = (target.spec.hash, target.seed, *key)
    if full not in table:
        table[full] = compute()
    return table[full]


def offset_positions(batch: int, length: int) -> torch.Tensor:
    """(B, N) positions from OFFSET on with gaps 1, 2, 3, ... (cycling) that differ per batch row."""
    gaps = 1 + (torch.arange(length) + torch.arange(batch).view(-1, 1)) % (3 + torch.arange(batch).view(-1, 1))
    gaps[:, 0] = 0
    return OFFSET + gaps.cumsum(-1)


def _random_case(target: Target, shape: Shape) -> dict[str, torch.Tensor]:
    case = VectorCase(shape.id, "", (), shape.batch, shape.heads, shape.kv_heads, shape.length, shape.head_dim,
                      masked_rows=shape.masked_rows)
    gen_seed = int(target.generator(shape.id).initial_seed())
    inputs = _memo(target, ("inputs", shape), lambda: make_inputs(target.reference(), case, f"{gen_seed}"))
    if shape.offset:
        inputs = {**inputs, "positions": offset_positions(shape.batch, shape.length)}
    return inputs


def _traced_inputs(target: Target, inputs: dict, dtype):
    """The plan, rows, grouped parameters, positions and key mask of ``inputs`` in ``dtype``, as backends get them."""
    variant = target.reference()
    q, k, v = (inputs[n].to(dtype) for n in ("q", "k", "v"))
    n = q.shape[2]
    positions = check_positions(inputs.get("positions"), q.shape[0], n, q.device)
    grouped = variant.plan.add_inputs(variant.plan.split_params(params_of(inputs, dtype), check_qkv(q, k, v), q),
                                      inputs_of(inputs, dtype), q.shape[0], q.shape[1], n, q)
    return variant.plan, q, k, v, grouped, positions, inputs.get("key_mask")


def _trace(target: Target, inputs: dict, dtype) -> str | None:
    return culprit(*_traced_inputs(target, inputs, dtype))


class _TorchTL:
    """``triton.language`` as far as fragments use it, rendered in torch: ``tl.<name>`` is ``torch.<name>`` (with
    Python numbers as tensors), and the dtypes. A name torch lacks raises, and the fragment is not traced."""

    float16, bfloat16, float32, float64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    int1, int8, int16, int32, int64 = torch.bool, torch.int8, torch.int16, torch.int32, torch.int64

    def __getattr__(self, name):
        fn = getattr(torch, name, None)
        if name.startswith("_") or not callable(fn):
            raise AttributeError(name)
        return lambda *args, **kw: fn(*(torch.as_tensor(a) if isinstance(a, (bool, int, float)) else a
                                        for a in args), **kw)


def _first_bad(value, where: torch.Tensor, allow_neg_inf: bool) -> tuple | None:
    """The (b, h, i, j) index of the first non-finite entry of ``value`` at a True entry of ``where``, or None."""
    value = torch.as_tensor(value).expand_as(where)
    bad = (torch.isnan(value) | torch.isposinf(value)) if allow_neg_inf else ~torch.isfinite(value)
    hits = (bad & where).nonzero()
    return tuple(int(i) for i in hits[0].tolist()) if len(hits) else None


def _fragment_culprit(plan, q, k, v, params, positions, key_mask=None) -> str | None:
    """The first Triton fragment (logits slot in spec order, then the accumulator's) that gives non-finite values
    at a pair that may attend, evaluated in torch (``_TorchTL``) on float32 logits as the kernels compute them, each
    fragment on the torch maths' output of the transforms before it; as one phrase, or None (no fragment does, or
    the fragments could not be rendered in torch). The kernels discard a fragment's value at every other pair."""
    from ..backends.triton.codegen import host_termed

    tl = _TorchTL()
    q, k, v = q.float(), k.float(), v.float()
    params = {kind: {n: p.float() for n, p in group.items()} for kind, group in params.items()}
    pos = positions.unsqueeze(1)
    dims = Dims(q.shape[1], q.shape[3], k.shape[1])
    with torch.no_grad():
        qs, ks, vs = (plan.row_scale(slot, x, pos, params, widen=True)
                      for slot, x in ((Slot.QUERY, q), (Slot.KEY, k), (Slot.VALUE, v)))
        features = plan.token_features(qs, ks, vs, positions, key_mask, params)
        ctx = plan.context(positions, pos, dims, key_mask, features, features)
        group = dims.num_heads // dims.num_kv_heads
        x = (qs @ ks.repeat_interleave(group, dim=1).transpose(-1, -2)) * plan.logit_scale(dims.head_dim)
        allowed = plan.allowed(ctx, key_mask).expand_as(x)

        def blame(t, slot, field, text, value, where, allow_neg_inf, context):
            hit = _first_bad(value, where, allow_neg_inf)
            if hit is None:
                return None
            b, h, i, j = hit
            heads = context.heads.flatten().tolist()
            what = "NaN" if bool(torch.isnan(torch.as_tensor(value).expand_as(where)[hit])) else "inf"
            return (f"non-finite values first appear in transform '{t.kind}' ({slot} slot): its Triton fragment "
                    f"{field} {text!r} gives {what} at query position {int(positions[b, i])}, key position "
                    f"{int(positions[b, j])} (batch row {b}, head {heads[h]}), a pair that may attend, where the "
                    f"torch maths before it is finite (the transform's Triton lowering, not the backend)")

        try:
            for t in plan.many(Slot.LOGITS):
                low = None if host_termed(plan, t) else t.triton()
                if low is not None:
                    names = {f"p_{name}": f"p{i}" for i, name in enumerate(low.params)}
                    env = {"tl": tl, "qp": ctx.qpos, "kp": ctx.kpos, "head": ctx.heads, "H": dims.num_heads, "x": x,
                           **{f"p{i}": params[t.kind][name][ctx.heads] for i, name in enumerate(low.params)}}
                    y = eval(low.forward.format(x="x", **names), env)  # the plugin's own fragment, rendered in torch
                    found = blame(t, "logits", "forward", low.forward, y, allowed, True, ctx)
                    if found:
                        return found
                    env["y"] = y
                    finite = allowed & torch.isfinite(torch.as_tensor(y).expand_as(allowed))
                    for field, text in (("derivative", low.derivative),
                                        *((f"param_derivatives[{i}]", e) for i, e in enumerate(low.param_derivatives))):
                        value = eval(text.format(x="x", y="y", **names), env)
                        found = blame(t, "logits", field, text, value, finite, False, ctx)
                        if found:
                            return found
                x = t.apply(x, ctx, params[t.kind])
            acc = plan.one(Slot.ACCUMULATOR)
            low = acc.triton() if acc is not None else None
            if low is not None:
                index, ok, sel_ctx = plan.selector_view(acc, allowed, ctx)
                xs = x.index_select(1, index)
                ok = ok.expand_as(xs)
                env = {"tl": tl, "qp": sel_ctx.qpos, "kp": sel_ctx.kpos, "head": sel_ctx.heads, "H": dims.num_heads,
                       "ok": ok, "x": xs}
                keep = ok & torch.as_tensor(eval(low.keep, env)).expand_as(ok) if low.keep else ok
                for field, text in (("value", low.value), ("derivative", low.derivative)):
                    found = blame(acc, "accumulator", field, text, eval(text.format(x="x"), env), keep, False,
                                  sel_ctx)
                    if found:
                        return found
        except Exception:  # a fragment torch cannot render (a Triton-only function, say): not traced
            return None
    return None


def _compare(target: Target, name: str, got: dict, truth: dict, low: dict | None, inputs: dict | None = None
             ) -> None:
    """:func:`_close` of every result (``<name>: <key>``)."""
    for key in truth:
        _close(target, f"{name}: {key}", got[key], truth[key], low[key] if low else None, inputs)


def _close(target: Target, name: str, got: torch.Tensor, truth: torch.Tensor, low: torch.Tensor | None,
           inputs: dict | None = None) -> None:
    """``check_close``; a non-finite result (or truth) is traced, on ``inputs`` in batch form, to the transform
    whose term first goes non-finite: its torch maths (in float64, then the tested dtype; :func:`culprit`), then,
    on the triton backend, its Triton fragment rendered in torch at the pairs that may attend; else the message
    says the backend produced it."""
    try:
        check_close(name, got, truth, low, target.dtype)
    except AssertionError as exc:
        if inputs is None or "non-finite" not in str(exc):
            raise
        for dtype in dict.fromkeys((torch.float64, target.dtype)):
            blame = _trace(target, inputs, dtype)
            if blame:
                raise AssertionError(f"{name}: {blame} (the transform's own maths, not the backend)") from None
        fragments = _runs_fragments(target)
        if fragments:
            blame = _fragment_culprit(*_traced_inputs(target, inputs, target.dtype))
            if blame:
                raise AssertionError(f"{name}: {blame}") from None
        unwritten = "(an unwritten or overflowing element)"
        if str(exc).endswith(unwritten):
            traced = "torch maths or Triton fragment" if fragments else "own maths"
            raise AssertionError(f"{str(exc).removesuffix(unwritten).rstrip()}, and no transform's {traced} "
                                 f"gives non-finite values on these inputs: the backend produced it "
                                 f"{unwritten}") from None
        raise


def _runs_fragments(target: Target) -> bool:
    """Whether the backend under test runs the transforms' Triton fragments (the triton backend)."""
    try:
        from ..backends.triton.backend import TritonBackend
    except ImportError:
        return False
    return isinstance(target.registry.backends.get(target.backend), TritonBackend)


# -- the checks ---------------------------------------------------------------------------------------------------
def check_vector(target: Target, case: VectorCase) -> None:
    """Stored vectors: inputs, and outputs/gradients the reference computed in float64, under the tolerance rule.

    Decode vectors get no allowance from the reference's own decoding in the tested dtype (it could share a bug
    with the backend under test): only the floor."""
    target.require(grad=case.mode == "batch", decode=case.mode == "decode")
    meta, tensors = load(target.spec.name)
    if meta["spec_hash"] != target.spec.hash:
        raise AssertionError(f"vectors were generated for another version of spec '{target.spec.name}' "
                             f"({meta['spec_hash'][:12]} != {target.spec.hash[:12]}): regenerate them")
    prefix = f"{case.id}."
    inputs = {k.removeprefix(prefix): v for k, v in tensors.items()
              if k.startswith(prefix) and not k.startswith(prefix + "expected.")}
    truth = {k.removeprefix(prefix + "expected."): v for k, v in tensors.items()
             if k.startswith(prefix + "expected.")}
    got = run_case(target.variant(), case, {k: v.to(target.device) for k, v in inputs.items()}, target.dtype)
    low = None
    if target.dtype != torch.float64 and case.mode == "batch":
        low = _memo(target, ("vector-low", case.id, target.dtype),
                    lambda: run_case(target.reference(), case, inputs, target.dtype))
    kept = truth.pop("kept_positions", None)
    got_kept = got.pop("kept_positions", None)
    if kept is not None and target.dtype == torch.float64 and not torch.equal(got_kept.cpu(), kept):
        raise AssertionError(f"vector {case.id}: cache kept positions {got_kept.flatten().tolist()}, expected "
                             f"{kept.flatten().tolist()}")
    _compare(target, f"vector {case.id}", got, truth, low, inputs)


def check_differential(target: Target, shape: Shape, grad: bool) -> None:
    """Fresh random inputs against the float64 reference: outputs (and gradients of q, k, v and parameters)."""
    target.require(grad=grad)
    inputs = _random_case(target, shape)
    truth = _memo(target, ("batch", shape, grad, torch.float64),
                  lambda: run_batch(target.reference(), inputs, torch.float64, grad))
    low = None
    if target.dtype != torch.float64:
        low = _memo(target, ("batch", shape, grad, target.dtype),
                    lambda: run_batch(target.reference(), inputs, target.dtype, grad))
    got = run_batch(target.variant(), inputs, target.dtype, grad, target.device)
    _compare(target, f"{'gradients' if grad else 'outputs'} {shape.id}", got, truth, low, inputs)


def check_accumulated(target: Target) -> None:
    """``return_accumulated``: F (B, N, N) equals the reference's F, and is kept in float32 or wider."""
    if "accumulator" not in target.spec.slots():
        raise Unsupported("spec has no accumulator")
    target.require()
    shape = Shape("accumulated", 2, 4, 2, 45, 8, offset=True)
    inputs = _random_case(target, shape)
    truth = _memo(target, ("accumulated", torch.float64),
                  lambda: run_batch(target.reference(), inputs, torch.float64, False, selection=True))
    low = None
    if target.dtype != torch.float64:
        low = _memo(target, ("accumulated", target.dtype),
                    lambda: run_batch(target.reference(), inputs, target.dtype, False, selection=True))
    got = run_batch(target.variant(), inputs, target.dtype, False, target.device, selection=True)
    if got["F"] is None:
        raise AssertionError("return_accumulated: F is None for a spec with an accumulator")
    wide = (torch.float32, torch.float64)
    if got["F"].dtype not in wide or (target.dtype == torch.float64 and got["F"].dtype != torch.float64):
        raise AssertionError(f"return_accumulated: F is {str(got['F'].dtype).removeprefix('torch.')}: accumulated "
                             f"state must be kept in float32 or wider (float64 for float64 inputs)")
    _compare(target, "return_accumulated", got, truth, low, inputs)


#: the documents of the packed check: one token (a document that sees only itself), an odd length, a long one
PACKED_LENGTHS = (1, 63, 200)


def _documents_alone(variant, inputs: dict, dtype, grad: bool) -> dict[str, torch.Tensor]:
    """Each document of a packed row run alone through ``variant`` (no packing involved), assembled: the outputs
    and the gradients of q, k, v and the per-token inputs side by side, the parameters' gradients summed."""
    parts: list[dict[str, torch.Tensor]] = []
    start = 0
    for length in PACKED_LENGTHS:
        tokens = slice(start, start + length)
        alone = {}
        for key, value in inputs.items():
            if key in ("q", "k", "v", "cotangent"):
                alone[key] = value[:, :, tokens]
            elif key.startswith("input."):
                alone[key] = value[..., tokens]
            else:
                alone[key] = value
        parts.append(run_batch(variant, alone, dtype, grad))
        start += length
    out = {}
    for key in parts[0]:
        if key.startswith("grad.param."):
            out[key] = sum(p[key] for p in parts)
        else:
            out[key] = torch.cat([p[key] for p in parts], dim=-1 if key.startswith("grad.input.") else 2)
    return out


def check_packed(target: Target, grad: bool) -> None:
    """A packed row of three documents (lengths 1, 63, 200; ``documents=`` as a list of lengths) equals each
    document run alone through the reference: outputs, and gradients of q, k, v, parameters and per-token inputs
    (positions restart, F resets, each document's first token is the protected one)."""
    target.require(grad=grad)
    inputs = _random_case(target, Shape("packed", 1, 4, 2, sum(PACKED_LENGTHS), 8))
    truth = _memo(target, ("packed", grad, torch.float64),
                  lambda: _documents_alone(target.reference(), inputs, torch.float64, grad))
    low = None
    if target.dtype != torch.float64:
        low = _memo(target, ("packed", grad, target.dtype),
                    lambda: _documents_alone(target.reference(), inputs, target.dtype, grad))
    got = run_batch(target.variant(), inputs, target.dtype, grad, target.device, documents=list(PACKED_LENGTHS))
    _compare(target, f"packed documents {PACKED_LENGTHS}", got, truth, low, inputs)


def _prefill_documents(variant, inputs: dict, dtype, device, budget, packed: bool) -> torch.Tensor:
    """Prefill the documents of a packed row: packed into a cache of one row per document, or each alone into its
    own cache (the truth); the outputs side by side."""
    q, k, v = (inputs[n].to(device=device, dtype=dtype) for n in ("q", "k", "v"))
    params = {key: p.to(device) for key, p in params_of(inputs, dtype).items()}
    with torch.no_grad():
        if packed:
            cache = variant.new_cache(batch=len(PACKED_LENGTHS), budget=budget)
            token_inputs = _token_inputs(inputs, dtype, device, slice(None))
            return variant.prefill(q, k, v, cache, params, inputs=token_inputs, documents=list(PACKED_LENGTHS))
        outs, start = [], 0
        for length in PACKED_LENGTHS:
            tokens = slice(start, start + length)
            cache = variant.new_cache(batch=1, budget=budget)
            outs.append(variant.prefill(q[:, :, tokens], k[:, :, tokens], v[:, :, tokens], cache, params,
                                        inputs=_token_inputs(inputs, dtype, device, tokens)))
            start += length
        return torch.cat(outs, dim=2)


def check_packed_prefill(target: Target) -> None:
    """Three prompts packed in one row (1, 63, 200) prefilled into a cache with one row per document, with the
    spec's evictor at a budget of 24 (eviction during the prefill), equal each prompt prefilled alone."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    budget = 24 if target.spec.cache is not None else None
    inputs = _random_case(target, Shape("packed", 1, 4, 2, sum(PACKED_LENGTHS), 8))
    truth = _memo(target, ("packed-prefill", torch.float64),
                  lambda: _prefill_documents(target.reference(), inputs, torch.float64, "cpu", budget, False))
    got = _prefill_documents(target.variant(), inputs, target.dtype, target.device, budget, True)
    _close(target, f"packed prefill {PACKED_LENGTHS}, budget {budget}", got, truth, None, inputs)


def check_causality(target: Target) -> None:
    """Perturbing tokens after position t leaves outputs at positions <= t unchanged."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal")
    target.require()
    inputs = _random_case(target, Shape("causality", 1, 2, 1, 40, 8))
    gen = target.generator("causality-perturb")
    changed = dict(inputs)
    for name in ("q", "k", "v"):
        noise = torch.randn(changed[name][:, :, 25:].shape, generator=gen, dtype=torch.float64)
        changed[name] = torch.cat([changed[name][:, :, :25], changed[name][:, :, 25:] + 3 * noise], dim=2)
    for name in [key for key in changed if key.startswith("input.")]:  # per-token inputs of the later tokens too
        noise = torch.randn(changed[name][..., 25:].shape, generator=gen, dtype=torch.float64)
        changed[name] = torch.cat([changed[name][..., :25], changed[name][..., 25:] + 3 * noise], dim=-1)
    variant = target.variant()
    a = run_batch(variant, inputs, target.dtype, False, target.device)["out"][:, :, :25]
    b = run_batch(variant, changed, target.dtype, False, target.device)["out"][:, :, :25]
    _close(target, "causality: outputs before the perturbed tokens", b, a.to(torch.float64), None, inputs)


def check_batch_invariance(target: Target) -> None:
    """Each batch row computed alone equals the same row computed in a batch of 3."""
    target.require()
    inputs = _random_case(target, Shape("batch", 3, 2, 1, 21, 8))
    variant = target.variant()
    whole = run_batch(variant, inputs, target.dtype, False, target.device)["out"]
    for row in range(3):
        alone = {k: (v[row:row + 1] if k in ("q", "k", "v") or k.startswith("input.") else v)
                 for k, v in inputs.items()}
        one = run_batch(variant, alone, target.dtype, False, target.device)["out"]
        _close(target, f"batch invariance: row {row}", one, whole[row:row + 1].to(torch.float64), None, inputs)


def _decode(variant, inputs, dtype, device="cpu", budget=None, prefill=0, first_position=1, watch=False,
            keep=(0, ""), trail=None):
    """Prefill the first ``prefill`` tokens, then decode the rest one by one. Returns (out, cache, problems):
    ``problems`` lists budget overruns, protected tokens evicted (with ``watch``) and positions 1..k of
    ``keep = (k, why)`` (:func:`eviction.must_keep`) missing after a step. ``trail``: a list that gets, after the
    prefill and after each step, (the step's output on CPU, :func:`eviction.kept_positions`, tokens evicted so
    far)."""
    q, k, v = (inputs[n].to(device=device, dtype=dtype) for n in ("q", "k", "v"))
    params = {key: p.to(device) for key, p in params_of(inputs, dtype).items()}
    cache = variant.new_cache(batch=q.shape[0], budget=budget)
    cache.next_position = first_position
    watcher = eviction.WatchedVictims(cache.evictor) if watch and cache.evictor is not None else None
    problems: list[str] = []
    outs = []
    with torch.no_grad():
        if prefill:
            outs.append(variant.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache, params,
                                        inputs=_token_inputs(inputs, dtype, device, slice(0, prefill))))
            if trail is not None:
                trail.append((outs[-1].cpu(), eviction.kept_positions(cache), cache.evicted))
        for i in range(prefill, q.shape[2]):
            outs.append(variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params,
                                       inputs=_token_inputs(inputs, dtype, device, slice(i, i + 1))))
            if trail is not None:
                trail.append((outs[-1].cpu(), eviction.kept_positions(cache), cache.evicted))
            if budget is not None and cache.num_tokens > budget and not problems:
                problems.append(f"cache holds {cache.num_tokens} tokens after step {i + 1}, over its budget "
                                f"{budget}")
            lost = [p for p in range(first_position, first_position + min(keep[0], i + 1))
                    if not bool((cache.positions == p).any(-1).all())]
            if lost and not problems:
                problems.append(f"position {lost[0]} was evicted by step {i + 1}, but {keep[1]}: the spec says it "
                                f"is never evicted")
    if watcher is not None:
        problems += watcher.problems
    return torch.cat(outs, dim=2), cache, problems


def _token_inputs(inputs, dtype, device, tokens):
    found = inputs_of(inputs, dtype, tokens)
    return {key: t.to(device) for key, t in found.items()} if found else None


def check_decode(target: Target) -> None:
    """A prefill followed by token-by-token decoding (no budget) equals the float64 batch truth, from position 1
    and from an offset past float16's range. The allowance comes from the reference's *batch form* in the
    tested dtype: a decode-only bug (shared by the reference's own decoding) cannot widen it."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    n = 45  # past the 32-token windows of the shipped local specs
    base = _random_case(target, Shape("decode", 2, 4, 2, n, 8))
    for first in (1, OFFSET):
        inputs = {**base, "positions": torch.arange(first, first + n)}
        truth = _memo(target, ("decode-truth", first),
                      lambda inputs=inputs: run_batch(target.reference(), inputs, torch.float64, False))["out"]
        low = None
        if target.dtype != torch.float64:
            low = _memo(target, ("decode-low", first, target.dtype),
                        lambda inputs=inputs: run_batch(target.reference(), inputs, target.dtype, False))["out"]
        got, _, _ = _decode(target.variant(), inputs, target.dtype, target.device, prefill=11, first_position=first)
        _compare(target, f"prefill + decode from position {first} vs batch", {"out": got}, {"out": truth},
                 {"out": low} if low is not None else None, inputs)


def check_evictor(target: Target) -> None:
    """Evictor properties, at budgets derived from the evictor (:func:`eviction.budgets_for`: its smallest accepted
    budget, the one just above what it protects, one between): on crafted caches it evicts exactly the token its
    declared rule names and never a protected one; in real decoding a budget >= N changes nothing, and at each
    derived budget (where eviction happens) the budget holds after every step, no protected token is evicted, and
    what the spec itself protects (BOS under ``protect_bos``, a ``sink``) is never evicted."""
    if target.spec.cache is None:
        raise Unsupported("spec has no cache evictor")
    target.require(decode=True)
    variant = target.variant()
    factory = lambda: variant.plan.evictor_cls(target.spec.cache)  # noqa: E731 - a fresh evictor per use
    has_accumulator = "accumulator" in target.spec.slots()
    budgets = eviction.budgets_for(factory, has_accumulator)
    eviction.check_rule_on_crafted_caches(factory, budgets, has_accumulator, target.generator("crafted"))
    n = max(24, max(budgets) + 8)  # every derived budget evicts, several times
    inputs = _random_case(target, Shape(f"evict-n{n}", 1, 2, 1, n, 8))
    truth = _memo(target, ("evict-truth", n),
                  lambda: run_batch(target.reference(), inputs, torch.float64, False))["out"]
    low = None
    if target.dtype != torch.float64:
        low = _memo(target, ("evict-low", n, target.dtype),
                    lambda: run_batch(target.reference(), inputs, target.dtype, False))["out"]
    full, cache, problems = _decode(variant, inputs, target.dtype, target.device, budget=n, watch=True)
    _close(target, "budget >= N", full, truth, low, inputs)
    if cache.evicted or problems:
        raise AssertionError(f"budget >= N: {cache.evicted} tokens evicted {'; '.join(problems)}")
    keep = eviction.must_keep(target.spec)
    for budget in budgets:
        _, cache, problems = _decode(variant, inputs, target.dtype, target.device, budget=budget,
                                     prefill=min(4, budget), watch=True, keep=keep)
        if problems:
            raise AssertionError(f"budget {budget}: {problems[0]}")
        if cache.num_tokens != budget or not cache.evicted:
            raise AssertionError(f"budget {budget}: cache holds {cache.num_tokens} tokens after {n} steps, "
                                 f"{cache.evicted} evicted")


#: decode steps after the prefill in :func:`check_evicted_decode` (at least; twice the budget when that is more)
EVICTED_STEPS = 12


def evicted_runs(budgets: list[int]) -> list[tuple[int, int, int]]:
    """(budget, prefill, tokens) of each run of :func:`check_evicted_decode`: per budget, a prefill shorter than the
    budget (half of it, at least one token) and one longer (budget + 3: the prefill itself evicts), then
    max(:data:`EVICTED_STEPS`, 2 x budget) decode steps, each of which evicts."""
    return [(budget, prefill, prefill + max(EVICTED_STEPS, 2 * budget))
            for budget in budgets for prefill in sorted({max(1, budget // 2), budget + 3})]


def _evicted_trail(variant, inputs, dtype, device, budget, prefill) -> list:
    trail: list = []
    _decode(variant, inputs, dtype, device, budget=budget, prefill=prefill, trail=trail)
    return trail


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """The (batch row, key/value head) of the first row of kept positions that differs."""
    for i in range(want.shape[0]):
        for j in range(want.shape[1]):
            if got.shape[2] != want.shape[2] or not torch.equal(got[i, j], want[i, j]):
                return i, j
    return 0, 0


def check_evicted_decode(target: Target) -> None:
    """Decoding past eviction on the backend under test equals the reference backend's decoding of the same spec,
    inputs and budget, step by step: the output of the prefill and of every decode step (the tolerance rule against
    the reference's float64 decoding, floor only, as for decode vectors) and the positions the cache keeps after
    each (exactly). At the budgets :func:`eviction.budgets_for` derives from the evictor, with a prefill shorter
    and one longer than the budget (:func:`evicted_runs`). Needs no stored vectors: plugin specs get it too.

    Where the reference run in the tested dtype itself keeps other positions than in float64 (a near tie that
    precision cannot settle), that run is compared up to the step before."""
    spec = target.spec
    if spec.cache is None:
        raise Unsupported("spec has no cache evictor")
    if not spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    variant = target.variant()
    factory = lambda: variant.plan.evictor_cls(spec.cache)  # noqa: E731 - a fresh evictor per use
    evicting = 0
    for budget, prefill, n in evicted_runs(eviction.budgets_for(factory, "accumulator" in spec.slots())):
        inputs = _random_case(target, Shape(f"evicted-decode-n{n}", 2, 4, 2, n, 8))
        run = ("evicted-decode", budget, prefill, n)
        truth = _memo(target, (*run, torch.float64), lambda inputs=inputs, budget=budget, prefill=prefill:
                      _evicted_trail(target.reference(), inputs, torch.float64, "cpu", budget, prefill))
        same = truth
        if target.dtype != torch.float64:
            same = _memo(target, (*run, target.dtype), lambda inputs=inputs, budget=budget, prefill=prefill:
                         _evicted_trail(target.reference(), inputs, target.dtype, "cpu", budget, prefill))
        got = _evicted_trail(variant, inputs, target.dtype, target.device, budget, prefill)
        where = f"decode past eviction (spec '{spec.name}', budget {budget}, prefill {prefill} of {n} tokens)"
        steps = zip(got, truth, same, strict=True)
        for step, ((out, kept, _), (want, want_kept, evicted), (_, near, _)) in enumerate(steps):
            if not torch.equal(near, want_kept):
                break  # the reference itself keeps other positions in this precision: a near tie
            label = (f"the prefill of {prefill} tokens" if step == 0
                     else f"step {step} (the token at position {prefill + step})")
            label += f", {evicted} token{'s' if evicted != 1 else ''} evicted so far"
            if not torch.equal(kept, want_kept):
                i, j = _first_difference(kept, want_kept)
                raise AssertionError(f"{where}: after {label}: the cache keeps "
                                     f"positions {kept[i, j].tolist()} (batch row {i}, key/value head {j}) where "
                                     f"the reference keeps {want_kept[i, j].tolist()}")
            _close(target, f"{where}: {label}: out", out, want, None, inputs)
            evicting += evicted > 0
    if not evicting:
        raise AssertionError(f"decode past eviction (spec '{spec.name}'): not run, because no step after an "
                             f"eviction could be compared (the reference's float64 and "
                             f"{str(target.dtype).removeprefix('torch.')} decoding keep different positions)")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN in the same places counting as equal (the differential checks report NaN)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def check_determinism(target: Target) -> None:
    """Two runs on the same inputs give bitwise identical outputs and gradients."""
    backend = target.registry.backends[target.backend]
    if not getattr(backend, "deterministic", True):
        raise Unsupported(f"backend '{target.backend}' does not claim determinism")
    target.require(grad=True)
    inputs = _random_case(target, Shape("determinism", 1, 2, 1, 37, 8))
    first = run_batch(target.variant(), inputs, target.dtype, True, target.device)
    second = run_batch(target.variant(), inputs, target.dtype, True, target.device)
    for key in first:
        if not _same(first[key], second[key]):
            raise AssertionError(f"determinism: {key} differs between two identical runs")

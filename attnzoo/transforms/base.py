"""The transform contract: a kind name, a slot, a pydantic options model, learnable parameters, reference maths.

Shapes used throughout: B batch, H query heads, H_kv key/value heads (H % H_kv == 0), Nq query tokens, Nk key
tokens, D head dim. Positions are 1-based absolute token positions (int64).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, create_model

from .lowering import TritonSelection


class Slot(str, enum.Enum):
    """Where in the attention computation a transform acts (docs/specs.md: slots and their order)."""

    QUERY = "query"
    KEY = "key"
    VALUE = "value"
    LOGITS = "logits"
    ACCUMULATOR = "accumulator"
    MASK = "mask"
    NORMALISER = "normaliser"
    PROBABILITY = "probability"
    OUTPUT = "output"


#: Slots where a spec may list several transforms (applied in the order listed, masks intersected).
COMPOSING_SLOTS = frozenset({Slot.QUERY, Slot.KEY, Slot.VALUE, Slot.OUTPUT, Slot.LOGITS, Slot.MASK})


class StrictModel(BaseModel):
    """Base of every spec-file model: unknown keys, NaN/inf and type coercions are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class TransformOptions(StrictModel):
    """Options of a transform as written in a spec file. Subclasses add fields; ``kind`` is filled in."""

    kind: str


@dataclass(frozen=True)
class Dims:
    """Sizes a parameter shape may refer to: ``H`` (query heads), ``H_kv`` (key/value heads), ``D`` (head dim)."""

    num_heads: int
    head_dim: int
    num_kv_heads: int

    def resolve(self, shape: tuple[str | int, ...]) -> tuple[int, ...]:
        table = {"H": self.num_heads, "H_kv": self.num_kv_heads, "D": self.head_dim}
        return tuple(table[s] if isinstance(s, str) else int(s) for s in shape)


@dataclass(frozen=True)
class ParamSpec:
    """A learnable parameter: its short name (the params key is ``"<kind>.<name>"``), its shape in symbols of
    :class:`Dims` (e.g. ``("H", "D")``; ``()`` is a scalar) and its initial value: a float filled everywhere, or a
    function of the call's :class:`Dims` returning the values (a nested list or tensor of the resolved shape;
    e.g. one ALiBi slope per head)."""

    name: str
    shape: tuple[str | int, ...]
    init: float | Callable[[Dims], Any]

    def initial(self, dims: Dims, dtype=torch.float32, device=None) -> torch.Tensor:
        """The initial value at the call's sizes."""
        shape = dims.resolve(self.shape)
        if callable(self.init):
            value = torch.as_tensor(self.init(dims), dtype=dtype, device=device)
            if tuple(value.shape) != shape:
                raise ValueError(f"parameter '{self.name}': its init gave shape {tuple(value.shape)}, "
                                 f"declared {shape}")
            return value.clone()
        return torch.full(shape, self.init, dtype=dtype, device=device)


@dataclass
class Context:
    """What logits, mask and accumulator transforms may look at, broadcastable against logits (B, H, Nq, Nk).

    ``qpos``: (B, 1, Nq, 1) query positions; ``kpos``: (B, 1 or H', 1, Nk) key positions; ``heads``: (1, H', 1, 1)
    indices of the query heads the logits hold (all H of them, or a subset); ``dims``: the sizes of this call;
    ``key_mask``: (B, 1, 1, Nk) bool, False for padding keys, or None when every key is real (padding is never
    attended whatever a transform does; a transform that counts tokens may need to skip it).
    """

    qpos: torch.Tensor
    kpos: torch.Tensor
    heads: torch.Tensor
    dims: Dims
    key_mask: torch.Tensor | None = None
    #: per-token features (:meth:`LogitsTransform.features`) keyed ``"<kind>.<name>"``: the queries' (B, H', Nq, 1)
    #: and the keys' (B, H', 1, Nk), for the heads in ``heads``
    query_features: dict[str, torch.Tensor] = field(default_factory=dict)
    key_features: dict[str, torch.Tensor] = field(default_factory=dict)

    def features(self, kind: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries' and the keys' value of feature ``name`` of transform ``kind``, broadcastable against the
        logits: (B, H', Nq, 1) and (B, H', 1, Nk)."""
        key = f"{kind}.{name}"
        return self.query_features[key], self.key_features[key]


@dataclass(frozen=True)
class MapStep:
    """What a probability map's blocked form may read about the whole step of one block of queries, beyond the key
    block in hand: handed as the keyword ``step`` to each of :meth:`ProbabilityTransform.start`,
    :meth:`~ProbabilityTransform.update` and :meth:`~ProbabilityTransform.finish` that declares a parameter of that
    name (found once per class: :attr:`ProbabilityTransform.takes_step`), so that a map whose formula needs the
    number of keys a query sees (SSMax's ``s ln n``, ReLU attention's ``1 / n``) runs in one pass over the key
    blocks instead of buffering them.

    ``visible``: (B, H, Bq, 1) the number of keys each query may attend in this step, over all its key blocks: the
    allowed pairs (the causal flag, the mask transforms, padding keys excluded), the count the reference's
    ``weights`` gets as ``allowed.sum(-1)``; behind a decode cache that has evicted, the keys the cache holds that
    the query may see, not its position. Exact integers in the dtype sums are kept in (the queries', at least
    float32); 0 for a query with no key. ``qpos``: (B, 1, Bq, 1) the queries' absolute positions (int64).
    ``dims``: the sizes of the call."""

    visible: torch.Tensor
    qpos: torch.Tensor
    dims: Dims


@dataclass(frozen=True)
class TokenInput:
    """A per-token input a transform needs from the caller, (B, H, N) per query head and token: typically a
    projection of the layer input x, which the caller owns (``attnzoo.nn.Attention`` makes a linear map from
    ``x`` for it, with its weight at 0 and its bias at ``bias_init``). The caller passes it as
    ``inputs={"<kind>.<name>": tensor}``; the transform finds it in ``params`` beside its parameters."""

    name: str
    bias_init: float = 0.0
    description: str = ""


@dataclass
class TokenRows:
    """What a transform computing per-token features sees: the rows given to attention after the row maps, q'
    (B, H, N, D), k' and v' (B, H_kv, N, D), the positions (B, N) and the key mask (B, N) or None. In the batch
    form queries and keys are the same N tokens."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    key_mask: torch.Tensor | None
    dims: Dims


def restrict_heads(ctx: Context, heads: list[int]) -> Context:
    """The context of a subset of query heads (kpos, heads and per-head features narrowed; per-head masks follow
    ctx.heads)."""
    index = torch.tensor(heads, device=ctx.heads.device)
    kpos = ctx.kpos.index_select(1, index) if ctx.kpos.shape[1] > 1 else ctx.kpos

    def narrow(features):
        return {key: (t.index_select(1, index) if t.shape[1] > 1 else t) for key, t in features.items()}

    return replace(ctx, kpos=kpos, heads=index.view(1, -1, 1, 1), query_features=narrow(ctx.query_features),
                   key_features=narrow(ctx.key_features))


class Transform:
    """Base class of every transform. Subclass one of the slot bases below, set ``kind`` and ``Options``."""

    kind: ClassVar[str]
    slot: ClassVar[Slot]
    Options: ClassVar[type[TransformOptions]] = TransformOptions
    summary: ClassVar[str] = ""
    _options_model: ClassVar[type[TransformOptions] | None] = None

    def __init__(self, options: TransformOptions) -> None:
        self.options = options

    # -- declared by subclasses -------------------------------------------------------------------------------
    def parameters(self) -> list[ParamSpec]:
        """The learnable parameters this transform needs (may depend on its options)."""
        return []

    def token_inputs(self) -> list[TokenInput]:
        """The per-token inputs the caller passes (:class:`TokenInput`); none by default."""
        return []

    def check_spec(self, spec: Any) -> str | None:
        """A reason this transform cannot appear in ``spec`` (cross-field rules), or None."""
        return None

    def check_dims(self, dims: Dims) -> None:
        """Raise ValueError if the call's sizes do not fit the options (e.g. a head index out of range)."""

    def triton(self) -> Any:
        """This transform's Triton fragment (:mod:`attnzoo.transforms.lowering`), or None: the triton backend
        then declines specs that use it, naming it. Row-scale transforms need none."""
        return None

    # -- registry helpers ---------------------------------------------------------------------------------------
    @classmethod
    def options_model(cls) -> type[TransformOptions]:
        """``Options`` with ``kind`` narrowed to this transform's name: one arm of the spec's union."""
        if cls.__dict__.get("_options_model") is None:
            cls._options_model = create_model(
                f"{cls.__name__}Options", __base__=cls.Options, kind=(Literal[cls.kind], ...)
            )
        return cls._options_model

    @classmethod
    def contract_problem(cls) -> str | None:
        if not isinstance(getattr(cls, "slot", None), Slot):
            valid = ", ".join(f"Slot.{slot.name}" for slot in Slot)
            return f"slot must be an attnzoo.Slot ({valid}), got {getattr(cls, 'slot', None)!r}"
        if not (isinstance(cls.Options, type) and issubclass(cls.Options, TransformOptions)):
            return "Options must subclass attnzoo.TransformOptions"
        bases = {Slot.QUERY: RowMapTransform, Slot.KEY: RowMapTransform, Slot.VALUE: RowMapTransform,
                 Slot.OUTPUT: RowMapTransform, Slot.LOGITS: LogitsTransform, Slot.MASK: MaskTransform,
                 Slot.ACCUMULATOR: AccumulatorTransform, Slot.NORMALISER: NormaliserTransform,
                 Slot.PROBABILITY: ProbabilityTransform}
        if not issubclass(cls, bases[cls.slot]):
            return f"a transform in slot '{cls.slot.value}' must subclass {bases[cls.slot].__name__}"
        missing = [name for base, name in _REQUIRED if issubclass(cls, base) and getattr(cls, name) is
                   getattr(base, name)
                   and not (name == "selection" and cls.pointwise is not AccumulatorTransform.pointwise)
                   and not (name == "weights" and cls.pointwise is not ProbabilityTransform.pointwise)]
        if issubclass(cls, ProbabilityTransform) and not missing:
            problem = _blocked_form_problem(cls)
            if problem:
                return problem
        if missing:
            return (f"it does not implement {', '.join(f'{m}()' for m in missing)}, which a transform in slot "
                    f"'{cls.slot.value}' must")
        return None


class RowMapTransform(Transform):
    """Slots ``query``, ``key``, ``value``, ``output``: a shape-preserving map of each token's rows, with
    parameters (QK-norm's RMS normalisation with a per-dimension gain, say).

    The rows are the query, key or value rows given to attention (after any RoPE the model applied), or for
    ``output`` the attention output rows. A map is **per token**: the rows of token i (all heads of it) and its
    position decide its result, never other tokens (so causality holds and a decode cache can store transformed
    keys and values, computed once). Several transforms in one of these slots apply in spec order. A map runs
    outside the attention kernels of every backend (Triton included): it costs O(N·D), not O(N²).
    """

    def map(self, rows: torch.Tensor, positions: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """rows (B, Hx, N, D), positions (B, 1 or Hx, N) → new rows of the same shape (any floating dtype: the
        caller rounds to the rows' dtype once)."""
        raise NotImplementedError


class RowScaleTransform(RowMapTransform):
    """The fast special case of a row map: a scalar per token and head multiplies that row (SSA's
    temperatures). Implement :meth:`scale`; :meth:`map` follows from it."""

    def scale(self, rows: torch.Tensor, positions: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """rows (B, Hx, N, D), positions (B, 1 or Hx, N) → the scale t (B, Hx, N)."""
        raise NotImplementedError

    def map(self, rows: torch.Tensor, positions: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        scale = self.scale(rows, positions, params)
        return rows.to(torch.promote_types(rows.dtype, scale.dtype)) * scale.unsqueeze(-1)


class LogitsTransform(Transform):
    """Slot ``logits``: a pointwise map of the scaled logits before the softmax.

    The logits may hold a subset of the heads (a backend computing the selector head alone, say): index any
    per-head quantity with ``ctx.heads``, never by position.
    """

    def apply(self, logits: torch.Tensor, ctx: Context, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits (B, H, Nq, Nk) → new logits of the same shape."""
        raise NotImplementedError

    def bias(self, ctx: Context, params: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        """Optional: when the transform is ``l' = l + bias`` with a bias independent of l, return that bias in
        ``dtype`` (broadcastable to (B, H, Nq, Nk)) so that backends can hand it to fused kernels as an additive
        mask. None (the default) means the transform is not additive."""
        return None

    def separable(self, ctx: Context, params: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional: when :meth:`bias` is a sum of a query term and a key term, ``bias[i, j] = row[i] + col[j]``
        on every pair whose key position is at most the query position (a causal spec's visible pairs), return
        ``(row, col)`` in ``dtype``, broadcastable to (B, H, Nq, 1) and (B, H, 1, Nk). A backend may then fold
        ``col`` into the keys as one more dimension and drop ``row`` (a per-row constant cancels in the softmax),
        keeping the fused causal kernel: ALiBi's ``-slope * (i - j)`` is ``(-slope * i, slope * j)``. None (the
        default): not separable."""
        return None

    #: names of the per-token features :meth:`features` returns that the backend turns into running sums: the
    #: value a token gets is the sum of what :meth:`features` returned for it and every earlier real token of its
    #: row (padding adds 0), e.g. the Forgetting Transformer's ``D_t = sum_{s <= t} log f_s``
    cumulative: ClassVar[frozenset[str]] = frozenset()

    def features(self, rows: TokenRows, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Optional: per-token quantities, computed once per token from that token's rows (and position), each
        (B, H, N) for the query heads; :meth:`apply` reads the query's and the key's through
        ``ctx.features(self.kind, name)``. None (the default): the transform has none."""
        return None


class MaskTransform(Transform):
    """Slot ``mask``: which (query, key) pairs may attend. Masks of a spec are intersected."""

    def allowed(self, ctx: Context) -> torch.Tensor:
        """A bool tensor broadcastable to (B, H, Nq, Nk): True where the query may attend to the key."""
        raise NotImplementedError

    def earliest_key(self, query_position: int) -> int | None:
        """Optional: the smallest key position this mask lets any query at ``query_position`` or later see (a
        backend skips earlier keys); None (the default) promises nothing."""
        return None


def _relu_derivative(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


@dataclass(frozen=True)
class SelectionRule:
    """A selection function that every fast path knows by name (:data:`SELECTION_RULES`): its torch ``value`` and
    ``derivative``, and the same two as Triton expressions in ``{x}``. A :class:`PointwiseSelection` that names it
    (``rule="relu"``) is computed by the blocked kernels with ``value``, by the triton backend with the expressions
    and by the fused C decoding step with its own code for the name (``attnzoo/decode/fused_decode_body.h``)."""

    name: str
    value: Callable[[torch.Tensor], torch.Tensor]
    derivative: Callable[[torch.Tensor], torch.Tensor]
    triton_value: str
    triton_derivative: str


#: the selection rules known by name (selective attention's ReLU)
SELECTION_RULES: dict[str, SelectionRule] = {
    "relu": SelectionRule("relu", torch.relu, _relu_derivative, "tl.maximum({x}, 0.0)",
                          "tl.where({x} > 0.0, 1.0, 0.0)"),
}


@dataclass(frozen=True)
class PointwiseSelection:
    """An accumulator's selection declared as a pointwise function of one selector head's logits:
    ``S[k, j] = value(l[k, j])`` on the causally visible pairs, 0 on the excluded ones; ``derivative(l) = dS/dl``
    there. ``exclude_first``: the key at position 1 is never selected (the protected BOS); ``exclude_self``: a
    query never selects its own key.

    ``rule``: the name of a known function (:data:`SELECTION_RULES`, e.g. ``"relu"``), which gives ``value`` and
    ``derivative`` (leave them out) and lets every fast path compute it, the fused C decoding step included; a
    ``value`` that is a known rule's own function (``torch.relu``) names that rule too. Without a rule, ``value``
    and ``derivative`` are any torch functions: the blocked kernels and the torch decoding step call them."""

    value: Callable[[torch.Tensor], torch.Tensor] | None = None
    derivative: Callable[[torch.Tensor], torch.Tensor] | None = None
    exclude_first: bool = False
    exclude_self: bool = True
    rule: str | None = None

    def __post_init__(self) -> None:
        if self.rule is None:
            if self.value is None or self.derivative is None:
                raise ValueError(f"PointwiseSelection needs a rule (one of {', '.join(SELECTION_RULES)}) or both "
                                 f"value and derivative")
            for known in SELECTION_RULES.values():  # a known rule's own function: that rule, exactly
                if self.value is known.value and self.derivative in (known.derivative, None):
                    object.__setattr__(self, "rule", known.name)
            return
        known = SELECTION_RULES.get(self.rule)
        if known is None:
            raise ValueError(f"PointwiseSelection: unknown rule {self.rule!r} (known: {', '.join(SELECTION_RULES)}); "
                             f"give value and derivative instead")
        for name in ("value", "derivative"):
            given = getattr(self, name)
            if given is None:
                object.__setattr__(self, name, getattr(known, name))
            elif given is not getattr(known, name):
                raise ValueError(f"PointwiseSelection(rule={self.rule!r}) takes its {name} from the rule: leave "
                                 f"{name} out, or give value and derivative without a rule")

    def select(self, logits: torch.Tensor, allowed: torch.Tensor, ctx: Context) -> torch.Tensor:
        """S on ``logits`` of the selector head (B, 1, Nq, Nk): ``value`` where the pair is allowed and not
        excluded, else 0 (a pair that is not kept never reaches ``value`` or its gradient)."""
        keep = allowed
        if self.exclude_first:
            keep = keep & (ctx.kpos != 1)
        if self.exclude_self:
            keep = keep & (ctx.kpos != ctx.qpos)
        zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
        return torch.where(keep, self.value(torch.where(keep, logits, zero)), zero)

    def triton(self):
        """The Triton lowering of a named rule (:class:`~attnzoo.transforms.lowering.TritonSelection`), or None."""
        known = SELECTION_RULES.get(self.rule) if self.rule is not None else None
        if known is None:
            return None
        keep = (["(kp != 1)"] if self.exclude_first else []) + (["(kp != qp)"] if self.exclude_self else [])
        return TritonSelection(keep=" & ".join(keep), value=known.triton_value, derivative=known.triton_derivative)


def declared_pointwise(acc) -> PointwiseSelection | None:
    """What the fast paths compute for accumulator ``acc`` in place of its :meth:`~AccumulatorTransform.selection`:
    its declared :class:`PointwiseSelection` when it has one selector head and no parameters, and the declaration
    describes the class's selection (made in the class that defines ``selection()``, or below it: a subclass that
    rewrites ``selection()`` but inherits ``pointwise()`` keeps the general path), else None. Chosen by what the
    transform declares, never by its class."""
    if acc is None or len(acc.heads()) != 1 or acc.parameters():
        return None
    mro = type(acc).__mro__
    defines_selection = next(c for c in mro if "selection" in c.__dict__)
    defines_pointwise = next(c for c in mro if "pointwise" in c.__dict__)
    if defines_selection is not defines_pointwise and issubclass(defines_selection, defines_pointwise):
        return None
    return acc.pointwise()


class AccumulatorTransform(Transform):
    """Slot ``accumulator``: a non-negative selection ``S[b, k, j]`` (query k marks key j); backends subtract
    ``F[b, i, j] = sum over earlier queries k < i of S[b, k, j]`` from every head's logits.

    The selection reads the logits of a few query heads only (:meth:`heads`), so a backend computes just those.
    """

    def heads(self) -> list[int]:
        """The query heads whose logits :meth:`selection` reads, in the order they are passed."""
        raise NotImplementedError

    def selection(
        self, logits: torch.Tensor, allowed: torch.Tensor, ctx: Context, params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """logits (B, len(heads()), Nq, Nk) of :meth:`heads` after the logits slot; ``allowed`` and ``ctx``
        restricted to those heads (``ctx.heads`` holds their indices) → S (B, 1, Nq, Nk) >= 0. The default
        computes the :meth:`pointwise` declaration (a transform that declares one need not write this)."""
        declared = self.pointwise()
        if declared is None:
            raise NotImplementedError
        return declared.select(logits, allowed, ctx)

    def pointwise(self) -> PointwiseSelection | None:
        """Optional: the selection declared as a pointwise function of one selector head's logits (``heads()`` has
        one entry, no parameters): :meth:`selection` then defaults to it, and every fast path takes it whatever the
        class (the fused kernels of ``blocked``, its decoding steps, in C for a named ``rule``; the Triton lowering
        of a named rule): :func:`declared_pointwise`. None (the default): not pointwise."""
        return None

    def triton(self):
        """The Triton lowering of a declared pointwise selection with a named rule (:func:`declared_pointwise`),
        else None (a transform may write its own)."""
        declared = declared_pointwise(self)
        return declared.triton() if declared is not None else None


class NormaliserTransform(Transform):
    """Slot ``normaliser``: an extra logit per head that joins every row's softmax denominator and attends to
    nothing (an attention sink, gpt-oss style; a fixed 0 is the "off-by-one" softmax):

    ``p[h, i, j] = exp(l[h, i, j]) / (exp(sink[h]) + sum over allowed j' of exp(l[h, i, j']))``

    so a row's weights sum to less than 1 and a row with no allowed key outputs 0. One per spec.
    """

    def sink(self, heads: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sink logit of the query heads ``heads`` (1, H', 1, 1) int64 → a float tensor of that shape."""
        raise NotImplementedError


#: the functions a pointwise probability map may name (:class:`PointwiseMap`): those ``blocked`` has a fused node for
MAP_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class PointwiseMap:
    """A probability map declared pointwise: ``w = function(l + row_bias(qpos) + p[h])`` on the allowed pairs, 0
    elsewhere, no normalisation. ``function``: a name in :data:`MAP_FUNCTIONS` (``"sigmoid"``); ``row_bias(qpos,
    dtype)``: the bias at the query positions (any shape, the same shape back); ``offset``: the name of a per-head
    parameter (shape ``("H",)``) added to it, or None."""

    function: str
    row_bias: Callable[[torch.Tensor, torch.dtype], torch.Tensor]
    offset: str | None = None

    def __post_init__(self) -> None:
        if self.function not in MAP_FUNCTIONS:
            raise ValueError(f"PointwiseMap: unknown function {self.function!r} (known: {', '.join(MAP_FUNCTIONS)})")

    def bias(self, ctx: Context, params: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The bias broadcastable to (B, H', Nq, 1) in ``dtype``."""
        b = self.row_bias(ctx.qpos, dtype)
        return b if self.offset is None else b + params[self.offset].to(dtype)[ctx.heads]

    def weights(self, logits, allowed, ctx, params) -> torch.Tensor:
        zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
        w = MAP_FUNCTIONS[self.function](torch.where(allowed, logits, zero) + self.bias(ctx, params, logits.dtype))
        return torch.where(allowed, w, torch.zeros((), dtype=w.dtype, device=w.device)).to(logits.dtype)


def declared_map(mapped) -> PointwiseMap | None:
    """What the fast paths compute for probability map ``mapped`` in place of its ``weights``: its declared
    :class:`PointwiseMap`, when the declaration describes the class's map (made in the class that defines
    ``weights()`` or below it; ``values()`` and ``combine()`` the identity; not a softmax map), else None. Chosen by
    what the transform declares, never by its class."""
    if mapped is None or mapped.softmax_map:
        return None
    mro = type(mapped).__mro__
    declared_in = next(c for c in mro if "pointwise" in c.__dict__)
    weights_in = next(c for c in mro if "weights" in c.__dict__)
    if weights_in is not declared_in and issubclass(weights_in, declared_in):
        return None  # weights() rewritten below the declaration
    if any(name in c.__dict__ for c in mro if c is not ProbabilityTransform for name in ("values", "combine")):
        return None  # rows or outputs mapped: not the declared w @ v
    return mapped.pointwise()


class ProbabilityTransform(Transform):
    """Slot ``probability``: the row map from the logits to the weights on the values, in place of the softmax
    (sigmoid attention, softpick, stick-breaking, differential attention's pair of softmaxes). At most one per spec;
    a spec without one is softmax attention, exactly as before (docs/specs.md, "The probability slot").

    The reference form is :meth:`weights`: the logits (B, H, Nq, Nk) as they stand after the logits slot and the
    accumulator's subtraction of F, the allowed pairs (bool, broadcastable to the logits) and the context → the
    weights (B, H, Nq, Nk), exactly 0 where ``allowed`` is False (a row with no allowed key: all 0). The logits at
    pairs that are not allowed may hold anything (-inf, a large number): read them only through ``allowed``
    (``torch.where(allowed, logits, 0)`` first, so that no NaN or inf reaches the gradient). Compare positions
    (``ctx.kpos``, ``ctx.qpos``), never slot indices: a decode cache may hold its keys in any order.

    The blocked form (optional; the ``blocked`` backend declines a map without it) computes the same weights
    online over key blocks, as flash attention does for the softmax: :meth:`start` makes a state for one block of
    queries, :meth:`update` merges one key block into it, :meth:`finish` gives the outputs. ``order`` says which
    key blocks come first: ``"any"`` (the merge is order-free: sums, a running maximum) or ``"reverse"`` (from the
    block nearest the queries back to the first: the merge carries what the later keys left, as stick-breaking's
    running sum of log(1 - sigma)). A backend must give the same result, up to rounding, as :meth:`weights`.

    Several maps per head (differential attention): :meth:`values` gives the rows each map reads (the values
    (B, H, Nk, D) after the value slot, repeated to the query heads → (B, H, Nk, D'), per key token: a token's rows
    from its own rows, all heads, so that a backend may apply it one key block at a time) and :meth:`combine` maps
    the maps' outputs (B, H, Nq, D') to each head's (B, H, Nq, D). Both default to the identity. The output is

        ``combine(weights(l) @ values(v))``

    and the blocked form computes ``combine(finish(update(... start(...), values(v_block) ...)))``.
    """

    #: the order the blocked form takes key blocks in: "any", or "reverse" (nearest block first, by position)
    order: ClassVar[str] = "any"
    #: the blocked-form methods ("start", "update", "finish") that declare a parameter ``step``: a backend hands
    #: those, and only those, the :class:`MapStep` as the keyword ``step`` (set for each class when it is defined)
    takes_step: ClassVar[frozenset[str]] = frozenset()
    #: True when :meth:`weights` is the masked softmax itself (a row with no allowed key: all 0) and the
    #: transform's own work is in :meth:`values` and :meth:`combine` (differential attention): a backend may then
    #: compute it as softmax attention over ``values(v)`` with its softmax kernels, and ``combine`` the result
    softmax_map: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.takes_step = frozenset(name for name in ("start", "update", "finish") if _declares_step(getattr(cls, name)))

    def weights(self, logits: torch.Tensor, allowed: torch.Tensor, ctx: Context,
                params: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits (B, H, Nq, Nk), allowed (bool, broadcastable) → weights (B, H, Nq, Nk), 0 where not allowed.
        The default computes the :meth:`pointwise` declaration (a map that declares one need not write this)."""
        declared = self.pointwise()
        if declared is None:
            raise NotImplementedError
        return declared.weights(logits, allowed, ctx, params)

    def pointwise(self) -> PointwiseMap | None:
        """Optional: the map declared pointwise (:class:`PointwiseMap`): :meth:`weights` then defaults to it, and
        ``blocked`` runs it as one autograd node (``sigmoid_blocks.py``) whatever the class
        (:func:`declared_map`). None (the default): not declared."""
        return None

    def values(self, vs: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The rows the maps weigh: vs (B, H, Nk, D) → (B, H, Nk, D'); the identity by default."""
        return vs

    def combine(self, out: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The maps' outputs (B, H, Nq, D') → each head's output (B, H, Nq, D); the identity by default."""
        return out

    # -- the blocked form (optional) ------------------------------------------------------------------------------
    def start(self, out_shape: tuple[int, ...], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of one block of queries before any key: ``out_shape`` is (B, H, Bq, D') (D' the width of
        :meth:`values`), ``like`` the queries (their dtype and device; keep sums in at least float32).

        Each of the three methods may declare one more parameter, ``step``: it then gets the step's
        :class:`MapStep` (the number of keys each query sees over all the key blocks, the query positions) as the
        keyword ``step``; a method without it is called as written here."""
        raise NotImplementedError

    def update(self, state: dict[str, torch.Tensor], logits: torch.Tensor, allowed: torch.Tensor,
               values: torch.Tensor, ctx: Context, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Merge one key block: its logits (B, H, Bq, Bk), allowed pairs (broadcastable), rows from :meth:`values`
        (B, H, Bk, D') and context (``ctx.kpos`` the block's key positions) → the new state. Do not change the
        state's tensors in place (autograd may hold them)."""
        raise NotImplementedError

    def finish(self, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The state after the last key block → the maps' outputs (B, H, Bq, D'), before :meth:`combine`."""
        raise NotImplementedError

    @classmethod
    def has_blocked_form(cls) -> bool:
        """Whether the class implements :meth:`start`, :meth:`update` and :meth:`finish`."""
        return cls.start is not ProbabilityTransform.start


def _declares_step(method) -> bool:
    """Whether ``method`` takes a parameter named ``step`` by keyword (not through ``*args`` or ``**kwargs``)."""
    try:
        parameter = inspect.signature(method).parameters.get("step")
    except (TypeError, ValueError):  # no signature to read (a builtin): called without it
        return False
    return parameter is not None and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)


def _blocked_form_problem(cls) -> str | None:
    """A probability transform's blocked form is all of start(), update() and finish(), or none of them."""
    if cls.order not in ("any", "reverse"):
        return f"order must be 'any' or 'reverse', got {cls.order!r}"
    names = ("start", "update", "finish")
    done = [n for n in names if getattr(cls, n) is not getattr(ProbabilityTransform, n)]
    if done and len(done) < len(names):
        lacking = [f"{n}()" for n in names if n not in done]
        return (f"it implements {', '.join(f'{n}()' for n in done)} but not {', '.join(lacking)}: the blocked "
                "form is all three (or none)")
    return None


def gelu_dot_tanh(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """tanh(u · GELU(x)) per row: rows (B, Hx, N, D), weight (Hx, D) or (D,) → (B, Hx, N)."""
    g = torch.nn.functional.gelu(rows)
    if weight.dim() == 1:
        return torch.tanh(g @ weight)
    # (B, Hx, N, D) @ (Hx, D, 1): one batched matmul per head (einsum's own dispatch cost a tenth of a decode step's
    # row maps on the CPU)
    return torch.tanh((g @ weight.unsqueeze(-1)).squeeze(-1))


#: The methods each slot's base class leaves to its transforms (a transform that inherits one unimplemented is
#: refused at registration, not met as a bare NotImplementedError at its first call).
_REQUIRED = ((RowScaleTransform, "scale"), (RowMapTransform, "map"), (LogitsTransform, "apply"),
             (MaskTransform, "allowed"), (AccumulatorTransform, "selection"), (NormaliserTransform, "sink"),
             (ProbabilityTransform, "weights"))

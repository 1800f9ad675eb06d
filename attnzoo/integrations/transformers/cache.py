"""``AttnzooCache``: a transformers ``Cache`` whose layers are attnzoo ``KVCache`` objects (docs/transformers.md).

transformers holds no copy of the keys and values: a layer's ``update()`` hands the new ones back untouched and the
attention function prefills or decodes the layer's ``KVCache`` (the spec's evictor, the layer's budget, and, for a
sliding-window layer, no token that no later query can see). ``cache.layers[i].kv`` is layer i's ``KVCache``.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...decode.create import check_fraction, prompt_budget
from ...decode.quant import check_bits, check_head_dim, check_recent
from ...decode.rewind import mark, rewind, rewind_refusal
from ...evictors.base import budget_problem, is_fraction
from ...nn import Attention
from .base import CONFIG_KEY, CORE_NAME, UNSET, IntegrationError, applied_modules, where


def check_budget_value(value, here: str):
    """``value`` if it is a budget: an int >= 1 (tokens), a float in (0, 1] (a fraction of each request's prompt,
    resolved at its prefill: :meth:`AttnzooLayer.resolve_budget`) or None; else one line naming ``here``."""
    problem = budget_problem(value)
    if problem:
        raise IntegrationError(f"{here}: {problem}")
    return value


def budgets_for(budget, spec, count: int) -> list[int | None]:
    """One budget per layer: the spec's ``cache.budget`` by default; an int or None for every layer; or a list."""
    if budget is UNSET:
        budget = spec.cache.budget if spec is not None and spec.cache is not None else None
    if isinstance(budget, (list, tuple)):
        if len(budget) != count:
            raise IntegrationError(f"budget lists {len(budget)} values but the model has {count} attention layers")
        return [check_budget_value(b, f"budget[{i}]") for i, b in enumerate(budget)]
    return [check_budget_value(budget, "budget")] * count


def layer_budgets(model, budget, *, shape: str = "pyramid", slope: float = 0.5) -> list:
    """One budget per attention layer of ``model`` (after :func:`~attnzoo.integrations.transformers.apply`, or an
    int: the number of layers), for ``apply(model, spec, budget=...)`` and ``AttnzooCache(model, budget=...)``,
    holding what ``budget`` in every layer holds in all: ``"flat"``, ``budget`` everywhere; ``"pyramid"``
    (PyramidKV's shape), a straight line from ``(1 + slope) x budget`` at the first layer to ``(1 - slope) x
    budget`` at the last (a model's early layers attend broadly, its late ones to few tokens). An int budget is
    split in whole tokens that add up to ``layers x budget`` (largest remainders); a fraction of the prompt stays a
    fraction (the first layer's must be <= 1)."""
    count = model if isinstance(model, int) and not isinstance(model, bool) else len(applied_modules(model))
    if count < 1:
        raise IntegrationError(f"layer_budgets: the number of layers must be >= 1, got {count}")
    if shape not in ("flat", "pyramid"):
        raise IntegrationError(f"layer_budgets: shape must be 'flat' or 'pyramid', got {shape!r}")
    if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not 0 <= slope < 1:
        raise IntegrationError(f"layer_budgets: slope must be a number in [0, 1), got {slope!r}")
    problem = budget_problem(budget)
    if problem or budget is None:
        raise IntegrationError(f"layer_budgets: {problem or 'a budget is needed (None keeps every token)'}")
    if shape == "flat" or count == 1:
        return [budget] * count
    weights = [1 + slope - 2 * slope * i / (count - 1) for i in range(count)]
    if is_fraction(budget):
        if budget * weights[0] > 1:
            raise IntegrationError(f"layer_budgets: the first layer's fraction {budget * weights[0]:.3g} is over 1 "
                                   f"(budget {budget}, slope {slope}): use a smaller slope or budget")
        return [budget * w for w in weights]
    exact = [budget * w for w in weights]
    whole = [int(x) for x in exact]
    for i in sorted(range(count), key=lambda i: whole[i] - exact[i])[:count * budget - sum(whole)]:
        whole[i] += 1  # largest remainders first (ties to the earlier layer)
    if min(whole) < 1:
        raise IntegrationError(f"layer_budgets: the last layer would hold no token (budget {budget}, slope {slope}): "
                               f"use a smaller slope or a larger budget")
    return whole


def validate_budget(core: Attention, budget, module) -> None:
    """Refuse at apply time a budget the layer's cache would refuse: a token count by the evictor's rule; a
    fraction of the prompt (checked by the evictor once resolved) where there is no evictor, or one that accepts
    no budget."""
    try:
        if is_fraction(budget):
            check_fraction(core.variant.plan, budget)
            return
        core.new_cache(1, budget=budget)
    except ValueError as exc:
        raise IntegrationError(f"{where(module)}: {exc}") from None


class AttnzooLayer(CacheLayerMixin):
    """One layer of :class:`AttnzooCache`: an attnzoo ``KVCache`` (:attr:`kv`, created at the first forward, for
    its batch) and the count of tokens seen. ``keys``/``values`` stay None: transformers holds no copy of them."""

    is_compileable = False
    is_croppable = False  # assisted decoding crops inside a step's tokens: only a prefill's end is kept (crop_to)
    is_sliding = False
    supports_early_init = False
    #: (tokens seen, attnzoo.decode.rewind.Mark) at the end of each prefill with nothing evicted since: crop_to
    _marks: tuple = ()
    #: tokens of the last step (update): a step after a prefill keeps the state the prefill left
    _last_step = 0

    def __init__(self, index: int, core: Attention, budget: int | None, kv_bits: int | None = None,
                 kv_rotate: bool = True, evict: str = "always", kv_recent: int = 0) -> None:
        super().__init__()
        self.index = index
        self.core = core
        self.budget = budget
        #: 8, 4, 3 or 2: the layer's keys and values are held in that many bits between steps (KVCache.pack); None: full
        self.kv_bits = kv_bits
        #: quantized in Hadamard-rotated coordinates (KVCache.pack's ``rotate``)
        self.kv_rotate = kv_rotate
        #: the newest tokens held at full precision as well (KVCache.pack's ``recent``)
        self.kv_recent = kv_recent
        #: "always": the budget holds at every step; "prefill": a prefill evicts down to it, a one-token step keeps
        #: every token it appends (the cache grows while decoding, as kvpress's compressed contexts do)
        self.evict = evict
        self._step_budget: int | None = None  # the budget resolved at the first prefill ("prefill" mode)
        self.kv = None
        self.seen = 0
        self._pending: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"AttnzooLayer(index={self.index}, seen={self.seen}, kv={self.kv!r})"

    # transformers' layer API ----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand the new tokens back untouched (the attention function appends them to the attnzoo cache)."""
        self.is_initialized = True
        self._remember(key_states.shape[-2])
        self.seen += key_states.shape[-2]
        self._pending = key_states
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen (padding included), not tokens held: transformers derives positions and input slicing from
        it. :meth:`AttnzooCache.memory` reports the tokens held."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv = None
        self._marks, self._last_step = (), 0
        self.seen = 0
        self._pending = None
        self.is_initialized = False

    def offload(self) -> None:  # the attnzoo cache stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' layer crop: ``tokens_to_remove`` < 0 drops that many of the last tokens seen (0: nothing).
        Only back to the end of a prefill with nothing evicted or expired since (:meth:`crop_refusal`)."""
        if tokens_to_remove == 0:
            return
        self.crop_to(self.seen - abs(tokens_to_remove))

    def crop_refusal(self, seen: int) -> str | None:
        """Why this layer cannot go back to ``seen`` tokens seen, or None (a no-op when ``seen`` >= the tokens
        seen): ``seen`` must be the end of a prefill (a step of several tokens) after which this layer evicted or
        expired nothing (the tokens it held then are all held still) and reordered no row."""
        if seen >= self.seen or self.kv is None:
            return None
        found = [at for n, at in self._marks if n == seen]
        if not found:
            kept = [n for n, at in self._marks if rewind_refusal(self.kv, at) is None]
            return (f"it keeps no state at {seen} tokens seen (it keeps the state at the end of each prefill of "
                    f"several tokens until a token is evicted or expired since, or the rows are reordered; kept "
                    f"now: {kept or 'none'})")
        return rewind_refusal(self.kv, found[0])

    def crop_to(self, seen: int) -> None:
        """Go back to ``seen`` tokens seen (:meth:`crop_refusal`): the tokens after it dropped, the tokens held
        then with the scores they had then."""
        if seen >= self.seen or self.kv is None:
            return
        problem = self.crop_refusal(seen)
        if problem:
            raise IntegrationError(f"AttnzooCache layer {self.index} cannot crop to {seen} tokens: {problem}; to ask "
                                   f"several questions of one compressed context, pass context_cache.copy() to each "
                                   f"generate() (docs/transformers.md)")
        rewind(self.kv, next(at for n, at in self._marks if n == seen))
        self._marks = tuple((n, at) for n, at in self._marks if n <= seen)
        self.seen, self._pending, self._last_step = seen, None, 0

    def copy(self) -> AttnzooLayer:
        """This layer with a deep copy of its ``KVCache`` (:meth:`KVCache.copy`); the marks it can crop back to are
        shared (never written)."""
        new = copy.copy(self)
        new.kv = None if self.kv is None else self.kv.copy()
        new._pending = None  # noqa: SLF001 -- the copy of this class's own instance
        return new

    def _remember(self, new_tokens: int) -> None:
        """At the start of a step: keep the state the previous step left if it was a prefill (several tokens), to
        crop back to; forget the kept states that an eviction or expiry since made unreachable."""
        if self._marks and self.kv is not None:
            self._marks = tuple((n, at) for n, at in self._marks if rewind_refusal(self.kv, at) is None)
        if self._last_step > 1 and self.kv is not None and self.seen not in (n for n, _ in self._marks):
            self._marks = (*self._marks, (self.seen, mark(self.kv)))
        self._last_step = new_tokens

    def resolve_budget(self, k: torch.Tensor, key_mask, here: str) -> int | None:
        """The token budget of the ``KVCache`` this layer creates at its first step: :attr:`budget` as given, or,
        for a fraction of the prompt, that fraction of the first step's real tokens (the longest row's, for a
        left-padded batch: the cache is dense, one budget for every row), at least the smallest budget the evictor
        accepts (:func:`attnzoo.decode.create.prompt_budget`)."""
        if not is_fraction(self.budget):
            return self.budget
        tokens = k.shape[-2] if key_mask is None else int(key_mask.sum(-1).max())
        try:
            return prompt_budget(self.core.variant.plan, self.budget, max(tokens, 1))
        except ValueError as exc:
            raise IntegrationError(f"{here}: {exc}") from None

    def _reorder(self, index: torch.Tensor) -> None:
        self._marks = ()  # rows moved: the states kept to crop back to are other rows'
        if self.kv is None:
            return
        self.kv.reorder(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv is not None:
            self._reorder(torch.arange(self.kv.batch).repeat_interleave(repeats))

    # attnzoo ----------------------------------------------------------------------------------------------------
    def attend(self, core: Attention, q, k, v, key_mask, given, here: str, x=None) -> torch.Tensor:
        """Prefill (T > 1) or decode (T = 1) the new tokens q (B, H, T, D), k/v (B, H_kv, T, D) into this layer's
        attnzoo cache; ``key_mask`` (B, T) or None; ``given`` (B, T) 1-based positions from transformers, or
        None."""
        if self._pending is not k:
            raise IntegrationError(f"{here}: the keys handed to attention are not those AttnzooCache.update() "
                                   f"returned (a model family that post-processes cached keys is not supported)")
        self._pending = None
        b = q.shape[0]
        if self.kv is not None and self.kv.batch != b:
            raise IntegrationError(f"{here}: AttnzooCache holds batch {self.kv.batch}, the model was called with "
                                   f"batch {b}")
        positions = given
        if self.kv is None:
            self.kv = core.new_cache(b, budget=self.resolve_budget(k, key_mask, here))
            self._step_budget = self.kv.budget
            start = first_positions(positions, key_mask)
            if start is not None:
                self.kv.next_position = start
        if positions is not None:
            check_cache_positions(self.kv, positions, key_mask, here)
        if self.evict == "prefill":  # the budget at a prefill, none at a one-token step
            want = self._step_budget if q.shape[2] > 1 else None
            if self.kv.budget != want:
                self.kv.budget = want
                self.kv.step_state.forget()
        if self.kv_bits is not None:  # dequantized for this step; its new tokens attended as given, packed after it
            self.kv.unpack()
        if q.shape[2] == 1:
            out = core.decode(q, k, v, self.kv, key_mask=key_mask, x=x)
        else:
            out = core.prefill(q, k, v, self.kv, key_mask=key_mask, x=x)
        if self.kv_bits is not None:
            self.kv.pack(self.kv_bits, self.kv_rotate, self.kv_recent)
        return out

    def memory(self) -> dict:
        report = {"layer": self.index, "seen": self.seen, "budget": self.budget, "tokens": 0, "evicted": 0,
                  "expired": 0, "bytes": 0, "allocated_bytes": 0, "kv_bits": None}
        if self.kv is not None:
            report.update(self.kv.memory())
        return report


def first_positions(pos, key_mask) -> torch.Tensor | None:
    """Where each row starts when transformers' positions do not start at 0 (a continued sequence): the 1-based
    position of each row's first real token, or None when every row starts at 1."""
    if pos is None:
        return None
    real = key_mask if key_mask is not None else torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
    first = torch.where(real, pos, torch.iinfo(torch.int64).max).min(-1).values
    first = torch.where(real.any(-1), first, torch.ones_like(first))
    if bool((first == 1).all()):
        return None
    if bool((first < 1).any()):
        raise IntegrationError(f"position_ids start below 0: {(first - 1).tolist()}")
    return first


def check_cache_positions(kv, pos, key_mask, here: str) -> None:
    """The cache numbers each row's real tokens itself; refuse when transformers' position_ids (which drove RoPE)
    disagree, rather than give position-aware transforms other positions than the model's."""
    n = pos.shape[1]
    next_position = kv.next_position
    start = next_position.to(pos.device)
    if key_mask is None:
        expected = start[:, None] + torch.arange(n, device=pos.device)
        bad = pos != expected
    else:
        real = key_mask.to(torch.int64)
        expected = start[:, None] + real.cumsum(-1) - real
        bad = (pos != expected) & key_mask
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0].tolist())
        raise IntegrationError(f"{here}: position_ids disagree with the attnzoo cache: row {row}, new token {col} "
                               f"has position_id {int(pos[row, col]) - 1} where the cache expects "
                               f"{int(expected[row, col]) - 1} (one position per real token, padding excluded)")


class AttnzooCache(Cache):
    """A transformers ``Cache`` backed by one attnzoo ``KVCache`` per attention layer (the spec's evictor).

    ``AttnzooCache(model)`` after :func:`~attnzoo.integrations.transformers.apply`; ``budget`` (int, None or one
    value per layer) defaults to the budget recorded by ``apply``. ``update()`` hands the new keys and values back
    untouched; the attention function prefills or decodes the layer's ``KVCache``, so transformers holds no copy.
    ``cache.layers[i].kv`` (or ``cache.kv_caches[i]``) is layer i's ``KVCache``, with its own ``memory()``. Beam
    search (``reorder_cache``), ``batch_select_indices`` and ``batch_repeat_interleave`` reorder the rows of every
    ``KVCache``. :meth:`copy` is a deep copy (one compressed context, several questions: pass a copy to each
    ``generate()``); :meth:`crop` goes back to the end of a prefill only while nothing was evicted since (assisted
    decoding stays refused). A ``budget`` that is a float in (0, 1] is that fraction of each request's prompt,
    resolved per layer at its first step (:meth:`AttnzooLayer.resolve_budget`) and fixed while decoding.
    :meth:`memory` reports tokens and bytes per layer.
    ``kv_bits`` (8, 4, 3 or 2; None: full precision) holds every layer's keys and values in that many bits between steps
    (``KVCache.pack``, docs/decoding.md "Quantized keys and values"): each step dequantizes its layer's cache,
    attends its new tokens in full precision, and packs them with the rest after it; ``kv_rotate`` (default True)
    quantizes each token in Hadamard-rotated coordinates (outlier channels no longer set its scale; False: the
    head's own coordinates); ``kv_recent`` (default 0) holds each layer's newest ``kv_recent`` tokens at full
    precision as well (their codes are read once they are no longer the newest; the bytes counted). ``evict``:
    ``"always"`` (default) keeps the budget at every step, so memory stays bounded however long the generation;
    ``"prefill"`` compresses each prompt (a step of several tokens) down to the budget and keeps every generated
    token (memory grows by the tokens generated: kvpress's way, a compressed context then a free answer)."""

    def __init__(self, model, budget=UNSET, kv_bits: int | None = None, kv_rotate: bool = True,
                 evict: str = "always", kv_recent: int = 0) -> None:
        try:
            check_recent(kv_recent)
        except ValueError as exc:
            raise IntegrationError(f"AttnzooCache: {exc}") from None
        if kv_recent and kv_bits is None:
            raise IntegrationError(f"AttnzooCache: kv_recent={kv_recent} keeps the newest tokens at full precision "
                                   f"beside quantized ones: give kv_bits too")
        if not isinstance(kv_rotate, bool):
            raise IntegrationError(f"AttnzooCache: kv_rotate must be True or False, got {kv_rotate!r}")
        if evict not in ("always", "prefill"):
            raise IntegrationError(f"AttnzooCache: evict must be 'always' or 'prefill', got {evict!r}")
        if kv_bits is not None:
            try:
                check_bits(kv_bits, "kv_bits")
            except ValueError as exc:
                raise IntegrationError(f"AttnzooCache: {exc}") from None
        modules = applied_modules(model)
        record = getattr(model.config, CONFIG_KEY)
        if budget is UNSET:
            budget = record.get("budget")
        budgets = budgets_for(budget, None, len(modules))
        layers = []
        for module, b in zip(modules, budgets, strict=True):
            core = getattr(module, CORE_NAME)
            validate_budget(core, b, module)
            if kv_bits is not None:
                try:
                    check_head_dim(core.head_dim, kv_bits, "kv_bits")
                except ValueError as exc:
                    raise IntegrationError(f"{where(module)}: {exc}") from None
            layers.append(AttnzooLayer(module.layer_idx, core, b, kv_bits, kv_rotate, evict, kv_recent))
        super().__init__(layers=layers)
        self.kv_bits = kv_bits
        self.kv_rotate = kv_rotate
        self.kv_recent = kv_recent
        self.evict = evict

    def layer_for(self, module) -> AttnzooLayer:
        """The cache layer of attention ``module`` (its ``layer_idx``), refused in one line when this cache was made
        for another model or before ``apply()`` ran again."""
        index = module.layer_idx
        layer = self.layers[index] if 0 <= index < len(self.layers) else None
        if layer is None or layer.core is not getattr(module, CORE_NAME, None):
            raise IntegrationError(f"{where(module)}: this AttnzooCache was made for another model (or before apply() "
                                   f"ran again): make a new AttnzooCache(model)")
        return layer

    def copy(self) -> AttnzooCache:
        """A deep copy: every layer's ``KVCache`` copied (its keys, values, positions and per-token scores; no
        pickle), the model's attention cores shared. Compress a context once (``model(context_ids, cache=cache)``),
        then answer each question with ``generate(context_and_question_ids, cache=cache.copy())``: the context cache
        stays as it was."""
        new = copy.copy(self)
        new.layers = [layer.copy() for layer in self.layers]
        return new

    def crop(self, max_length: int) -> None:
        """Go back to ``max_length`` tokens seen (a negative ``max_length``: drop that many of the last tokens
        seen, as transformers' ``Cache.crop`` takes it), in every layer or none: only to the end of a prefill (a
        call of several tokens, such as a compressed context) after which no layer evicted or expired a token and no
        row was reordered; the tokens after it are dropped and the tokens held keep the scores they had then.
        Otherwise one line says why (an evicted token cannot be brought back) and points to :meth:`copy`."""
        seen = self.get_seq_length()
        target = seen + max_length if max_length < 0 else max_length
        if target < 0:
            raise IntegrationError(f"AttnzooCache.crop({max_length}): the cache has seen {seen} tokens")
        for layer in self.layers:  # every layer checked first: a refusal leaves the cache as it was
            problem = layer.crop_refusal(target)
            if problem:
                raise IntegrationError(f"AttnzooCache.crop({max_length}): layer {layer.index} cannot go back to "
                                       f"{target} tokens seen: {problem}; to ask several questions of one compressed "
                                       f"context, pass context_cache.copy() to each generate() (docs/transformers.md)")
        for layer in self.layers:
            layer.crop_to(target)

    @property
    def kv_caches(self) -> list:
        """The attnzoo ``KVCache`` of each layer (None before the first forward)."""
        return [layer.kv for layer in self.layers]

    @property
    def budgets(self) -> list[int | None]:
        return [layer.budget for layer in self.layers]

    def memory(self) -> list[dict]:
        """Per layer: ``layer``, ``seen`` (tokens processed), ``tokens`` (held per row and head), ``budget``,
        ``evicted`` (by the evictor), ``expired`` (past a window), ``bytes`` (held) and ``allocated_bytes``."""
        return [layer.memory() for layer in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(layer.kv.nbytes for layer in self.layers if layer.kv is not None)

    @property
    def batch_size(self) -> int:
        sizes = {layer.kv.batch for layer in self.layers if layer.kv is not None}
        return sizes.pop() if len(sizes) == 1 else -1


def recording_cache(model):
    """A transformers ``Cache`` whose layers hand keys back untouched and remember them, as AttnzooCache's do."""
    class ProbeLayer(AttnzooLayer):
        def __init__(self, index: int = 0) -> None:
            super().__init__(index, None, None)

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(text, "num_hidden_layers", None)
    if isinstance(count, int) and 0 < count <= 4096:
        return Cache(layers=[ProbeLayer(i) for i in range(count)])
    return Cache(layer_class_to_replicate=ProbeLayer)

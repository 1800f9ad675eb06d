"""``AttnzooCache``: a transformers ``Cache`` whose layers are attnzoo ``KVCache`` objects (docs/transformers.md).

transformers holds no copy of the keys and values: a layer's ``update()`` hands the new ones back untouched and the
attention function prefills or decodes the layer's ``KVCache`` (the spec's evictor, the layer's budget, and, for a
sliding-window layer, no token that no later query can see). ``cache.layers[i].kv`` is layer i's ``KVCache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...decode.quant import check_bits
from ...nn import Attention
from .base import CONFIG_KEY, CORE_NAME, UNSET, IntegrationError, applied_modules, where


def check_budget_value(value, here: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IntegrationError(f"{here}: a budget must be an int >= 1 or None, got {value!r}")
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


def validate_budget(core: Attention, budget, module) -> None:
    try:
        core.new_cache(1, budget=budget)
    except ValueError as exc:
        raise IntegrationError(f"{where(module)}: {exc}") from None


class AttnzooLayer(CacheLayerMixin):
    """One layer of :class:`AttnzooCache`: an attnzoo ``KVCache`` (:attr:`kv`, created at the first forward, for
    its batch) and the count of tokens seen. ``keys``/``values`` stay None: transformers holds no copy of them."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, index: int, core: Attention, budget: int | None, kv_bits: int | None = None) -> None:
        super().__init__()
        self.index = index
        self.core = core
        self.budget = budget
        #: 8 or 4: the layer's keys and values are held in that many bits between steps (KVCache.pack); None: full
        self.kv_bits = kv_bits
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
        self.seen = 0
        self._pending = None
        self.is_initialized = False

    def offload(self) -> None:  # the attnzoo cache stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise IntegrationError("AttnzooCache cannot crop (assisted or speculative decoding): an evicting cache "
                               "cannot give tokens back")

    def _reorder(self, index: torch.Tensor) -> None:
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
            self.kv = core.new_cache(b, budget=self.budget)
            start = first_positions(positions, key_mask)
            if start is not None:
                self.kv.next_position = start
        if positions is not None:
            check_cache_positions(self.kv, positions, key_mask, here)
        if self.kv_bits is not None:  # dequantized for this step; its new tokens attended as given, packed after it
            self.kv.unpack()
        if q.shape[2] == 1:
            out = core.decode(q, k, v, self.kv, key_mask=key_mask, x=x)
        else:
            out = core.prefill(q, k, v, self.kv, key_mask=key_mask, x=x)
        if self.kv_bits is not None:
            self.kv.pack(self.kv_bits)
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
    ``KVCache``; ``crop`` is refused (assisted decoding). :meth:`memory` reports tokens and bytes per layer.
    ``kv_bits`` (8 or 4; None: full precision) holds every layer's keys and values in that many bits between steps
    (``KVCache.pack``, docs/decoding.md "Quantized keys and values"): each step dequantizes its layer's cache,
    attends its new tokens in full precision, and packs them with the rest after it."""

    def __init__(self, model, budget=UNSET, kv_bits: int | None = None) -> None:
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
            if kv_bits == 4 and core.head_dim % 2:
                raise IntegrationError(f"{where(module)}: kv_bits=4 packs two codes a byte: the head size must be "
                                       f"even, got {core.head_dim}")
            layers.append(AttnzooLayer(module.layer_idx, core, b, kv_bits))
        super().__init__(layers=layers)
        self.kv_bits = kv_bits

    def _layer_for(self, module) -> AttnzooLayer:
        index = module.layer_idx
        layer = self.layers[index] if 0 <= index < len(self.layers) else None
        if layer is None or layer.core is not getattr(module, CORE_NAME, None):
            raise IntegrationError(f"{where(module)}: this AttnzooCache was made for another model (or before apply() "
                                   f"ran again): make a new AttnzooCache(model)")
        return layer

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

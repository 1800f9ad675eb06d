"""The fast decoding steps (docs/decoding.md, "A step validated once"): what a backend offers through
``Backend.decode_step`` once the full path has validated a cache's step, with the preconditions each needs.

- ``plain``: no evictor, and no transforms or only sliding windows and chunks (:data:`SPAN_MASKS`): append the
  row, attend over every held token (:func:`attend_held`), drop what no later query sees.
- ``selective``: an accumulator (alone in the spec) with the ``selective`` evictor at its budget: the victim by the
  evictor's rule leaves, the new token takes its slot, attention, F updated in place. Chosen by what the accumulator
  declares, whatever its class: a pointwise selection is written out (in C for a named rule), any other takes the
  backend's one-query attention.
- ``sink_window``: no transforms, sink + window at its budget: the same with the evictor's rule.
- ``h2o``, ``tova``, ``snapkv``: no transforms, at their budget, evicting after attention: the new token into the
  spare slot, attention over budget + 1 tokens, the evictor's ``update`` and ``victim``, the spare token into the
  victim's slot.

Each torch step calls the evictor's own Python rule (``score``/``protected``/``largest`` through
``Evictor.victim``, and ``update``) over the held slots as they are (:class:`SlotView`: out of position order, ties
to the oldest position); the fused C form of a step (:mod:`.fused`) is that rule's second implementation, given its
options by the evictor (``Evictor.kernel_rule``) and held to the Python rule by :func:`.check.check_fast_step`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..core.numerics import ACCUMULATED_STATE, accumulator_dtype
from ..transforms.base import Slot, declared_pointwise
from . import fused, layout
from .state import FastStep
from .step import drop_expired

#: masks under which a query at position i sees exactly the keys at positions earliest_key(i) .. i (and so does
#: any intersection of them): once ``drop_expired`` has run, a decoding step attends to every held token unmasked
SPAN_MASKS = frozenset({"sliding_window", "chunked"})
#: the dtypes of the written-out steps (the C steps' torch form) and of the C steps
_WRITTEN_OUT = (torch.float32, torch.float64)


# -- preconditions, checked before every fast step ------------------------------------------------------------------
def ready_plain(cache) -> bool:
    """Rows only and no evictor. Padding is masked by ``padding_bias``; under a window (the cache then holds only
    tokens the next query sees) there is none, and every row is at the same position."""
    return (cache.rows_only(padding=cache.horizon is None) and not cache.held_scores and cache.evictor is None
            and (cache.horizon is None or isinstance(cache.slot_buffers()[4], int)))


def ready_selective(cache) -> bool:
    """Rows and F only, at the budget."""
    scores = cache.held_scores
    return (cache.rows_only() and cache.num_tokens == cache.budget and cache.horizon is None and len(scores) == 1
            and ACCUMULATED_STATE in scores and cache.dense_scores(0))


def ready_scoring(cache) -> bool:
    """An evictor that scores after attention (H2O, TOVA): rows and the evictor's scores only, at the budget, with
    the spare slot the buffers keep for budget + 1. A score the full path left outside its buffer (an update() that
    assigned a new tensor, an eviction that gathered) is adopted into it here, once."""
    keys, _, _, held, _ = cache.slot_buffers()
    return (cache.rows_only() and held == cache.budget and cache.horizon is None
            and keys.shape[2] > held and set(cache.held_scores) == set(cache.evictor.state_names)
            and cache.dense_scores(1))


def ready_selective_any(cache) -> bool:
    """:func:`ready_selective`, and no held F below 0: the step picks the victim among the held tokens before the
    new one (F = 0) joins them, which is the full path's victim only while some eligible F is >= 0 (an accumulator
    whose S is >= 0, as the contract asks, always; one that breaks it takes the full path)."""
    return ready_selective(cache) and not bool((cache.held_scores[ACCUMULATED_STATE] < 0).any())


def ready_replacing(cache) -> bool:
    """An evictor without scores of its own (sink + window): rows only, at the budget."""
    return cache.rows_only() and cache.num_tokens == cache.budget and cache.horizon is None and not cache.held_scores


# -- the offer --------------------------------------------------------------------------------------------------------
def kernel_rule(evictor, budget):
    """The evictor's :class:`~attnzoo.evictors.base.KernelRule`, when its own class defines one (a subclass that
    changed the rule without it gets no fast step), else None."""
    if evictor is None or budget is None or "kernel_rule" not in type(evictor).__dict__:
        return None
    return evictor.kernel_rule(budget)


def offer(plan, cache, params, decode_one) -> FastStep | None:
    """The fast step for ``plan`` and ``cache`` after a validated full step, or None (``Backend.decode_step`` of
    the blocked backend; ``decode_one(plan, qs, ks, vs, qpos, kpos, params, carry)`` is its one-query attention,
    which the selective step of other accumulators and dtypes uses)."""
    if not plan.causal or plan.one(Slot.PROBABILITY) is not None:
        return None  # every step below computes the softmax: another probability map takes the full path
    kinds = [t.kind for t in plan.transforms]
    keys = cache.slot_buffers()[0]
    dtype = keys.dtype
    scale = plan.logit_scale(keys.shape[-1])
    evictor = cache.evictor
    if evictor is None and all(kind in SPAN_MASKS for kind in kinds) and (not kinds or cache.horizon is not None):
        run = functools.partial(plain_step, scale, bool(kinds))
        if not kinds:  # no window: the append fused, the attention torch's
            return fused.offer_append(ready_plain, run, attend_held, cache, scale)
        return FastStep("plain", ready_plain, run)
    rule = kernel_rule(evictor, cache.budget)
    if rule is None:
        return None
    acc = plan.one(Slot.ACCUMULATOR)
    if rule.kernel == "selective" and acc is not None and len(plan.transforms) == 1:
        return _selective_offer(plan, cache, params, decode_one, acc, evictor, rule, scale, dtype)
    if kinds:
        return None
    if rule.kernel == "sink_window":
        return fused.offer(evictor.kind, ready_replacing, functools.partial(replacing_step, scale), cache, scale,
                           rule.kernel, rule.options, rule.state, rule.spare)
    if rule.kernel == "scoring" and dtype in _WRITTEN_OUT:
        return fused.offer(evictor.kind, ready_scoring, functools.partial(scoring_step, scale), cache, scale,
                           rule.kernel, rule.options, rule.state, rule.spare)
    return None


def _selective_offer(plan, cache, params, decode_one, acc, evictor, rule, scale, dtype) -> FastStep | None:
    """The selective evictor's step for the spec's one transform, the accumulator ``acc``, chosen by what it
    declares, never by its class: a pointwise selection (``declared_pointwise``) in float32/float64 is written out
    (:func:`selective_step`, its ``value``), in C when it names a rule the C step knows (``layout.SELECTION_RULES``);
    any other accumulator takes :func:`selective_step_any` (the backend's one-query attention, its own
    ``selection``), while no held F is negative (the contract's S >= 0, which the step's choice of the victim
    before the append relies on: :func:`ready_selective_any`)."""
    declared = declared_pointwise(acc)
    geometry = cache.step_state.geometry
    if declared is None or dtype not in _WRITTEN_OUT or geometry is None:
        return FastStep(evictor.kind, ready_selective_any,
                        functools.partial(selective_step_any, decode_one, plan, params))
    h, group = acc.heads()[0], geometry[0] // geometry[1]
    bos_zero, self_zero = declared.exclude_first, declared.exclude_self
    code = layout.SELECTION_RULES.get(declared.rule) if declared.rule is not None else None
    # a known rule is >= 0 (or NaN) everywhere; any other value is checked on the held F before each step
    ready = ready_selective if code is not None else ready_selective_any
    run = functools.partial(selective_step, scale, h // group, h % group, bos_zero, self_zero, declared.value)
    if code is None:
        return FastStep(evictor.kind, ready, run)
    return fused.offer(evictor.kind, ready, run, cache, scale, rule.kernel, rule.options, rule.state, rule.spare,
                       selector_kv_head=h // group, selector_in_group=h % group, selection_rule=code,
                       zero_first_score=bos_zero, zero_own_score=self_zero)


# -- the torch steps --------------------------------------------------------------------------------------------------
class SlotView:
    """What an evictor's rule reads (``positions``, ``state``, ``keys``, ``budget``), over the slots a fast step
    holds as they are: out of position order (``ordered`` False: ``Evictor.victim`` breaks ties by position), with
    the spare slot when the step filled it. A score ``update`` assigns anew is copied back into the buffer
    (:meth:`write_back`)."""

    __slots__ = ("budget", "keys", "positions", "state")
    ordered = False
    valid = None  # the fast steps run on rows without padding (``rows_only``)

    def __init__(self, cache, keys, positions, state) -> None:
        self.budget, self.keys, self.positions, self.state = cache.budget, keys, positions, dict(state)

    def write_back(self, held: dict[str, torch.Tensor]) -> None:
        for name, t in self.state.items():
            if t is not held[name]:
                held[name].copy_(t)


def scoring_step(scale: float, q, k, v, cache):
    """H2O or TOVA at its budget (they evict after attention, by the step's probabilities): the new token goes into
    the spare slot, the query attends over budget + 1 tokens, the evictor's ``update`` scores them and its
    ``victim`` (H2O: per head, its recent window protected; ties to the oldest position) leaves; the spare slot's
    token moves into the victim's slot, which is the new token itself when it is the victim."""
    evictor = cache.evictor
    cache.fill_spare(k, v)
    ks, vs, pos, state = cache.held_slots(spare=1)
    b, h, _, d = q.shape
    hkv, m = ks.shape[1], ks.shape[2]
    logits = (q.reshape(b, hkv, h // hkv, d) @ ks.transpose(-1, -2)) * scale
    probs = torch.softmax(logits, dim=-1)
    out = (probs @ vs).reshape(b, h, 1, d)
    view = SlotView(cache, ks, pos, state)
    evictor.update(view, probs.reshape(b, h, 1, m))
    view.write_back(state)
    cache.settle_spare(evictor.victim(view))
    return out


def replacing_step(scale: float, q, k, v, cache):
    """Sink + window at its budget: the evictor's victim (the oldest position after the sinks) leaves and the new
    token takes its slot, then plain attention over the held tokens."""
    ks, vs, pos, state = cache.held_slots()  # views of the buffers: replace_slot writes into them
    cache.replace_slot(cache.evictor.victim(SlotView(cache, ks, pos, state))[:, 0], k, v)
    return plain_one(q, ks, vs, scale)


def selective_step(scale, kv_head, in_group, bos_zero, self_zero, value, q, k, v, cache):
    """A pointwise selection at its budget in float32/float64 (``selective_mask``'s, or any accumulator declaring
    one), its maths written out (the C step's torch form): the evictor's victim (the largest F of a slot not at
    position 1, a NaN first, ties to the oldest position; per row, so rows at different offsets each keep or lose
    their own first token), the new token into its slot, the logits once for attention and selection, S = the
    declared ``value`` of the selector head's logits but 0 at position 1 (``exclude_first``) and at the query's own
    key (``exclude_self``), F += S after it was subtracted."""
    ks, vs, pos, state = cache.held_slots()
    held = state[ACCUMULATED_STATE]
    victim = cache.evictor.victim(SlotView(cache, ks, pos, state))[:, 0]
    f, bos = held[:, 0], pos[:, 0] == 1
    cache.replace_slot(victim, k, v)
    b, h, _, d = q.shape
    hkv = ks.shape[1]
    logits = (q.reshape(b, hkv, h // hkv, d) @ ks.transpose(-1, -2)) * scale
    s = value(logits[:, kv_head, in_group])
    if bos_zero:
        s.masked_fill_(bos, 0.0)
    if self_zero:
        s.scatter_(1, victim.unsqueeze(1), 0.0)
    out = (torch.softmax(logits - f[:, None, None, :], dim=-1) @ vs).reshape(b, h, 1, d)
    held.add_(s.unsqueeze(1))
    return out


def selective_step_any(decode_one, plan, params, q, k, v, cache):
    """Selective attention at its budget, any accumulator and dtype: the evictor's victim leaves, the new token
    takes its slot with F = 0, then the backend's one-query attention, and F is updated in place. The new token
    never outranks an older eligible one (its F is 0, every F is >= 0, ties go to the oldest), so this is the token
    the full path evicts."""
    ks, _, pos, state = cache.held_slots()
    held = state[ACCUMULATED_STATE]
    cache.replace_slot(cache.evictor.victim(SlotView(cache, ks, pos, state))[:, 0], k, v)  # into the views
    ks, vs, _, _ = cache.held_slots()
    nxt = cache.slot_buffers()[4]
    qpos = pos.new_full((q.shape[0], 1), nxt - 1) if isinstance(nxt, int) else (nxt - 1).view(-1, 1)
    out, carry = decode_one(plan, q, ks, vs, qpos, pos[:, :1], params, held[:, 0])
    held.copy_(carry.unsqueeze(1).expand_as(held))
    return out


def plain_step(scale: float, window: bool, q, k, v, cache):
    """Plain causal attention over every held token; under a sliding window or a chunk the cache holds only the
    tokens the new query sees (the last step dropped the rest, and every row holds the same positions), and the
    tokens that no later query sees are dropped after."""
    cache.append_one(k, v)
    out = attend_held(q, cache, scale)
    if window:
        drop_expired(cache)
    return out


#: below this many keys one SDPA call beats the three operations of plain_one's products (fewer dispatches)
_SDPA_KEYS = 256


def plain_one(q, ks, vs, scale: float, bias=None):
    """Plain softmax attention of one query (B, H, 1, D) over every key (B, H_kv, M, D). From a few hundred
    keys on, a scaled batched product (the query heads of a key/value head as the rows), a softmax and a second
    product: measured on CPU (benchmarks/decode.py) 1.2x faster than SDPA's flash kernel at 1k keys, 1.8x at 8k
    and 2.2x at 32k, which is built for query blocks. Fewer keys, and half precision (which SDPA accumulates in
    float32), take SDPA. ``bias``: (B, H_kv, M), -inf at padding and 0 elsewhere (``KVCache.padding_bias``)."""
    b, h, _, d = q.shape
    hkv, m = ks.shape[1], ks.shape[2]
    if q.dtype not in _WRITTEN_OUT or m < _SDPA_KEYS:
        mask = None if bias is None else bias[:, :1, None, :].to(q.dtype)  # the same in every head: padding
        return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=scale, enable_gqa=h != hkv)
    rows = q.reshape(b * hkv, h // hkv, d)
    base = rows.new_empty(()) if bias is None else bias.reshape(b * hkv, 1, m)
    logits = torch.baddbmm(base, rows, ks.reshape(b * hkv, m, d).transpose(1, 2), beta=0.0 if bias is None else 1.0,
                           alpha=scale)
    return torch.bmm(torch.softmax(logits, dim=-1), vs.reshape(b * hkv, m, d)).view(b, h, 1, d)


def attend_held(q, cache, scale: float):
    """The plain step's attention: one query (B, H, 1, D) over every token the cache holds, a left-padded batch's
    padding masked (``KVCache.padding_bias``)."""
    keys, values, _, m, _ = cache.slot_buffers()
    bias = cache.padding_bias(accumulator_dtype(q.dtype)) if cache.padded else None
    return plain_one(q, keys[:, :, :m], values[:, :, :m], scale, bias)

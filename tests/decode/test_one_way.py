"""The decode step runs one way (issue 54, item 2): ``attnzoo.decode.step`` admits the new tokens, calls the
backend's one decoding method ``attend_held`` once, settles, applies the output slot and drops what expired. A
backend reads the cache and returns a ``HeldAttention``; a backend still written to the old contract (``extend``)
is refused with one line that says what to implement, never run through an ``attend_held`` it inherits."""

from __future__ import annotations

import types

import pytest
import torch

import attnzoo
from attnzoo.backends.base import Backend, HeldAttention, Mode
from attnzoo.backends.reference import ReferenceBackend
from attnzoo.core.composition import Composition
from attnzoo.core.contract import old_decoding_contract
from attnzoo.registry import new_registry


def _registry(*backends):
    module = types.ModuleType("one_way")
    module.register_backends = attnzoo.hookimpl(lambda register: [register(b) for b in backends])
    return new_registry(entry_points=False, extra_plugins=[("one_way", module)])


def _tokens(n, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, n, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


class ExtendOnly(Backend):
    """A third-party decoding backend written to the contract before issue 54: ``extend`` and no ``attend_held``."""

    name = "extend_only"
    modes = frozenset(Mode)

    def supports(self, plan, device, dtype, mode):
        return []

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        return ReferenceBackend().forward(plan, q, k, v, params, positions, key_mask, return_accumulated)

    def extend(self, plan, q, k, v, cache, params, *, evict_first, key_mask=None):
        raise AssertionError("never called")


class ReferenceWithExtend(ReferenceBackend):
    """The reference's ``attend_held`` inherited, an ``extend`` of its own: running the inherited method would
    silently drop what the plugin's ``extend`` meant to change."""

    name = "reference_with_extend"

    def extend(self, plan, q, k, v, cache, params, *, evict_first, key_mask=None):
        raise AssertionError("never called")


class HeldOnly(ReferenceBackend):
    """A plugin's decoding backend under its own name: only ``attend_held`` (the reference's maths), counting its
    calls and checking what the step hands it."""

    name = "held_only"

    def __init__(self):
        self.calls = []

    def attend_held(self, plan, step, cache, params, *, want_probs=False):
        held_before = cache.num_tokens
        out = super().attend_held(plan, step, cache, params, want_probs=want_probs)
        assert cache.num_tokens == held_before, "attend_held changed the cache"
        self.calls.append((step.queries.shape[2], cache.num_tokens, want_probs is not False))
        return out


@pytest.mark.parametrize("backend", [ExtendOnly, ReferenceWithExtend])
def test_a_backend_that_defines_extend_is_refused_with_one_line(backend):
    assert old_decoding_contract(backend)
    reg = _registry(backend())
    name = backend.name
    want = (f"backend '{name}' defines extend(), which attnzoo no longer calls: implement attend_held(plan, step, "
            f"cache, params, *, want_probs) instead (docs/plugins.md, \"Writing a decoding backend\")")
    variant = attnzoo.compile("selective-pruned", backend=name, registry=reg)
    assert variant.plan.spec.name == "selective-pruned"
    assert reg.backends[name].verdict(variant.plan, torch.device("cpu"), torch.float64, Mode.DECODE) == [want]
    q, k, v = _tokens(3)
    cache = variant.new_cache(batch=2, budget=4)
    with pytest.raises(attnzoo.UnsupportedError) as caught:
        variant.prefill(q, k, v, cache)
    assert want in str(caught.value)
    assert cache.num_tokens == 0  # refused before anything moved
    assert want in attnzoo.explain("selective-pruned", registry=reg, mode="decode")
    # the batch form is not affected, and auto never picks it for decoding
    assert variant(q, k, v).shape == q.shape
    assert attnzoo.compile("selective-pruned", registry=reg).backend_for("cpu", torch.float64, "decode").name \
        != name


def test_the_contract_check_reads_the_class_that_defines_each_method():
    class Migrated(ReferenceWithExtend):  # attend_held below the extend it inherits: the new contract
        name = "migrated"

        def attend_held(self, plan, step, cache, params, *, want_probs=False):
            return super().attend_held(plan, step, cache, params, want_probs=want_probs)

    class Both(Backend):  # both in one class: attend_held is the one called
        name = "both"

        def extend(self, *args, **kwargs):
            raise AssertionError

        def attend_held(self, plan, step, cache, params, *, want_probs=False):
            raise AssertionError

    assert not old_decoding_contract(Migrated) and not old_decoding_contract(Both)
    assert not old_decoding_contract(ReferenceBackend) and not old_decoding_contract(Backend)


@pytest.mark.parametrize("spec, budget", [("selective-pruned", 6), ("h2o", 6), ("tova", 6), ("ssa", None),
                                          ("local", None)])
def test_a_plugin_backend_with_only_attend_held_decodes_as_the_reference(spec, budget):
    held_only = HeldOnly()
    reg = _registry(held_only)
    mine = attnzoo.compile(spec, backend="held_only", registry=reg)
    ref = attnzoo.compile(spec, backend="reference", registry=reg)
    q, k, v = _tokens(20)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False  # a left-padded prompt
    kwargs = {"budget": budget} if budget is not None else {}
    caches = [variant.new_cache(batch=2, **kwargs) for variant in (mine, ref)]
    outs = [variant.prefill(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache, key_mask=mask)
            for variant, cache in zip((mine, ref), caches, strict=True)]
    assert torch.equal(outs[0], outs[1])
    for t in range(5, 20):
        got, want = (variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache)
                     for variant, cache in zip((mine, ref), caches, strict=True))
        assert torch.equal(got, want), f"step {t}"
        assert torch.equal(caches[0].positions, caches[1].positions), f"step {t}"
    for name, score in caches[1].state.items():
        assert torch.equal(caches[0].state[name], score)
    assert len(held_only.calls) == 16  # once a step, the prompt's included (no fast step: not the blocked backend)
    assert held_only.calls[0][:2] == (5, 5)  # the step's tokens were appended before it attended
    evictor = ref.plan.evictor_cls
    assert all(wants == bool(evictor is not None and evictor.needs_probabilities) for *_, wants in held_only.calls)


def test_a_backend_that_decodes_without_gradients_is_refused_before_the_cache_changes():
    class NoGradients(ReferenceBackend):
        name = "no_gradients"
        decodes_with_gradients = False

    variant = attnzoo.compile("selective-pruned", backend="no_gradients", registry=_registry(NoGradients()))
    q, k, v = _tokens(4)
    cache = variant.new_cache(batch=2, budget=6)
    variant.prefill(q[:, :, :3], k[:, :, :3], v[:, :, :3], cache)
    held = (cache.num_tokens, cache.positions.clone(), cache.accumulated().clone())
    with pytest.raises(ValueError, match="the no_gradients backend decodes without gradients: run decoding under "
                                         r"torch.no_grad\(\)"):
        variant.decode(q[:, :, 3:].requires_grad_(), k[:, :, 3:], v[:, :, 3:], cache)
    assert cache.num_tokens == held[0] and torch.equal(cache.positions, held[1])
    assert torch.equal(cache.accumulated(), held[2])
    with torch.no_grad():
        variant.decode(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], cache)
    assert cache.num_tokens == 4


def test_the_step_reads_admit_widen_from_the_backend_class(monkeypatch):
    """``admit_widen`` (a class attribute, not the backend's identity) widens every row map of the step: the query,
    key and value slots in admit and the output slot after attending."""

    class Widening(ReferenceBackend):
        name = "widening"
        admit_widen = True

    seen = []
    row_scale = Composition.row_scale

    def recording(self, slot, rows, positions, params, widen=False):
        seen.append((slot.value, widen))
        return row_scale(self, slot, rows, positions, params, widen=widen)

    monkeypatch.setattr(Composition, "row_scale", recording)
    for backend, widened in ((Widening(), True), (ReferenceBackend(), False)):
        reg = _registry(backend) if widened else new_registry(entry_points=False)
        variant = attnzoo.compile("ssa", backend=backend.name, registry=reg)
        q, k, v = (t.to(torch.float16) for t in _tokens(2))
        seen.clear()
        variant.prefill(q, k, v, variant.new_cache(batch=2))
        assert {slot for slot, _ in seen} >= {"query", "key", "output"}
        assert all(widen is widened for _, widen in seen), seen


def test_held_attention_is_the_contract_tuple():
    held = HeldAttention(torch.zeros(1), None)
    assert held.probs is None and held._fields == ("out", "accumulated", "probs")

"""Fast paths chosen by what a transform declares, not by its class (issue 54, item 1). A plugin's subclass of
``selective_mask`` registered under its own name, and a plugin accumulator that subclasses nothing of it but makes
the same declaration (``pointwise()``: the rule ``relu``, the same exclusions), take as many fast decoding steps as
the built-in, of the same kind (in C where the op is built), and the fused batch kernel, with the reference
backend's outputs in float64. A plugin whose declaration differs (another rule, a rewritten ``selection()``, an S
below 0) never takes the built-in's path: it decodes what the reference decodes."""

from __future__ import annotations

import types

import pytest
import torch

import attnzoo
from attnzoo.backends import blocked
from attnzoo.backends.sigmoid_blocks import SigmoidCausal
from attnzoo.decode.check import check_fast_step
from attnzoo.transforms.base import (
    AccumulatorTransform,
    PointwiseMap,
    PointwiseSelection,
    ProbabilityTransform,
    Slot,
    declared_map,
    declared_pointwise,
)
from attnzoo.transforms.probability import Sigmoid, SigmoidOptions
from attnzoo.transforms.selective import SelectiveMask, SelectiveMaskOptions

B, H, HKV, D = 2, 4, 2, 8
PREFILL, STEPS, BUDGET = 5, 40, 16


class PluginSubclass(SelectiveMask):
    """The built-in's maths under another name (the issue's plugin)."""

    kind = "plugin_selective"


class PluginLookalike(AccumulatorTransform):
    """Not a SelectiveMask: the same declaration written from scratch (no ``selection()`` of its own)."""

    kind = "plugin_lookalike"
    slot = Slot.ACCUMULATOR
    Options = SelectiveMaskOptions

    def heads(self):
        return [self.options.selector_head]

    def pointwise(self):
        return PointwiseSelection(rule="relu", exclude_first=self.options.protect_bos,
                                  exclude_self=not self.options.self_mask)


def _square(x):
    return torch.relu(x) ** 2


def _square_derivative(x):
    return 2 * torch.relu(x)


class PluginSquared(SelectiveMask):
    """Another rule (ReLU squared), declared: not the C step's ReLU."""

    kind = "plugin_squared"

    def pointwise(self):
        return PointwiseSelection(value=_square, derivative=_square_derivative,
                                  exclude_first=self.options.protect_bos, exclude_self=not self.options.self_mask)


class PluginRewritten(SelectiveMask):
    """``selection()`` rewritten (twice the ReLU) under the inherited ``pointwise()``: the declaration no longer
    describes it."""

    kind = "plugin_rewritten"

    def selection(self, logits, allowed, ctx, params):
        return 2 * super().selection(logits, allowed, ctx, params)


class PluginNegative(SelectiveMask):
    """An S that goes below 0 (against the contract): F < 0 would make the new token the full path's victim."""

    kind = "plugin_negative"

    def pointwise(self):
        return PointwiseSelection(value=lambda x: x - 0.25, derivative=torch.ones_like,
                                  exclude_first=self.options.protect_bos, exclude_self=not self.options.self_mask)


class SigmoidSubclass(Sigmoid):
    kind = "plugin_sigmoid"


class SigmoidLookalike(ProbabilityTransform):
    """Sigmoid attention declared from scratch: ``weights()`` and the blocked form from the declaration."""

    kind = "plugin_sigmoid_lookalike"
    slot = Slot.PROBABILITY
    Options = SigmoidOptions
    parameters = Sigmoid.parameters
    row_bias = Sigmoid.row_bias

    def pointwise(self):
        return PointwiseMap("sigmoid", self.row_bias, "bias" if self.options.learnable else None)

    start, update, finish = Sigmoid.start, Sigmoid.update, Sigmoid.finish


class SigmoidHalved(Sigmoid):
    """``weights()`` rewritten (half the sigmoid) under the inherited declaration."""

    kind = "plugin_sigmoid_halved"

    def weights(self, logits, allowed, ctx, params):
        return super().weights(logits, allowed, ctx, params) / 2


PLUGINS = (PluginSubclass, PluginLookalike, PluginSquared, PluginRewritten, PluginNegative, SigmoidSubclass,
           SigmoidLookalike, SigmoidHalved)


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("declared_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(t) for t in PLUGINS] and None)
    return attnzoo.new_registry(entry_points=False, extra_plugins=[("declared_plugin", module)])


def _spec(kind: str, **options) -> dict:
    return {"name": f"{kind.replace('_', '-')}-pruned", "transforms": [{"kind": kind, **options}],
            "cache": {"evictor": "selective", "budget": BUDGET}}


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = PREFILL + STEPS
    q = torch.randn(B, H, n, D, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(B, HKV, n, D, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v


def _decode(spec, registry, backend, dtype=torch.float64, seed=0):
    """Outputs of a prefill and STEPS decodes, and the fast step kind each decode took (None: the full path)."""
    variant = attnzoo.compile(spec, backend=backend, registry=registry)
    q, k, v = _inputs(dtype, seed)
    cache = variant.new_cache(B, budget=BUDGET)
    outs, kinds = [variant.prefill(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], cache)], []
    with torch.no_grad():
        for t in range(PREFILL, PREFILL + STEPS):
            kinds.append(cache.lean_step_kind)
            outs.append(variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache))
    return torch.cat(outs, dim=2), kinds


OPTIONS = [{}, {"selector_head": 3, "protect_bos": False}, {"self_mask": True, "selector_head": 1}]


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "head3-bos", "self-mask"])
@pytest.mark.parametrize("kind", ["plugin_selective", "plugin_lookalike"])
def test_a_plugin_with_the_builtins_declaration_takes_as_many_fast_steps(kind, options, registry, lean_kind):
    builtin_out, builtin_kinds = _decode(_spec("selective_mask", **options), registry, "blocked")
    out, kinds = _decode(_spec(kind, **options), registry, "blocked")
    reference, _ = _decode(_spec(kind, **options), registry, "reference")
    fast = sum(k is not None for k in kinds)
    assert fast == sum(k is not None for k in builtin_kinds) and fast >= STEPS - BUDGET
    assert set(kinds) - {None} == set(builtin_kinds) - {None} == {lean_kind}
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, builtin_out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["plugin_selective", "plugin_lookalike", "plugin_squared"])
def test_the_plugins_fast_steps_decode_what_the_full_path_decodes(kind, dtype, registry, lean_kind):
    variant = attnzoo.compile(_spec(kind), backend="blocked", registry=registry)
    report = check_fast_step(variant, budget=6, dtype=dtype)
    assert report["kinds"] == (["torch"] if kind == "plugin_squared" else [lean_kind])


@pytest.mark.parametrize("kind", ["plugin_squared", "plugin_rewritten", "plugin_negative"])
def test_another_declaration_does_not_take_the_builtins_step(kind, registry, lean_kind):
    """Another rule decodes through the torch step of its own value; a rewritten selection, through the
    backend's one-query attention (its own ``selection()``); an S below 0 takes the full path once F is negative.
    Each decodes what the reference decodes."""
    out, kinds = _decode(_spec(kind), registry, "blocked")
    reference, _ = _decode(_spec(kind), registry, "reference")
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    assert "fused" not in kinds
    if kind == "plugin_negative":
        assert kinds[-1] is None
    else:
        assert sum(k == "torch" for k in kinds) >= STEPS - BUDGET


def _make(cls):
    return cls(cls.options_model()(kind=cls.kind))


def test_the_declaration_is_what_the_paths_read(registry):
    builtin, sub, alike = (_make(t) for t in (SelectiveMask, PluginSubclass, PluginLookalike))
    assert declared_pointwise(sub) == declared_pointwise(alike) == declared_pointwise(builtin)
    assert declared_pointwise(builtin).rule == "relu"
    assert alike.triton() == sub.triton() == builtin.triton() is not None
    rewritten = _make(PluginRewritten)
    assert declared_pointwise(rewritten) is None and rewritten.triton() is None
    assert declared_pointwise(_make(PluginSquared)).rule is None
    # a known rule's own functions name it; a rule with another function is refused
    assert PointwiseSelection(value=torch.relu, derivative=declared_pointwise(builtin).derivative).rule == "relu"
    with pytest.raises(ValueError, match="takes its value from the rule"):
        PointwiseSelection(rule="relu", value=_square)
    with pytest.raises(ValueError, match="unknown rule 'gelu'"):
        PointwiseSelection(rule="gelu")


@pytest.mark.parametrize("kind", ["selective_mask", "plugin_selective", "plugin_lookalike", "plugin_squared",
                                  "plugin_rewritten"])
def test_the_fused_batch_kernel_is_chosen_by_declaration(kind, registry, monkeypatch):
    calls = []
    real = blocked.SelectiveCausal.apply
    monkeypatch.setattr(blocked.SelectiveCausal, "apply", lambda *a: calls.append(1) or real(*a))
    q, k, v = (t[:, :, :37] for t in _inputs(torch.float64, seed=1))
    q.requires_grad_()
    spec = _spec(kind, selector_head=2)
    out = attnzoo.compile(spec, backend="blocked", registry=registry)(q, k, v)
    reference = attnzoo.compile(spec, backend="reference", registry=registry)(q, k, v)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    got, = torch.autograd.grad(out.square().sum(), q)
    want, = torch.autograd.grad(reference.square().sum(), q)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert len(calls) == (0 if kind == "plugin_rewritten" else 1)


@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("kind", ["sigmoid", "plugin_sigmoid", "plugin_sigmoid_lookalike", "plugin_sigmoid_halved"])
def test_the_sigmoid_node_is_chosen_by_declaration(kind, learnable, registry, monkeypatch):
    """blocked's one-node sigmoid attention (sigmoid_blocks.py) for any map declaring ``PointwiseMap("sigmoid",
    ...)``, never for a subclass that rewrote ``weights()``; each equals the reference, outputs and gradients."""
    calls = []
    real = SigmoidCausal.apply
    monkeypatch.setattr(SigmoidCausal, "apply", lambda *a: calls.append(1) or real(*a))
    q, k, v = (t[:, :, :37] for t in _inputs(torch.float64, seed=2))
    q.requires_grad_()
    spec = {"name": "sig", "transforms": [{"kind": kind, "learnable": learnable}]}
    variant = attnzoo.compile(spec, backend="blocked", registry=registry)
    params = variant.init_params(num_heads=H, head_dim=D, num_kv_heads=HKV, dtype=torch.float64)
    params = {name: p + 0.1 * torch.arange(p.numel(), dtype=p.dtype).view(p.shape) for name, p in params.items()}
    out = variant(q, k, v, params=params)
    reference = attnzoo.compile(spec, backend="reference", registry=registry)(q, k, v, params=params)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    got, = torch.autograd.grad(out.square().sum(), q)
    want, = torch.autograd.grad(reference.square().sum(), q)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert len(calls) == (0 if kind == "plugin_sigmoid_halved" else 1)
    assert (declared_map(_make(SigmoidHalved)) is None) and declared_map(_make(SigmoidLookalike)) is not None

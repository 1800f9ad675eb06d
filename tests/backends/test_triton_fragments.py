"""Triton fragments at out-of-range rows and columns, and the conformance suite naming a fragment's non-finite value.

A plugin's logits fragment that takes ``tl.log`` of the positions (SSMax-style ``l * s * ln i``) is finite at every
valid position (positions are 1-based), but the kernels' tiles also hold rows past the last query and columns past
the last key. There the fragment sees ``qp = 1`` and ``kp = 1`` (docs/triton.md), and whatever it computes is
discarded with ``tl.where``, so it cannot turn the gradients into NaN (``0 * -inf``).
"""

import re
import types
import warnings

import pytest
import torch

pytest.importorskip("triton")

import attnzoo  # noqa: E402
from attnzoo.conformance import checks  # noqa: E402
from attnzoo.registry import new_registry  # noqa: E402
from attnzoo.transforms.base import LogitsTransform, ParamSpec, Slot  # noqa: E402
from attnzoo.transforms.lowering import TritonLogits  # noqa: E402

pytestmark = pytest.mark.interpreter

LQ = "tl.log(qp.to(tl.float32))"
LK = "tl.log(kp.to(tl.float32))"


class LogPositions(LogitsTransform):
    """``l' = l * s_h * ln(i) + b_h * ln(j)``: finite at every valid (1-based) position, ``-inf`` at position 0."""

    kind = "logpos_test"
    slot = Slot.LOGITS

    def parameters(self):
        return [ParamSpec("s", ("H",), lambda dims: [0.4 + 0.1 * h for h in range(dims.num_heads)]),
                ParamSpec("b", ("H",), 0.3)]

    def apply(self, logits, ctx, params):
        lq, lk = torch.log(ctx.qpos.to(logits.dtype)), torch.log(ctx.kpos.to(logits.dtype))
        return logits * params["s"][ctx.heads].to(logits.dtype) * lq + params["b"][ctx.heads].to(logits.dtype) * lk

    def triton(self):
        return TritonLogits(forward=f"{{x}} * {{p_s}} * {LQ} + {{p_b}} * {LK}", derivative=f"{{p_s}} * {LQ}",
                            params=("s", "b"), param_derivatives=(f"{{x}} * {LQ}", LK))


class LogDistance(LogitsTransform):
    """``l' = l - s_h * ln(1 + i - j)`` on the causally visible pairs. The torch maths clamps the distance; the
    fragment does not, so it is NaN (log of a negative) at the future pairs, which the causal mask hides."""

    kind = "logdist_test"
    slot = Slot.LOGITS

    def parameters(self):
        return [ParamSpec("s", ("H",), 0.7)]

    def apply(self, logits, ctx, params):
        distance = (ctx.qpos - ctx.kpos + 1).clamp_min(1).to(logits.dtype)
        return logits - params["s"][ctx.heads].to(logits.dtype) * torch.log(distance)

    def triton(self):
        log = "tl.log((qp - kp + 1).to(tl.float32))"
        return TritonLogits(forward=f"{{x}} - {{p_s}} * {log}", derivative="1.0", params=("s",),
                            param_derivatives=(f"-{log}",))


class BadFragment(LogitsTransform):
    """``l' = l * s_h * ln(i)`` in torch; its Triton fragment writes ``ln(i - 1)`` (forward) or divides by
    ``i - 1`` (derivative): non-finite at the valid query position 1."""

    kind = "badlog_test"
    slot = Slot.LOGITS
    broken = "forward"

    def parameters(self):
        return [ParamSpec("s", ("H",), 0.5)]

    def apply(self, logits, ctx, params):
        return logits * params["s"][ctx.heads].to(logits.dtype) * torch.log(ctx.qpos.to(logits.dtype))

    def triton(self):
        if self.broken == "forward":
            wrong = "tl.log((qp - 1).to(tl.float32))"
            return TritonLogits(forward=f"{{x}} * {{p_s}} * {wrong}", derivative=f"{{p_s}} * {wrong}",
                                params=("s",), param_derivatives=(f"{{x}} * {wrong}",))
        wrong = f"{LQ} * ((qp - 1).to(tl.float32) / (qp - 1).to(tl.float32))"  # 0/0 at position 1
        return TritonLogits(forward=f"{{x}} * {{p_s}} * {LQ}", derivative=f"{{p_s}} * {wrong}",
                            params=("s",), param_derivatives=(f"{{x}} * {LQ}",))


def _registry(*transforms):
    module = types.ModuleType("fragment_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(t) for t in transforms])
    return new_registry(entry_points=False, extra_plugins=[("fragment_plugin", module)])


def _grads(variant, q, k, v, params, cot, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    ps = {key: p.to(dtype).requires_grad_() for key, p in params.items()}
    out = variant(*leaves, params=ps)
    return [out.detach(), *torch.autograd.grad(out, [*leaves, *ps.values()], cot.to(dtype))]


@pytest.mark.parametrize("kind, extra", [("logpos_test", []), ("logpos_test", [{"kind": "selective_mask"}]),
                                         ("logdist_test", [{"kind": "selective_mask"}])],
                         ids=["log-positions", "log-positions-accumulator", "log-distance-accumulator"])
def test_log_fragments_are_safe_outside_the_allowed_pairs(kind, extra):
    """N = 45 with 32x32 blocks (the interpreter's): rows and columns 45..63 of the last tiles are out of range.
    Outputs and the gradients of q, k, v and the parameters match the float64 reference (GQA): ``ln(i)`` at
    out-of-range rows and columns, and ``ln(1 + i - j)`` at the pairs the causal mask hides, leak no NaN (through
    the selector's kernels too)."""
    reg = _registry(LogPositions, LogDistance)
    spec = {"name": "logfrag", "transforms": [{"kind": kind}, *extra]}
    ref = attnzoo.compile(spec, backend="reference", registry=reg)
    tri = attnzoo.compile(spec, backend="triton", registry=reg)
    gen = torch.Generator().manual_seed(1)
    b, h, hkv, n, d = 2, 4, 2, 45, 8
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    cot = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    params = ref.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    assert f"{kind}.s" in params
    names = ["out", "q", "k", "v", *params]
    want = _grads(ref, q, k, v, params, cot, torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _grads(tri, q, k, v, params, cot, torch.float32)
    if kind == "logpos_test":  # the interpreter computes in numpy: ln(0) would warn, ln(1) at out-of-range rows not
        assert not [w for w in seen if "divide by zero encountered in log" in str(w.message)], "ln(0) computed"
    for name, w, g in zip(names, want, got, strict=True):
        assert bool(torch.isfinite(g).all()), f"{name}: non-finite"
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("broken", ["forward", "derivative"])
def test_fragment_non_finite_at_a_valid_position_is_named(broken):
    """A fragment that is non-finite at a valid position (query position 1) while the transform's torch maths is
    finite: the conformance message names the transform and its fragment, not 'an unwritten element'."""
    bad = type("BadFragmentBroken", (BadFragment,), {"broken": broken})
    reg = _registry(bad)
    spec = attnzoo.load_spec({"name": "badlog", "transforms": [{"kind": "badlog_test"}]}, registry=reg)
    target = checks.Target(spec, "triton", torch.float32, reg)
    shape = checks.Shape("gqa-n20", 1, 4, 2, 20, 8)
    with pytest.raises(AssertionError) as err:
        checks.check_differential(target, shape, grad=broken == "derivative")
    message = str(err.value)
    assert "transform 'badlog_test'" in message and f"Triton fragment {broken}" in message, message
    assert "unwritten" not in message and "\n" not in message, message


def test_a_nan_no_transform_explains_is_the_backends(monkeypatch):
    """A NaN the kernels leave (here planted in the last output row) while neither the torch maths nor any
    fragment is non-finite: the message says the backend produced it."""
    from attnzoo.backends.triton import backend as triton_backend

    real = triton_backend._Run.forward

    def poison_last_row(self, *args, **kwargs):
        out, *rest = real(self, *args, **kwargs)
        out[:, :, -1] = float("nan")
        return (out, *rest)

    monkeypatch.setattr(triton_backend._Run, "forward", poison_last_row)
    reg = _registry(LogPositions)
    spec = attnzoo.load_spec({"name": "logpos", "transforms": [{"kind": "logpos_test"}]}, registry=reg)
    target = checks.Target(spec, "triton", torch.float32, reg)
    with pytest.raises(AssertionError, match=r"no transform's torch maths or Triton fragment gives non-finite "
                                             r"values on these inputs: the backend produced it \(an unwritten"):
        checks.check_differential(target, checks.Shape("gqa-n20", 1, 4, 2, 20, 8), grad=False)


def test_generated_source_says_what_fragments_see_out_of_range():
    from attnzoo.backends.triton import codegen
    from attnzoo.plan import Plan

    reg = _registry(LogPositions)
    spec = {"name": "logpos", "transforms": [{"kind": "logpos_test"}, {"kind": "selective_mask"}]}
    sources = codegen.generate(Plan.from_spec(attnzoo.load_spec(spec, registry=reg), reg))
    for part in sources.values():
        loads = re.findall(r"tl\.load\([QK]POS [^\n]*other=(\d+)\)", part)
        assert loads and set(loads) == {"1"}, loads
        assert "Fragments see qp = 1 at rows past the last query and kp = 1 at columns past the last key" in part
    backward = sources["backward"]
    assert "def _logits_bwd(g, ok, x," in backward and "g = tl.where(ok, g * (" in backward
    assert "tl.sum(tl.sum(tl.where(ok, g * (" in backward  # the parameters' gradients

"""Every dtype torch has, every backend, every mode: ``explain``'s verdict is what a call does. A backend that
says yes computes (checked against the float64 reference); one that says no is what the call raises, as an
UnsupportedError with the same reasons, in one line, never an error from inside torch."""

import warnings

import pytest
import torch

import attnzoo
from attnzoo.cli import main
from attnzoo.dispatch import Variant
from attnzoo.registry import new_registry

#: every dtype torch defines (float64 to float8, float4, complex, ints, uints, bool, quantized, bits)
ALL_DTYPES = sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)
MODES = ("forward", "backward", "decode")
H, HKV, N, D = 2, 1, 5, 8
#: how close a computed output is to the float64 reference's, by dtype (inputs of about 1, N = 5)
ATOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def explained(spec, backend, dtype, mode, registry=None):
    """``explain``'s verdict for one backend: None for yes, else the reasons as it prints them."""
    text = attnzoo.explain(spec, dtype=dtype, mode=mode, registry=registry)
    line = next(line for line in text.splitlines()[1:] if line.split()[0] == backend)
    verdict = line.split(None, 1)[1]
    return None if verdict.startswith("yes") else verdict.removeprefix("no: ")


def inputs(dtype, grad):
    """q, k, v in ``dtype``, seeded; None where torch makes no tensor of it (quantized dtypes, bits)."""
    gen = torch.Generator().manual_seed(0)
    exact = [torch.randn(1, heads, N, D, generator=gen, dtype=torch.float64) for heads in (H, HKV, HKV)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        try:
            made = [t.to(dtype) for t in exact]
        except (RuntimeError, NotImplementedError, TypeError):
            try:
                made = [torch.zeros(t.shape, dtype=dtype) for t in exact]
            except (RuntimeError, NotImplementedError, TypeError):
                return None
    if grad and (dtype.is_floating_point or dtype.is_complex):
        made = [t.requires_grad_() for t in made]
    return made


def parameters(variant, grad):
    return {key: value.requires_grad_(grad) for key, value in
            variant.init_params(H, D, HKV, dtype=torch.float64).items()}


def run(variant, mode, q, k, v, params):
    if mode == "decode":
        return variant.prefill(q, k, v, variant.new_cache(batch=1, budget=None), params=params)
    return variant(q, k, v, params=params)


def check_agreement(spec, backend, dtype, mode):
    grad = mode == "backward"
    variant = Variant(spec, backend=backend)
    made = inputs(dtype, grad)
    if made is None:  # no tensor of this dtype exists, so no call can be made: every backend declines it
        assert explained(spec, backend, dtype, mode) is not None, (backend, dtype)
        return
    params = parameters(variant, grad)
    if grad and not any(t.requires_grad for t in [*made, *params.values()]):
        mode, grad = "forward", False  # nothing here can want a gradient (vanilla in bool, ints): a forward call
    why = explained(spec, backend, dtype, mode)
    if why is not None:
        with pytest.raises(attnzoo.UnsupportedError) as info:
            run(variant, mode, *made, params)
        assert info.value.reasons == {backend: info.value.reasons[backend]}
        assert "; ".join(info.value.reasons[backend]) == why, (backend, dtype, mode)
        assert "\n" not in str(info.value)
        return
    out = run(variant, mode, *made, params)
    assert out.dtype == dtype and out.shape == (1, H, N, D)
    truth_params = parameters(variant, grad)
    rounded = [t.detach().to(torch.float64) for t in made]  # the same inputs, in float64
    want = run(Variant(spec, backend="reference"), mode, *rounded, truth_params)
    torch.testing.assert_close(out.detach().to(torch.float64), want.detach(), rtol=0, atol=ATOL[dtype])
    if grad:
        got_grads = torch.autograd.grad(out.to(torch.float64).sum(), list(params.values()))
        want_grads = torch.autograd.grad(want.sum(), list(truth_params.values()))
        for got, expected in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=10 * ATOL[dtype])


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton", "xformers"])
def test_explain_says_what_a_call_does_for_every_dtype_and_mode(backend):
    """selective-ssa (the accumulator, the fused CPU kernel where it applies, parameters with gradients) in every
    dtype torch has, forward, backward and decode (prefill). The flex backend: the next test."""
    for dtype in ALL_DTYPES:
        for mode in MODES:
            check_agreement("selective-ssa", backend, dtype, mode)


def test_flex_explain_says_what_a_call_does_for_every_dtype():
    """vanilla on flex (selective-ssa's accumulator is declined for every dtype): each dtype flex accepts
    compiles (seconds each on CPU), every other one is declined with the reason explain gives."""
    for dtype in ALL_DTYPES:
        for mode in MODES:
            check_agreement("vanilla", "flex", dtype, mode)


def test_the_accepted_dtypes_are_the_four_float_dtypes_on_cpu():
    """What the loops above found, stated: on CPU, eager torch takes float64/32/16 and bfloat16; float8, float4,
    complex and integers are declined by every backend, with a reason naming the dtype."""
    for dtype in ALL_DTYPES:
        verdicts = {b: explained("selective", b, dtype, "forward") for b in ("reference", "blocked")}
        if dtype in ATOL:
            assert verdicts == {"reference": None, "blocked": None}, dtype
            continue
        text = attnzoo.explain("selective", dtype=dtype)
        assert text.endswith("auto -> none can run this case"), dtype
        for line in text.splitlines()[1:-1]:
            assert " no: " in line and _name(dtype) in line, line


def test_a_plugin_backend_that_ignores_the_dtype_is_declined_for_a_non_float_one():
    class Anything(attnzoo.Backend):
        name = "anything"
        priority = 50

        def supports(self, plan, device, dtype, mode):
            return []

        def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
            return v

    def register_backends(register):
        register(Anything())

    import types

    module = types.ModuleType("anything")
    module.register_backends = attnzoo.hookimpl(register_backends)
    registry = new_registry(entry_points=False, extra_plugins=[("anything", module)])
    why = explained("vanilla", "anything", torch.int32, "forward", registry=registry)
    assert why == "dtype int32 is not a floating-point dtype: q, k and v must be floating point"
    q = torch.zeros(1, 1, 3, 4, dtype=torch.int32)
    with pytest.raises(attnzoo.UnsupportedError) as info:
        attnzoo.compile("vanilla", backend="anything", registry=registry)(q, q, q)
    assert info.value.reasons == {"anything": [why]}
    assert explained("vanilla", "anything", torch.float32, "forward", registry=registry) is None


def test_a_non_float_dtype_is_refused_as_unsupported_and_still_as_a_valueerror():
    """Before the backends were asked, check_qkv refused integer q, k, v with a ValueError: callers that catch it
    still do."""
    q = torch.zeros(1, 1, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"dtype int64: not a floating-point dtype") as info:
        attnzoo.compile("vanilla")(q, q, q)
    assert isinstance(info.value, attnzoo.UnsupportedError) and "\n" not in str(info.value)


def test_probabilities_decline_a_dtype_the_reference_does_not_take():
    q = torch.zeros(1, 1, 3, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(attnzoo.UnsupportedError, match=r"\(probabilities\) \(reference: dtype float8_e4m3fn: torch "
                                                       r"has no matmul or softmax in it"):
        attnzoo.compile("vanilla").probabilities(q, q, q)


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d.is_floating_point], ids=_name)
def test_the_cli_explains_every_float_dtype_as_the_api_does(capsys, dtype):
    assert main(["explain", "selective", "--dtype", _name(dtype)]) == 0
    assert capsys.readouterr().out.strip() == attnzoo.explain("selective", dtype=dtype)

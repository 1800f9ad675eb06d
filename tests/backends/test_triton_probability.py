"""The triton backend's probability maps under Triton's interpreter (conftest sets TRITON_INTERPRET=1): sigmoid
(pointwise), softpick (ratio), differential attention (the softmax kernels over its values, combined on the host)
against the reference, forward, backward and decoding; stick-breaking declined; a plugin's ratio map; broken
lowerings caught by the conformance suite; and the source of every spec without a map unchanged, byte for byte."""

import hashlib
import types

import pytest
import torch

pytest.importorskip("triton")

from broken import registry_replacing  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.backends.triton import backend as triton_backend  # noqa: E402
from attnzoo.backends.triton import codegen  # noqa: E402
from attnzoo.conformance import checks, runner  # noqa: E402
from attnzoo.plan import Plan  # noqa: E402
from attnzoo.registry import get_registry, new_registry  # noqa: E402
from attnzoo.transforms.base import ProbabilityTransform, Slot  # noqa: E402
from attnzoo.transforms.lowering import TritonProbability  # noqa: E402
from attnzoo.transforms.probability import OnlineSoftmax, Sigmoid, Softpick  # noqa: E402

pytestmark = pytest.mark.interpreter


def _plan(spec, registry=None):
    registry = registry or get_registry()
    return Plan.from_spec(attnzoo.load_spec(spec, registry=registry), registry)


def _spec(name, *transforms, causal=True):
    return {"name": name, "attention": {"causal": causal}, "transforms": list(transforms)}


# -- generated source ---------------------------------------------------------------------------------------------
#: sha256 of codegen.generate(plan) (forward, backward) for every shipped spec the backend took before the
#: probability maps were lowered (generator version 5): a spec without a map gets the same source, byte for byte
UNCHANGED = {
    "alibi": ("17cc7784ca9e3f2098ae30b31e3967d73667ef75ed21e310afe976d9b3f20ca4",
              "fc0715b1acca98f7462c5485b868ac43f45f2050eb9bcbbbcd7cc40d733425a1"),
    "alibi-learnable": ("222c8747cf6f4d9f41c1e4a6bf59ee79ad059ed2e41fbf3cbba13dddd9772d03",
                        "c78c29824e899570516ef662c4ae155673d11a2e83c65e315c4ea6f54fda54dd"),
    "constant-temperature": ("d2770cd9406b9bc9c40d39d1d980469169daa586c8d8eee067fd5012be2e7cb7",
                             "b63c12f3a16475412f863eff977d2a2166a452f4845b7415ba8e420fecc4b6dc"),
    "forgetting": ("b82833d61a00184d568fc7504678d8f6ef867dbf9a93d6904cd4204dea5846c3",
                   "aa8cbb20fa1e945fde8c5cb7c50d88a16250143590a6898b2265b9bb4782a191"),
    "gated": ("e48338056892104c5c761a25661fd18738b21444ddb7b638de6925269085ba46",
              "aeed263bcca185c428fd392594962681bf8f077ac8ecad9d83881a9d7db40a40"),
    "h2o": ("ac16e8b04f09ad4697ca5ebfcdfcdbf0705a82256952b17d9850786119900fb3",
            "f5e5f358af12f315ca9a21d55d1c387283324391a783f671fbb0a259956c3605"),
    "local": ("3c3c594f67960748da08486d74aa7bcd1cf664805e1a20fd1f2b5e5ea345a5c0",
              "db4e2c13aab27f26414eb8fb19f68c199f44ef54d1fb9d13ec373f0564d0984c"),
    "local-global": ("23e8960cd3884f2f6f17325c4a1e4c267a5597045229420213016dfbf43ee599",
                     "124263938543b758081010054ee757369c67c1fd942d8dbdc677551f06b9eb19"),
    "off-by-one": ("26ce53f324793b6dd246088a42e7527ac0f3ef32359270daf0c30d0d958168cf",
                   "9b2087a7c9f331c8bd99d4bca580139c58999c2a92f8b872b2a49ec25aacd443"),
    "qk-norm": ("4907290512f51904f155783279143ba07db69ea4192cdd64fd2f6497c92f9d97",
                "6700105e3584b57b3cd64552de52dc1046d14eecb5e4d970c41718e8a0c69ee9"),
    "selective": ("b0493e99967641c8457ca444e58ff9472fb43be525113356d8d4b8361deab1cd",
                  "72a9b69e0f02165219d807fbb5cbc4f9fd477571861cf67c774836fa4eeb7668"),
    "selective-pruned": ("185ac5937f83e9238c996724ff71ad18607b4a614582448e07e70a89d2b8fb0c",
                         "78dbbef5a4627a7a1a24f531aac28656d9e59184bd1dbcb61090bba915987e6e"),
    "selective-ssa": ("36722b358b8b883253f4dfaae31d73506ef396932789eabb60482735bce6bc3f",
                      "8f26c69230d2450340ecb13f7363cc95bcd7657fa31d393bff3292e2b06c4f3c"),
    "sink": ("40151efc54f76acd30f96f459d9ed915ed7133a2a91173144d6ec25761612161",
             "f10be877b45adbbb38787fb186cf3028f9cccd27b80311680b4722cccf82f3f3"),
    "softcap": ("2ffbd2543dc1c5f6fe11e499781d6da623ccbed27aeb26f8ba156f34225f354e",
                "e7c6730e15d9b5faf798ba8c1699716aa943c9fe1987f4e133b8b2817a723310"),
    "ssa": ("5d424fef230dd661be55c8b23d95c72394ccfe768e0bff953e23a61b5fdacb9f",
            "524b1562826711f4ed0ea26ed4a7ecb96e4ceb2644344b41519b56bf3e222a20"),
    "ssa-key": ("3c2c9469f062555732d8d4014d43a9f30371a32147817dd62159b6af0b947882",
                "e7a3c0e8731f23fee36739788a5348c3a1798e0758df91c96188bd564bff11af"),
    "ssa-position": ("bb9efd112e7c468f7be425c4b162ac9de8569520831dfffa83e698cd6845bec9",
                     "82ec3ce40937a317f87a5517008c7e3b017a5f4552640833b5ad9f4fb266f82e"),
    "ssa-query": ("a38cf1e09a32fbad39c6464f41dca599e4746ff47c42a2b01a96c177b3e9ec5a",
                  "b9a43c457b77ca93cd95daf5dd32486ce92ba7deacd1a5b3091a4c17b66c425c"),
    "ssa-value": ("b6a365a8e8ab17b82c3b3e0c5ba08ef2dc9b3bda1980c7c810070ccbd0230cb0",
                  "704ec6d9b44dbc6b3b96405322ac6ce69ff7b1a648d404258d8c095d54bc61bf"),
    "streaming": ("3f0dc2654d6b1000a9178552894a6ba3a36cdc89b2c1e6314f8609a3c791fbf0",
                  "d8fb41ca32ec85231f8096a04275b51aeb368cf696718dea681aa9307b0ee8cf"),
    "tova": ("22022fdfad9ad965ac08fb55cf4335908c8182c8435bdbed637aa4addc2d1d1a",
             "2c2e557de9f4b49c7446d615a96c06d76b62333a4e56a0b441a0d6511b155372"),
    "vanilla": ("b9594bf7f21003aa4661927eda82862cc2e1f03ea7a4d7469696bd5bb5972e09",
                "8ccf5df9e2c1f092a7529a53679d63ee62a55219804cfe9da423db7902f76e11"),
    "yarn": ("c93a67a521d21f27aa991a1d2623abb8c8c685de618dc30c8dfa4f2c008630cf",
             "676d645bcebf9f4ddf4e7bd4863afa7a9221d723ce4baa2698fd5dbc917e432e"),
}


@pytest.mark.parametrize("name", sorted(UNCHANGED))
def test_source_without_a_map_is_unchanged(name):
    sources = codegen.generate(_plan(name))
    got = tuple(hashlib.sha256(sources[part].encode()).hexdigest() for part in ("forward", "backward"))
    assert got == UNCHANGED[name]
    assert "_map_" not in sources["forward"] + sources["backward"]


def test_map_sources_name_the_map():
    for name, kind, mode in (("sigmoid", "sigmoid", "pointwise"), ("softpick", "softpick", "ratio")):
        sources = codegen.generate(_plan(name))
        for source in sources.values():
            assert (f"probability map (the _map_* helpers; LSE holds each row's shift and denominator): {kind} "
                    f"({mode})") in source
            assert f"# --- from transform '{kind}' (probability, {mode}) ---" in source
            compile(source, "kernels.py", "exec")
        assert "def _map_step" in sources["forward"] and "def _map_bwd" in sources["backward"]
        assert "tl.log(l_safe)" not in sources["forward"]  # no log-sum-exp: the map's statistics instead
    diff = codegen.generate(_plan("diff"))
    assert "probability map on the host around these softmax kernels (its values before, its combine after): diff" \
        in diff["forward"]
    assert "_map_" not in diff["forward"] + diff["backward"]  # the softmax kernels themselves
    assert codegen.layout(_plan("diff")).probability == "softmax"
    learnable = _plan(_spec("s", {"kind": "alibi_learnable"}, {"kind": "sigmoid", "learnable": True}))
    assert codegen.layout(learnable).params == ("alibi_learnable.slope", "sigmoid.bias")  # after the logits' rows


def test_stick_breaking_is_declined_with_its_reason():
    triton = get_registry().backends["triton"]
    reasons = triton.supports(_plan("stick-breaking"), torch.device("cpu"), torch.float32, "forward")
    assert reasons == ["transform 'stick_breaking' (probability) takes key blocks in order 'reverse' (its blocked "
                       "form visits them from the nearest back, carrying what the later keys left): the generated "
                       "kernels merge key blocks in any order, so it is not lowered"]
    with pytest.raises(attnzoo.UnsupportedError, match="stick_breaking"):
        attnzoo.compile("stick-breaking", backend="triton")


# -- against the reference ----------------------------------------------------------------------------------------
CASES = {
    "sigmoid": "sigmoid",  # bias "-log n"
    "sigmoid-number": _spec("sn", {"kind": "sigmoid", "bias": -2.0}, causal=False),
    "sigmoid-learnable": _spec("sl", {"kind": "sigmoid", "learnable": True}),
    "softpick": "softpick",
    "diff": "diff",  # with diff_norm
    # the maps composed with logits transforms, masks, row scales, per-token terms and the accumulator's -F
    "sigmoid-alibi-window": _spec("saw", {"kind": "sigmoid", "learnable": True}, {"kind": "alibi"},
                                  {"kind": "sliding_window", "window": 20}, {"kind": "query_temperature"},
                                  {"kind": "value_temperature"}),
    "softpick-softcap-selective": _spec("sss", {"kind": "softpick"}, {"kind": "softcap", "cap": 5.0},
                                        {"kind": "selective_mask", "selector_head": 1}),
    "sigmoid-learnable-selective": _spec("sls", {"kind": "sigmoid", "learnable": True},
                                         {"kind": "alibi_learnable"}, {"kind": "selective_mask"}),
    "softpick-forgetting": _spec("sf", {"kind": "softpick"}, {"kind": "forgetting_gate"}),
    "diff-selective": _spec("ds", {"kind": "diff"}, {"kind": "softcap", "cap": 5.0}, {"kind": "selective_mask"}),
}


def _inputs(n, b=2, h=4, hkv=2, d=8, masked=False, offset=0, scale=1.5):
    q = scale * torch.randn(b, h, n, d, dtype=torch.float64)
    k, v = (scale * torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    positions = offset + torch.arange(1, n + 1).expand(b, n)
    mask = None
    if masked:  # row 1: left padding, and a gap inside; positions count the real tokens
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[1, :3] = False
        mask[1, n // 2] = False
        positions = offset + mask.long().cumsum(-1).clamp(min=1)
    return q, k, v, positions, mask


def _params(variant, h, d, hkv):
    return {key: p + 0.3 * torch.randn_like(p) for key, p in
            variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64).items()}


def _outputs_and_gradients(variant, dtype, q, k, v, params, positions, mask, cot):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    ps = {key: p.to(dtype).requires_grad_() for key, p in params.items()}
    out = variant(*leaves, params=ps or None, positions=positions, key_mask=mask)
    return {"out": out.detach(), **dict(zip(["q", "k", "v", *ps], torch.autograd.grad(
        out, [*leaves, *ps.values()], cot.to(dtype)), strict=True))}


def _assert_matches(got, want, real=None, tol=1e-4):
    for name, w in want.items():
        g = got[name].double()
        if name == "out" and real is not None:  # padded query rows: any output (their gradients are still checked)
            g, w = g[real], w[real]
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n, masked, offset", [(33, False, 0), (7, True, 1000)], ids=["n33", "n7-masked-offset"])
def test_outputs_and_every_gradient_match_the_reference(case, n, masked, offset):
    """float32 kernels against the float64 reference: outputs and the gradients of q, k, v and every parameter
    (the map's, the logits transforms', the row scales'), GQA 4/2, across 32-wide blocks, with a key mask (padding
    and a gap: a row with no key at all where the mask hides the whole causal prefix) and positions offset."""
    spec = CASES[case]
    ref = attnzoo.compile(spec, backend="reference")
    tri = attnzoo.compile(spec, backend="triton")
    q, k, v, positions, mask = _inputs(n, masked=masked, offset=offset)
    params = _params(ref, 4, 8, 2)
    cot = torch.randn_like(q)
    if mask is not None:  # a padded query's output is defined by the spec but no one reads it: only real rows
        cot = cot * mask[:, None, :, None]
    want = _outputs_and_gradients(ref, torch.float64, q, k, v, params, positions, mask, cot)
    got = _outputs_and_gradients(tri, torch.float32, q, k, v, params, positions, mask, cot)
    real = mask[:, None, :, None].expand_as(q) if mask is not None else None
    _assert_matches(got, want, real)


def test_window_skips_key_blocks_with_a_map():
    """sigmoid + alibi + a sliding window at N = 100: the later query blocks skip the key blocks before the window
    (the kernels' bounds), and the result still equals the reference."""
    from attnzoo.backends.triton.backend import _window_bounds

    spec = CASES["sigmoid-alibi-window"]
    tri = attnzoo.compile(spec, backend="triton")
    positions = torch.arange(1, 101).expand(2, 100)
    bounds = _window_bounds(tri.plan, positions, 32, 32)
    assert bounds is not None and int(bounds[:4].max()) > 0
    ref = attnzoo.compile(spec, backend="reference")
    q, k, v, positions, _ = _inputs(100)
    params = _params(ref, 4, 8, 2)
    cot = torch.randn_like(q)
    _assert_matches(_outputs_and_gradients(tri, torch.float32, q, k, v, params, positions, None, cot),
                    _outputs_and_gradients(ref, torch.float64, q, k, v, params, positions, None, cot))


def test_softpick_rows_of_negative_logits_and_large_logits():
    """Softpick's shift: rows whose logits are all negative (every weight 0, the denominator eps e^0) and rows of
    large logits (the shift keeps every exponent <= 0) match the reference."""
    ref = attnzoo.compile("softpick", backend="reference")
    tri = attnzoo.compile("softpick", backend="triton")
    q, k, v, positions, _ = _inputs(40, b=1)
    q[:, :2] = -q[:, :2].abs()
    k[:, :1] = k[:, :1].abs()  # heads 0 and 1: all logits < 0
    q[:, 2:] *= 8.0  # heads 2 and 3: logits up to ~100
    cot = torch.randn_like(q)
    got = _outputs_and_gradients(tri, torch.float32, q, k, v, {}, positions, None, cot)
    want = _outputs_and_gradients(ref, torch.float64, q, k, v, {}, positions, None, cot)
    assert float(want["out"][:, :2].abs().max()) == 0.0 and float(got["out"][:, :2].abs().max()) == 0.0
    _assert_matches(got, want, tol=1e-3)


# -- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["sigmoid-learnable", "softpick", "diff", "softpick-softcap-selective",
                                  "softpick-forgetting"])
@pytest.mark.parametrize("padded", [False, True], ids=["decode-kernel", "padded"])
def test_prefill_then_decode_equals_the_batch_form(case, padded, monkeypatch):
    """A prefill of 5 tokens then one token at a time through the cache equals the reference over the whole
    sequence. Without padding every step after the prefill runs the _decode kernel (counted); a left-padded row
    sends the steps through the forward kernel with the cache's key mask."""
    spec = CASES[case]
    ref = attnzoo.compile(spec, backend="reference")
    tri = attnzoo.compile(spec, backend="triton")
    n = 12
    q, k, v, _, _ = _inputs(n)
    mask = torch.ones(2, n, dtype=torch.bool)
    if padded:
        mask[1, :2] = False
    positions = mask.long().cumsum(-1).clamp(min=1)
    params = _params(ref, 4, 8, 2)
    want = ref(q, k, v, params=params, positions=positions, key_mask=mask)
    decodes = []
    real_decode = triton_backend._Run.decode
    monkeypatch.setattr(triton_backend._Run, "decode", lambda self, *a: decodes.append(1) or real_decode(self, *a))
    cache = tri.new_cache(2)
    fp = {key: p.float() for key, p in params.items()}
    with torch.no_grad():
        outs = [tri.prefill(q[:, :, :5].float(), k[:, :, :5].float(), v[:, :, :5].float(), cache, params=fp,
                            key_mask=mask[:, :5] if padded else None)]
        for i in range(5, n):
            outs.append(tri.decode(q[:, :, i:i + 1].float(), k[:, :, i:i + 1].float(), v[:, :, i:i + 1].float(),
                                   cache, params=fp))
    got = torch.cat(outs, dim=2).double()
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    runs = 2 if case.startswith("diff") else 1  # diff: the softmax kernels once per D-wide slice of its values
    assert len(decodes) == (0 if padded else (n - 5) * runs)


# -- a plugin's map, and lowerings the suite catches ---------------------------------------------------------------
class RatioSoftmax(OnlineSoftmax, ProbabilityTransform):
    """The masked softmax written as a ratio map (a plugin's view): N = D = e^(x - m), C = 0, no shift floor. Rows
    with no allowed key have Z = 0 and output 0."""

    kind = "ratio_softmax"
    slot = Slot.PROBABILITY
    softmax_map = False  # computed by the map kernels, not as the softmax it is

    def triton(self):
        e = "tl.exp({x} - {m})"
        return TritonProbability(mode="ratio", numerator=e, numerator_derivative=e, denominator=e,
                                 denominator_derivative=e, constant="0.0", shift_floor=float("-inf"))


def _with(*classes):
    module = types.ModuleType("maps")
    module.register_transforms = attnzoo.hookimpl(lambda register: [register(c) for c in classes])
    return new_registry(entry_points=False, extra_plugins=[("maps", module)])


def test_a_plugin_ratio_map_runs_in_the_kernels():
    """A ratio map from a plugin (the softmax, shift floor -inf, C = 0) equals the reference's softmax attention,
    outputs and gradients, with masked rows (Z = 0 there, output 0)."""
    reg = _with(RatioSoftmax)
    spec = _spec("rs", {"kind": "ratio_softmax"}, {"kind": "alibi"})
    assert "ratio_softmax (ratio)" in codegen.generate(_plan(spec, reg))["forward"]
    ref = attnzoo.compile(_spec("rs", {"kind": "alibi"}), backend="reference")  # the softmax itself
    tri = attnzoo.compile(spec, backend="triton", registry=reg)
    q, k, v, positions, mask = _inputs(33, masked=True)
    cot = torch.randn_like(q) * mask[:, None, :, None]
    got = _outputs_and_gradients(tri, torch.float32, q, k, v, {}, positions, mask, cot)
    want = _outputs_and_gradients(ref, torch.float64, q, k, v, {}, positions, mask, cot)
    _assert_matches(got, want, mask[:, None, :, None].expand_as(q))


def test_malformed_map_lowerings_are_declined_by_name():
    class Misspelt(RatioSoftmax):
        kind = "misspelt"

        def triton(self):
            return TritonProbability(mode="ratio", numerator="tl.exp({x} - {shift})", numerator_derivative="1.0",
                                     denominator="1.0", denominator_derivative="0.0")

    class NoMode(RatioSoftmax):
        kind = "no_mode"

        def triton(self):
            return TritonProbability(mode="rowwise")

    class NoLowering(RatioSoftmax):
        kind = "no_lowering"

        def triton(self):
            return None

    reg = _with(Misspelt, NoMode, NoLowering)
    triton = reg.backends["triton"]

    def reasons(kind):
        return triton.supports(_plan(_spec("m", {"kind": kind}), reg), torch.device("cpu"), torch.float32, "forward")

    assert reasons("misspelt") == ["transform 'misspelt': Triton fragment numerator 'tl.exp({x} - {shift})' uses the "
                                   "placeholder {shift}, which is not one of {x}, {m}"]
    assert reasons("no_mode") == ["transform 'no_mode': its Triton lowering's mode must be 'pointwise' or 'ratio', "
                                  "not 'rowwise'"]
    assert reasons("no_lowering") == ["transform 'no_lowering' (probability) has no Triton lowering"]


class WrongSoftpickDerivative(Softpick):
    def triton(self):  # forgets the denominator's derivative: right outputs, wrong gradients
        return TritonProbability(**{**super().triton().__dict__, "denominator_derivative": "0.0"})


class WrongSigmoidDerivative(Sigmoid):
    def triton(self):  # the derivative of the logistic function taken as w instead of w (1 - w)
        return TritonProbability(**{**super().triton().__dict__, "derivative": "{y}"})


@pytest.mark.parametrize("name, broken", [("softpick", WrongSoftpickDerivative),
                                          ("sigmoid", WrongSigmoidDerivative)])
def test_suite_catches_a_broken_map_lowering(name, broken):
    reg = registry_replacing(name, broken)
    cases = [c for c in runner.build_cases(reg, [name], ["triton"], (torch.float32,))
             if c.check in ("outputs/gqa-n63", "gradients/gqa-n63")]
    results = {r.check: r for r in runner.run_suite(cases)}
    assert results["outputs/gqa-n63"].status == "pass"
    assert results["gradients/gqa-n63"].status == "fail"
    assert results["gradients/gqa-n63"].message.startswith("gradients gqa-n63: grad.q:")


def test_float16_through_the_map_kernels():
    """Half precision, as on a GPU: the conformance suite's outputs and gradients at N = 45 with offset positions
    (the interpreter computes float16 correctly; bfloat16 it does not)."""
    shape = next(s for s in checks.DIFFERENTIAL_SHAPES if s.id == "offset-gaps-n45")
    for name in ("sigmoid", "softpick"):
        cases = [c for c in runner.build_cases(get_registry(), [name], ["triton"], (torch.float16,))
                 if c.check in (f"outputs/{shape.id}", f"gradients/{shape.id}")]
        results = runner.run_suite(cases)
        assert [r.status for r in results] == ["pass", "pass"], [r.message for r in results]

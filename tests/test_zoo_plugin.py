"""A plugin written from the docs (tests/data/zoo_plugin): QK-norm with per-dimension gains and the Forgetting
Transformer with a token-dependent gate, each in under 60 lines, pass the conformance suite on reference and
blocked (outputs, every gradient and decoding)."""

import importlib.util
from pathlib import Path

import torch

import attnzoo
from attnzoo.conformance import runner

PLUGIN = Path(__file__).parent / "data" / "zoo_plugin" / "zoo_plugin.py"


def plugin_registry():
    spec = importlib.util.spec_from_file_location("zoo_plugin", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return attnzoo.new_registry(entry_points=False, extra_plugins=(("zoo_plugin", module),))


def test_each_plugin_transform_is_short():
    text = PLUGIN.read_text()
    for start, end in (("class UserQKNormOptions", "class UserForgetting"), ("class UserForgetting", "@attnzoo")):
        body = text[text.index(start):text.index(end)]
        assert len([line for line in body.splitlines() if line.strip()]) < 60


def test_plugin_transforms_pass_the_conformance_suite():
    reg = plugin_registry()
    cases = runner.build_cases(reg, specs=["user-qk-norm", "user-forgetting"], backends=["reference", "blocked"],
                               dtypes=(torch.float64, torch.float32))
    results = runner.run_suite(cases)
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    passed = {(r.spec, r.backend, r.check.split("/")[0]) for r in results if r.status == "pass"}
    for spec in ("user-qk-norm", "user-forgetting"):
        for backend in ("reference", "blocked"):
            assert {(spec, backend, "outputs"), (spec, backend, "gradients")} <= passed
    for spec in ("user-qk-norm", "user-forgetting"):  # the forgetting gate's running D is kept in the cache
        assert (spec, "blocked", "decode") in passed and (spec, "reference", "decode") in passed


def test_the_plugin_forgetting_gate_equals_the_built_in():
    reg = plugin_registry()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    w, b = torch.randn(4, 8, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)
    mine = attnzoo.compile("user-forgetting", backend="blocked", registry=reg)(
        q, k, v, params={"user_forgetting.w": w, "user_forgetting.b": b})
    built_in = attnzoo.attention(q, k, v, "forgetting", backend="reference",
                                 params={"forgetting_gate.weight": w, "forgetting_gate.bias": b})
    torch.testing.assert_close(mine, built_in, rtol=1e-10, atol=1e-12)

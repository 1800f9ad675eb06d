"""A plugin written from the docs (tests/data/zoo_plugin), installed as a user installs it (pip, an entry point in
the ``attnzoo`` group): QK-norm with per-dimension gains and the Forgetting Transformer with a token-dependent gate,
each in under 60 lines, pass the conformance suite on reference, blocked and triton (Triton's interpreter), outputs,
every gradient and decoding."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.conformance import runner

SOURCE = Path(__file__).parent / "data" / "zoo_plugin"
PLUGIN = SOURCE / "zoo_plugin" / "__init__.py"
SPECS = ["user-qk-norm", "user-forgetting"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory, monkeypatch_module):
    """pip-install a copy of the plugin (the source tree stays clean) into a directory put on sys.path, and
    build a registry from the entry points, restricted to this plugin."""
    work = tmp_path_factory.mktemp("zoo")
    shutil.copytree(SOURCE, work / "src")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(work / "site"), str(work / "src")], check=True, capture_output=True)
    monkeypatch_module.syspath_prepend(str(work / "site"))
    importlib.invalidate_caches()
    monkeypatch_module.setenv("ATTNZOO_PLUGINS", "zoo")
    reg = attnzoo.new_registry()
    info = reg.plugins["zoo"]
    assert not info.builtin and info.package == "zoo-plugin" and not info.errors, info
    return reg


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_each_plugin_transform_is_short():
    text = PLUGIN.read_text()
    for start, end in (("class UserQKNormOptions", "class UserForgetting"), ("class UserForgetting", "@attnzoo")):
        body = text[text.index(start):text.index(end)]
        assert len([line for line in body.splitlines() if line.strip()]) < 60


def passing(results):
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    return {(r.spec, r.backend, r.check.split("/")[0]) for r in results if r.status == "pass"}


def test_plugin_transforms_pass_the_conformance_suite(installed):
    passed = passing(runner.run_suite(runner.build_cases(installed, specs=SPECS, backends=["reference", "blocked"],
                                                         dtypes=(torch.float64, torch.float32))))
    for spec in SPECS:  # the forgetting gate's running D is kept in the cache
        for backend in ("reference", "blocked"):
            assert {(spec, backend, "outputs"), (spec, backend, "gradients"), (spec, backend, "decode")} <= passed


def test_plugin_transforms_pass_the_conformance_suite_on_triton(installed):
    """QK-norm is a row map (the host applies it around the kernels); the forgetting gate's separable form gives
    per-token terms the kernels load beside the key/query tiles, forward, backward (their gradients flow back into
    the gate's parameters through the host's torch maths) and decode."""
    cases = runner.build_cases(installed, SPECS, ["triton"], (torch.float32,))
    keep = {"outputs/gqa-n63", "gradients/gqa-n63", "outputs/offset-gaps-n45", "gradients/offset-gaps-n45"}
    cases = [c for c in cases if not c.check.startswith(("outputs/", "gradients/", "packed/")) or c.check in keep]
    passed = passing(runner.run_suite(cases))
    for spec in SPECS:
        assert {(spec, "triton", "outputs"), (spec, "triton", "gradients"), (spec, "triton", "decode")} <= passed


def test_the_plugin_forgetting_gate_equals_the_built_in(installed):
    reg = installed
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    w, b = torch.randn(4, 8, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)
    mine = attnzoo.compile("user-forgetting", backend="blocked", registry=reg)(
        q, k, v, params={"user_forgetting.w": w, "user_forgetting.b": b})
    built_in = attnzoo.attention(q, k, v, "forgetting", backend="reference",
                                 params={"forgetting_gate.weight": w, "forgetting_gate.bias": b})
    torch.testing.assert_close(mine, built_in, rtol=1e-10, atol=1e-12)

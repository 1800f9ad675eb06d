"""Each evictor's rule is written once in Python (attnzoo/evictors/builtin.py); the fused C step is its second
implementation, and ``attnzoo.decode.check.check_fast_step`` holds the two together (issue 41). A difference planted
in either, in the options the evictor hands the kernel, or in the C body itself, is caught; the torch fast steps
follow the Python rule wherever it goes."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.decode import fused_build
from attnzoo.decode.check import check_fast_step
from attnzoo.evictors.base import KernelRule
from attnzoo.evictors.builtin import H2O, Selective, SinkWindow

SPECS = ["selective-pruned", "streaming", "h2o", "tova", "snapkv"]


@pytest.fixture
def fused_only(lean_kind):
    if lean_kind != "fused":
        pytest.skip("a planted difference in the C step's options only shows in the C step")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("spec", SPECS)
def test_the_fast_steps_decode_what_the_python_rule_decides(spec, dtype, lean_kind):
    report = check_fast_step(attnzoo.compile(spec, backend="blocked"), budget=6, dtype=dtype)
    assert report["kinds"] == [lean_kind] and report["fast_steps"] >= report["steps"] - 4


@pytest.mark.parametrize("evictor, rule, spec", [
    (H2O, lambda self, budget: KernelRule("scoring", (0, self.recent(budget) + 1), "attention", 1), "h2o"),
    (SinkWindow, lambda self, budget: KernelRule("sink_window", (self.options.sink + 1,)), "streaming"),
    (Selective, lambda self, budget: KernelRule("selective", (0,), "accumulated"), "selective-pruned"),
], ids=["h2o-recent+1", "sink+1", "selective-bos-unprotected"])
def test_a_difference_planted_in_the_kernels_options_is_caught(evictor, rule, spec, monkeypatch, fused_only):
    monkeypatch.setattr(evictor, "kernel_rule", rule)
    with pytest.raises(AssertionError, match=f"spec '{spec}', step .*fast step 'fused'"):
        check_fast_step(attnzoo.compile(spec, backend="blocked"), budget=6)


def _recent_one_less(self, cache):
    newest = cache.positions.amax(-1, keepdim=True)
    return cache.positions > newest - (self.recent(cache.budget) - 1)


def test_a_difference_planted_in_the_python_rule_is_caught(monkeypatch, lean_kind):
    """H2O's recent window one smaller in Python only: the C step, given the old window by ``kernel_rule``, parts
    from the full path; the torch fast step calls the Python rule, so it follows the change (one Python edit
    changes every path but the C body)."""
    monkeypatch.setattr(H2O, "protected", _recent_one_less)
    if lean_kind == "fused":
        with pytest.raises(AssertionError, match="keeps positions"):
            check_fast_step(attnzoo.compile("h2o", backend="blocked"), budget=6)
    else:
        assert check_fast_step(attnzoo.compile("h2o", backend="blocked"), budget=6)["kinds"] == ["torch"]


def test_a_difference_planted_in_the_c_body_is_caught(tmp_path, monkeypatch, fused_only):
    """The C body compiled with H2O's recent window one larger (``>=`` for ``>``) parts from the Python rule."""
    body = (fused_build._SOURCE.parent / "fused_decode_body.h").read_text()
    planted = "(!tova && ph[j] >= newest_unprotected)"
    assert body.count("(!tova && ph[j] > newest_unprotected)") == 1
    (tmp_path / "fused_decode_body.h").write_text(body.replace("(!tova && ph[j] > newest_unprotected)", planted))
    (tmp_path / "fused_decode.cpp").write_text(fused_build._SOURCE.read_text())
    monkeypatch.setattr(fused_build, "_SOURCE", tmp_path / "fused_decode.cpp")
    monkeypatch.setattr(fused_build, "_LOADED", None)
    assert fused_build.library() is not None, fused_build.status()
    with pytest.raises(AssertionError, match="spec 'h2o'.*fast step 'fused'"):
        check_fast_step(attnzoo.compile("h2o", backend="blocked"), budget=6)
    check_fast_step(attnzoo.compile("tova", backend="blocked"), budget=6)  # the planted line is H2O's alone


def test_a_rule_the_c_step_does_not_know_is_refused_and_decoded_by_torch(monkeypatch, fused_only):
    """The declared rule ``relu`` handed to the C step under a number it does not know: the op refuses it before
    reading anything, and each step runs the torch form, whose S is the declaration's own ``value``."""
    from attnzoo.decode import layout

    monkeypatch.setattr(layout, "SELECTION_RULES", {"relu": 2})
    report = check_fast_step(attnzoo.compile("selective-pruned", backend="blocked"), budget=6)
    assert report["kinds"] == ["fused"] and report["fast_steps"] >= report["steps"] - 4

"""Tensor parallelism under vLLM (attnzoo.integrations.vllm.tp, docs/vllm.md "Tensor parallel"): each rank's heads
and their parameters sliced, and what cannot be split refused in one line (unit tests, no vLLM, no engine)."""

from __future__ import annotations

import types

import pytest
import torch

from attnzoo.integrations.transformers.base import IntegrationError
from attnzoo.integrations.vllm.tp import rank_heads, slice_parameters, split_refusal
from attnzoo.spec import load_spec
from attnzoo.transforms.base import ParamSpec

#: SSA's query temperature with per-head token weights (H, D), and a QK-norm gain per key/value head (H_kv, D)
PER_HEAD = {"name": "per-head", "summary": "per-head parameters on both head axes", "attention": {"causal": True},
            "transforms": [{"kind": "query_temperature", "token_aware": True, "position_aware": True},
                           {"kind": "key_norm", "gain": "per_head"}]}


def test_each_rank_gets_vllms_share_of_the_heads():
    assert [(r.heads, r.kv_heads) for r in (rank_heads(4, 2, 2, 0), rank_heads(4, 2, 2, 1))] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    # more ranks than key/value heads: vLLM replicates each over tp / H_kv ranks
    assert [rank_heads(8, 2, 4, r).kv_heads for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    for heads, kv in ((9, 3), (4, 3)):
        with pytest.raises(IntegrationError) as caught:
            rank_heads(heads, kv, 2, 0)
        assert "\n" not in str(caught.value) and "tensor_parallel_size 2" in str(caught.value)


def test_per_head_parameters_are_sliced_by_the_ranks_heads():
    from attnzoo.nn import Attention

    core = Attention(load_spec(PER_HEAD), 4, 8, 2, backend="blocked")
    gen = torch.Generator().manual_seed(0)
    state = {f"transform_params.{k}": torch.randn(v.shape, generator=gen) for k, v in core.transform_params.items()}
    weight, gain = "transform_params.query_temperature__token_weight", "transform_params.key_norm__gain"
    assert state[weight].shape == (4, 8) and state[gain].shape == (2, 8)
    for rank in (0, 1):
        got = slice_parameters(state, core.variant.plan, rank_heads(4, 2, 2, rank))
        assert torch.equal(got[weight], state[weight][2 * rank:2 * rank + 2])
        assert torch.equal(got[gain], state[gain][rank:rank + 1])
        scalar = "transform_params.query_temperature__position_logit"
        assert torch.equal(got[scalar], state[scalar])  # no head axis: whole on every rank
    replicated = slice_parameters(state, core.variant.plan, rank_heads(4, 2, 4, 3))  # one kv head on two ranks
    assert torch.equal(replicated[gain], state[gain][1:2]) and torch.equal(replicated[weight], state[weight][3:4])


def test_a_parameter_that_mixes_heads_is_refused_in_one_line():
    mixing = ParamSpec("mix", ("H", "H_kv"), 0.0)
    plan = types.SimpleNamespace(param_specs=lambda: {"talking.mix": (None, mixing)})
    with pytest.raises(IntegrationError) as caught:
        slice_parameters({"transform_params.talking__mix": torch.zeros(4, 2)}, plan, rank_heads(4, 2, 2, 0))
    assert "\n" not in str(caught.value) and "'talking.mix'" in str(caught.value) and "mixes heads" in str(
        caught.value)


@pytest.mark.parametrize("spec", ["vanilla", "ssa", PER_HEAD, "alibi-learnable", "qk-norm", "sink", "snapkv", "h2o",
                                  "streaming", "knorm", "keydiff"])
def test_what_splits_exactly_is_served(spec):
    """The probe (the whole core against each rank's, float64, prefill, eviction, decode) finds these exact."""
    assert split_refusal(load_spec(spec), 4, 2, 16, 2, budget=8) is None


@pytest.mark.parametrize("spec, heads, kv, words", [
    ("ssa", 9, 3, ["9 query heads", "tensor_parallel_size 2"]),  # SmolLM2-135M's heads
    ("alibi", 4, 2, ["'alibi'", "index among all heads"]),
    ("local-global", 4, 2, ["'local_global'"]),
    ("selective-pruned", 4, 2, ["'selective_mask'", "selector"]),
    ("tova", 4, 2, ["'tova'", "mixes heads"]),  # its scores are averaged over every head of the layer
    ("h2o", 4, 1, ["'h2o'", "splits over ranks"]),  # one key/value head on two ranks: its group split
])
def test_what_cannot_be_split_is_refused_in_one_line(spec, heads, kv, words):
    reason = split_refusal(load_spec(spec), heads, kv, 16, 2, budget=8)
    assert reason is not None and "\n" not in reason
    for word in words:
        assert word in reason, reason

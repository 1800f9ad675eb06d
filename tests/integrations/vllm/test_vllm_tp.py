"""Tensor parallelism under vLLM (attnzoo.integrations.vllm.tp, docs/vllm.md "Tensor parallel"): each rank's heads
and their parameters sliced (unit tests, no vLLM, no engine), what cannot be split refused in one line, and a tiny
Llama (4 heads, 2 key/value heads) served with ``tensor_parallel_size=2`` (vLLM's CPU platform, gloo, the ``mp``
executor, one CPU per rank) generating the greedy tokens transformers + attnzoo generate, which the one-rank engine
generates too (test_vllm.py): vanilla, SSA with random per-head token weights, and SnapKV evicting to a budget of 8
on each rank's pages. The engine tests need vLLM and two CPUs: about 95 s on 2 cores for the file (three engines of
20-30 s each; the unit tests about 5 s)."""

from __future__ import annotations

import os
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


def test_heads_that_do_not_split_are_refused_before_vllms_own_check():
    """``start.check_heads`` (run first in vLLM's ``ModelConfig.verify_with_parallel_config``): SmolLM2-135M's 9
    query heads and 3 key/value heads over 2 ranks, one line naming the checkpoint, the spec and the heads; nothing
    for one rank or a checkpoint without a record."""
    from attnzoo.integrations.vllm.start import ServeDeclined, check_heads

    def config(record):
        text = types.SimpleNamespace(num_attention_heads=9, **({"attnzoo": record} if record else {}))
        return types.SimpleNamespace(hf_config=text, hf_text_config=text, model="smol",
                                     get_total_num_kv_heads=lambda: 3)

    record = {"spec": "ssa", "hash": load_spec("ssa").hash}
    for model, size in ((config(None), 2), (config(record), 1)):
        check_heads(model, types.SimpleNamespace(tensor_parallel_size=size))
    with pytest.raises(ServeDeclined) as caught:
        check_heads(config(record), types.SimpleNamespace(tensor_parallel_size=2))
    assert "\n" not in str(caught.value) and "'ssa'" in str(caught.value) and "9 query heads" in str(caught.value)


# -- engines -----------------------------------------------------------------------------------------------------------

NEW, BUDGET = 6, 8
LENGTHS = (5, 17)
PRUNED_NEW, PRUNED_LENGTHS = 12, (5, 20, 20)


def _two_cpus(monkeypatch):
    """vLLM's CPU workers bind their threads per NUMA node ("Not enough allowed NUMA nodes to bind threads of 2
    local CPUWorkers" on one node): one CPU each, by hand; the KV cache sized by the engine, not the environment."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor_parallel_size=2 needs two CPUs")
    if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _engine(path, **extra):
    from test_vllm import ENGINE
    from vllm import LLM

    return LLM(model=str(path), tensor_parallel_size=2, distributed_executor_backend="mp",
               **{**ENGINE, "max_model_len": 256, "kv_cache_memory_bytes": 32 * 2**20, **extra})


def _greedy(llm, prompts, tokens):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, ignore_eos=True, max_tokens=tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("spec", ["ssa"])
def test_two_ranks_generate_the_one_rank_greedy_tokens(spec, tmp_path, monkeypatch):
    """Each rank serves 2 of the 4 query heads and 1 of the 2 key/value heads over its own paged cache; SSA's
    per-head token weights (random, as training would leave them) sliced by rank (they change the tokens: checked
    against the plain model's; every rank given rank 0's slice fails this test, checked by hand). SSA's engine
    attends as vanilla's does, with the per-head parameters on top: a separate vanilla engine (about 30 s on 2
    cores) was dropped to keep make test under 15 minutes."""
    pytest.importorskip("vllm")
    from test_vllm import _checkpoint

    _two_cpus(monkeypatch)
    prompts, expected, _ = _checkpoint(tmp_path / "ck", spec, new_tokens=NEW, lengths=LENGTHS)
    if spec == "ssa":
        assert expected != _checkpoint(tmp_path / "plain", None, new_tokens=NEW, lengths=LENGTHS)[1]
    assert _greedy(_engine(tmp_path / "ck"), prompts, NEW) == expected


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_ranks_evict_on_their_own_pages(tmp_path, monkeypatch):
    """SnapKV at a budget of 8, prompts of 5 and 20 tokens (two of one length: a batched decode step on full pages),
    12 tokens decoded: each rank's ring pages hold its key/value head's pruned cache, evicted by its own query heads'
    scores, giving the tokens of transformers + attnzoo's evicting cache (which eviction changes)."""
    pytest.importorskip("vllm")
    from test_vllm import _checkpoint

    _two_cpus(monkeypatch)
    prompts, full, evicting = _checkpoint(tmp_path / "ck", "snapkv", budget=BUDGET, new_tokens=PRUNED_NEW,
                                          lengths=PRUNED_LENGTHS)
    assert full != evicting, "eviction does not change the tokens here: the test would not see it"
    got = _greedy(_engine(tmp_path / "ck"), prompts, PRUNED_NEW)
    for g, w in zip(got, evicting, strict=True):  # generate() stops at EOS (2), vLLM here does not
        assert g[:len(w)] == w


@pytest.mark.slow
@pytest.mark.subprocess
def test_smollm2s_nine_heads_are_refused_over_two_ranks_in_one_line(tmp_path, monkeypatch):
    """SmolLM2-135M's attention (9 heads of 64, 3 key/value heads) in a one-layer Llama with SSA: refused by
    attnzoo in one line when vLLM builds its configuration, before vLLM's own three-line validation report and
    before any worker starts."""
    pytest.importorskip("vllm")
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.vllm import ServeDeclined

    _two_cpus(monkeypatch)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256))
    zt.apply(model, "vanilla")
    model.save_pretrained(tmp_path / "smol")
    with pytest.raises(ServeDeclined) as caught:
        _engine(tmp_path / "smol")
    message = str(caught.value)
    assert "\n" not in message and "'vanilla'" in message and "9 query heads" in message, message
    assert "tensor_parallel_size 2" in message

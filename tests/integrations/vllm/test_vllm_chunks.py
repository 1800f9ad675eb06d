"""Chunked prefill of an evicting spec (docs/vllm.md, "Chunked prefill of a pruned checkpoint"): the serving layer
stages a prompt's keys and values until its last chunk, each chunk attending over the staged prompt so far, and
evicts it into its page at the request's first step that no longer prefills, exactly as the whole prompt's step
does. For the evictors that allow it (sink_window, TOVA, SnapKV, KNorm, KeyDiff); H2O and selective attention keep
the whole-prompt step, said at start. The layer is checked without an engine; the engine against the whole-prompt
engine's tokens is in ``test_vllm.py``'s module of engines (here: one engine per evictor, chunks of 32 tokens)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

pytest.importorskip("vllm")

CHUNKED = ["streaming", "tova", "snapkv", "knorm", "keydiff"]


def _layer(spec: str, budget: int, dtype):
    from attnzoo.integrations.vllm.layer import Layer
    from attnzoo.nn import Attention
    from attnzoo.spec import load_spec

    torch.manual_seed(3)
    core = Attention(load_spec(spec), 4, 16, 2, backend="blocked", dtype=dtype)
    with torch.no_grad():
        for p in core.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return Layer(core, budget, "test", chunked=True), core


def _metadata(counts, done, prompts, table):
    """vLLM's metadata for a step of ``counts[i]`` new tokens of request ``i`` after ``done[i]`` (its prompt
    ``prompts[i]`` tokens long: ``is_prefilling`` where fewer were computed before the step)."""
    n = sum(counts)
    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    after = [d + c for d, c in zip(done, counts, strict=True)]
    meta = types.SimpleNamespace(num_actual_tokens=n, query_start_loc=starts,
                                 seq_lens=torch.tensor(after, dtype=torch.int32), block_table=table,
                                 attnzoo_prefilling=torch.tensor([d < p for d, p in zip(done, prompts, strict=True)]))
    return n, starts.tolist(), after, meta


#: SnapKV under a window shorter than the prompts (its last 4 queries score: a prompt's eviction then takes its
#: first tokens unattended, the last 4 through the core's prefill), with SSA's query and value temperatures (the
#: staged keys and values go through the value slot's row map before they are held)
SSA_SNAPKV = {"name": "ssa-snapkv-w4", "attention": {"causal": True},
              "transforms": [{"kind": "query_temperature", "token_aware": True, "position_aware": True},
                             {"kind": "value_temperature", "token_aware": True, "position_aware": True}],
              "cache": {"evictor": "snapkv", "window": 4, "kernel": 3}}


@pytest.mark.parametrize("spec", [*CHUNKED, pytest.param(SSA_SNAPKV, id="ssa-snapkv-w4")])
def test_a_prompt_in_chunks_gives_the_whole_prompts_outputs_and_page(spec):
    """Three requests (prompts of 21, 6 and 30 tokens; budget 8) in chunks of at most 7 tokens, their chunks side by
    side in a step and beside another request's decode steps (a chunk of one token among them), then decoding:
    every output and each page's tokens at the end are those of the core's whole-prompt prefill and decode steps
    (each request alone in attnzoo's own cache), float64."""
    from attnzoo.core.numerics import accumulator_dtype
    from attnzoo.integrations.vllm.ring import RingGeometry, block_size_for

    dtype, budget, prompts, blocks = torch.float64, 8, [21, 6, 30], [4, 1, 6]
    layer, core = _layer(spec, budget, dtype)
    names = tuple(core.new_cache(1, budget=budget).state_names)
    geometry = RingGeometry(2, 16, dtype, budget, names, accumulator_dtype(dtype), block_size_for(64))
    kv_cache = torch.zeros(8, geometry.page_bytes // 8 + 3, dtype=dtype)
    table = torch.tensor(blocks, dtype=torch.int32).unsqueeze(1)
    gen = torch.Generator().manual_seed(0)
    # the steps: each request's new tokens; a prompt's chunks, then one token per step
    plan = [[7, 6, 7], [7, 1, 1], [6, 1, 7], [1, 1, 7], [1, 1, 8], [1, 1, 1], [1, 1, 1], [1, 0, 1], [1, 1, 1]]
    done = [0, 0, 0]
    whole = {i: ([], [], []) for i in range(3)}  # each request's prompt rows (q, k, v), for the reference
    caches = [core.new_cache(1, budget=budget) for _ in prompts]
    outs: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    want: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    for counts in plan:
        n, starts, after, meta = _metadata(counts, done, prompts, table)
        q, k, v = (torch.randn(n, h, 16, generator=gen, dtype=dtype) for h in (4, 2, 2))
        out = torch.full((n, 64), float("nan"), dtype=dtype)
        layer.attend_pruned(geometry, q, k, v, kv_cache, meta, out)
        for i in range(3):
            rows = slice(starts[i], starts[i + 1])
            if not counts[i]:
                continue
            outs[i].append(out[rows].view(-1, 4, 16))
            if done[i] < prompts[i]:
                for held, t in zip(whole[i], (q, k, v), strict=True):
                    held.append(t[rows])
                if after[i] == prompts[i]:
                    args = [torch.cat(t).transpose(0, 1).unsqueeze(0) for t in whole[i]]
                    want[i].append(core.prefill(*args, caches[i])[0].transpose(0, 1))
            else:
                args = [t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
                want[i].append(core.decode(*args, caches[i])[0].transpose(0, 1))
        done = after
    pages = geometry.all_views(kv_cache)
    for i, cache in enumerate(caches):
        torch.testing.assert_close(torch.cat(outs[i]), torch.cat(want[i]), rtol=1e-10, atol=1e-10)
        header = pages["hdr"][blocks[i]].tolist()
        held = header[1]
        assert header[1:3] == [cache.num_tokens, int(cache.next_position[0])]
        order = pages["positions"][blocks[i], :, :held].argsort(-1)
        torch.testing.assert_close(pages["positions"][blocks[i], :, :held].gather(-1, order), cache.positions[0])
        keys = pages["keys"][blocks[i], :, :held]
        torch.testing.assert_close(keys.gather(1, order[..., None].expand_as(keys)), cache.keys[0])
    assert not layer.staged  # every prompt evicted into its page


def test_a_finished_requests_staged_prompt_is_dropped_with_it():
    """A request that ends with its prompt (max_tokens=1) or is preempted has no step that evicts its staging: the
    wrap of the model runner's ``_update_states`` drops the staged prompts of the pages of the requests the
    scheduler says finished or preempted, in every layer of the process, and leaves the others."""
    from attnzoo.integrations.vllm import install
    from attnzoo.integrations.vllm.layer import drop_staged

    first, _ = _layer("snapkv", 8, torch.float64)
    second, _ = _layer("tova", 8, torch.float64)
    held = (torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), torch.zeros(1, 4, 16), 3)
    for layer in (first, second):
        layer.staged.update({4: held, 6: held, 9: held})
    runner = types.SimpleNamespace(requests={
        "done": types.SimpleNamespace(block_ids=([4, 5],)), "preempted": types.SimpleNamespace(block_ids=([9],)),
        "running": types.SimpleNamespace(block_ids=([6],))})
    output = types.SimpleNamespace(finished_req_ids={"done", "gone"}, preempted_req_ids={"preempted"})
    assert install.finished_blocks(runner, output) == {4, 9}  # "gone": a request the runner no longer holds
    drop_staged(install.finished_blocks(runner, output))
    assert set(first.staged) == set(second.staged) == {6}
    output = types.SimpleNamespace(finished_req_ids=set(), preempted_req_ids=None)
    assert install.finished_blocks(runner, output) == set()


def test_the_model_runner_drops_finished_requests_staging_before_its_own_update():
    """The wrap is installed on vLLM's model runner (the original kept as ``__wrapped__``), and drops the staged
    prompts before the original runs (which forgets the requests, and their pages with them)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from attnzoo.integrations.vllm import install

    install.install()
    assert getattr(GPUModelRunner._update_states, "__wrapped__", None) is not None
    layer, _ = _layer("snapkv", 8, torch.float64)
    layer.staged.update({7: (torch.zeros(1),) * 3 + (1,), 8: (torch.zeros(1),) * 3 + (1,)})
    seen = []
    wrapped = install.wrap_update_states(lambda runner, output: seen.append(set(layer.staged)) or "updated")
    runner = types.SimpleNamespace(requests={"r": types.SimpleNamespace(block_ids=([7],))})
    assert wrapped(runner, types.SimpleNamespace(finished_req_ids={"r"})) == "updated"
    assert seen == [{8}] and set(layer.staged) == {8}


def _config(spec, chunked=True, batched=256):
    from attnzoo.spec import load_spec

    record = {"spec": spec, "name": spec, "hash": load_spec(spec).hash, "budget": 16}
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(attnzoo=record), model="/ckpt",
                                           max_model_len=1024, is_hybrid=False),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        scheduler_config=types.SimpleNamespace(enable_chunked_prefill=chunked, max_num_batched_tokens=batched),
        cache_config=types.SimpleNamespace(enable_prefix_caching=True), speculative_config=None,
        kv_transfer_config=None)


@pytest.mark.parametrize("spec", [*CHUNKED, "h2o", "selective-pruned"])
def test_the_start_line_says_which_evictors_are_prefilled_in_chunks(spec, caplog):
    from attnzoo.integrations.vllm.start import check_config

    config = _config(spec)
    with caplog.at_level(logging.WARNING, logger="attnzoo.integrations.vllm.start"):
        check_config(config, on_cpu=True)
    lines = [r.getMessage() for r in caplog.records if "chunked prefill" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    line = lines[0]
    assert "chunked: tova, sink_window, snapkv, knorm, keydiff; prefilled whole: selective, h2o" in line or \
        "chunked prefill is served for tova, sink_window, snapkv, knorm, keydiff, not for selective, h2o" in line
    if spec in CHUNKED:
        assert line.startswith(f"attnzoo: /ckpt: attnzoo spec '{spec}': chunked prefill served exactly (chunks of "
                               f"up to 256 tokens)"), line
        assert config.scheduler_config.enable_chunked_prefill
        assert config.scheduler_config.max_num_batched_tokens == 256
    else:
        assert line.startswith(f"attnzoo: /ckpt: attnzoo spec '{spec}': chunked prefill is not served for this "
                               f"evicting spec ("), line
        assert "every prompt is prefilled whole in one step" in line and "max_model_len 1024" in line
        assert not config.scheduler_config.enable_chunked_prefill
        assert config.scheduler_config.max_num_batched_tokens == 1024


#: the engine cases: {name: (spec, budget)}: an evictor that reads the prompt's last queries (SnapKV), one that reads
#: none (streaming; KNorm and KeyDiff take the same path, checked on the layer above with the others), TOVA under a
#: sliding window shorter than the prompts (a horizon) with per-layer budgets. An engine costs ~15 s to start here
ENGINE_CASES = {"snapkv": ("snapkv", 16), "streaming": ("streaming", 16),
                "tova-window": ({"name": "tova-window", "summary": "TOVA under a sliding window",
                                 "attention": {"causal": True},
                                 "transforms": [{"kind": "sliding_window", "window": 24}],
                                 "cache": {"evictor": "tova", "budget": 16}}, [16, 20])}
#: prompts longer than a chunk (32 tokens: vLLM's max_num_batched_tokens), one shorter; tokens decoded
LENGTHS, NEW = (100, 71, 9), 16


def _evicting_checkpoint(path, spec, budget):
    """``test_vllm.py``'s tiny Llama with ``spec`` at ``budget``, saved; returns (prompts, transformers + attnzoo's
    evicting greedy ``generate`` tokens)."""
    from test_vllm import _checkpoint

    prompts, _, generated = _checkpoint(path, spec, budget, new_tokens=NEW, lengths=LENGTHS)
    return prompts, generated


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_an_engine_with_chunked_prefill_gives_the_whole_prompts_tokens(name, tmp_path):
    """vLLM's chunked prefill (``enable_chunked_prefill``, ``max_num_batched_tokens=32``) of prompts of 100, 71 and
    9 tokens on a pruned checkpoint (budget 16): each engine step holds chunks of several prompts and, later, decode
    steps; the greedy tokens are transformers + attnzoo's evicting ``generate``'s (what the whole-prompt engine
    gives: ``test_vllm.py``)."""
    pytest.importorskip("transformers")
    from vllm import LLM, SamplingParams

    spec, budget = ENGINE_CASES[name]
    prompts, want = _evicting_checkpoint(tmp_path / name, spec, budget)
    llm = LLM(model=str(tmp_path / name), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=1024, gpu_memory_utilization=0.2, enable_chunked_prefill=True,
              max_num_batched_tokens=32, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    got = [list(o.outputs[0].token_ids) for o in outs]
    for g, w in zip(got, want, strict=True):  # generate() stops at EOS (2), vLLM here does not
        assert g[:len(w)] == w


def test_the_start_line_names_a_plugin_evictor_by_what_it_declares(monkeypatch):
    """The start line's lists of evictors prefilled in chunks and whole come from the registry, each as
    ``chunk_refusal`` decides for a spec holding it alone: a plugin's evictor that scores by the last query's
    attention (``probability_rows = 1``) is named among the chunked, one that reads every query's among the whole."""
    import types

    import attnzoo
    from attnzoo.evictors.builtin import H2O, TOVA
    from attnzoo.integrations.vllm.start import chunked_line, evictor_chunking, whole_prompt_line
    from attnzoo.registry import new_registry

    class LastQuery(TOVA):
        kind = "last_query_plugin"

    class EveryQuery(H2O):
        kind = "every_query_plugin"

    module = types.ModuleType("chunk_plugin")
    module.register_evictors = attnzoo.hookimpl(lambda register: (register(LastQuery), register(EveryQuery)))
    monkeypatch.setattr(attnzoo.registry, "_default",
                        new_registry(entry_points=False, extra_plugins=[("chunk_plugin", module)]))
    chunked, whole = evictor_chunking()
    assert "last_query_plugin" in chunked and "every_query_plugin" in whole
    assert {"tova", "snapkv", "sink_window"} <= set(chunked) and {"h2o", "selective"} <= set(whole)
    assert "last_query_plugin" in chunked_line("w", 256, 1024)
    assert "not for selective, h2o, every_query_plugin" in whole_prompt_line("w", 1024, "why")

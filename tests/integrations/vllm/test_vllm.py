"""Serving through vLLM (attnzoo.integrations.vllm, docs/vllm.md): a tiny Llama (head_dim 64) saved by
``zt.save_pretrained`` with a spec generates, under vLLM's engine and its OpenAI-compatible server, exactly the
greedy tokens transformers + attnzoo generate; a declined spec fails at engine start with one line.

These tests need vLLM (its CPU build pins torch and transformers < 5.20): ``make test`` runs them in their own
environment (``.venv-vllm``, ``make vllm-env``); elsewhere they are skipped. Engine start-ups are few: one engine,
one server, each serving several prompts of different lengths at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

pytest.importorskip("vllm")
pytest.importorskip("transformers")

#: every transform the vLLM backend serves, in one spec (so one engine checks them all): QK-norm, SSA's query
#: and value temperatures, learnable ALiBi, soft-capping, a sliding window shorter than the longest prompt, a sink
SERVED = {"name": "served-composite", "summary": "the transforms vLLM serves", "attention": {"causal": True},
          "transforms": [{"kind": "query_norm", "gain": "shared"}, {"kind": "key_norm", "gain": "shared"},
                         {"kind": "query_temperature", "token_aware": True, "position_aware": True},
                         {"kind": "value_temperature", "token_aware": True, "position_aware": True},
                         {"kind": "alibi_learnable", "max_bias": 8.0}, {"kind": "softcap", "cap": 20.0},
                         {"kind": "sliding_window", "window": 24}, {"kind": "attention_sink", "value": 0.0}]}
PROMPT_LENGTHS = (5, 17, 40)
#: selective attention's accumulator with no cache section: nothing bounds a request's page (declined)
NO_EVICTOR = {"name": "selective-no-cache", "summary": "selective attention without a cache",
              "transforms": [{"kind": "selective_mask"}]}
#: the pruned checkpoints: tokens kept per layer, and tokens decoded (well past the budget)
BUDGET, PRUNED_TOKENS = 16, 24
#: prompts shorter and longer than the budget, two of one length (rows at the same position in a decode batch)
PRUNED_LENGTHS = (5, 17, 40, 40)
#: TOVA under a sliding window longer than its budgets, with a budget per layer: its cache has a horizon (tokens the
#: window has passed expire as well as the evicted ones, so a page may hold fewer than the budget, and each request
#: takes its decode step alone on its page: the backend's full-page batch needs exactly one eviction per step), and
#: the page is sized by the largest budget while each layer keeps its own. One checkpoint (one engine start) for the
#: three: TOVA's rule, a window's horizon, per-layer budgets
WINDOWED_TOVA = {"name": "tova-window", "summary": "TOVA under a sliding window", "attention": {"causal": True},
                 "transforms": [{"kind": "sliding_window", "window": 24}],
                 "cache": {"evictor": "tova", "budget": BUDGET}}
#: {name: (spec, budget)}: each served evictor at the budget (SnapKV: probabilities read over its window of the
#: newest queries, which the budget shrinks to budget - 1, one score per token; KeyDiff: key-only, one stored
#: similarity per token); TOVA under a window with a budget per layer. KNorm (key-only, no per-token state: KeyDiff's
#: path without the state) is checked on the ring pages without an engine (test_vllm_ring.py), its engine dropped for
#: the suite's time
PRUNED = {"streaming": ("streaming", BUDGET), "selective-pruned": ("selective-pruned", BUDGET), "h2o": ("h2o", BUDGET),
          "tova-window": (WINDOWED_TOVA, [BUDGET, 20]), "snapkv": ("snapkv", BUDGET), "keydiff": ("keydiff", BUDGET)}
NEW_TOKENS = 8
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.2)


def _checkpoint(path, spec, budget=None, new_tokens=NEW_TOKENS, lengths=PROMPT_LENGTHS):
    """A tiny Llama with ``spec`` applied (its transform parameters moved off their initial values, as training
    would), saved by zt.save_pretrained; returns (prompts, transformers' greedy tokens for each (the whole sequence
    each step), ``generate``'s with attnzoo's cache, or None without a spec)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnzoo.integrations import transformers as zt

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config)
    if spec is not None:
        zt.apply(model, spec, **({"budget": budget} if budget is not None else {}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".attnzoo." in name:
                    p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(2, 256, (n - 1,), generator=gen).tolist() for n in lengths]
    expected = []
    with torch.no_grad():
        for prompt in prompts:  # greedy, the whole sequence each step (the batch form)
            ids = torch.tensor([prompt])
            for _ in range(new_tokens):
                ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            expected.append(ids[0, len(prompt):].tolist())
        generated = None if spec is None else [
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(p):]
            .tolist() for p in prompts]
    return prompts, expected, generated


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    out = {}
    for name, spec in (("served", SERVED), ("vanilla", "vanilla"), ("ssa", "ssa"), ("selective", NO_EVICTOR),
                       ("plain", None)):
        out[name] = (str(root / name), *_checkpoint(root / name, spec))
    return out


@pytest.mark.parametrize("name", ["served", "ssa"])
def test_the_engine_generates_transformers_greedy_tokens(checkpoints, name):
    """The engine's greedy tokens are transformers' (the whole sequence each step) for a composite spec (ALiBi,
    soft-capping, a window, a sink: attnzoo's own attention over vLLM's pages) and for SSA's temperatures (row maps
    only: vLLM's own kernel over mapped rows, ``native.py``), one rank each."""
    from vllm import LLM, SamplingParams

    path, prompts, expected, _ = checkpoints[name]
    llm = LLM(model=path, **ENGINE)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected
    _, _, plain, _ = checkpoints["plain"]
    assert expected != plain, "the spec does not change the tokens: the test would not see vLLM's own attention"


def test_transformers_generate_decodes_with_attnzoos_cache_under_vllms_transformers(checkpoints):
    """vLLM pins transformers < 5.20, which passes the cache as ``past_key_values`` (``cache`` from 5.20 on):
    ``generate`` on an applied model still decodes through AttnzooCache, giving the whole-sequence tokens."""
    for name in ("served", "vanilla"):
        _, _, expected, generated = checkpoints[name]
        for want, got in zip(expected, generated, strict=True):  # generate stops at EOS (2), the loop does not
            assert got == want[:len(got)] and (len(got) == NEW_TOKENS or got[-1] == 2), name


def test_a_declined_spec_fails_at_start_in_one_line(checkpoints):
    from vllm import LLM

    from attnzoo.integrations.vllm import ServeDeclined

    path = checkpoints["selective"][0]
    with pytest.raises(ServeDeclined) as caught:
        LLM(model=path, **ENGINE)
    message = str(caught.value)
    assert "\n" not in message
    assert "'selective-no-cache'" in message and "selective_mask" in message and "accumulator" in message


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """The checkpoints of :data:`PRUNED`, saved (selector parameters moved off their initial values) when a test
    first asks for one: {name: (path, prompts, full-attention greedy tokens, attnzoo's evicting generate() tokens)}."""
    root = tmp_path_factory.mktemp("vllm-pruned")

    class Saved(dict):
        def __missing__(self, name):
            spec, budget = PRUNED[name]
            self[name] = (str(root / name), *_checkpoint(root / name, spec, budget=budget, new_tokens=PRUNED_TOKENS,
                                                         lengths=PRUNED_LENGTHS))
            return self[name]

    return Saved()


def _can_fail(name, pruned, tmp_path) -> None:
    """What lets case ``name`` of :data:`PRUNED` fail: eviction changes the tokens; a window's cache has a horizon
    and expires tokens; budgets per layer give other tokens than any one budget for every layer."""
    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.transformers.cache import AttnzooCache

    path, prompts, full, evicting = pruned[name]
    assert full != evicting, "eviction does not change the tokens here: the test would not see it"
    spec, budget = PRUNED[name]
    if isinstance(budget, list):
        for each in sorted(set(budget)):
            alike = _checkpoint(tmp_path / f"budget{each}", spec, budget=each, new_tokens=PRUNED_TOKENS,
                                lengths=PRUNED_LENGTHS)[2]
            assert evicting != alike, f"every layer at a budget of {each} gives the same tokens"
    if isinstance(spec, dict) and any(t["kind"] == "sliding_window" for t in spec["transforms"]):
        model = zt.from_pretrained(path)
        cache = AttnzooCache(model)
        model.generate(torch.tensor([prompts[-1]]), max_new_tokens=PRUNED_TOKENS, do_sample=False, pad_token_id=0,
                       past_key_values=cache)
        assert all(layer.kv.horizon is not None for layer in cache.layers)
        assert all(m["expired"] > 0 and m["evicted"] > 0 for m in cache.memory()), cache.memory()


@pytest.mark.parametrize("name", list(PRUNED))
def test_a_pruned_checkpoint_generates_attnzoos_evicting_tokens(pruned, name, tmp_path):
    """KV pruning served (docs/vllm.md, "KV pruning"): each layer's cache is one page of budget + 1 tokens per
    request, allocated by vLLM's KV manager; prompts shorter and longer than the budget in one generate() call (two
    of one length), decoding past it, give the tokens of transformers + attnzoo's evicting
    cache; the pages are reused by the next call's requests. Every served evictor (sink_window, selective, H2O,
    TOVA, SnapKV, KNorm, KeyDiff); TOVA under a sliding window (a cache with a horizon: each request steps alone)
    with a budget per layer (the page holds the largest budget, each layer keeps its own)."""
    from vllm import LLM, SamplingParams

    path, prompts, _, evicting = pruned[name]
    _can_fail(name, pruned, tmp_path)
    llm = LLM(model=path, **ENGINE)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=PRUNED_TOKENS)
    for order in (prompts, prompts[::-1]):  # the second call's requests take pages the first call's left
        outs = llm.generate([{"prompt_token_ids": p} for p in order], greedy)
        got = [list(o.outputs[0].token_ids) for o in outs]
        want = evicting if order is prompts else evicting[::-1]
        for g, w in zip(got, want, strict=True):  # generate() stops at EOS (2), vLLM here does not
            assert g[:len(w)] == w


def _forced_logprobs(path, prompts, continuations, dtype, evicting=True) -> list[torch.Tensor]:
    """transformers + attnzoo's log-probabilities (float32, (tokens, vocab)) before each token of each continuation,
    the model loaded in ``dtype`` and fed the prompt, then the continuation one token at a time (teacher-forced)
    through an AttnzooCache with the recorded budget (none when not ``evicting``)."""
    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.transformers.cache import AttnzooCache

    model = zt.from_pretrained(path, dtype=dtype, **({} if evicting else {"budget": None}))
    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, continuations, strict=True):
            cache = AttnzooCache(model)
            steps = [torch.tensor([prompt])] + [torch.tensor([[t]]) for t in tokens[:-1]]
            logits = [model(ids, past_key_values=cache, use_cache=True).logits[0, -1] for ids in steps]
            out.append(torch.stack(logits).float().log_softmax(-1))
    return out


def test_a_pruned_checkpoint_served_in_bfloat16(pruned):
    """A pruned checkpoint (selective-pruned at a budget of 16, trained selector parameters) served with
    ``dtype="bfloat16"``: its pages hold keys and values in bfloat16 and F in float32 (the accumulator dtype).

    Exact tokens are not expected: this tiny random model's top two logits are often less than one bfloat16 step
    apart (logits near 1 are rounded to 1/128, and transformers' bfloat16 run even ties them), so vLLM's kernels and
    transformers' round a near-tie differently. What is compared is the distribution each step: transformers +
    attnzoo in bfloat16, fed the tokens vLLM generated (teacher-forced, through the evicting cache), give each of
    vLLM's top-5 log-probabilities within 0.1 nats (measured: 0.07 at worst); the same model without eviction is
    off by more than 0.2 on every prompt (measured: 0.26 to 0.49), so the tolerance sees eviction. (vLLM's bfloat16
    tokens here are the float32 evicting generate()'s but for two near-tied ones swapped at the end of one prompt.)"""
    from vllm import LLM, SamplingParams

    path, prompts, _, _ = pruned["selective-pruned"]
    llm = LLM(model=path, **{**ENGINE, "dtype": "bfloat16"})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, ignore_eos=True, max_tokens=PRUNED_TOKENS, logprobs=5))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    served = [o.outputs[0].logprobs for o in outs]

    def worst(evicting):  # per prompt: the largest difference over the steps and vLLM's top tokens
        forced = _forced_logprobs(path, prompts, tokens, torch.bfloat16, evicting)
        return [max(abs(float(f[j, t]) - lp.logprob) for j, step in enumerate(steps) for t, lp in step.items())
                for f, steps in zip(forced, served, strict=True)]

    close, far = worst(True), worst(False)
    assert max(close) <= 0.1, close
    assert min(far) > 0.2, f"the tolerance would not see eviction: {far}"


def test_a_malformed_record_and_token_inputs_fail_at_start_in_one_line(checkpoints, tmp_path):
    """The record is read as zt.from_pretrained reads it (zt.check_record): a spec edited with its hash left as it
    was, or a misspelled key, is refused at engine start naming config.json and the field (never served, never read
    as no record); a checkpoint with token projections (the forgetting gate from the layer input) is declined by
    its transform, its extra tensors notwithstanding."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM

    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.vllm import ServeDeclined

    def edited(record):
        record["spec"]["transforms"][2]["position_coefficient"] = "sigmoid"
        return record

    cases = [(edited, ["attnzoo.hash", "hashes to"]),
             (lambda r: {("Spec" if k == "spec" else k): v for k, v in r.items()}, ["attnzoo.Spec", "unknown key"])]
    for index, (make, words) in enumerate(cases):
        path = tmp_path / f"hostile{index}"
        shutil.copytree(checkpoints["served"][0], path)
        data = json.loads((path / "config.json").read_text())
        data["attnzoo"] = make(data["attnzoo"])
        (path / "config.json").write_text(json.dumps(data))
        with pytest.raises(ServeDeclined) as caught:
            LLM(model=str(path), **ENGINE)
        message = str(caught.value)
        assert "\n" not in message and f"{path / 'config.json'}: " in message
        assert all(w in message for w in words), message

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    zt.apply(model, {"name": "fox-input", "attention": {"causal": True},
                     "transforms": [{"kind": "forgetting_gate", "source": "input"}]})
    model.save_pretrained(tmp_path / "fox")
    with pytest.raises(ServeDeclined) as caught:
        LLM(model=str(tmp_path / "fox"), **ENGINE)
    assert "\n" not in str(caught.value) and "forgetting_gate" in str(caught.value)


def test_without_the_plugin_vllm_refuses_a_checkpoint_with_a_record(checkpoints):
    """The record's checkpoint names its architectures with attnzoo's prefix (saving.guard_config): vLLM without
    attnzoo's plugin (VLLM_PLUGINS excluding it) refuses it instead of serving it with its own attention."""
    path = checkpoints["served"][0]
    assert json.loads(open(os.path.join(path, "config.json")).read())["architectures"] == ["AttnzooLlamaForCausalLM"]
    code = ("from vllm import LLM\n"
            "if __name__ == '__main__':\n"
            f"    LLM(model={path!r}, skip_tokenizer_init=True, dtype='float32', enforce_eager=True, "
            "max_model_len=256, gpu_memory_utilization=0.2)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_PLUGINS": "none"})
    assert done.returncode != 0
    assert "Model architectures ['AttnzooLlamaForCausalLM'] are not supported" in done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body, timeout=120):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_the_openai_server_answers_with_the_same_tokens(pruned, tmp_path):
    """vLLM's OpenAI-compatible server (what ``vllm serve`` runs) on 127.0.0.1, started and stopped here, serving a
    pruned checkpoint (H2O at a budget of 16): the tokens of attnzoo's evicting generate()."""
    path, prompts, _, expected = pruned["h2o"]
    port = _free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    args = ["--model", path, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--skip-tokenizer-init", "--max-model-len", "1024", "--gpu-memory-utilization", "0.2"]
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
        got = []
        for prompt in prompts:
            answer = _post(f"http://127.0.0.1:{port}/v1/completions",
                           {"model": path, "prompt": prompt, "max_tokens": PRUNED_TOKENS, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True})
            got.append(answer["choices"][0]["token_ids"])
        for g, w in zip(got, expected, strict=True):  # generate() stops at EOS (2), the server here does not
            assert g[:len(w)] == w
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

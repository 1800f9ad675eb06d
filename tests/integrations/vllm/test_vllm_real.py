"""The real model served by vLLM through the ring pages (issue 52, item 3; docs/vllm.md): SmolLM2-135M-Instruct with
``snapkv`` at a quarter of a 1,024-token passkey prompt (the first case of ``benchmarks/quality.py``'s
``passkey_cases``, the key at 10% depth), saved and served by vLLM, generates exactly HF + attnzoo's evicting
``generate()`` greedy tokens. About 45 s on 2 cores (the engine starts in about 20 s). Skipped without vLLM, or where
the model is neither cached nor convertible (``attnzoo model smollm2``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

pytest.importorskip("vllm")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
CONTEXT, KEPT, NEW = 1024, 0.25, 24


def _quality():
    spec = importlib.util.spec_from_file_location("quality_benchmark", ROOT / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_real_model_under_snapkv_gives_hf_attnzoos_greedy_tokens(smollm2_cached, tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams

    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.transformers.base import cache_argument

    quality = _quality()
    model, tokenizer = zt.smollm2(progress=False)
    case = quality.passkey_cases(tokenizer, [CONTEXT], [0.1], 1, 0)[0]
    budget = quality.budget_of(KEPT, CONTEXT)
    zt.apply(model, "snapkv", budget=budget)
    model.save_pretrained(tmp_path / "snapkv")
    cache = zt.AttnzooCache(model)
    with torch.no_grad():
        want = model.generate(torch.tensor([case["ids"]]), attention_mask=torch.ones(1, CONTEXT, dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                              eos_token_id=None, **{cache_argument(model): cache})[0, CONTEXT:].tolist()
    assert all(m["evicted"] > 0 and m["budget"] == budget for m in cache.memory()), cache.memory()
    del model
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would override kv_cache_memory_bytes
    llm = LLM(model=str(tmp_path / "snapkv"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=CONTEXT + 128, kv_cache_memory_bytes=64 * 2**20)
    out = llm.generate([{"prompt_token_ids": case["ids"]}],
                       SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want

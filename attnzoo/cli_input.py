"""The ``attnzoo`` command's input checks, shared with ``attnzoo bench``: argparse with its refusals on one line,
integers in a range, dtype and device names, files and folders to write, ``KEY=VALUE`` settings, and a transformers
``config.json`` read safely. Each refusal is :class:`BadInput` (one line, exit 2). Below :mod:`attnzoo.cli` and
:mod:`attnzoo.bench`, which both import it (docs/architecture.md)."""

from __future__ import annotations

import argparse
import json

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class BadInput(Exception):
    """Raised by a command for input it cannot use; main() prints its one line and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse with its refusals on one line (exit 2): ``attnzoo build: error: ... (see attnzoo build --help)``
    instead of a usage block; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def int_in(low: int, high: int):
    """An argparse ``type``: an integer from ``low`` to ``high``, else one line naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text[:40]}' is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: an integer from {low:,} to {high:,}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


def dtype_named(name: str, floating: bool = True):
    """The torch dtype ``name`` (a floating one unless ``floating`` is False), else one line."""
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise BadInput(f"unknown dtype '{name[:40]}' (e.g. float32, float64, float16, bfloat16)")
    if floating and not value.is_floating_point:
        raise BadInput(f"dtype '{name}' is not a floating dtype (e.g. float32, float64, float16, bfloat16)")
    return value


def device_named(name: str) -> str:
    """A device name torch knows and this machine has (one line otherwise)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise BadInput(f"unknown device '{name}' (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"device '{name}' is not available here (torch sees no CUDA GPU)")
    if device.type not in ("cpu", "cuda"):
        module = getattr(torch, device.type, None)
        if module is None or not getattr(module, "is_available", lambda: False)():
            raise BadInput(f"device '{name}' is not available here")
    return str(device)


def writable(path: str) -> None:
    """One line (exit 2) unless ``path`` can be written: its folder exists and takes files, it is not a folder."""
    import os
    from pathlib import Path

    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise BadInput(f"--report {path}: is a directory")
    if not folder.is_dir():
        raise BadInput(f"--report {path}: no such directory '{folder}'")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise BadInput(f"--report {path}: not writable")


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file: the same file on disk, or the same resolved path."""
    import os

    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` from --set: VALUE read as JSON when it parses (numbers, lists), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise BadInput(f"--set {text}: expected KEY=VALUE, e.g. --set batch=32")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def folder_for_writing(path: str, flag: str) -> None:
    """One line (exit 2) unless ``path`` is, or can be made, a folder to write into: checked before any work."""
    import os
    from pathlib import Path

    target = Path(path)
    if target.exists() and not target.is_dir():
        raise BadInput(f"{flag} {path}: exists and is not a folder")
    existing = target
    while not existing.exists():
        if existing.is_symlink():
            raise BadInput(f"{flag} {path}: '{existing}' is a dangling symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(f"{flag} {path}: '{existing}' is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {path}: '{existing}' is not writable")


#: How deep a config.json may nest objects and arrays (transformers writes a few levels: sub-configurations,
#: rope_scaling, tagged floats); deeper is refused before it is parsed (Python's JSON parser recurses).
CONFIG_DEPTH = 32


def clip(value, limit: int = 80) -> str:
    """``value`` as text, cut to ``limit`` characters with an ellipsis: what a message echoes of an input."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def clip_message(message, limit: int) -> str:
    """Another library's message about an input, on one line, with every word (an echoed value) cut to 80 characters
    and the whole to ``limit``."""
    import re

    return clip(re.sub(r"(\S{79})\S+", "\\1…", " ".join(str(message).split())), limit)


def nests_deeper(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests objects and arrays more than ``limit`` deep (brackets inside strings do not
    count): a scan in linear time that does not recurse, before a parser that does."""
    import re

    depth = 0
    for bracket in re.sub(r"[^\[\]{}]+", "", re.sub(r'"[^"\\]*(?:\\.[^"\\]*)*"?', "", text)):
        if bracket in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def read_config(path: str):
    """A transformers ``config.json`` (or a checkpoint folder holding one) as its ``PretrainedConfig``, read as
    ``AutoConfig.from_pretrained`` reads a local file (transformers' own JSON loader: its ``{"__float__": "Infinity"}``
    tags become floats), but size- and depth-limited, with no code run and nothing downloaded. The attnzoo record of
    a checkpoint saved after ``apply()`` (its ``attnzoo`` key) is checked as every host checks it
    (:func:`~attnzoo.integrations.transformers.records.check_record`): a malformed one is refused."""
    import os

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise BadInput(f"{file}: {'not a regular file' if os.path.exists(file) else 'no such file'}")
    if os.path.getsize(file) > (1 << 22):
        raise BadInput(f"{file}: larger than 4 MiB, not a model configuration")
    try:
        with open(file, encoding="utf-8") as fh:
            text = fh.read((1 << 22) + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{file}: not readable JSON ({clip_message(exc, 240)})") from None
    if len(text) > (1 << 22):
        raise BadInput(f"{file}: larger than 4 MiB, not a model configuration")
    if nests_deeper(text, CONFIG_DEPTH):
        raise BadInput(f"{file}: objects and arrays nested more than {CONFIG_DEPTH} deep, not a model configuration")
    try:
        from transformers import CONFIG_MAPPING, PretrainedConfig
    except ImportError:
        raise BadInput("native-spec needs transformers: pip install 'attnzoo[transformers]'") from None
    try:  # transformers' reader of a local config.json (what from_pretrained and from_json_file call)
        data = PretrainedConfig._dict_from_json_file(file)
    except (OSError, ValueError, RecursionError, MemoryError) as exc:  # ValueError: JSON, and ints over 4,300 digits
        raise BadInput(f"{file}: not readable JSON ({clip_message(exc, 240)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise BadInput(f"{file}: a transformers config.json names its model_type")
    if data["model_type"] not in CONFIG_MAPPING:
        raise BadInput(f"{file}: model_type '{clip(data['model_type'])}' is not one transformers knows")
    data.pop("attn_implementation", None)  # an attnzoo checkpoint's guard
    if "attnzoo" in data:  # an attnzoo checkpoint's record: read as zt.from_pretrained and vLLM read it
        from .integrations.transformers import IntegrationError
        from .integrations.transformers.records import check_record

        try:
            data["attnzoo"] = check_record(data["attnzoo"], file)
        except IntegrationError as exc:  # one line naming the file and the field, its values clipped
            raise BadInput(str(exc)) from None
    try:
        return file, CONFIG_MAPPING[data["model_type"]].from_dict(data)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal, in one line
        raise BadInput(f"{file}: transformers rejects it ({clip_message(exc, 240)})") from None

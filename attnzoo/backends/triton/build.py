"""Build artifacts: generated Triton kernel sources, cached on disk and keyed by what they depend on.

An artifact is a directory ``<cache>/<key>/`` holding ``kernels.py`` and ``kernels_backward.py`` (the generated
forward and backward sources) and ``manifest.json`` (spec name and hash, versions, each source's sha256). The key
is the sha256 of the spec hash, the attnzoo version, the Triton and torch versions, the generator version and a
fingerprint of the template and of the spec's transforms' lowerings (a plugin that changes a fragment gets a new
key). The cache directory is ``$ATTNZOO_CACHE_DIR``, or the per-user cache directory (``platformdirs``).

Trust: the code that runs is the code generated now. The sources are generated in the process (deterministic,
under a millisecond; once per key and process) and imported from memory (:func:`load_kernels`); the files on disk
are an artifact for people and for ``--compile-for``, never imported. An artifact whose files differ from the
sources generated now is damaged and rewritten. Nothing in the cache is followed through a symbolic link (files
and locks are opened with ``O_NOFOLLOW``, directories checked with ``lstat``), and a cache directory, artifact
directory or file that another user can write (or owns; root excepted) is refused with one line saying how to fix
it (:class:`CacheError`), as ssh's ``StrictModes`` refuses such files; nothing is overwritten then.

Building follows check → lock → check → write: files are written to a temporary name and renamed (atomic), the
manifest last, so a reader sees a whole artifact or none; a file lock per key keeps concurrent builds of one key
from colliding.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from ...buildcache import (  # the cache and its trust rules (shared with the fused decoding step's library)
    CacheError,
    cache_dir,
    cache_root,
    check_trusted,
    checked_dir,
    locked,
    read_file,
    write_atomic,
)
from ...plan import Plan
from ...registry import get_registry
from ...spec import load_spec

#: the generated sources of an artifact, by part: the forward kernels load on first use, the backward ones on the
#: first backward pass
SOURCES = {"forward": "kernels.py", "backward": "kernels_backward.py"}
MANIFEST = "manifest.json"

__all__ = ["MANIFEST", "SOURCES", "Artifact", "CacheError", "artifact_key", "build", "cache_dir", "cache_root",
           "check_trusted", "checked_dir", "generated_sources", "interpreting", "kernel_module_name", "load_kernels",
           "read_file", "toolchain", "triton_version", "write_atomic"]


def triton_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:  # noqa: BLE001 - not installed (or broken metadata): no version to key on
        return None


def toolchain() -> dict[str, Any]:
    from .codegen import GENERATOR_VERSION

    return {"attnzoo": __version__, "generator": GENERATOR_VERSION, "torch": torch.__version__,
            "triton": triton_version()}


def artifact_key(spec, plan=None, registry=None) -> str:
    """sha256 of the spec hash, every version the generated source depends on, and the generator's fingerprint
    of the template and of the spec's transforms' lowerings."""
    from .codegen import fingerprint

    plan = plan or Plan.from_spec(spec, registry or get_registry())
    data = json.dumps({"spec": spec.hash, **toolchain(), "lowering": fingerprint(plan)}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()


@dataclass
class Artifact:
    spec_name: str
    key: str
    directory: Path
    manifest: dict[str, Any]
    hit: bool  # True when it was already in the cache, whole and identical to the sources generated now
    sources: dict[str, bytes] = field(default_factory=dict, repr=False)  # file name -> the source generated now

    @property
    def source_path(self) -> Path:
        """The forward kernels' source."""
        return self.directory / SOURCES["forward"]

    def path(self, part: str) -> Path:
        return self.directory / SOURCES[part]


# -- what the cache trusts ----------------------------------------------------------------------------------------
_generated: dict[str, dict[str, bytes]] = {}  # key -> the sources generated in this process, by file name


def generated_sources(plan, key: str) -> dict[str, bytes]:
    """``plan``'s generated sources by file name, generated once per key and process (the key covers everything
    the generated text depends on)."""
    from .codegen import generate

    if key not in _generated:
        _generated[key] = {SOURCES[part]: text.encode() for part, text in generate(plan).items()}
    return _generated[key]


def _try_load(directory: Path, key: str, spec_name: str, sources: dict[str, bytes]) -> Artifact | None:
    """The artifact in ``directory`` if it is whole and its files are the sources generated now; None if absent
    or damaged. :class:`CacheError` for anything that must not be followed or trusted."""
    if not checked_dir(directory):
        return None
    for name, data in sources.items():
        if read_file(directory / name) != data:
            return None
    try:
        manifest = json.loads(read_file(directory / MANIFEST) or b"")
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's stack: damaged, built again
        return None
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()}
    if not isinstance(manifest, dict) or manifest.get("key") != key or manifest.get("sources") != digests:
        return None
    return Artifact(spec_name, key, directory, manifest, hit=True, sources=sources)


def build(spec, registry=None, root: Path | None = None, force: bool = False, plan=None) -> Artifact:
    """The artifact of ``spec`` (a path, registered name or Spec): its sources generated now, written to the cache
    unless the cache already holds exactly them.

    Raises ValueError when the spec cannot be lowered to Triton (the reasons name the transforms), and
    :class:`CacheError` (one line) for a cache that cannot be used safely. ``plan`` (optional) is the spec already
    resolved against its registry.
    """
    if plan is None:
        registry = registry or get_registry()
        plan = Plan.from_spec(load_spec(spec, registry=registry), registry)
    loaded = plan.spec
    key = artifact_key(loaded, plan)
    sources = generated_sources(plan, key)
    root = cache_root(cache_dir() if root is None else Path(root))
    directory = root / key[:32]
    if not force and (found := _try_load(directory, key, loaded.name, sources)) is not None:
        return found
    with locked(root / f"{key[:32]}.lock"):
        if not force and (found := _try_load(directory, key, loaded.name, sources)) is not None:
            return found
        checked_dir(directory, create=True)
        manifest = {
            "key": key, "spec": loaded.name, "spec_hash": loaded.hash, **toolchain(),
            "sources": {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for name, data in sources.items():
            write_atomic(directory / name, data)
        write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return Artifact(loaded.name, key, directory, manifest, hit=False, sources=sources)


# -- load -----------------------------------------------------------------------------------------------------
class _InMemory(importlib.abc.Loader):
    """Runs a generated source from its text in memory, and hands that text to whoever reads a kernel's source:
    ``inspect`` (Triton's ``@jit``, its interpreter) asks the module's loader through ``linecache``, as the name
    given to the code (``<file> (in memory)``) is no file."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.filename = filename

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        exec(compile(self.text, self.filename, "exec"), module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.text


_modules: dict[str, Any] = {}


def kernel_module_name(key: str, part: str, interpreted: bool) -> str:
    """The module name a spec's generated ``part`` is imported as (Triton's hooks see kernels by module)."""
    return f"attnzoo_kernels_{key[:16]}_{part}{'_interp' if interpreted else ''}"


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``; CPU checking mode)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load_kernels(spec, registry=None, root: Path | None = None, plan=None, part: str = "forward"):
    """The module of ``spec``'s ``part`` ("forward" or "backward") kernels, run from the source generated now
    (never imported from the cache's file): built if absent, loaded once per process (and per interpreter mode,
    which Triton reads when the kernels are defined)."""
    artifact = build(spec, registry, root, plan=plan)
    name = kernel_module_name(artifact.key, part, interpreting())
    if name not in _modules:
        loader = _InMemory(artifact.sources[SOURCES[part]].decode(), f"{artifact.path(part)} (in memory)")
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        sys.modules[name] = module  # triton resolves the kernels' globals through the module
        try:
            loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[name] = module
    return _modules[name]


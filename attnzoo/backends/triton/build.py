"""Build artifacts: generated Triton kernel sources, cached on disk and keyed by what they depend on.

An artifact is a directory ``<cache>/<key>/`` holding ``kernels.py`` and ``kernels_backward.py`` (the generated
forward and backward sources) and ``manifest.json`` (spec name and hash, versions, each source's sha256). The key
is the sha256 of the spec hash, the attnzoo version, the Triton and torch versions, the generator version and a
fingerprint of the template and of the spec's transforms' lowerings (a plugin that changes a fragment gets a new
key). The cache directory is ``$ATTNZOO_CACHE_DIR``, or the per-user cache directory (``platformdirs``).

Building follows try load → lock → try load → generate → write: files are written to a temporary name and renamed
(atomic), the manifest last, so a reader sees a whole artifact or none; a file lock per key keeps concurrent
builds of one key from colliding. A damaged artifact (source not matching the manifest's hash) is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from ...plan import Plan
from ...registry import get_registry
from ...spec import load_spec

#: the generated sources of an artifact, by part: the forward kernels load on first use, the backward ones on the
#: first backward pass
SOURCES = {"forward": "kernels.py", "backward": "kernels_backward.py"}
MANIFEST = "manifest.json"


def cache_dir() -> Path:
    """Where artifacts live: ``$ATTNZOO_CACHE_DIR`` or the per-user cache directory."""
    env = os.environ.get("ATTNZOO_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("attnzoo"))


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
    hit: bool  # True when it was already in the cache

    @property
    def source_path(self) -> Path:
        """The forward kernels' source."""
        return self.directory / SOURCES["forward"]

    def path(self, part: str) -> Path:
        return self.directory / SOURCES[part]


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary name, then a rename), with the mode an ordinary file gets
    (``0o666`` less the umask), so a cache shared by several users or CI jobs stays readable by all of them."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:  # mkstemp's names, but not its 0o600: os.open applies the umask to 0o666
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _try_load(directory: Path, key: str, spec_name: str) -> Artifact | None:
    """The artifact in ``directory`` if it is whole and matches ``key``; None if absent or damaged."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        digests = {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in SOURCES.values()}
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key or manifest.get("sources") != digests:
        return None
    return Artifact(spec_name, key, directory, manifest, hit=True)


def build(spec, registry=None, root: Path | None = None, force: bool = False, plan=None) -> Artifact:
    """The artifact of ``spec`` (a path, registered name or Spec), generating it unless cached.

    Raises ValueError when the spec cannot be lowered to Triton (the reasons name the transforms). ``plan``
    (optional) is the spec already resolved against its registry.
    """
    from filelock import FileLock

    from .codegen import generate

    if plan is None:
        registry = registry or get_registry()
        plan = Plan.from_spec(load_spec(spec, registry=registry), registry)
    loaded = plan.spec
    key = artifact_key(loaded, plan)
    root = cache_dir() if root is None else Path(root)
    directory = root / key[:32]
    if not force and (found := _try_load(directory, key, loaded.name)) is not None:
        return found
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key[:32]}.lock")):
        if not force and (found := _try_load(directory, key, loaded.name)) is not None:
            return found
        sources = {SOURCES[part]: text.encode() for part, text in generate(plan).items()}
        manifest = {
            "key": key, "spec": loaded.name, "spec_hash": loaded.hash, **toolchain(),
            "sources": {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for name, data in sources.items():
            _write_atomic(directory / name, data)
        _write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return Artifact(loaded.name, key, directory, manifest, hit=False)


_modules: dict[tuple[str, bool], Any] = {}


def kernel_module_name(key: str, part: str, interpreted: bool) -> str:
    """The module name a spec's generated ``part`` is imported as (Triton's hooks see kernels by module)."""
    return f"attnzoo_kernels_{key[:16]}_{part}{'_interp' if interpreted else ''}"


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``; CPU checking mode)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load_kernels(spec, registry=None, root: Path | None = None, plan=None, part: str = "forward"):
    """The imported module of ``spec``'s ``part`` ("forward" or "backward") kernels: built if absent, loaded once
    per process (and per interpreter mode, which Triton reads when the kernels are defined)."""
    artifact = build(spec, registry, root, plan=plan)
    path = artifact.path(part)
    memo = (str(path), interpreting())
    if memo not in _modules:
        name = kernel_module_name(artifact.key, part, memo[1])
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # triton resolves the kernels' globals through the module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[memo] = module
    return _modules[memo]

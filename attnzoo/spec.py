"""Spec files: a variant as validated, hashable data.

Files are YAML, TOML or JSON and load the same way, safely: a size limit, a nesting limit, YAML without object
tags or aliases (no alias bombs), duplicate keys rejected, invalid UTF-8 rejected, NaN/inf rejected. Every problem
raises :class:`SpecError` with one line: ``file: field.path: reason``.

The model, the file reading and the validation against a registry are in :mod:`attnzoo.spec_data` (below the
registry, which loads plugins' specs through it); this module adds the default registry (:func:`get_registry`)
and is the public path (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from . import spec_data
from .registry import get_registry
from .spec_data import (
    EXCERPT,
    MAX_BYTES,
    MAX_DEPTH,
    SPEC_KEYS,
    SUFFIXES,
    AttentionOptions,
    SpecBase,
    build_spec_model,
    did_you_mean,
    names_a_file,
    read_spec_file,
)

__all__ = [
    "EXCERPT", "MAX_BYTES", "MAX_DEPTH", "SPEC_KEYS", "SUFFIXES", "AttentionOptions", "SpecBase", "build_spec_model",
    "did_you_mean", "load_spec", "names_a_file", "read_spec_file", "validate_spec_data",
]


def validate_spec_data(data: dict[str, Any], source: str, registry=None) -> SpecBase:
    """Validate plain data against the registry's spec model (the default registry when none is given)."""
    return spec_data.validate_spec_data(data, source, registry or get_registry())


def load_spec(source: Any, registry=None) -> SpecBase:
    """A spec from a path (YAML, TOML or JSON), the name of a registered spec, a mapping, or a spec itself.

    A bare name (no path separator, no spec-file suffix; see :func:`names_a_file`) that is registered gives the
    registered spec even when a file or directory of that name is in the working directory: write ``./name`` to
    load such a file. Any other string, and any :class:`~pathlib.Path`, is read as a file; a directory is never a
    spec file. Raises :class:`SpecError` with one line naming the file, the field and the reason. ``registry``:
    the default registry (:func:`attnzoo.registry.get_registry`) when None.
    """
    if isinstance(source, SpecBase):
        return source
    return spec_data.load_spec(source, registry or get_registry())

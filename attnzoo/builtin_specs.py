"""Registers the shipped spec files (``attnzoo/specs/``; ``specs/`` at the repository root points there)."""

from __future__ import annotations

from pathlib import Path

from .hookspecs import hookimpl
from .spec_data import SUFFIXES

SPEC_DIR = Path(__file__).parent / "specs"


def shipped_spec_files() -> list[Path]:
    return sorted(p for p in SPEC_DIR.iterdir() if p.suffix in SUFFIXES)


@hookimpl
def register_specs(register):
    for path in shipped_spec_files():
        register(path)

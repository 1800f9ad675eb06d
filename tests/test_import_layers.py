"""The import contracts of attnzoo (``.importlinter``, docs/architecture.md): no import cycle at any depth, the
layers from the core up to the commands, the reference backend importing no fast backend. They hold on the real
tree, and a cycle planted in a copy of the package breaks them, naming it. Also: an underscore name stays in its
module (ruff's PLC2701 only checks imports from other packages, so the check is here)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"

pytest.importorskip("importlinter")


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts on the ``attnzoo`` package found in ``package_parent``."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, str(CONFIG), "--no-cache", "--no-logo"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


def copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "attnzoo", tmp_path / "attnzoo", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


def test_the_contracts_hold():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_planted_cycle_breaks_them(tmp_path):
    parent = copy_package(tmp_path)
    core = parent / "attnzoo" / "core" / "numerics.py"
    core.write_text(core.read_text() + "\nfrom attnzoo import cli  # planted\n")
    done = lint_imports(parent)
    assert done.returncode != 0
    out = " ".join(done.stdout.split())
    assert "BROKEN" in out
    assert "attnzoo.core.numerics -> attnzoo.cli" in out  # the layers contract names the planted import
    assert "No import cycles inside attnzoo, at any depth BROKEN" in out


def test_the_reference_stays_apart_from_the_fast_backends(tmp_path):
    parent = copy_package(tmp_path)
    ref = parent / "attnzoo" / "backends" / "reference.py"
    ref.write_text(ref.read_text() + "\nfrom .blocked import BlockedBackend  # planted\n")
    done = lint_imports(parent)
    assert done.returncode != 0
    assert "attnzoo.backends.reference -> attnzoo.backends.blocked" in " ".join(done.stdout.split())


# -- underscore names stay in their module --------------------------------------------------------------------------
def private_imports(path: Path) -> set[str]:
    """The underscore names ``path`` imports from another attnzoo module."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = list(parts if parts[-1] == "__init__" else parts[:-1])
    if parts[-1] == "__init__":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level else node.module
        if (source or "").startswith("attnzoo"):
            found |= {a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")}
    return found


def test_underscore_names_stay_in_their_module():
    """No attnzoo module imports an underscore name from another (issue 41: a name another module needs is public
    in its home module)."""
    found = {}
    for path in sorted((ROOT / "attnzoo").rglob("*.py")):
        names = private_imports(path)
        if names:
            found[path.relative_to(ROOT).as_posix()] = sorted(names)
    assert not found, f"private names imported from another module (make them public): {found}"

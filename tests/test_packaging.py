"""Packaging: the wheel builds without writing into the source tree, installs, and imports on every Python
version ``requires-python`` admits that this machine has."""

import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.release, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parent.parent


def _untracked():
    """Untracked and ignored paths of the source tree (git's view), without the venv and the caches."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    skip = (".venv", "__pycache__", ".pytest_cache", ".ruff_cache")
    return {line[3:] for line in out.splitlines() if not any(s in line for s in skip)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    before = _untracked()
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    assert _untracked() == before, "building the wheel wrote into the source tree"
    (path,) = out.glob("attnzoo-*.whl")
    return path


def test_wheel_carries_the_data_and_the_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "attnzoo/py.typed" in names
    assert {f"attnzoo/specs/{p.name}" for p in (ROOT / "attnzoo/specs").iterdir()} <= set(names)
    assert len([n for n in names if n.startswith("attnzoo/conformance/vectors/")]) == len(
        list((ROOT / "attnzoo/conformance/vectors").iterdir()))
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    # the fused decoding steps' C++ source and its one layout definition, built by the installed package on first
    # use into the build cache
    assert {"attnzoo/decode/fused_decode.cpp", "attnzoo/decode/fused_decode_body.h",
            "attnzoo/decode/layout.py"} <= set(names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Python: >=3.11" in meta and "License-Expression: Apache-2.0" in meta


def test_installed_wheel_imports(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import attnzoo, sys; print(attnzoo.__file__); print(sorted(attnzoo.get_registry().specs)[:2]); "
            "from attnzoo.decode import fused_build; print(fused_build._compiler() is None or "
            "fused_build.library() is not None, fused_build.status())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(str(target))
    assert done.stdout.splitlines()[-1].startswith("True"), done.stdout  # the installed C source compiles


def _admitted_pythons():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = tuple(int(x) for x in spec.split("#")[0].strip().removeprefix(">=").split("."))
    return low, [f"python3.{minor}" for minor in range(low[1], 15)]


def _interpreter(name):
    """A working ``python3.X`` (on PATH, or in pyenv's versions), or None."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(name), *sorted(root.glob(f"{name.removeprefix('python')}*/bin/{name}"))]
    for exe in filter(None, candidates):
        if subprocess.run([str(exe), "--version"], capture_output=True).returncode == 0:
            return str(exe)
    return None


def test_sources_parse_on_every_admitted_python():
    """The oldest admitted version's grammar (ast feature_version), and every admitted interpreter found here
    compiles the package (the others lack torch here: importing is checked on this one)."""
    low, pythons = _admitted_pythons()
    assert low == (3, 11)
    for path in (ROOT / "attnzoo").rglob("*.py"):
        ast.parse(path.read_text(), str(path), feature_version=low)
    found = [exe for exe in map(_interpreter, pythons) if exe]
    for python in found:
        done = subprocess.run([python, "-c", "import compileall, sys; sys.exit(not compileall.compile_dir("
                               f"{str(ROOT / 'attnzoo')!r}, quiet=1, legacy=False, optimize=0, workers=1, "
                               "force=True, ddir='attnzoo', rx=None) )"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/tmp/pyc"})
        assert done.returncode == 0, (python, done.stdout[-1000:], done.stderr[-1000:])

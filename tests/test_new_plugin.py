"""docs/plugin-tutorial.md followed verbatim in a fresh environment: `attnzoo new-plugin` scaffolds a package
that installs as a user installs it, passes its own tests (formulas written by hand) and the conformance suite."""

import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from attnzoo.cli import main
from attnzoo.scaffold import names

pytestmark = [pytest.mark.release, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parent.parent


def tutorial_commands():
    text = (ROOT / "docs" / "plugin-tutorial.md").read_text()
    block = re.search(r"<!-- tutorial-commands -->\s*```bash\n(.*?)```", text, re.S)
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture
def fresh_env(tmp_path):
    """A new virtual environment that sees this one's packages (attnzoo, torch) through a .pth file and gets its
    own installs: the plugin installed there is invisible to the rest of the test session."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "attnzoo-parent.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def test_following_the_tutorial_gives_a_conformant_plugin(tmp_path, fresh_env):
    commands = tutorial_commands()
    assert [c.split()[0] for c in commands] == ["attnzoo", "pip", "pytest", "attnzoo"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TRITON_INTERPRET"))}
    env["ATTNZOO_CACHE_DIR"] = str(tmp_path / "cache")
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "attnzoo":
            argv = [str(fresh_env), "-m", "attnzoo.cli", *argv[1:]]
        elif argv[0] == "pip":  # offline: no index, no isolated build environment (hatchling is installed)
            argv = [str(fresh_env), "-m", "pip", *argv[1:2], "-q", "--no-deps", "--no-build-isolation", *argv[2:]]
        elif argv[0] == "pytest":
            argv = [str(fresh_env), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *argv[1:]]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        if argv[2:3] == ["pytest"]:
            assert "5 passed" in done.stdout, done.stdout[-2000:]
        if command.startswith("attnzoo conformance"):
            assert "0 fail" in done.stdout and "│ mygate" in done.stdout, done.stdout[-2000:]
    listed = subprocess.run([str(fresh_env), "-m", "attnzoo.cli", "list", "--json"], capture_output=True, text=True,
                            env=env, check=True).stdout
    assert '"mygate_key_norm"' in listed and '"package": "attnzoo-mygate"' in listed


def test_new_plugin_refuses_a_bad_name_and_an_existing_directory(tmp_path, capsys):
    assert main(["new-plugin", "My Gate", "--dir", str(tmp_path)]) == 2
    assert "plugin name 'My Gate'" in capsys.readouterr().err
    assert main(["new-plugin", "gate2", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["new-plugin", "gate2", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert names("rope-scale")["module"] == "attnzoo_rope_scale"

"""Every subcommand and every option of ``attnzoo`` given hostile values: each is refused before any work with exit 2
and one line on stderr, no traceback, and no file written or overwritten. A table, checked against the parsers so
that a new option without a row fails here."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from attnzoo import bench
from attnzoo.cli import build_parser, main

HERE = Path(__file__).resolve().parent
SPEC_TEXT = "name: mine\ntransforms: []\n"


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A folder of hostile inputs, as the working directory; returns a mapping of their names to paths."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text(SPEC_TEXT)
    (tmp_path / "a-file").write_text("kept\n")
    (tmp_path / "secrets").write_text("root:$6$salt$SECRETHASH:19000:0:99999:7:::\n")
    (tmp_path / "shadow.yaml").symlink_to(tmp_path / "secrets")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "nowhere.yaml")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1}')
    (tmp_path / "not-json.json").write_text("{not json")
    monkeypatch.delenv("ATTNZOO_CACHE_DIR", raising=False)
    return tmp_path


#: (argv, environment, a fragment the one line contains); {FILE} etc. are paths in the hostile folder
ROWS = [
    (["list", "--bogus"], {}, "unrecognized arguments"),
    (["validate", "folder"], {}, "not a regular file"),
    (["validate", "./fifo"], {}, "not a regular file"),
    (["validate", "/dev/zero"], {}, "not a regular file"),
    (["validate", "dangling.yaml"], {}, "no such file"),
    (["validate", "shadow.yaml"], {}, "not a spec file"),
    (["validate", "x" * 300 + ".yaml"], {}, "cannot read"),
    (["explain", "no-such-spec"], {}, "no registered spec"),
    (["explain", "vanilla", "--device", "tpu9"], {}, "unknown device"),
    (["explain", "vanilla", "--device", "cuda"], {}, "not available here"),
    (["explain", "vanilla", "--dtype", "float99"], {}, "unknown dtype 'float99'"),
    (["explain", "vanilla", "--mode", "sideways"], {}, "invalid choice"),
    (["conformance", "no-such-spec"], {}, "no-such-spec"),
    (["conformance", "vanilla", "--backend", "nope"], {}, "nope"),
    (["conformance", "--plugin", "nope"], {}, "nope"),
    (["conformance", "vanilla", "--dtype", "int8"], {}, "not a floating dtype"),
    (["conformance", "vanilla", "--report", "folder"], {}, "is a directory"),
    (["conformance", "spec.yaml", "--report", "spec.yaml"], {}, "an input of this run"),
    (["conformance", "vanilla", "--expected-failures", "a-file", "--report", "a-file"], {}, "an input of this run"),
    (["conformance", "vanilla", "--report", "r.json", "--report", "./r.json"], {}, "another report"),
    (["conformance", "vanilla", "--report", "missing/r.json"], {}, "no such directory"),
    (["conformance", "vanilla", "--expected-failures", "/dev/zero"], {}, "not a regular file"),
    (["conformance", "vanilla", "--expected-failures", "fifo"], {}, "not a regular file"),
    (["conformance", "vanilla", "--expected-failures", "missing"], {}, "cannot read"),
    (["conformance", "vanilla", "--seed", "-1"], {}, "out of range"),
    (["conformance", "vanilla", "--seed", "x"], {}, "not an integer"),
    (["conformance", "vanilla", "--device", "bogus"], {}, "unknown device"),
    (["conformance", "vanilla", "--backend", "reference", "--shape", ""], {}, "empty pattern"),
    (["conformance", "vanilla", "--backend", "reference", "--shape", "nope"], {}, "matches no check"),
    (["conformance", "vanilla", "--backend", "reference", "--quick", "--shape", "gqa-n1030"], {}, "matches no check"),
    (["conformance", "vanilla", "--backend", "reference", "--skip", " "], {}, "empty pattern"),
    (["conformance", "vanilla", "--backend", "reference", "--skip", "nope"], {}, "matches no check"),
    (["conformance", "vanilla", "--backend", "reference", "--skip", "*"], {}, "leave no case to run"),
    (["conformance", "vanilla", "--shape", "[", "--report", "a-file"], {}, "matches no check"),
    (["build", "no-such-spec"], {}, "no registered spec"),
    (["build", "vanilla", "--cache-dir", "a-file"], {}, "a-file"),
    (["build", "vanilla"], {"ATTNZOO_CACHE_DIR": "a-file"}, "a-file"),
    (["build", "vanilla"], {"ATTNZOO_CACHE_DIR": "/proc/attnzoo"}, "/proc/attnzoo"),
    (["build", "vanilla", "--compile-for", "bogus"], {}, "bogus"),
    (["build", "vanilla", "--compile-for", "90", "--head-dim", "0"], {}, "head dim"),
    (["build", "vanilla", "--compile-for", "90", "--head-dim", "-4"], {}, "head dim"),
    (["build", "vanilla", "--compile-for", "90", "--dtype", "float64"], {}, "float64"),
    (["build", "vanilla", "--head-dim", "abc"], {}, "invalid"),
    (["new-plugin", "abc\n"], {}, "plugin name"),
    (["new-plugin", "a" * 300], {}, "plugin name"),
    (["new-plugin", "abc", "--dir", "a-file"], {}, "not a directory"),
    (["new-plugin", "abc", "--dir", "dangling"], {}, "dangling symbolic link"),
    (["new-plugin", "abc", "--kind", "nope"], {}, "invalid choice"),
    (["experiment", "graph", "--spec", "nope"], {}, "nope"),
    (["experiment", "graph", "--seed", "-1"], {}, "seeds=[-1]"),
    (["experiment", "graph", "--steps", "0"], {}, "steps=0"),
    (["experiment", "graph", "--set", "lr"], {}, "expected KEY=VALUE"),
    (["experiment", "graph", "--out", "a-file"], {}, "exists and is not a folder"),
    (["experiment", "graph", "--steps", "100000000"], {}, "steps=100000000"),
    (["native-spec", "/dev/zero"], {}, "/dev/zero: not a regular file"),
    (["native-spec", "folder"], {}, "no such file"),
    (["native-spec", "not-json.json"], {}, "not readable JSON"),
    (["native-spec", "config.json", "--spec", "nope"], {}, "nope"),
    (["native-spec", "config.json", "--prefer", "bogus"], {}, "invalid choice"),
    (["model", "nosuch"], {}, "no model named 'nosuch'"),
    (["model", "smollm2"], {"ATTNZOO_MODEL_DIR": "a-file"}, "a-file: not a directory"),
    (["model", "smollm2", "--gguf", "fifo"], {"ATTNZOO_MODEL_DIR": "folder"}, "fifo: not a regular file"),
    (["model", "smollm2", "--gguf", "a-file"], {"ATTNZOO_MODEL_DIR": "folder"}, "5 bytes where SmolLM2"),
    (["model", "smollm2", "--gguf", "dangling"], {"ATTNZOO_MODEL_DIR": "folder"}, "cannot read the gguf"),
    (["model", "smollm2", "--prompt", "x", "--max-new-tokens", "0"], {}, "out of range"),
    (["bench", "nope"], {}, "nope"),
    (["bench", "--lengths", "0"], {}, "out of range"),
    (["bench", "--memory-lengths", "-1"], {}, "out of range"),
    (["bench", "--repeats", "0"], {}, "out of range"),
    (["bench", "--out", "a-file"], {}, "exists and is not a folder"),
    (["bench", "--worker", "blocked", "vanilla", "many", "0"], {}, "not an integer"),
    (["bench", "--config", "{bad"], {}, "bad worker arguments"),
]

#: options that take no value (flags): nothing hostile to give them
FLAGS = {"--help", "--version", "--json", "--force", "--grad", "--no-progress", "--yes", "--rebuild"}


def _run(argv, env, monkeypatch, capsys) -> tuple[int, str, str]:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusals (one line: attnzoo.cli.Parser)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, env, fragment", ROWS, ids=[" ".join(r[0])[:60] for r in ROWS])
def test_hostile_values_are_refused_in_one_line(argv, env, fragment, hostile, monkeypatch, capsys):
    before = {p.name: (p.read_bytes() if p.is_file() and not p.is_fifo() else None) for p in hostile.iterdir()}
    code, out, err = _run(argv, env, monkeypatch, capsys)
    lines = err.splitlines()
    assert code == 2, f"exit {code}; stderr {err!r}"
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fragment in lines[0], lines[0]
    assert "SECRET" not in err
    after = {p.name: (p.read_bytes() if p.is_file() and not p.is_fifo() else None) for p in hostile.iterdir()}
    assert after == before, "a refused command wrote or changed files"


def _valued(parser: argparse.ArgumentParser) -> set[str]:
    """The options of ``parser`` that take values."""
    return {o for a in parser._actions for o in a.option_strings[:1] if o not in FLAGS and a.nargs != 0}


def test_every_subcommand_and_option_has_a_hostile_row():
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    options = {name: _valued(sub) for name, sub in subcommands.choices.items()}
    options["bench"] = _valued(bench.build_parser())
    covered: dict[str, set[str]] = {}
    for argv, _, _ in ROWS:
        covered.setdefault(argv[0], set()).update(t for t in argv[1:] if t.startswith("--"))
    assert set(options) == set(covered), f"subcommands without a row: {set(options) - set(covered)}"
    for command, wanted in options.items():
        assert wanted <= covered[command], f"{command}: options without a hostile row: {wanted - covered[command]}"

"""Spec loading against hostile and malformed files, and the identity (canonical JSON, hash) of good ones.

Every file in ``tests/data/hostile/`` must be rejected by ``attnzoo validate`` with exit code 2 and exactly one line
on stderr naming the file and the problem, never a traceback, and none of them may run code.
"""

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

import attnzoo
from attnzoo.cli import main
from attnzoo.registry import new_registry

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "hostile"
SPECS = HERE.parent / "specs"

#: corpus file -> a fragment its one-line error must contain (the field path and/or the reason)
EXPECTED = {
    "alias-bomb.yaml": "line 2: YAML aliases are not allowed",
    "bad-name.yaml": "name: String should match pattern",
    "broken.json": "invalid JSON: Expecting ',' delimiter (line 2",
    "broken.toml": "invalid TOML",
    "deep-nesting.json": "nesting deeper than 32 levels",
    "deep-nesting.toml": "nesting deeper than 32 levels",
    "deep-nesting.yaml": "nesting deeper than 32 levels",
    "duplicate-key.json": "duplicate key 'name'",
    "duplicate-key.yaml": "line 3: duplicate key 'name'",
    "empty.yaml": "empty file",
    "h2o-recent-not-below-budget.yaml": "cache.budget: h2o.recent (32) must be smaller than the budget (32)",
    "h2o-selective-mask.yaml": "cache: evictor 'h2o' keeps a set per head",
    "huge-integer.json": "invalid JSON: Exceeds the limit (4300 digits)",
    "infinity.json": "attention.scale: inf is not allowed",
    "invalid-utf8.yaml": "not valid UTF-8 (byte 20)",
    "key-with-newline.yaml": r"'col\nour': unknown key",
    "missing-kind.yaml": "transforms[0]: missing 'kind'",
    "missing-name.yaml": "name: Field required",
    "multi-document.yaml": "expected a single document in the stream, but found another document",
    "nan.json": "transforms[0].cap: nan is not allowed",
    "nan.toml": "transforms[0].cap: nan is not allowed",
    "nan.yaml": "transforms[0].cap: nan is not allowed",
    "non-string-key.yaml": "keys must be strings, not bool True",
    "prefix-causal.yaml": "transforms[0]: prefix needs attention.causal: false",
    "python-name.yaml": "tag 'tag:yaml.org,2002:python/name:os.system' is not allowed",
    "python-object-apply-open.yaml": "line 5: tag 'tag:yaml.org,2002:python/object/apply:builtins.open' is not",
    "python-object-apply.yaml": "line 3: tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed",
    "selective-budget-one.yaml": "cache.budget: evictor 'selective' needs budget >= 2",
    "selector-head-negative.yaml": "transforms[0].selector_head: Input should be greater than or equal to 0",
    "sliding-window-zero.yaml": "transforms[0].window: Input should be greater than or equal to 1",
    "softcap-cap-zero.yaml": "transforms[0].cap: Input should be greater than 0",
    "top-level-list.yaml": "the top level must be a mapping, not list",
    "top-level-string.json": "the top level must be a mapping, not str",
    "two-query-temperatures.yaml": "transforms[1]: kind 'query_temperature' appears twice",
    "unknown-evictor.yaml": "cache: unknown evictor 'lru'",
    "unknown-extension.txt": "unknown file type '.txt'",
    "unknown-key-top.yaml": "colour: unknown key",
    "unknown-key-transform.yaml": "transforms[0].capp: unknown key",
    "unknown-kind.yaml": "transforms[0]: unknown kind 'flash_softmax'",
    "unterminated.yaml": "line 3: while scanning a quoted scalar, found unexpected end of stream",
    "wrong-type-cap.yaml": "transforms[0].cap: Input should be a valid number",
    "wrong-type-causal.yaml": "attention.causal: Input should be a valid boolean",
    "wrong-type-transforms-mapping.yaml": "transforms: Input should be a valid list",
    "wrong-type-window-float.yaml": "transforms[0].window: Input should be a valid integer",
}

#: files the corpus's YAML tags would create in the working directory if they ever ran
MARKERS = ("attnzoo-pwned-system", "attnzoo-pwned-open")

NAMES = sorted(EXPECTED)


def corpus_files() -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if p.is_file())


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    assert lines[0].strip(), "the one line is empty"
    return lines[0]


def reject(args: list[str], capsys) -> str:
    """Run ``attnzoo validate`` in-process; return its single stderr line after checking exit 2 and no output."""
    code = main(["validate", *args])
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}; stderr {err!r}"
    assert out == ""
    assert "Traceback" not in err
    return one_line(err)


# -- the hostile corpus ---------------------------------------------------------------------------------------------
def test_corpus_matches_its_table():
    on_disk = {p.name for p in corpus_files()}
    assert on_disk == set(EXPECTED), f"untabled: {on_disk - set(EXPECTED)}; missing: {set(EXPECTED) - on_disk}"
    assert len(on_disk) >= 15
    assert sum(p.stat().st_size for p in corpus_files()) < 64 * 1024, "keep big inputs generated, not committed"


@pytest.mark.parametrize("name", NAMES)
def test_validate_rejects_in_process(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the corpus's tags would write their markers
    path = CORPUS / name
    line = reject([str(path)], capsys)
    assert line.startswith(f"attnzoo: {path}: ")
    assert EXPECTED[name] in line
    assert list(tmp_path.iterdir()) == [], "loading a spec file created files: code ran"


@pytest.mark.parametrize("name", NAMES)
def test_load_spec_raises_spec_error(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = CORPUS / name
    with pytest.raises(attnzoo.SpecError) as info:
        attnzoo.load_spec(path)
    message = str(info.value)
    assert info.value.source == str(path)
    assert EXPECTED[name] in message
    assert len(message.splitlines()) == 1
    assert not any((tmp_path / m).exists() for m in MARKERS)


@pytest.mark.subprocess
def test_validate_all_in_a_subprocess(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"name: big\nsummary: " + b"a" * (20 * 1024 * 1024) + b"\n")
    files = [str(p) for p in corpus_files()] + [str(big)]
    result = subprocess.run(
        [sys.executable, "-m", "attnzoo.cli", "validate", *files],
        cwd=tmp_path, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == len(files), result.stderr[-2000:]
    for line, path in zip(lines, files, strict=True):
        assert line.startswith(f"attnzoo: {path}: "), line
    assert "file is larger than the 1024 KiB limit" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.yaml"], "a spec file ran code"


def test_marker_files_would_detect_code_execution(tmp_path, monkeypatch):
    """The corpus's markers are a working detector: an unsafe loader does create one (so its absence means no code
    ran). Only the ``builtins.open`` payload is used here: it creates an empty file in tmp_path and nothing else."""
    monkeypatch.chdir(tmp_path)
    data = yaml.unsafe_load((CORPUS / "python-object-apply-open.yaml").read_text())
    data["transforms"][0]["cap"].close()
    assert (tmp_path / "attnzoo-pwned-open").exists()


# -- hostile inputs generated at test time ---------------------------------------------------------------------
def test_twenty_megabyte_file_is_refused_without_reading_it_all(tmp_path, capsys):
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.write(b'{"name": "big", "summary": "')
        handle.write(b"x" * (20 * 1024 * 1024))
        handle.write(b'"}')
    line = reject([str(big)], capsys)
    assert f"{big}: file is larger than the 1024 KiB limit" in line


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"name": "x", "summary": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (".toml", 'name = "x"\nsummary = ' + "[" * 5_000 + "]" * 5_000 + "\n"),
    (".yaml", "name: x\nsummary: " + "{a: " * 5_000 + "1" + "}" * 5_000 + "\n"),
])
def test_nesting_far_past_the_recursion_limit(suffix, text, tmp_path, capsys):
    path = tmp_path / f"deeper{suffix}"
    path.write_text(text)
    line = reject([str(path)], capsys)
    assert "nesting deeper than 32 levels" in line


@pytest.mark.parametrize("name", ["nan.toml", "softcap-cap-zero.yaml"])  # found while reading / validating
def test_path_is_named_as_given_not_normalised(name, capsys):
    given = f"{CORPUS}//./{name}"
    line = reject([given], capsys)
    assert line.startswith(f"attnzoo: {given}: transforms[0].cap")


def test_unprintable_file_name_stays_on_one_line(tmp_path, capsys):
    path = tmp_path / "two\nlines.yaml"
    path.write_text("name: [\n")
    line = reject([str(path)], capsys)
    assert repr(str(path)) in line


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d / ("x" * 300 + ".yaml"), "cannot read"),  # longer than a file name may be
    (lambda d: d / "missing.yaml", "missing.yaml: no such file"),
    (lambda d: (d / "dir.yaml").mkdir() or d / "dir.yaml", "dir.yaml: not a regular file"),
])
def test_unreadable_paths(make, fragment, tmp_path, capsys):
    line = reject([str(make(tmp_path))], capsys)
    assert fragment in line


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "root:$6$salt$SECRETHASH:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"),
    (".yaml", "root: $6$salt$SECRETHASH\n"),
    (".toml", 'password = "SECRETHASH"\n'),
    (".json", '{"token": "SECRETHASH"}'),
])
def test_a_file_that_is_not_a_spec_is_never_quoted(suffix, text, tmp_path, capsys):
    """A symlink named like a spec to a file of secrets: the message says what is wrong, quoting nothing."""
    target = tmp_path / "shadow"
    target.write_text(text)
    link = tmp_path / f"innocent{suffix}"
    link.symlink_to(target)
    line = reject([str(link)], capsys).removeprefix(f"attnzoo: {link}: ")
    assert line.startswith("not a spec file") and "SECRET" not in line and "root" not in line and "token" not in line


def test_keys_and_values_from_a_spec_are_quoted_short(tmp_path, capsys):
    path = tmp_path / "long.yaml"
    path.write_text("name: x\n" + "k" * 300 + "SECRET: 1\n")
    line = reject([str(path)], capsys)
    assert "'" + "k" * 40 + "'...: unknown key" in line and "SECRET" not in line
    path.write_text("name: x\ntransforms:\n  - kind: " + "z" * 300 + "SECRET\n")
    line = reject([str(path)], capsys)
    assert "unknown kind '" + "z" * 40 + "'..." in line and "SECRET" not in line


def test_one_bad_file_among_good_ones(capsys):
    good = [str(SPECS / "selective-ssa.yaml"), str(SPECS / "softcap.json")]
    bad = str(CORPUS / "nan.toml")
    code = main(["validate", good[0], bad, good[1]])
    out, err = capsys.readouterr()
    assert code == 2
    assert [line.split()[1] for line in out.splitlines()] == good
    assert one_line(err).startswith(f"attnzoo: {bad}: transforms[0].cap")


def test_random_mutations_never_leak_other_errors(tmp_path):
    """Seeded byte-level fuzzing of good specs: each mutant either loads or raises a one-line SpecError."""
    rng = random.Random(0)
    sources = [SPECS / "selective-ssa.yaml", SPECS / "alibi.toml", SPECS / "softcap.json"]
    alphabet = b'\x00\xff\n\t :-[]{},"\'!&*#%@`|>?=.0123456789enaNI'
    outcomes = {"ok": 0, "error": 0}
    for source in sources:
        original = source.read_bytes()
        for i in range(150):
            data = bytearray(original)
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(len(data))
                op = rng.random()
                if op < 0.4:
                    data[pos] = rng.choice(alphabet)
                elif op < 0.7:
                    del data[pos]
                else:
                    data.insert(pos, rng.choice(alphabet))
            path = tmp_path / f"m{i}{source.suffix}"
            path.write_bytes(bytes(data))
            try:
                attnzoo.load_spec(path)
                outcomes["ok"] += 1
            except attnzoo.SpecError as exc:
                assert len(str(exc).splitlines()) == 1, (bytes(data), str(exc))
                assert str(exc).startswith(f"{path}: ")
                outcomes["error"] += 1
    assert outcomes["error"] > 100 and outcomes["ok"] > 10, outcomes


# -- good specs ----------------------------------------------------------------------------------------------------
def shipped() -> list[Path]:
    return sorted(p for p in SPECS.iterdir() if p.suffix in (".yaml", ".yml", ".toml", ".json"))


def test_every_shipped_spec_validates(capsys):
    files = [str(p) for p in shipped()]
    assert len(files) >= 15
    assert {Path(f).suffix for f in files} == {".yaml", ".toml", ".json"}
    code = main(["validate", *files])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == len(files)
    for line, path in zip(lines, files, strict=True):
        assert line.startswith(f"ok  {path}  ({Path(path).stem}, "), line


#: The hash of every shipped spec, pinned: a change to the spec model (a new slot, a new option with a default) must
#: not change what an existing spec file means. The first 23 were computed before the probability slot existed.
PINNED_HASHES = {
    "alibi-learnable": "e15692ad999baccfc46365778ec21b4a7e0a0bb78cf24505b73f8bfbac015e8a",
    "alibi": "66a1ee9e1131e125b8dd0f1ee38879fdeec3ac6b580987113870da2e38935498",
    "constant-temperature": "89897b61d2ace951122640fd5c40de21debd2448963c8293de4b301548724b40",
    "forgetting": "92d4a4a7602b9801513219124f8390d9668031559e613641febbd38072b334aa",
    "h2o": "59aa0a308e2b6fac7964507d65f1330729576b32af1a854050f360d95058489f",
    "local-global": "ce47707e49e691a64fd901ba5e5492c5a96c9a5a37c0e8beac077aae1af55189",
    "local": "4189f18367449536af34d42aec62f6f1e62efbb80f363bd8899b12bc05b4fe0e",
    "off-by-one": "7adaf637897209a3a6fa75ab57bf8fd07b3419705c138f86e8cdaaffb7b942d3",
    "qk-norm": "775f894008fda721133b105b61d684ae61bcd8c36fa0574eea6bf02b5b92c698",
    "selective-pruned": "19ea5afd008bcb6b6dcbb97d0ec5903033762bd5a8e4504e69ee447fa4fe9564",
    "selective-ssa": "3d21607d49e743884d04df0312c4f24c56683c1e99b2d5a1f1fdb6e11d4ab9b7",
    "selective": "9922c9efe4b0af7c272a31c0a45ac036312b3c26cc0e5e0d1897a6ca15155c51",
    "sink": "5c20932b54dac81aeea6a6c38acb80a25486ce22c18413c726fd81c9143973b7",
    "softcap": "74c75ff474999d1d8c5c58838574911424abebcd0682baa2526b3cfba6472e05",
    "ssa-key": "d0025e2362a6131c84342c56d5c5e73c613e1a916996ded0c0e5a80f2742709a",
    "ssa-position": "498242e38056eef6426847be521a73a007b125b4e270f48a4c37f34fd2338c6b",
    "ssa-query": "186cbe12c15c34e0f7877c831e3eb28120f2beefa87116b7b063bcb9d050e5a1",
    "ssa-value": "db9e5e7972d56cfe346a7ddea89c5c70aad329be65aa3f6ff81c691a8f03f0c6",
    "ssa": "cf674e2ddbe87dbcfa739fd2786157d56e631bdb0a3b1da185ed1fd3840f736a",
    "streaming": "7e3145f4cc5d78024948188be127cf5e1688a18e70cbf0ff18ef32b1ee2280af",
    "tova": "9d1e3b1eff77e7a613e6b40bb8840e83d288e0cad96ee38a7142136ac17d643d",
    "vanilla": "2b0664502e47a2cbe0988eb288dc315b7a69f715078cfd05e3cc894ef8deb4be",
    "yarn": "9bcdc256ae8199c54ef0cc19547478c68cc40003e434399d586ec1bfd3435b0b",
    # the probability maps (issue 43)
    "sigmoid": "5d15f46981c684cc9aa9577fb0bd16f0a61f4ea34d7522a9873898a022ca1669",
    "softpick": "0e942f2520ac189afdd78fa4c3541325d20c27851912ad7be01009ca635ba9ed",
    "stick-breaking": "14a1dfebba0e8246fe4f5eabf30fc9da6f32777630bba9df6a5d73f7aced470e",
    "diff": "73207eda306d8592fbbb5d5aa5903c622f8eaae9c6e694157c90baa95e5a2530",
    # the prompt scorers (issue 52)
    "snapkv": "732984adf4e5cc3d53005b1aabecdeaad74b65be3b4446871e88982c2a525848",
    "knorm": "f762498f0e823433a6797483ddeae7d24d2d0336e0db4d51a24b349ea988ca9a",
    "keydiff": "83c5ca189a7ba981efc8ce335f646a9e881fa46513958021fe2f615a6f07c635",
    # SnapKV pooled over 31 positions (issue 52: a retrieved span kept whole)
    "snapkv-span": "b9dea31e052c67d9ed3bb135dc074087c90e33692ad843f3874d0ec9aae983d1",
}


def test_shipped_spec_hashes_are_pinned():
    assert {p.stem: attnzoo.load_spec(p).hash for p in shipped()} == PINNED_HASHES


@pytest.mark.parametrize("path", shipped(), ids=lambda p: p.name)
def test_shipped_file_matches_its_registered_spec(path):
    spec = attnzoo.load_spec(path)
    registered = attnzoo.load_spec(path.stem)
    assert spec.name == path.stem
    assert spec.hash == registered.hash
    assert spec.canonical_json() == registered.canonical_json()


SELECTIVE_SSA = {
    ".yaml": """\
name: selective-ssa
summary: selective attention with SSA query and value temperatures
attention: {causal: true}
transforms:
  - {kind: query_temperature, token_aware: true, position_aware: true}
  - {kind: value_temperature, token_aware: true, position_aware: true}
  - {kind: selective_mask, selector_head: 0, protect_bos: true}
cache: {evictor: selective, budget: 256}
""",
    ".toml": """\
name = "selective-ssa"
summary = "selective attention with SSA query and value temperatures"

[attention]
causal = true

[[transforms]]
kind = "query_temperature"
token_aware = true
position_aware = true

[[transforms]]
kind = "value_temperature"
token_aware = true
position_aware = true

[[transforms]]
kind = "selective_mask"
selector_head = 0
protect_bos = true

[cache]
evictor = "selective"
budget = 256
""",
    ".json": """\
{
  "name": "selective-ssa",
  "summary": "selective attention with SSA query and value temperatures",
  "attention": {"causal": true},
  "transforms": [
    {"kind": "query_temperature", "token_aware": true, "position_aware": true},
    {"kind": "value_temperature", "token_aware": true, "position_aware": true},
    {"kind": "selective_mask", "selector_head": 0, "protect_bos": true}
  ],
  "cache": {"evictor": "selective", "budget": 256}
}
""",
}


def test_yaml_toml_and_json_give_the_same_spec(tmp_path):
    specs = {}
    for suffix, text in SELECTIVE_SSA.items():
        path = tmp_path / f"selective-ssa{suffix}"
        path.write_text(text)
        specs[suffix] = attnzoo.load_spec(path)
        assert specs[suffix].source == str(path)
    hashes = {s.hash for s in specs.values()}
    canon = {s.canonical_json() for s in specs.values()}
    assert len(hashes) == 1 and len(canon) == 1
    assert hashes == {attnzoo.load_spec("selective-ssa").hash}
    assert len(hashes.pop()) == 64


def test_hash_ignores_summary_but_not_options():
    base = yaml.safe_load(SELECTIVE_SSA[".yaml"])
    spec = attnzoo.load_spec(base)
    resummarised = attnzoo.load_spec({**base, "summary": "something else entirely"})
    assert resummarised.hash == spec.hash
    assert resummarised.canonical_json() != spec.canonical_json()
    changed_budget = attnzoo.load_spec({**base, "cache": {"evictor": "selective", "budget": 128}})
    assert changed_budget.hash != spec.hash
    transforms = [dict(t) for t in base["transforms"]]
    transforms[2]["selector_head"] = 1
    changed_head = attnzoo.load_spec({**base, "transforms": transforms})
    assert changed_head.hash != spec.hash
    # writing a default out explicitly is the same function, so the same hash
    transforms = [dict(t) for t in base["transforms"]]
    transforms[2]["self_mask"] = False
    assert attnzoo.load_spec({**base, "transforms": transforms}).hash == spec.hash


def test_a_specs_function_leaves_out_its_name_and_summary_only():
    """``Spec.function()``: what a spec computes (its fields without name and summary), with every default filled
    in: equal for a spec renamed, redescribed or with a default written out; different for an option changed."""
    base = yaml.safe_load(SELECTIVE_SSA[".yaml"])
    spec = attnzoo.load_spec(base)
    assert set(spec.function()) == {"attention", "transforms", "cache"}
    assert attnzoo.load_spec({**base, "name": "other", "summary": "else"}).function() == spec.function()
    transforms = [dict(t) for t in base["transforms"]]
    transforms[2]["self_mask"] = False  # the default, written out
    assert attnzoo.load_spec({**base, "transforms": transforms}).function() == spec.function()
    transforms[2]["selector_head"] = 1
    assert attnzoo.load_spec({**base, "transforms": transforms}).function() != spec.function()


def test_canonical_json_fills_defaults():
    spec = attnzoo.load_spec({"name": "minimal", "transforms": [{"kind": "selective_mask"}],
                              "cache": {"evictor": "selective"}})
    text = spec.canonical_json()
    assert json.loads(text) == {
        "name": "minimal",
        "summary": "",
        "attention": {"causal": True, "scale": None},
        "transforms": [{"kind": "selective_mask", "selector_head": 0, "protect_bos": True, "self_mask": False}],
        "cache": {"evictor": "selective", "budget": None},
    }
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_load_by_registered_name():
    spec = attnzoo.load_spec("selective-ssa")
    assert spec.name == "selective-ssa"
    assert [t.kind for t in spec.transforms] == ["query_temperature", "value_temperature", "selective_mask"]
    assert spec.cache.evictor == "selective" and spec.cache.budget == 256
    assert spec.hash == attnzoo.load_spec(SPECS / "selective-ssa.yaml").hash


def test_validate_accepts_a_registered_name(capsys):
    assert main(["validate", "selective-ssa"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok  selective-ssa  (selective-ssa, ") and err == ""


def test_unknown_name_lists_the_registered_ones(capsys):
    with pytest.raises(attnzoo.SpecError) as info:
        attnzoo.load_spec("selective-sssa")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("selective-sssa: no such file and no registered spec of that name (did you mean "
                              "'selective-ssa'?) (registered: ")
    for name in ("selective-ssa", "vanilla", "softcap", "alibi"):
        assert name in message
    line = reject(["selective-sssa"], capsys)
    assert "registered: " in line and "selective-ssa" in line


@pytest.fixture
def shadowing_cwd(tmp_path, monkeypatch):
    """A working directory holding a directory ``selective`` and a garbage file ``vanilla``: registered names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "selective").mkdir()
    (tmp_path / "vanilla").write_bytes(b"\x00not a spec: [\n")
    return tmp_path


def test_bare_registered_name_wins_over_the_working_directory(shadowing_cwd):
    for name in ("selective", "vanilla"):
        assert attnzoo.load_spec(name) is attnzoo.get_registry().specs[name]


def test_a_path_to_a_shadowing_file_loads_the_file(shadowing_cwd):
    with pytest.raises(attnzoo.SpecError) as info:
        attnzoo.load_spec("./vanilla")
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.startswith("./vanilla: ")
    with pytest.raises(attnzoo.SpecError, match=r"^\./selective: not a regular file$"):
        attnzoo.load_spec("./selective")


def test_cli_uses_the_registered_name_in_a_shadowing_cwd(shadowing_cwd, capsys):
    assert main(["explain", "selective"]) == 0
    assert main(["validate", "vanilla"]) == 0
    out, err = capsys.readouterr()
    assert "spec 'selective' (" in out and "ok  vanilla  (vanilla, " in out and err == ""


def test_two_transforms_in_one_non_composing_slot():
    """Two *different* accumulators (a plugin adds a second one): refused; row maps in one slot compose."""

    class OtherAccumulator(attnzoo.AccumulatorTransform):
        kind = "other_accumulator"
        slot = attnzoo.Slot.ACCUMULATOR

        def selection(self, *args, **kwargs):  # never called: the spec is refused first
            raise AssertionError("not reached")

    module = types.ModuleType("other_accumulator_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(OtherAccumulator))
    reg = new_registry(entry_points=False, extra_plugins=(("other_accumulator_plugin", module),))
    data = {"name": "x", "attention": {"causal": True},
            "transforms": [{"kind": "selective_mask"}, {"kind": "other_accumulator"}]}
    with pytest.raises(attnzoo.SpecError, match=r"^<mapping>: transforms\[1\]: slot 'accumulator' already holds "
                                                r"transforms\[0\] \(one accumulator, one normaliser and one "
                                                r"probability map per spec; row maps, logits and masks compose in "
                                                r"spec order\)$"):
        attnzoo.load_spec(data, registry=reg)
    rows = attnzoo.load_spec({"name": "x", "transforms": [{"kind": "query_norm"}, {"kind": "query_temperature"}]})
    assert [t.kind for t in rows.transforms] == ["query_norm", "query_temperature"]
    # logits compose: two different logits transforms are fine
    ok = attnzoo.load_spec({"name": "x", "transforms": [{"kind": "softcap", "cap": 30.0}, {"kind": "alibi"}]})
    assert [t.kind for t in ok.transforms] == ["softcap", "alibi"]


def test_the_hash_is_computed_once_and_a_changed_copy_hashes_afresh():
    spec = attnzoo.load_spec("selective-ssa")
    first = spec.hash
    assert spec.hash is first  # computed once (a server's decode step checks it per step)
    renamed = spec.model_copy(update={"name": "other"})
    assert renamed.hash != first
    assert renamed.hash == attnzoo.load_spec({**spec.model_dump(mode="json"), "name": "other"}).hash
    assert spec.model_copy().hash == first

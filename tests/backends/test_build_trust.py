"""The artifact cache's trust model (docs/triton.md): the code that runs is the code generated now; nothing in the
cache is followed through a symbolic link; what another user can write or owns is refused in one line, and
nothing is overwritten then; bad --compile-for input stops before anything is stored."""

import json
import os
import stat

import pytest

from attnzoo import buildcache
from attnzoo.backends.triton import aot
from attnzoo.backends.triton import build as builder
from attnzoo.cli import main

#: a spec of its own, so that no other test has its kernels loaded in this process
SPEC = {"name": "trust", "transforms": [{"kind": "softcap", "cap": 17.0}]}
PLANTED = "import builtins\nbuiltins.attnzoo_planted_code_ran = True\n_fwd = 'planted'\n"


def _key():
    from attnzoo.spec import load_spec

    return builder.artifact_key(load_spec(SPEC))[:32]


@pytest.fixture
def fresh(monkeypatch):
    """No kernels loaded, no sources generated yet in this process (as in a new one)."""
    monkeypatch.setattr(builder, "_modules", {})
    monkeypatch.setattr(builder, "_generated", {})


@pytest.fixture
def victim(tmp_path):
    """Another user's directory, as a planted symbolic link would name it: it must stay as it is."""
    path = tmp_path / "victim"
    path.mkdir()
    (path / "manifest.json").write_text("the victim's own file\n")
    return path


def _untouched(victim):
    assert [p.name for p in victim.iterdir()] == ["manifest.json"]
    assert (victim / "manifest.json").read_text() == "the victim's own file\n"


def _one_line(exc):
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- what runs is what is generated now --------------------------------------------------------------------------
def test_planted_source_with_a_matching_digest_never_runs(tmp_path, fresh):
    import builtins

    artifact = builder.build(SPEC, root=tmp_path)
    generated = artifact.path("forward").read_bytes()
    manifest = json.loads((artifact.directory / builder.MANIFEST).read_text())
    artifact.path("forward").write_text(PLANTED)  # a writer, not damage: the digest is rewritten to match
    manifest["sources"]["kernels.py"] = __import__("hashlib").sha256(PLANTED.encode()).hexdigest()
    (artifact.directory / builder.MANIFEST).write_text(json.dumps(manifest))
    builder._generated.clear()  # a new process: the source is generated again, not read

    module = builder.load_kernels(SPEC, root=tmp_path)
    assert not hasattr(builtins, "attnzoo_planted_code_ran")
    assert module._fwd != "planted" and hasattr(module._fwd, "fn")
    assert artifact.path("forward").read_bytes() == generated  # the damaged file was rewritten
    again = builder.build(SPEC, root=tmp_path)
    assert again.hit and again.manifest["sources"] == artifact.manifest["sources"]


def test_kernels_run_from_memory_with_their_source_for_triton(tmp_path, fresh):
    import inspect
    import linecache

    module = builder.load_kernels(SPEC, root=tmp_path, part="backward")
    artifact = builder.build(SPEC, root=tmp_path)
    artifact.path("backward").write_text(PLANTED)  # after the import: never read back
    linecache.clearcache()
    source = inspect.getsource(module._bwd_dq.fn)
    assert source.startswith("@triton.jit") and source in artifact.sources["kernels_backward.py"].decode()
    assert module._bwd_dq.fn.__code__.co_filename == f"{artifact.path('backward')} (in memory)"


# -- never through a symbolic link ---------------------------------------------------------------------------------
@pytest.mark.parametrize("force", [False, True], ids=["build", "force"])
def test_artifact_directory_planted_as_a_symlink_is_refused(tmp_path, victim, force):
    root = tmp_path / "cache"
    root.mkdir()
    (root / _key()).symlink_to(victim)
    with pytest.raises(builder.CacheError) as caught:
        builder.build(SPEC, root=root, force=force)
    text = _one_line(caught)
    assert f"{root / _key()}: a symbolic link" in text and "remove it" in text
    _untouched(victim)


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_lock_planted_as_a_symlink_is_refused(tmp_path, victim, dangling):
    root = tmp_path / "cache"
    root.mkdir()
    target = victim / ("absent" if dangling else "manifest.json")
    (root / f"{_key()}.lock").symlink_to(target)
    with pytest.raises(builder.CacheError) as caught:
        builder.build(SPEC, root=root)
    assert f"{root / _key()}.lock: a symbolic link" in _one_line(caught)
    _untouched(victim)  # neither truncated nor created
    assert not (root / _key()).exists()


@pytest.mark.parametrize("force", [False, True], ids=["build", "force"])
def test_artifact_file_planted_as_a_symlink_is_refused(tmp_path, victim, force):
    artifact = builder.build(SPEC, root=tmp_path)
    manifest = artifact.directory / builder.MANIFEST
    manifest.unlink()
    manifest.symlink_to(victim / "manifest.json")
    with pytest.raises(builder.CacheError) as caught:
        builder.build(SPEC, root=tmp_path, force=force)
    assert f"{manifest}: a symbolic link" in _one_line(caught)
    _untouched(victim)
    assert manifest.is_symlink()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
@pytest.mark.parametrize("where", ["kernels.py", "lock"])
def test_fifo_where_a_file_belongs_is_refused_without_hanging(tmp_path, where):
    root = tmp_path / "cache"
    artifact = builder.build(SPEC, root=root)
    path = artifact.path("forward") if where == "kernels.py" else root / f"{_key()}.lock"
    path.unlink()
    os.mkfifo(path)
    artifact.path("backward").unlink()  # a miss: the build takes the lock
    with pytest.raises(builder.CacheError, match="not a regular file"):
        builder.build(SPEC, root=root)


def test_a_hit_takes_no_lock_and_writes_nothing(tmp_path):
    root = tmp_path / "cache"
    artifact = builder.build(SPEC, root=root)
    (root / f"{_key()}.lock").unlink()
    before = {p: p.stat().st_mtime_ns for p in artifact.directory.iterdir()}
    assert builder.build(SPEC, root=root).hit
    assert sorted(p.name for p in root.iterdir()) == [_key()]  # as a read-only cache (root's, say) needs
    assert {p: p.stat().st_mtime_ns for p in artifact.directory.iterdir()} == before


# -- nothing another user can write --------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["cache", "artifact", "file"])
def test_world_writable_is_refused_with_the_fix(tmp_path, what):
    artifact = builder.build(SPEC, root=tmp_path / "cache")
    path = {"cache": tmp_path / "cache", "artifact": artifact.directory, "file": artifact.path("forward")}[what]
    before = sorted(p.name for p in artifact.directory.iterdir())
    path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWOTH)
    with pytest.raises(builder.CacheError) as caught:
        builder.build(SPEC, root=tmp_path / "cache")
    assert f"{path}: other users can write it" in _one_line(caught) and f"chmod go-w {path}" in str(caught.value)
    assert sorted(p.name for p in artifact.directory.iterdir()) == before
    path.chmod(stat.S_IMODE(path.stat().st_mode) & ~stat.S_IWOTH)  # the fix it names
    assert builder.build(SPEC, root=tmp_path / "cache").hit


def test_group_writable_is_refused_unless_a_private_group(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    builder.build(SPEC, root=root)
    root.chmod(0o770)
    monkeypatch.setattr(buildcache, "private_group", lambda gid, uid: True)  # the group is the owner alone
    assert builder.build(SPEC, root=root).hit
    monkeypatch.setattr(buildcache, "private_group", lambda gid, uid: False)
    with pytest.raises(builder.CacheError, match="other users can write it"):
        builder.build(SPEC, root=root)


def test_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    builder.build(SPEC, root=root)
    owner = root.stat().st_uid
    monkeypatch.setattr(buildcache, "trusted_owners", lambda: {owner + 1})  # as seen by another user (not root)
    with pytest.raises(builder.CacheError) as caught:
        builder.build(SPEC, root=root)
    assert f"{root}: owned by another user (uid {owner})" in _one_line(caught)
    assert "ATTNZOO_CACHE_DIR" in str(caught.value)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_artifact_owned_by_another_user_is_refused(tmp_path):
    artifact = builder.build(SPEC, root=tmp_path)
    os.chown(artifact.directory, 4242, 4242)
    with pytest.raises(builder.CacheError, match=f"{artifact.directory}: owned by another user \\(uid 4242\\)"):
        builder.build(SPEC, root=tmp_path)


def test_a_umask_of_000_still_gives_a_cache_it_trusts(tmp_path):
    old = os.umask(0)
    try:
        artifact = builder.build(SPEC, root=tmp_path / "a" / "cache")
    finally:
        os.umask(old)
    for path in (tmp_path / "a", artifact.directory.parent, artifact.directory, *artifact.directory.iterdir()):
        assert not path.stat().st_mode & stat.S_IWOTH, path
    assert builder.build(SPEC, root=tmp_path / "a" / "cache").hit


# -- a cache directory that cannot be one: one line ----------------------------------------------------------------
@pytest.mark.parametrize("where", ["file", "under-file", "proc"])
def test_unusable_cache_directory_is_one_line(tmp_path, monkeypatch, capsys, where):
    (tmp_path / "f").write_text("a file\n")
    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    path = {"file": tmp_path / "f", "under-file": tmp_path / "f" / "cache", "proc": "/proc/attnzoo-cache"}[where]
    monkeypatch.setenv("ATTNZOO_CACHE_DIR", str(path))
    with pytest.raises(builder.CacheError) as caught:
        builder.build(SPEC)
    assert str(caught.value).startswith(f"{path}: ") and "ATTNZOO_CACHE_DIR" in _one_line(caught)
    assert main(["build", "vanilla"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnzoo: {path}: ") and err.count("\n") == 1 and "Traceback" not in err
    assert (tmp_path / "f").read_text() == "a file\n"


# -- --compile-for: checked before anything is stored --------------------------------------------------------------
@pytest.mark.parametrize(("flags", "said"), [
    (["--head-dim", "0"], "--head-dim 0: a head dim is a number of channels, at least 1"),
    (["--head-dim", "64", "-4"], "--head-dim -4"),
    (["--dtype", "float16", "float64"], "--dtype float64: the triton kernels take float32, float16 or"),
    (["--dtype", "int8"], "--dtype int8"),
    (["--compile-for", "sm_9x"], "--compile-for 'sm_9x'"),
], ids=["d0", "d-4", "float64", "int8", "arch"])
def test_compile_for_input_is_checked_before_anything_is_stored(tmp_path, capsys, flags, said):
    argv = ["build", "vanilla", "--cache-dir", str(tmp_path / "cache"), "--compile-for", "90", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("dtype", "head_dim"), [("float64", 64), ("float16", 0)])
def test_compile_for_api_checks_before_anything_is_stored(tmp_path, dtype, head_dim):
    import torch

    artifact = builder.build(SPEC, root=tmp_path)
    with pytest.raises(ValueError, match="--dtype float64|--head-dim 0"):
        aot.compile_for(None, None, artifact.directory, 90, getattr(torch, dtype), head_dim)
    assert not (artifact.directory / aot.COMPILED).exists()


def test_compile_targets_parse(monkeypatch):
    import torch

    monkeypatch.setattr(builder, "interpreting", lambda: False)  # as in a process that can compile for a GPU
    archs, dtypes, dims = aot.targets(["80,sm_90", "9.0"], ["bfloat16", "float16", "bfloat16"], [64, 128, 64])
    assert (archs, dtypes, dims) == ([80, 90, 90], [torch.bfloat16, torch.float16], [64, 128])
    monkeypatch.undo()  # the tests run in the interpreter: refused last, after the input's own checks
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        aot.targets(["90"], ["bfloat16"], [64])


# -- the compiled kernels an artifact holds ------------------------------------------------------------------------
def _compiled(artifact, victim):
    """An artifact with one compiled kernel for sm_90 (a Triton cache entry holding a file and a planted link)."""
    directory = aot.arch_dir(artifact.directory, 90)
    entry = directory / "triton" / "abc123"
    entry.mkdir(parents=True)
    (entry / "_fwd.cubin").write_bytes(b"cubin")
    (entry / "planted.json").symlink_to(victim / "manifest.json")
    (directory / aot.INDEX).write_text(json.dumps({"entries": {"abc123": {"kernel": "_fwd"}}}))
    return directory


def test_install_copies_files_never_links(tmp_path, victim, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(aot, "_EXPECTED", {})
    monkeypatch.setattr(aot, "_hook", lambda: None)
    artifact = builder.build(SPEC, root=tmp_path / "cache")
    _compiled(artifact, victim)
    target = tmp_path / "triton-cache"
    assert aot.install(artifact.directory, 90, ["m"], SPEC["name"], cache_dir=str(target)) == 1
    assert sorted(p.name for p in (target / "abc123").iterdir()) == ["_fwd.cubin"]


@pytest.mark.parametrize("planted", ["compiled-link", "world-writable"])
def test_install_refuses_what_it_cannot_trust(tmp_path, victim, monkeypatch, planted):
    pytest.importorskip("triton")
    monkeypatch.setattr(aot, "_EXPECTED", {})
    monkeypatch.setattr(aot, "_hook", lambda: None)
    artifact = builder.build(SPEC, root=tmp_path / "cache")
    directory = _compiled(artifact, victim)
    if planted == "compiled-link":
        compiled = directory.parent
        compiled.rename(tmp_path / "elsewhere")
        compiled.symlink_to(tmp_path / "elsewhere")
        path, said = compiled, "a symbolic link"
    else:
        path, said = directory / "triton" / "abc123" / "_fwd.cubin", "other users can write it"
        path.chmod(0o666)
    with pytest.raises(builder.CacheError) as caught:
        aot.install(artifact.directory, 90, ["m"], SPEC["name"], cache_dir=str(tmp_path / "triton-cache"))
    assert f"{path}: {said}" in _one_line(caught)
    assert not (tmp_path / "triton-cache" / "abc123").exists()
    _untouched(victim)

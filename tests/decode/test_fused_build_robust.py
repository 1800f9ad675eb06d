"""The fused decoding steps' build never blocks silently and never raises out of decode (issue 51, item 3): a build
lock another process holds is waited for with one line on stderr and given up after ATTNZOO_FUSED_LOCK_TIMEOUT; an
environment variable that does not parse, a damaged manifest or library, a cache directory that cannot be used:
each one status line naming the variable or file, and decode runs through the torch steps. And the ops' fake
kernels refuse tensors on two devices (issue 51, item 1).

Fast: no case compiles. Where the library's key must not be the one this machine has built (or this process has
loaded), the compiler is one that does not exist (``CXX=/nonexistent/c++``), so a build, if it were tried, fails
at once; the cache is a fresh directory (ATTNZOO_FUSED_CACHE_DIR)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo import buildcache
from attnzoo.decode import fused_build, layout

NO_CXX = "/nonexistent/c++"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A fresh cache directory, no compiler settings of the caller's, nothing decided yet in this process."""
    for var in ("CXX", "CC", "ATTNZOO_FUSED_CFLAGS", "ATTNZOO_FUSED_LOCK_TIMEOUT", "ATTNZOO_FUSED_DECODE",
                "ATTNZOO_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ATTNZOO_FUSED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fused_build, "_LOADED", None)
    # a library an earlier test of this process loaded is reused whatever the cache directory says (its key does not
    # name the directory): these tests decide afresh, as a new process would
    monkeypatch.setattr(fused_build, "_LIBRARIES", {})
    return monkeypatch


def _decode() -> tuple[str | None, float]:
    """H2O decoded through the blocked backend's lean steps and through the reference: the step kind taken and
    the largest difference."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 10, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(2))
    outs, kinds = {}, {}
    for backend in ("blocked", "reference"):
        variant = attnzoo.compile("h2o", backend=backend)
        cache = variant.new_cache(1, budget=4)
        variant.prefill(q[:, :, :6], k[:, :, :6], v[:, :, :6], cache)
        outs[backend] = torch.cat([variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache)
                                   for t in range(6, 10)], dim=2)
        kinds[backend] = cache.lean_step_kind
    return kinds["blocked"], (outs["blocked"] - outs["reference"]).abs().max().item()


def _falls_back(monkeypatch, *named: str) -> str:
    """The status line, checked: the torch steps, one line naming each of ``named``; decode runs through the torch
    steps and gives the reference's outputs."""
    monkeypatch.setattr(fused_build, "_LOADED", None)
    assert fused_build.library() is None
    line = fused_build.status()
    assert line.startswith("torch lean steps: the fused C steps are unavailable: ") and "\n" not in line, line
    for name in named:
        assert name in line, (name, line)
    kind, error = _decode()
    assert kind == "torch" and error < 1e-12, (kind, error)
    return line


def _paths() -> tuple[Path, Path]:
    """The directory in the cache of the library this process would load under the current settings, and its lock
    file."""
    key = fused_build._configured()[-1]
    root = fused_build._cache_root()
    return root / "fused-decode" / key[:32], root / "fused-decode" / f"{key[:32]}.lock"


# -- environment variables ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("var", "value", "says"), [
    ("CXX", " ", "CXX=' ' names no compiler"),
    ("CXX", '"g++', "CXX='\"g++' does not parse as shell words (No closing quotation)"),
    ("CC", "'gcc", "CC=\"'gcc\" does not parse"),
    ("ATTNZOO_FUSED_CFLAGS", "-DX='1", "ATTNZOO_FUSED_CFLAGS=\"-DX='1\" does not parse"),
])
def test_a_setting_that_does_not_parse_is_named_and_decode_runs(env, var, value, says):
    env.setenv(var, value)
    _falls_back(env, says)


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1e"])
def test_a_lock_timeout_that_does_not_parse_is_named_when_a_build_must_wait(env, value):
    env.setenv("CXX", NO_CXX)
    env.setenv("ATTNZOO_FUSED_LOCK_TIMEOUT", value)
    _falls_back(env, f"ATTNZOO_FUSED_LOCK_TIMEOUT={value!r} is not a number of seconds")


@pytest.mark.parametrize("var", ["ATTNZOO_FUSED_CACHE_DIR", "ATTNZOO_CACHE_DIR"])
@pytest.mark.parametrize("under", ["", "sub"])
def test_a_cache_directory_that_is_a_file_is_named(env, tmp_path, var, under):
    file = tmp_path / "a-file"
    file.write_text("x")
    env.delenv("ATTNZOO_FUSED_CACHE_DIR")
    env.setenv(var, str(file / under) if under else str(file))
    line = _falls_back(env, f"{var}='{file / under if under else file}'", str(file))
    if var == "ATTNZOO_FUSED_CACHE_DIR":
        assert "ATTNZOO_CACHE_DIR" not in line.replace("ATTNZOO_FUSED_CACHE_DIR", "")  # the variable that helps


def test_a_cache_directory_of_no_user_is_named(env):
    env.setenv("ATTNZOO_FUSED_CACHE_DIR", "~no-such-user-attnzoo/cache")
    _falls_back(env, "ATTNZOO_FUSED_CACHE_DIR='~no-such-user-attnzoo/cache' cannot be the build cache")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_cache_directory_is_named(env, tmp_path):
    env.setenv("CXX", NO_CXX)
    directory, _ = _paths()
    directory.mkdir(parents=True)
    directory.parent.chmod(0o600)  # no search: the key's directory cannot be looked at
    try:
        _falls_back(env, str(directory))
    finally:
        directory.parent.chmod(0o700)


# -- a damaged build in the cache ---------------------------------------------------------------------------------
def _manifests(key: str) -> dict[str, bytes]:
    return {
        "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
        "not UTF-8": b'{"key": "\xff\xfe"}',
        "not JSON": b'{"key": ',
        "a list": b"[1, 2]",
        "a key of another type": b'{"key": 5, "library": "00"}',
        "a sha256 of another type": json.dumps({"key": key, "library": 7}).encode(),
        "a sha256 of another library": json.dumps({"key": key, "library": "0" * 64}).encode(),
    }


@pytest.mark.parametrize("case", list(_manifests("")))
@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_a_damaged_manifest_is_named_and_decode_runs(env, case, compiler):
    """No compiler at all, or one that fails: the status line names the damaged file (with a compiler that works,
    the build is made again and replaces it)."""
    if compiler == "missing":
        env.setenv("PATH", "/nonexistent")
    else:
        env.setenv("CXX", NO_CXX)
    directory, _ = _paths()
    directory.mkdir(parents=True)
    (directory / "fused_decode.so").write_bytes(b"\x7fELF not a library")
    (directory / "manifest.json").write_bytes(_manifests(fused_build._configured()[-1])[case])
    line = _falls_back(env, "the build in the cache is not used")
    assert str(directory / ("fused_decode.so" if "sha256 of another library" in case else "manifest.json")) in line
    assert ("no C++ compiler found" if compiler == "missing" else f"{NO_CXX} could not compile") in line


@pytest.mark.parametrize("case", ["no manifest", "no library", "a manifest that is a directory"])
def test_a_build_missing_a_file_is_named(env, case):
    env.setenv("CXX", NO_CXX)
    directory, _ = _paths()
    directory.mkdir(parents=True)
    key = fused_build._configured()[-1]
    if case == "no library":
        (directory / "manifest.json").write_text(json.dumps({"key": key, "library": "0" * 64}))
        _falls_back(env, f"{directory / 'fused_decode.so'}: missing")
    elif case == "no manifest":
        (directory / "fused_decode.so").write_bytes(b"")
        _falls_back(env, f"{directory / 'manifest.json'}: missing")
    else:
        (directory / "manifest.json").mkdir()
        _falls_back(env, f"{directory / 'manifest.json'}: cannot read it")


def test_whatever_else_fails_is_one_line_and_an_interrupt_is_not_caught(env):
    def broken(namespace):
        raise RuntimeError("planted\nsecond line")

    env.setattr(layout, "header", broken)
    assert "could not be set up: RuntimeError: planted" in _falls_back(env)

    def interrupted(namespace):
        raise KeyboardInterrupt

    env.setattr(layout, "header", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fused_build._compile()


# -- the build lock -----------------------------------------------------------------------------------------------
def _hold(path: Path) -> int:
    """The lock ``path`` held through an open file description of its own (as another process would)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_held_build_lock_is_waited_for_with_one_line_then_given_up(env, capsys):
    env.setenv("CXX", NO_CXX)  # if the lock were taken, the build would fail at once: nothing compiles
    env.setenv("ATTNZOO_FUSED_LOCK_TIMEOUT", "0.5")
    _, lock = _paths()
    fd = _hold(lock)
    try:
        start = time.monotonic()
        line = _falls_back(env, str(lock), "held this lock for 0.", "ATTNZOO_FUSED_LOCK_TIMEOUT=0.5")
        assert time.monotonic() - start < 10
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if "waiting for the lock" in x]
    assert len(said) == 1 and str(lock) in said[0] and "after 0.5 s (ATTNZOO_FUSED_LOCK_TIMEOUT)" in said[0], err
    assert f"(pid {os.getpid()})" in said[0] and f"(pid {os.getpid()})" in line  # /proc/locks names the holder
    # released: the lock is taken at once, nothing said, and the build (failing at once) is tried
    env.setattr(fused_build, "_LOADED", None)
    assert f"{NO_CXX} could not compile" in fused_build.status()
    assert "waiting" not in capsys.readouterr().err


def test_a_lock_without_a_timeout_waits_until_it_is_released(tmp_path, capsys):
    """The Triton artifacts' lock (no timeout): waits as long as it takes, saying so once."""
    lock = tmp_path / "k.lock"
    fd = _hold(lock)
    threading.Timer(0.4, os.close, (fd,)).start()
    start = time.monotonic()
    with buildcache.locked(lock):
        waited = time.monotonic() - start
    assert waited >= 0.3
    said = [x for x in capsys.readouterr().err.splitlines() if "waiting" in x]
    assert said == [f"attnzoo: waiting for the lock {lock}: another process (pid {os.getpid()}) holds it; waiting "
                    f"until it is released"], said
    with buildcache.locked(lock, timeout=0):  # free: taken at once, nothing said
        pass
    assert capsys.readouterr().err == ""


def test_a_lock_timeout_is_a_cache_error_naming_the_file(tmp_path, capsys):
    lock = tmp_path / "k.lock"
    fd = _hold(lock)
    try:
        with pytest.raises(buildcache.LockTimeout,
                           match=rf"^{re.escape(str(lock))}: another process .*held this lock for 0\.\d s$"):
            with buildcache.locked(lock, timeout=0.2):
                pass
    finally:
        os.close(fd)
    assert issubclass(buildcache.LockTimeout, buildcache.CacheError)
    assert capsys.readouterr().err.count("\n") == 1


# -- fresh interpreters --------------------------------------------------------------------------------------------
_DECODE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import test_fused_build_robust as t
    from attnzoo.decode import fused_build
    planted = {planted!r}
    if planted is not None:
        directory, _ = t._paths()
        directory.mkdir(parents=True)
        directory.joinpath("manifest.json").write_bytes(t._manifests("")[planted])
    start = time.monotonic()
    kind, error = t._decode()
    print(json.dumps({{"kind": kind, "error": error, "seconds": time.monotonic() - start,
                      "status": fused_build.status()}}), flush=True)
""")


def _child(env: dict, planted: str | None = None, timeout: float = 120) -> tuple[dict, str]:
    code = _DECODE.format(tests=str(Path(__file__).parent), planted=planted)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1]), done.stderr


def _child_env(tmp_path, **more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "ATTNZOO_FUSED_CFLAGS",
                                                            "ATTNZOO_FUSED_LOCK_TIMEOUT", "ATTNZOO_FUSED_DECODE")}
    return env | {"ATTNZOO_FUSED_CACHE_DIR": str(tmp_path / "cache")} | more


@pytest.mark.subprocess
@pytest.mark.parametrize(("more", "planted", "says"), [
    ({"CXX": " "}, None, "CXX=' ' names no compiler"),
    ({"ATTNZOO_FUSED_CFLAGS": "-DX='1"}, None, "ATTNZOO_FUSED_CFLAGS"),
    ({"CXX": NO_CXX}, "nested 100,000 deep", "manifest.json: not a manifest (RecursionError"),
])
def test_a_fresh_process_decodes_through_the_torch_steps(tmp_path, more, planted, says):
    got, _ = _child(_child_env(tmp_path, **more), planted)
    assert got["kind"] == "torch" and got["error"] < 1e-12 and says in got["status"], got


@pytest.mark.subprocess
def test_a_build_lock_held_by_a_stopped_process_is_given_up(tmp_path):
    """Another process holds the lock of the key this machine would build (a build stopped with Ctrl-Z): the first
    decode of a fresh process says once what it waits for, gives up after ATTNZOO_FUSED_LOCK_TIMEOUT and decodes
    through the torch steps; the status line names the lock file and the process."""
    env = _child_env(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; sys.path.insert(0, sys.argv[1]); "
         "import test_fused_build_robust as t; _, lock = t._paths(); fd = t._hold(lock); print(lock, flush=True); "
         "time.sleep(300)", str(Path(__file__).parent)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        lock = holder.stdout.readline().strip()
        assert lock.endswith(".lock"), lock
        got, err = _child(env | {"ATTNZOO_FUSED_LOCK_TIMEOUT": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert got["kind"] == "torch" and got["error"] < 1e-12, got
    assert got["seconds"] < 30, got
    assert f"{lock}: another process (pid {holder.pid}) held this lock for 1." in got["status"], got
    said = [x for x in err.splitlines() if "waiting for the lock" in x]
    assert said == [f"attnzoo: waiting for the lock {lock}: another process (pid {holder.pid}) holds it (building "
                    f"the fused decoding steps, or stopped); the torch steps run instead after 1 s "
                    f"(ATTNZOO_FUSED_LOCK_TIMEOUT)"], err


# -- the fake kernels ---------------------------------------------------------------------------------------------
def _step_args(device_of: dict[str, str]) -> dict:
    B, H, HKV, D, M = 2, 4, 2, 8, 6
    shapes = {"q": (B, H, 1, D), "k": (B, HKV, 1, D), "v": (B, HKV, 1, D), "keys": (B, HKV, M + 1, D),
              "values": (B, HKV, M + 1, D), "scores": (B, HKV, M + 1)}
    args = {name: torch.zeros(shape, dtype=torch.float64, device=device_of.get(name, "cpu"))
            for name, shape in shapes.items()}
    args["positions"] = torch.zeros(B, HKV, M + 1, dtype=torch.long, device=device_of.get("positions", "cpu"))
    args["nexts"] = torch.zeros(B, dtype=torch.long, device=device_of.get("nexts", "cpu"))
    return args | {"next": 0, "held": M, "scale": 0.35, "tova": False, "recent": 2}


@pytest.mark.parametrize(("devices", "refused"), [
    ({"q": "meta"}, "k is on cpu, q on meta"),
    ({"keys": "meta"}, "keys is on meta, q on cpu"),
    ({"nexts": "meta"}, "nexts is on meta, q on cpu"),
    ({"q": "meta", "k": "meta", "v": "meta", "keys": "meta", "values": "meta", "positions": "meta",
      "scores": "meta"}, "nexts is on cpu, q on meta"),
])
def test_the_fake_kernel_refuses_tensors_on_two_devices(devices, refused):
    """The fake kernel itself (no library needed): positional and keyword arguments, one line naming the argument."""
    names = [name for name, _ in layout.OPS["scoring_step"][0]]
    fake = fused_build._fake("scoring_step", names, True)
    args = _step_args(devices)
    for call in (lambda: fake(**args), lambda: fake(*(args[n] for n in names))):
        with pytest.raises(ValueError, match=rf"^scoring_step: {refused}: the op's tensors must all be on one device$"):
            call()
    same = _step_args({name: "meta" for name in ("q", "k", "v", "keys", "values", "positions", "scores", "nexts")})
    out = fake(**same)
    assert out.shape == same["q"].shape and out.device.type == "meta"
    append = fused_build._fake("append_step", [n for n, _ in layout.OPS["append_step"][0]], False)
    with pytest.raises(ValueError, match="append_step: v is on cpu, k on meta"):
        append(same["k"], torch.zeros(same["v"].shape, dtype=torch.float64), 0, None, 1, same["keys"], same["values"],
               same["positions"])
    assert append(same["k"], same["v"], 0, None, 1, same["keys"], same["values"], same["positions"]) is None


def test_the_op_refuses_a_meta_q_with_buffers_on_the_cpu(ops):
    """Through the registered op: what returned a meta tensor and wrote nothing is refused in one line."""
    args = _step_args({"q": "meta"})
    before = args["keys"].clone()
    with pytest.raises(ValueError, match="scoring_step: k is on cpu, q on meta"):
        ops.op("scoring")(**args)
    with pytest.raises(ValueError, match="append_step: v is on cpu, k on meta"):
        ops.op("append")(args["k"].to("meta"), args["v"], 0, None, 1, args["keys"], args["values"],
                         args["positions"])
    assert torch.equal(args["keys"], before)

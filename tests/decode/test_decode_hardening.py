"""The lean decoding steps compute what the full path computes, or decline the step (docs/decoding.md, "A step
validated once"). Each reported failure is a row of a table, run on both forms of the lean steps (fused in C, and
the torch operations that define them) against the float64 reference decode, step by step. The memory cases run
in a child process, so that a crash fails their rows instead of killing pytest; so does the fork during a compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.decode import fused_build

B, H, HKV, D, PREFILL = 2, 4, 2, 8, 3
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def form(lean_kind):
    """The lean steps in both forms: fused in C (compiled once per process) and the torch operations
    (``lean_kind``, tests/conftest.py)."""
    return lean_kind

# -- the rows compared with the reference -------------------------------------------------------------------------
@dataclass
class Row:
    """A decode of ``n`` tokens (``PREFILL`` prefilled) through the blocked backend's lean steps and through the
    reference, float64. ``first``: each row's first position; ``data(q, k, v)``: changes the tokens (both);
    ``between(t, cache)``: changes a cache before step t (both caches alike); ``given(step)``: the lean step's
    q, k, v as handed over (views of the same numbers)."""

    spec: str | dict
    budget: int | None = 6
    n: int = 30
    first: tuple[int, ...] | None = None
    data: Callable | None = None
    between: Callable | None = None
    given: Callable | None = None


def _key(value, at=(0, 0, 10, 0)):
    def put(q, k, v):
        k[at] = value
    return put


def _negated(step):  # views with the negative bit, reading as the step's numbers
    return [torch._neg_view(-x) for x in step]


def _conjugate_imag(step):  # the imaginary part of a conjugate view: a real view with the negative bit
    return [torch.complex(torch.zeros_like(x), -x).conj().imag for x in step]


class Wrapped(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass: no storage of its own, every operation on the wrapped tensor."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, Wrapped) else x

        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def _state_at(t0, name, make):
    def change(t, cache):
        if t == t0:
            held = cache.state[name]
            cache.state[name] = make(held)
    return change


def _rows_set(t, cache, names=("values", "positions")):
    if t in (10, 20):
        for name in names:
            setattr(cache, name, getattr(cache, name).clone())


ROWS = {
    # 1. rows at different offsets: position 1 (BOS) is protected per row, not by row 0's first slot
    "offsets-bos-in-row-0": Row("selective-pruned", n=40, first=(1, 7)),
    "offsets-bos-in-row-1": Row("selective-pruned", n=40, first=(7, 1)),
    "offsets-bos-unmasked": Row({"name": "sel-bos", "transforms": [{"kind": "selective_mask", "protect_bos": False}],
                                 "cache": {"evictor": "selective", "budget": 6}}, n=40, first=(1, 7)),
    # 2. non-finite scores: the NaN-scored eligible token leaves first, as the reference's argmax/argmin rule it
    "nan-key-selective": Row("selective-pruned", data=_key(NAN)),
    "nan-key-h2o": Row("h2o", data=_key(NAN)),
    "nan-key-tova": Row("tova", data=_key(NAN)),
    "inf-key-selective": Row("selective-pruned", data=_key(INF)),
    "inf-key-h2o": Row("h2o", data=_key(INF)),
    "minus-inf-key-h2o": Row("h2o", data=_key(-INF)),
    "inf-key-tova": Row("tova", data=_key(INF, at=(1, 1, 12, 3))),
    # 3. views with the negative (or conjugate) bit: resolved by torch, never read raw by C
    "negative-bit-selective": Row("selective-pruned", given=_negated),
    "negative-bit-h2o": Row("h2o", given=_negated),
    "negative-bit-tova": Row("tova", given=_negated),
    "negative-bit-streaming": Row("streaming", given=_negated),
    "negative-bit-vanilla-append": Row("vanilla", budget=None, given=_negated),
    "conjugate-imag-h2o": Row("h2o", given=_conjugate_imag),
    # 4. a state assigned as an expanded (stride 0) or negated view: made dense before any step writes it
    "expanded-F": Row("selective-pruned", between=_state_at(10, "accumulated",
                                                           lambda f: f[:, :1].clone().expand(f.shape))),
    "negated-F": Row("selective-pruned", between=_state_at(10, "accumulated", lambda f: torch._neg_view(-f))),
    "expanded-h2o-scores": Row("h2o", between=_state_at(10, "attention", lambda a: a[:, :1].clone().expand(a.shape))),
    # 7. rows replaced between steps keep the room the next token needs
    "values-positions-set-h2o": Row("h2o", between=_rows_set),
    "rows-set-tova": Row("tova", between=lambda t, c: _rows_set(t, c, ("keys", "values", "positions"))),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_lean_steps_equal_the_reference(name, form):
    _compare(name, ROWS[name], form)


def _compare(name: str, row: Row, form: str) -> None:
    torch.manual_seed(11)
    q = torch.randn(B, H, row.n, D, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, row.n, D, dtype=torch.float64) for _ in range(2))
    if row.data is not None:
        row.data(q, k, v)
    lean, ref = attnzoo.compile(row.spec, backend="blocked"), attnzoo.compile(row.spec, backend="reference")
    caches = [lean.new_cache(B, budget=row.budget), ref.new_cache(B, budget=row.budget)]
    for variant, cache in zip((lean, ref), caches, strict=True):
        if row.first is not None:
            cache.next_position = torch.tensor(row.first)
        variant.prefill(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], cache)
    kinds = []
    for t in range(PREFILL, row.n):
        step = [x[:, :, t:t + 1] for x in (q, k, v)]
        if row.between is not None:
            for cache in caches:
                row.between(t, cache)
        kinds.append(caches[0].lean_step_kind)
        got = lean.decode(*(row.given(step) if row.given else step), caches[0])
        want = ref.decode(*step, caches[1])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10,
                                   equal_nan=True, msg=lambda m, t=t: f"{name}, step {t}: {m}")
    assert torch.equal(caches[0].positions, caches[1].positions)  # the same tokens held, in position order
    for key, held in caches[1].state.items():
        torch.testing.assert_close(caches[0].state[key], held, rtol=1e-10, atol=1e-10, equal_nan=True)
    # the lean step in this form took nearly every step (a row that changes the cache takes the full path once)
    assert kinds.count(form) >= row.n - PREFILL - 6, kinds


def test_the_nan_rule_is_the_reference_evictors():
    """The rule the lean steps follow is the reference evictors' (torch's argmax/argmin in position order): a NaN
    score outranks every number, for the largest and the smallest alike, the first (oldest) NaN first."""
    scores = torch.tensor([[1.0, NAN, 5.0, NAN, -2.0]])
    assert scores.argmax(-1).item() == 1 and scores.argmin(-1).item() == 1
    assert torch.tensor([[INF, INF, 3.0]]).argmax(-1).item() == 0  # ties: the first, the oldest


# -- the memory cases, in a child process ----------------------------------------------------------------------
def _free(t):
    t.untyped_storage().resize_(0)


def _fake(step):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        step[0] = torch.empty(step[0].shape, dtype=step[0].dtype)


def _wrapped(step):
    return [Wrapped(x) for x in step]


#: name: (spec, budget, break(step, cache) before a lean step, a text the error it raises must hold), or a Row
#: whose lean steps must equal the reference (a __torch_dispatch__ wrapper: its data_ptr() is no data, so the fused
#: step declines it and the torch step dispatches)
MEMORY = {
    "q-freed": ("h2o", 6, lambda step, cache: _free(step[0]), "storage"),
    "k-freed": ("h2o", 6, lambda step, cache: _free(step[1]), "storage"),
    "k-freed-streaming": ("streaming", 6, lambda step, cache: _free(step[1]), "storage"),
    "k-freed-selective": ("selective-pruned", 6, lambda step, cache: _free(step[1]), "storage"),
    "v-freed-vanilla-append": ("vanilla", None, lambda step, cache: _free(step[2]), "storage"),
    "q-shrunk": ("tova", 6, lambda step, cache: step[0].untyped_storage().resize_(8), "storage"),
    "q-shrunk-vanilla": ("vanilla", None, lambda step, cache: step[0].untyped_storage().resize_(8), "storage"),
    "cache-keys-freed": ("h2o", 6, lambda step, cache: _free(cache.keys), "storage"),
    "cache-values-freed-selective": ("selective-pruned", 6, lambda step, cache: _free(cache.values), "storage"),
    "cache-keys-freed-vanilla": ("vanilla", None, lambda step, cache: _free(cache.keys), "storage"),
    "cache-scores-freed": ("h2o", 6, lambda step, cache: _free(cache.state["attention"]), "storage"),
    "fake-q": ("h2o", 6, lambda step, cache: _fake(step), "FakeTensor"),
    "wrapper-subclass-h2o": Row("h2o", given=_wrapped),
    "wrapper-subclass-selective": Row("selective-pruned", given=_wrapped),
    "wrapper-subclass-vanilla-append": Row("vanilla", budget=None, given=_wrapped),
}


def _memory_case(name: str, form: str, loaded) -> dict:
    fused_build._LOADED = loaded if form == "fused" else (None, "switched off in this case")
    if isinstance(MEMORY[name], Row):
        try:
            _compare(name, MEMORY[name], form)
        except AssertionError as exc:
            return {"outcome": "differs", "message": str(exc)[-1500:]}
        return {"outcome": "equal"}
    spec, budget, breaks, _ = MEMORY[name]
    torch.manual_seed(12)
    n = 12
    q = torch.randn(B, H, n, D, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, n, D, dtype=torch.float64) for _ in range(2))
    lean = attnzoo.compile(spec, backend="blocked")
    cache = lean.new_cache(B, budget=budget)
    lean.prefill(q[:, :, :8], k[:, :, :8], v[:, :, :8], cache)
    for t in range(8, n):
        step = [x[:, :, t:t + 1].clone() for x in (q, k, v)]
        if t == n - 1:
            if cache.lean_step_kind != form:
                return {"outcome": f"the lean step in form {form} is not set up: {cache.lean_step_kind}"}
            breaks(step, cache)
            try:
                lean.decode(*step, cache)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                return {"outcome": "raised", "type": type(exc).__name__, "message": str(exc)}
            return {"outcome": "returned"}
        lean.decode(*step, cache)
    raise AssertionError("unreachable")


MEMORY_RUNS = [(name, form) for name in MEMORY for form in ("fused", "torch")]


def _memory_child(first: int = 0) -> None:
    """The memory cases in both forms from ``MEMORY_RUNS[first]`` on, one JSON line before and after each (a crash
    leaves a start alone)."""
    loaded = (fused_build.library(), fused_build._LOADED[1])
    for name, form in MEMORY_RUNS[first:]:
        print(json.dumps({"case": name, "form": form, "start": True}), flush=True)
        if form == "fused" and loaded[0] is None:
            result = {"outcome": "skipped", "message": fused_build.status()}
        else:
            result = _memory_case(name, form, loaded)
        print(json.dumps({"case": name, "form": form, **result}), flush=True)


def _child(code: str, timeout: float) -> subprocess.CompletedProcess:
    here = Path(__file__).parent
    script = f"import sys; sys.path.insert(0, {str(here)!r}); import {Path(__file__).stem} as t; {code}"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=here.parents[1])


@pytest.fixture(scope="module")
def memory_results():
    """Every memory case's outcome by (case, form): one child runs them all; a child that crashes is reported for
    the case it was in, and a new child goes on from the next case."""
    results, first, done = {}, 0, None
    while first < len(MEMORY_RUNS):
        done = _child(f"t._memory_child({first})", timeout=600)
        started = None
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry.pop("start", False):
                started = (entry["case"], entry["form"])
            else:
                results[(entry.pop("case"), entry.pop("form"))] = entry
        if done.returncode == 0 or started is None:
            break
        if started not in results:
            results[started] = {"outcome": f"crashed (exit status {done.returncode})", "stderr": done.stderr[-1500:]}
        first = MEMORY_RUNS.index(started) + 1
    return results, done


@pytest.mark.parametrize("name", list(MEMORY))
@pytest.mark.parametrize("form_name", ["fused", "torch"])
def test_memory_cases_are_refused_with_one_line(name, form_name, memory_results):
    """q, k or v whose storage was freed or shrunk after the lean step was set up, the cache's buffers freed
    through its public views, a fake tensor: refused with one line before any kernel reads past a storage (the
    fused step: a ValueError before C sees a pointer; the torch step: the same check of its inputs, and torch's
    own check of the views it makes of the cache's buffers), never a crash. A wrapper subclass: the reference's
    outputs."""
    results, done = memory_results
    result = results.get((name, form_name))
    assert result is not None, f"not reached: the child stopped before it (exit status {done.returncode})\n" + \
        done.stderr[-2000:]
    if result["outcome"] == "skipped":
        pytest.skip(result["message"])
    if isinstance(MEMORY[name], Row):
        assert result["outcome"] == "equal", result
        return
    assert result["outcome"] == "raised", result
    assert MEMORY[name][3] in result["message"], result
    if result["type"] == "ValueError":
        assert "\n" not in result["message"]
    if form_name == "fused" and name != "fake-q":
        assert result["type"] == "ValueError", result


# -- a fork while the fused library compiles ----------------------------------------------------------------------
def _fork_child(patience: float = 30.0) -> None:
    """One thread compiles (held inside the compile until the fork is done); the process forks; the forked child
    asks for the library. It must get an answer within seconds (a fresh lock), not wait for a compile that no
    thread of its own is doing."""
    import threading

    parent = os.getpid()
    inside, release = threading.Event(), threading.Event()

    def slow_compile():
        if os.getpid() == parent:
            inside.set()
            release.wait(60)
            return None, "the parent's compile"
        return None, "the child's own compile"

    fused_build._LOADED = None
    fused_build._compile = slow_compile
    compiling = threading.Thread(target=fused_build.library)
    compiling.start()
    assert inside.wait(30)
    pid = os.fork()
    if pid == 0:
        fused_build.library()
        os._exit(0 if fused_build._LOADED == (None, "the child's own compile") else 3)
    start = time.monotonic()
    status = None
    while time.monotonic() - start < patience:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    release.set()
    compiling.join()
    print(json.dumps({"finished": status is not None and finished != 0, "status": status,
                      "seconds": round(time.monotonic() - start, 2)}), flush=True)


def test_a_fork_during_the_compile_does_not_block_the_child():
    done = _child("t._fork_child()", timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-2000:]
    result = json.loads(lines[-1])
    assert result["finished"] and result["status"] == 0, result
    assert result["seconds"] < 20, result


def test_the_step_checks_sit_where_the_step_is_set_up():
    """The fused step lays its buffers out once, re-checking them only when they change (identity or address),
    and reads no view of the cache per step: many steps, one layout."""
    if fused_build.library() is None:
        pytest.skip(fused_build.status())
    variant = attnzoo.compile("h2o", backend="blocked")
    cache = variant.new_cache(1, budget=6)
    x = torch.randn(1, 2, 20, 8, dtype=torch.float64)
    variant.prefill(x[:, :, :6], x[:, :, :6], x[:, :, :6], cache)  # at the budget
    variant.decode(x[:, :, 6:7], x[:, :, 6:7], x[:, :, 6:7], cache)  # the full path, which offers the lean step
    step = cache.step_state.fast
    layouts = []
    real = step._lay_out

    def counted(*args, **kwargs):
        layouts.append(1)
        return real(*args, **kwargs)

    step._lay_out = counted
    for t in range(7, 20):
        variant.decode(x[:, :, t:t + 1], x[:, :, t:t + 1], x[:, :, t:t + 1], cache)
    assert len(layouts) == 1 and cache.lean_step_kind == "fused"

"""Context-parallel ranks that disagree (docs/distributed.md): one rank called with another spec, other transform
parameters, another layout, piece size, exchange, grad mode, dtype, length, head count or positions raises the
same one-line :class:`attnzoo.errors.RankDisagreementError` on every rank, within seconds, before any collective
that could hang or abort; agreeing ranks still give the unsharded result.

One spawn of 2 gloo ranks on CPU runs every case in sequence (each refusal leaves the group usable for the next);
each worker writes one JSON line per case as it finishes, so a case that hangs or aborts is named by the cases
recorded before it, and the parent's deadline turns a hang into a failure."""

from __future__ import annotations

import json
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnzoo
from attnzoo.distributed import ContextParallel, Layout
from attnzoo.errors import RankDisagreementError

pytestmark = pytest.mark.distributed

WORLD = 2
#: what every rank calls with, unless its case changes it (rank 1 only)
BASE = dict(world=WORLD, spec="selective", n=16, heads=2, kv_heads=2, head_dim=4, dtype=torch.float64, balanced=True,
            method="ring", piece_size=None, grad=True, positions=False, params=None, perturb=False, extra=0)
#: (case, what rank 1 calls with instead, what the error must name); rank 0 keeps BASE (with ``same``)
CASES = [
    ("spec", dict(spec="vanilla"), "the spec"),
    ("transform parameters", dict(perturb=True), "the transform parameters"),
    ("balanced", dict(balanced=False), "balanced"),
    ("piece_size", dict(grad=False, piece_size=2), "piece_size"),
    ("method", dict(method="allgather"), "method"),
    ("grad mode", dict(grad=False), "gradients"),
    ("requires_grad", dict(grad="q only"), "gradients"),
    ("dtype", dict(dtype=torch.float32), "dtype"),
    ("lengths", dict(extra=1), "the sequence length"),
    ("heads", dict(heads=4), "heads"),
    ("positions", dict(positions=True), "positions"),
]
#: what rank 0 calls with in a case, where it is not BASE (the same spec with parameters; both without gradients)
SAME = {"transform parameters": dict(spec="alibi-learnable", params=True), "piece_size": dict(grad=False,
                                                                                              piece_size=4)}
DEADLINE_S = 240  # spawning, importing torch and every case, on a slow shared machine
CASE_LIMIT_S = 10  # one refusal: a few milliseconds of work


def _inputs(opts, rank):
    """The rank's q, k, v (and the whole sequence's, for the reference), parameters and positions."""
    n = opts["n"]
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, d = 1, opts["heads"], opts["kv_heads"], opts["head_dim"]
    q, k, v = (torch.randn(b, x, n, d, generator=gen, dtype=torch.float64).to(opts["dtype"]) for x in (h, hkv, hkv))
    layout = Layout(n, opts["world"], opts["balanced"])
    local = [layout.shard(t, rank) for t in (q, k, v)]
    if opts["extra"]:
        local = [torch.cat([t, t[:, :, :opts["extra"]]], dim=2) for t in local]
    params = None
    if opts["params"] or opts["perturb"]:
        variant = attnzoo.compile(opts["spec"])
        params = {key: t.to(opts["dtype"]) for key, t in
                  variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv).items()}
        if opts["perturb"]:
            key = sorted(params)[0]
            params[key] = params[key].clone()
            params[key].view(-1)[0] += 1e-3
    grad = opts["grad"]
    if grad:
        for i, t in enumerate(local):
            t.requires_grad_(grad is True or i == 0)
    positions = layout.positions(rank) if opts["positions"] else None
    return (q, k, v), local, params, positions


def _call(opts, rank):
    (q, k, v), local, params, positions = _inputs(opts, rank)
    cp = ContextParallel(opts["spec"], balanced=opts["balanced"], method=opts["method"], block_size=4,
                         piece_size=opts["piece_size"])
    with torch.set_grad_enabled(bool(opts["grad"])):
        out = cp(*local, params=params, positions=positions)
    return out, (q, k, v), params


def _record(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _worker(rank, store, out_dir):
    torch.set_num_threads(1)
    # a collective left waiting (the failure this tests against) times out instead of waiting forever
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    path = out_dir / f"rank{rank}.jsonl"
    try:
        for name, changed, _ in CASES:
            opts = {**BASE, **SAME.get(name, {}), **(changed if rank == 1 else {})}
            start = time.perf_counter()
            try:
                _call(opts, rank)
                row = {"case": name, "error": None, "message": "returned"}
            except Exception as exc:  # noqa: BLE001 - any other error is a failure the parent reports
                row = {"case": name, "error": type(exc).__name__, "message": str(exc)}
                if not isinstance(exc, RankDisagreementError):
                    row["traceback"] = traceback.format_exc()[-2000:]
            row["seconds"] = time.perf_counter() - start
            _record(path, row)
        # after every refusal the group still works: agreeing ranks give the unsharded result
        start = time.perf_counter()
        opts = {**BASE, "spec": "alibi-learnable", "params": True}
        out, (q, k, v), params = _call(opts, rank)
        truth = attnzoo.compile("alibi-learnable", backend="reference")(q, k, v, params=params)
        agrees = torch.allclose(out.detach(), Layout(opts["n"], WORLD).shard(truth, rank), rtol=1e-9, atol=1e-11)
        _record(path, {"case": "agreeing ranks", "error": None, "message": f"equal to the reference: {agrees}",
                       "agrees": agrees, "seconds": time.perf_counter() - start})
    finally:
        dist.destroy_process_group()


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_disagreeing_ranks_raise_one_line_on_every_rank(tmp_path):
    context = mp.start_processes(_worker, args=(tmp_path / "store", tmp_path), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    crashed = None
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                break
    except Exception as exc:  # noqa: BLE001 - a rank aborted (gloo's collective mismatch) or raised
        crashed = exc
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    rows = [{r["case"]: r for r in _rows(tmp_path / f"rank{rank}.jsonl")} for rank in range(WORLD)]
    done = [name for name, *_ in CASES if all(name in rows[r] for r in range(WORLD))]
    report = "; ".join(f"{name}: " + " | ".join(f"rank {r}: {rows[r][name]['error']}: {rows[r][name]['message']}"
                                                  for r in range(WORLD)) for name in done)
    missing = [name for name, *_ in CASES if name not in done]
    assert not missing, (f"no result for {missing} (the first hung or aborted: {crashed or 'deadline passed'}); "
                         f"recorded: {report}")
    failures = []
    for name, _, needle in CASES:
        got = [rows[r][name] for r in range(WORLD)]
        for r, row in enumerate(got):
            message = row["message"]
            if row["error"] != "RankDisagreementError":
                failures.append(f"{name}: rank {r} {row['error']}: {message} {row.get('traceback', '')}")
            elif "\n" in message or needle not in message or "rank 0" not in message or "rank 1" not in message:
                failures.append(f"{name}: rank {r}'s line does not name {needle!r} and both ranks: {message}")
            if row["seconds"] > CASE_LIMIT_S:
                failures.append(f"{name}: rank {r} took {row['seconds']:.1f} s")
        if got[0]["message"] != got[1]["message"]:
            failures.append(f"{name}: the ranks' lines differ: {got[0]['message']!r} vs {got[1]['message']!r}")
    for r in range(WORLD):
        final = rows[r].get("agreeing ranks")
        if final is None or not final["agrees"]:
            failures.append(f"agreeing ranks after the refusals, rank {r}: {final}")
    assert not failures, "\n".join(failures)
    assert crashed is None, crashed


@pytest.mark.parametrize("world", [1])
def test_one_rank_needs_no_agreement(world, tmp_path):
    """A world of one rank (the docs' examples) runs as before: its fingerprint is compared with itself only."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=world)
    try:
        out, (q, k, v), params = _call({**BASE, "world": world, "spec": "alibi-learnable", "params": True}, 0)
    finally:
        dist.destroy_process_group()
    truth = attnzoo.compile("alibi-learnable", backend="reference")(q, k, v, params=params)
    assert torch.allclose(out.detach(), truth, rtol=1e-9, atol=1e-11)

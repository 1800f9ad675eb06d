"""Context-parallel attention whose pairs are the triton backend's generated kernels (attnzoo/distributed/
kernel_pairs.py), checked on the CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; the
spawned ranks inherit it): 2 gloo ranks in float32 against the float64 reference (outputs, q/k/v gradients and
every transform parameter's, summed over the ranks), with GQA, batch 2, positions with gaps, a sliding window
that crosses the chunks (pairs with rows that see no key), a forward in pieces, float16 (as close as the whole
sequence's triton run), and a planted bug (the gradient of
the chunks' carries dropped) that the comparison catches. One process group (starting a rank costs seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned import finish

import attnzoo
from attnzoo.distributed import ContextParallel, Layout, sum_gradients

pytestmark = [pytest.mark.distributed, pytest.mark.interpreter]

pytest.importorskip("triton")

#: a window of 6 over 4 chunks of 7-8 tokens: masks across the shard boundaries, and pairs where some queries
#: see no key at all; with learnable ALiBi slopes (the kernels' packed parameters), a soft cap and a sink (joined
#: outside the pairs)
WINDOWED = {"name": "alibi-softcap-sink-window", "attention": {"causal": True},
            "transforms": [{"kind": "alibi_learnable"}, {"kind": "softcap", "cap": 5.0},
                           {"kind": "attention_sink", "value": 0.0}, {"kind": "sliding_window", "window": 6}]}
SPECS = ["selective-ssa", WINDOWED]
N, BATCH, HEADS, KV_HEADS, HEAD_DIM = 29, 2, 4, 2, 8
TOL = dict(rtol=1e-4, atol=5e-5)  # float32 kernels against the float64 reference


def _tensors(name, variant):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))

    def normal(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    t = {"q": normal(BATCH, HEADS, N, HEAD_DIM), "k": normal(BATCH, KV_HEADS, N, HEAD_DIM),
         "v": normal(BATCH, KV_HEADS, N, HEAD_DIM), "cot": normal(BATCH, HEADS, N, HEAD_DIM)}
    init = variant.init_params(num_heads=HEADS, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, dtype=torch.float64)
    params = {key: init[key] + 0.3 * normal(*init[key].shape) for key in sorted(init)}
    steps = torch.randint(1, 3, (BATCH, N), generator=gen)
    steps[:, 0] = 1
    return t, params, steps.cumsum(-1)  # row 0 starts at BOS, both with gaps


def _check(spec, rank, world, dropped=False):
    """Mismatches of the sharded triton pairs against the reference, on this rank; ``dropped``: with the
    gradient of every pair's incoming carry zeroed (a planted bug)."""
    from attnzoo.backends.triton import backend as triton_backend

    reference = attnzoo.compile(spec, backend="reference")
    name = reference.spec.name
    t, params, positions = _tensors(name, reference)
    q, k, v = (t[x].clone().requires_grad_() for x in "qkv")
    p_ref = {key: value.clone().requires_grad_() for key, value in params.items()}
    out = reference(q, k, v, params=p_ref, positions=positions)
    wrt = [q, k, v, *p_ref.values()]
    truth = torch.autograd.grad(out, wrt, t["cot"], allow_unused=True)
    truth = [g if g is not None else torch.zeros_like(x) for g, x in zip(truth, wrt, strict=True)]

    layout = Layout(N, world)
    cp = ContextParallel(spec, backend="triton", method="ring", block_size=4)
    ql, kl, vl = (layout.shard(t[x], rank).float().requires_grad_() for x in "qkv")
    pl = {key: torch.nn.Parameter(value.float()) for key, value in params.items()}
    pos_l = layout.shard(positions, rank, dim=-1)
    backward = triton_backend._Run.backward

    def dropping(self, *args):
        result = backward(self, *args)
        if self.dcarry is not None:
            self.dcarry = torch.zeros_like(self.dcarry)
        return result

    if dropped:
        triton_backend._Run.backward = dropping
    try:
        got = cp(ql, kl, vl, params=pl, positions=pos_l)
        got.backward(layout.shard(t["cot"], rank).float())
    finally:
        triton_backend._Run.backward = backward
    sum_gradients(pl.values())

    def close(a, b):
        return a.shape == b.shape and torch.allclose(a.double(), b, **TOL)

    bad = [] if cp.last_pairs == "triton" else [f"pairs {cp.last_pairs}"]
    if not close(got.detach(), layout.shard(out.detach(), rank)):
        bad.append("out")
    with torch.no_grad():  # other ranks' keys in pieces of 3 tokens
        lean = ContextParallel(spec, backend="triton", method="ring", block_size=4, piece_size=3)(
            ql, kl, vl, params=pl, positions=pos_l)
    if not close(lean, layout.shard(out.detach(), rank)):
        bad.append("out without gradients, in pieces")
    for label, x, g in zip("qkv", (ql, kl, vl), truth[:3], strict=True):
        if not close(x.grad, layout.shard(g, rank)):
            bad.append(f"grad.{label}")
    for (key, p), g in zip(pl.items(), truth[3:], strict=True):
        if not close(p.grad if p.grad is not None else torch.zeros_like(p), g):
            bad.append(f"grad.param.{key}")
    return bad


def _check_half(rank, world):
    """float16: the sharded triton pairs are as close to the float64 reference as the triton backend on the whole
    sequence in float16 is (within 2x, plus 1e-3), for the output and the q/k/v gradients."""
    spec = "selective-ssa"
    reference = attnzoo.compile(spec, backend="reference")
    t, params, positions = _tensors("half " + spec, reference)
    layout = Layout(N, world)

    def run(fn, tensors, pos, dtype):
        q, k, v = (tensors[x].detach().to(dtype).clone().requires_grad_() for x in "qkv")
        out = fn(q, k, v, params={key: p.float() if dtype != torch.float64 else p for key, p in params.items()},
                 positions=pos)
        out.backward(tensors["cot"].to(dtype))
        return [out.detach(), q.grad, k.grad, v.grad]

    truth = [layout.shard(x, rank) for x in run(reference, t, positions, torch.float64)]
    whole = [layout.shard(x, rank) for x in run(attnzoo.compile(spec, backend="triton"), t, positions,
                                                 torch.float16)]
    mine = {x: layout.shard(t[x], rank) for x in ("q", "k", "v", "cot")}
    cp = ContextParallel(spec, backend="triton", method="ring", block_size=4)
    got = run(cp, mine, layout.shard(positions, rank, dim=-1), torch.float16)
    bad = []
    for label, g, w, r in zip(("out", "grad.q", "grad.k", "grad.v"), got, whole, truth, strict=True):
        err, base = (g.double() - r).abs().max(), (w.double() - r).abs().max()
        if g.dtype != torch.float16 or not err <= 2 * base + 1e-3:
            bad.append(f"float16 {label}: {float(err):.1e} against the whole sequence's {float(base):.1e}")
    return bad


def _check_declines(rank, world):
    """The triton pairs decline in one line where the kernels cannot run the call; ``auto`` on the CPU keeps the
    CPU pairs."""
    bad = []
    x = torch.randn(1, 2, Layout(8, world).local_size(rank), 4)
    for spec, dtype, needle in (("forgetting", torch.float32, "per-token features"),
                                ("vanilla", torch.float64, "float64")):
        try:
            ContextParallel(spec, backend="triton")(x.to(dtype), x.to(dtype), x.to(dtype))
            bad.append(f"{spec} {dtype}: not declined")
        except attnzoo.UnsupportedError as exc:
            if needle not in str(exc) or "\n" in str(exc) or "'triton'" not in str(exc):
                bad.append(f"{spec} {dtype}: {exc}")
    auto = ContextParallel("selective")
    auto(x, x, x)
    if auto.last_pairs != "fused":
        bad.append(f"auto on the CPU: {auto.last_pairs}")
    return bad


def _worker(rank, world, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    failures = []
    try:
        for spec in SPECS:
            name = spec if isinstance(spec, str) else spec["name"]
            failures += [f"{name}: {m}" for m in _check(spec, rank, world)]
        caught = _check("selective", rank, world, dropped=True)
        if not {"grad.q", "grad.k"} & set(caught):
            failures.append(f"the dropped carry gradient went unnoticed ({caught})")
        failures += _check_half(rank, world) + _check_declines(rank, world)
    finally:
        dist.destroy_process_group()
    finish(out_dir / f"rank{rank}.json", failures)


def test_triton_pairs_equal_the_reference(tmp_path):
    mp.start_processes(_worker, args=(2, tmp_path / "store", tmp_path), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        failures = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert failures == [], f"rank {rank}: {failures[:10]}"


def test_the_gpu_benchmark_script_runs_here():
    """benchmarks/context_parallel_gpu.py (what benchmarks/gpu_check.py runs for context parallelism on a GPU) at
    its smoke sizes in the interpreter: 2 ranks on the triton pairs agree with the whole-sequence triton run."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "context_parallel_gpu.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--smoke", "--specs", "selective"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["pairs"] == "triton" and row["group"] == "gloo"
    assert row["max_relative_error"] < 1e-5
    assert row["cp_fwd_bwd_ms"] > 0 and row["whole_fwd_bwd_ms"] > 0

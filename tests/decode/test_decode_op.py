"""The fused decoding steps as torch ops (issue 41, "The C step as a torch op"): a schema that names every argument
and the buffers it writes, from one definition (attnzoo/decode/layout.py); a fake kernel, so torch.compile keeps a
decode loop through the op in one graph; the library built once into the build cache and loaded from it by the
next process; a tensor the op cannot take refused with one line before it reads anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attnzoo.decode import layout

B, H, HKV, D, M = 3, 4, 2, 8, 6


def _scoring_case(dtype=torch.float64, steps=5):
    torch.manual_seed(3)
    q = torch.randn(B, H, steps, D, dtype=dtype)
    k, v = (torch.randn(B, HKV, steps, D, dtype=dtype) for _ in range(2))
    keys, values = (torch.randn(B, HKV, M + 1, D, dtype=dtype) for _ in range(2))
    positions = torch.arange(M + 1).repeat(B, HKV, 1)
    scores = torch.rand(B, HKV, M + 1, dtype=dtype)
    nexts = torch.tensor([M, M + 3, M + 7])
    return (q, k, v), [keys, values, positions, scores, nexts]


def _loop(op, q, k, v, keys, values, positions, scores, nexts):
    """A decode loop through the op: H2O's step (recent window 2) for every token of q, k, v."""
    outs = []
    for t in range(q.shape[2]):
        outs.append(op(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], 0, nexts, keys, values, positions,
                       scores, M, 0.35, False, 2))
    return torch.stack(outs)


def test_the_schema_names_every_argument_and_the_buffers_it_writes(ops):
    for kernel, name in layout.KERNELS.items():
        schema = ops.op(kernel)._schema
        assert str(schema) == f"{ops.namespace}::{layout.schema(name)}"
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == {"nexts", "keys", "values", "positions"} | ({"scores"} if "scores" in
                                                                       [a.name for a in schema.arguments] else set())
    assert "positions, Tensor(d!) scores, int held, float scale, bool tova, int recent" in \
        str(ops.op("scoring")._schema)


def test_the_fake_kernel_gives_the_output_shape(ops):
    op = ops.op("scoring")
    (q, k, v), buffers = _scoring_case(steps=1)
    with FakeTensorMode() as mode:
        fq, fk, fv, *fb = (mode.from_tensor(t) for t in (q, k, v, *buffers))
        out = op(fq, fk, fv, 0, fb[4], *fb[:4], M, 0.35, False, 2)
    assert out.shape == (B, H, 1, D) and out.dtype == torch.float64 and type(out).__name__ == "FakeTensor"
    with torch.device("meta"):
        out = ops.op("selective")(*(torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)),
                                  5, None, *(torch.empty(t.shape, dtype=t.dtype) for t in buffers[:4]), M, 0.35,
                                  True, 1, 1, 1, True, False)
    assert out.shape == (B, H, 1, D) and out.device.type == "meta"


def test_torch_compile_keeps_a_decode_loop_through_the_op_in_one_graph(ops):
    """fullgraph=True fails on any graph break; the compiled loop decodes what the eager one does, buffers, scores,
    positions and each row's next position included."""
    torch._dynamo.reset()
    op = ops.op("scoring")
    (q, k, v), buffers = _scoring_case()
    eager = [t.clone() for t in buffers]
    compiled = [t.clone() for t in buffers]
    want = _loop(op, q, k, v, *eager)
    explained = torch._dynamo.explain(lambda *a: _loop(op, *a))(q, k, v, *[t.clone() for t in buffers])
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    got = torch.compile(lambda *a: _loop(op, *a), fullgraph=True, backend="aot_eager")(q, k, v, *compiled)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(compiled[4], buffers[4] + q.shape[2])


def test_the_op_refuses_what_it_cannot_take_before_reading_it(ops):
    op = ops.op("scoring")
    (q, k, v), buffers = _scoring_case(steps=1)
    q.untyped_storage().resize_(8)  # freed under its view
    with pytest.raises(ValueError, match=r"q of shape .* reaches past its storage") as caught:
        op(q, k, v, 0, buffers[4], *buffers[:4], M, 0.35, False, 2)
    assert "\n" not in str(caught.value).strip()
    (q, k, v), buffers = _scoring_case(steps=1)
    before = [t.clone() for t in buffers]
    for bad, text in ((dict(held=M + 1), "keys of shape"), (dict(q=q.float()), "q must be Double"),
                      (dict(keys=buffers[0][:1].expand(B, HKV, M + 1, D)), "keys has elements that share memory"),
                      (dict(positions=buffers[2][:, :, ::2]), "positions")):
        args = dict(q=q, k=k, v=v, next=0, nexts=buffers[4], keys=buffers[0], values=buffers[1],
                    positions=buffers[2], scores=buffers[3], held=M, scale=0.35, tova=False, recent=2) | bad
        with pytest.raises(ValueError, match=text):
            op(**args)
    for a, b in zip(buffers, before, strict=True):
        assert torch.equal(a, b)  # nothing written


def _child(code: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env=env, cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-2000:]
    return json.loads(lines[-1])


_LOAD = ("import json, sys; from attnzoo.decode import fused_build; o = fused_build.library(); "
         "print(json.dumps({'built': None if o is None else o.built, 'status': fused_build.status(), "
         "'cpp_extension': 'torch.utils.cpp_extension' in sys.modules}))")


def test_a_second_process_loads_the_build_without_compiling(ops):
    """The library this process loaded (or built) is in the build cache; another process loads it from there:
    nothing compiled (cpp_extension not even imported), the file untouched."""
    before = os.stat(ops.path).st_mtime_ns
    got = _child(_LOAD, dict(os.environ))
    assert got == {"built": False, "cpp_extension": False, "status": got["status"]}, got
    assert "loaded from the build cache" in got["status"] and os.stat(ops.path).st_mtime_ns == before


def test_a_build_other_users_can_write_is_refused_in_one_line(ops, tmp_path):
    """The cache's trust rules (those of the Triton artifacts): a library another user can write is not loaded,
    with one line saying why, and the torch lean steps run."""
    import shutil

    root = tmp_path / "cache"
    (root / "fused-decode").mkdir(parents=True)
    target = root / "fused-decode" / ops.path.parent.name
    shutil.copytree(ops.path.parent, target)
    (target / ops.path.name).chmod(0o666)
    env = dict(os.environ, ATTNZOO_FUSED_CACHE_DIR=str(root))
    got = _child(_LOAD, env)
    assert got["built"] is None and "other users can write it" in got["status"] and "\n" not in got["status"], got


@pytest.mark.parametrize("spec", ["h2o", "selective-pruned"])
def test_batch_rows_in_parallel_equal_the_python_rule(ops, spec):
    """The op splits batch rows over threads (at::parallel_for): with two threads at B = 8 (rows at different
    offsets after eviction) every step still equals the full path's Python rule."""
    import attnzoo
    from attnzoo.decode.check import check_fast_step

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        found = check_fast_step(attnzoo.compile(spec, backend="blocked"), budget=6, batch=8, steps=24)
    finally:
        torch.set_num_threads(threads)
    assert found["kinds"] == ["fused"]

"""The triton backend under Triton's interpreter (conftest sets TRITON_INTERPRET=1): generated source, the
artifact cache, and the kernels against the reference (the conformance suite, and broken lowerings it catches)."""

import json
import multiprocessing
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

from broken import registry_replacing  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.backends.triton import build as builder  # noqa: E402
from attnzoo.backends.triton import codegen  # noqa: E402
from attnzoo.cli import main  # noqa: E402
from attnzoo.conformance import checks, runner  # noqa: E402
from attnzoo.plan import Plan  # noqa: E402
from attnzoo.registry import get_registry, new_registry  # noqa: E402
from attnzoo.transforms.base import LogitsTransform, Slot  # noqa: E402
from attnzoo.transforms.logits import Softcap  # noqa: E402
from attnzoo.transforms.lowering import TritonLogits  # noqa: E402

pytestmark = pytest.mark.interpreter


def _plan(name, registry=None):
    registry = registry or get_registry()
    return Plan.from_spec(attnzoo.load_spec(name, registry=registry), registry)


# -- generated source ------------------------------------------------------------------------------------------
def test_same_spec_gives_byte_identical_source():
    first = codegen.generate(_plan("selective-ssa"))
    again = codegen.generate(_plan(attnzoo.load_spec("selective-ssa").model_dump()))
    assert first == again


def test_source_marks_each_fragment_with_its_transform():
    spec = {"name": "mix", "transforms": [{"kind": "softcap", "cap": 20.0}, {"kind": "sliding_window", "window": 8},
                                          {"kind": "selective_mask"}, {"kind": "query_temperature"}]}
    sources = codegen.generate(_plan(spec))
    source = sources["forward"] + sources["backward"]
    assert "_sel_bwd_dk" in sources["backward"] and "_sel_bwd_dk" not in sources["forward"]
    for marker in ("# --- from transform 'softcap' (logits) ---", "# --- from transform 'sliding_window' (mask) ---",
                   "# --- from transform 'selective_mask' (accumulator, selector head 0) ---",
                   "# --- back through 'softcap' ---"):
        assert marker in source
    assert "query_temperature (query)" in source  # row scales are named in the header as the torch prologue
    for part in sources.values():
        compile(part, "kernels.py", "exec")
    plain = codegen.generate(_plan("vanilla"))["forward"]
    assert "def _sel_carry" not in plain and "def _select" not in plain  # no accumulator: none of its kernels


def test_different_options_give_different_source():
    a = codegen.generate(_plan({"name": "a", "transforms": [{"kind": "softcap", "cap": 20.0}]}))
    b = codegen.generate(_plan({"name": "a", "transforms": [{"kind": "softcap", "cap": 30.0}]}))
    assert a != b


class NoLowering(LogitsTransform):
    kind = "no_lowering"
    slot = Slot.LOGITS

    def apply(self, logits, ctx, params):
        return logits * 2


def test_transform_without_lowering_is_declined_by_name():
    module = types.ModuleType("nolow")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(NoLowering))
    reg = new_registry(entry_points=False, extra_plugins=[("nolow", module)])
    spec = {"name": "x", "transforms": [{"kind": "no_lowering"}]}
    reasons = reg.backends["triton"].supports(_plan(spec, reg), torch.device("cpu"), torch.float32, "backward")
    assert reasons == ["transform 'no_lowering' (logits) has no Triton lowering"]
    with pytest.raises(attnzoo.UnsupportedError, match="no_lowering"):
        attnzoo.compile(spec, backend="triton", registry=reg)
    # the plugin's transform still runs on the backends that need no lowering
    q = torch.randn(1, 2, 5, 8)
    attnzoo.compile(spec, backend="blocked", registry=reg)(q, q[:, :1], q[:, :1])


def test_declines_float64_and_interpreter_bfloat16():
    triton_backend = get_registry().backends["triton"]
    plan = _plan("vanilla")
    assert "float64" in triton_backend.supports(plan, torch.device("cpu"), torch.float64, "forward")[0]
    assert "bfloat16" in triton_backend.supports(plan, torch.device("cpu"), torch.bfloat16, "forward")[0]
    assert triton_backend.supports(plan, torch.device("cpu"), torch.float16, "backward") == []


def test_auto_never_picks_the_interpreter():
    assert attnzoo.compile("selective").backend_for("cpu", torch.float32, True).name == "blocked"
    assert "triton     yes (priority -1)" in attnzoo.explain("selective")


def test_cpu_without_interpreter_is_declined():
    code = ("import os, torch, attnzoo; os.environ.pop('TRITON_INTERPRET', None); "
            "from attnzoo.registry import get_registry; from attnzoo.plan import Plan; r = get_registry(); "
            "p = Plan.from_spec(attnzoo.load_spec('vanilla'), r); "
            "print(r.backends['triton'].supports(p, torch.device('cpu'), torch.float32, 'forward'))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "TRITON_INTERPRET=1" in out


# -- build artifacts -----------------------------------------------------------------------------------------------
def test_build_then_cache_hit(tmp_path):
    first = builder.build("selective", root=tmp_path)
    second = builder.build("selective", root=tmp_path)
    assert not first.hit and second.hit
    assert first.key == second.key and first.source_path == second.source_path
    manifest = json.loads((first.directory / "manifest.json").read_text())
    assert manifest["spec"] == "selective" and manifest["spec_hash"] == attnzoo.load_spec("selective").hash
    assert {"attnzoo", "torch", "triton", "generator", "sources"} <= set(manifest)
    generated = codegen.generate(_plan("selective"))
    assert first.path("forward").read_text() == generated["forward"]
    assert first.path("backward").read_text() == generated["backward"]


def test_key_covers_spec_and_versions(tmp_path, monkeypatch):
    spec = attnzoo.load_spec("ssa")
    key = builder.artifact_key(spec)
    assert key != builder.artifact_key(attnzoo.load_spec("ssa-query"))
    monkeypatch.setattr(codegen, "GENERATOR_VERSION", "test-bump")
    assert builder.artifact_key(spec) != key
    monkeypatch.setattr(torch, "__version__", "0.0-test")
    assert builder.artifact_key(spec) != key


def test_an_artifact_is_generated_once_per_process(tmp_path, monkeypatch):
    """The code that runs is generated in the process (docs/triton.md, trust model), once per key: loading both
    parts after a build generates nothing again."""
    builder.build("softcap", root=tmp_path)

    def refuse(plan):
        raise AssertionError("generated again")

    monkeypatch.setattr(codegen, "generate", refuse)
    for part in ("forward", "backward"):
        module = builder.load_kernels("softcap", root=tmp_path, part=part)
        assert hasattr(module, "_fwd" if part == "forward" else "_bwd_dq")


def test_damaged_artifact_is_rebuilt(tmp_path):
    artifact = builder.build("vanilla", root=tmp_path)
    artifact.path("backward").write_text("garbage = True\n")
    again = builder.build("vanilla", root=tmp_path)
    assert not again.hit
    assert again.path("backward").read_text() == codegen.generate(_plan("vanilla"))["backward"]


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNZOO_CACHE_DIR", str(tmp_path / "c"))
    assert builder.cache_dir() == tmp_path / "c"
    assert builder.build("yarn").directory.parent == tmp_path / "c"


def _build_in_process(root):
    return builder.build("selective-ssa", root=root).key


def test_concurrent_builds_of_one_key_agree(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        keys = pool.map(_build_in_process, [tmp_path] * 4)
    assert len(set(keys)) == 1
    artifact = builder.build("selective-ssa", root=tmp_path)
    assert artifact.hit  # whole, with a manifest that matches its source
    leftovers = [p.name for p in artifact.directory.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


def test_cli_build(tmp_path, capsys):
    assert main(["build", "vanilla", "selective", "--cache-dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["hit"] for r in rows] == [False, False]
    assert all(r["load_ms"] is not None and r["load_backward_ms"] is not None for r in rows)
    assert main(["build", "vanilla", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hit"] is True
    assert main(["build", "no-such-spec", "--cache-dir", str(tmp_path)]) == 2
    assert "no-such-spec" in capsys.readouterr().err


# -- the kernels against the reference ----------------------------------------------------------------------------
# the interpreter is slow: N = 127 (D = 16, the same BLOCK_D as D = 8) adds blocks that N = 63 already crosses
SMALL_SHAPES = tuple(s for s in checks.DIFFERENTIAL_SHAPES if s.length < 300 and s.id != "n127")


def _triton_cases(specs, dtype, shapes, registry=None):
    """The conformance cases of the triton backend, restricted to ``shapes`` for the differential checks."""
    registry = registry or get_registry()
    cases = runner.build_cases(registry, specs, ["triton"], (dtype,))
    keep = {f"outputs/{s.id}" for s in shapes} | {f"gradients/{s.id}" for s in shapes}
    # packed input (N = 264) takes 20-40 s per spec in the interpreter: test_packed_documents runs a sample,
    # `make conformance-triton` every spec
    return [c for c in cases if not c.check.startswith(("outputs/", "gradients/", "packed/")) or c.check in keep]


def _kernel_body(name):
    plan = _plan(name)
    return {part: src.split('"""', 2)[2] for part, src in codegen.generate(plan).items()}


#: specs whose kernels are vanilla's, byte for byte (only row maps, computed by the backend's torch prologue),
#: with no evictor or normaliser (which change the launch): they get the vectors, outputs and gradients at two
#: shapes and causality; vanilla itself gets everything
SHARES_VANILLA = {name for name in get_registry().specs if name != "vanilla"
                  and _plan(name).evictor_cls is None and _plan(name).one(Slot.NORMALISER) is None
                  and _plan(name).one(Slot.PROBABILITY) is None and _kernel_body(name) == _kernel_body("vanilla")}
def _launch_key(name):
    """A spec as the kernels and their launch see it: its fields with the evictor's options left out (its kind and
    the budget kept), without name and summary."""
    data = get_registry().specs[name].function()
    if data.get("cache"):
        data["cache"] = {key: data["cache"].get(key) for key in ("evictor", "budget")}
    return json.dumps(data, sort_keys=True)


#: specs that are an earlier shipped spec with other evictor options only (snapkv-span: snapkv's pooling width, which
#: the evictor computes in torch): the same kernels and launch, so the sample of SHARES_VANILLA's checks (the
#: options are checked by the evictor's own tests and the reference backend's conformance suite)
SAME_LAUNCH = {name for name in get_registry().specs
               if any(other < name and _launch_key(other) == _launch_key(name) for other in get_registry().specs)}
#: specs the kernels do not compute (stick-breaking: its key blocks go from the nearest back): declined, with the
#: reason
DECLINED = {name for name in get_registry().specs if codegen.problems(_plan(name))}
_SHARED_CHECKS = ("vectors/", "outputs/gqa-n63", "gradients/gqa-n63", "outputs/offset-gaps-n45",
                  "gradients/offset-gaps-n45", "causality")


def test_specs_sharing_a_launch_differ_in_evictor_options_only():
    assert SAME_LAUNCH == {"snapkv-span"}


def test_specs_sharing_vanillas_kernels_are_the_row_map_ones():
    assert {"ssa", "ssa-query", "ssa-key", "ssa-value", "gated"} <= SHARES_VANILLA
    assert not SHARES_VANILLA & {"selective", "softcap", "alibi", "h2o", "sink", "local"}


@pytest.mark.parametrize("spec", sorted(get_registry().specs))
def test_conformance_float32(spec):
    """Every shipped spec: vectors, outputs and all gradients at N = 1, 63 (GQA), masked rows and offset
    positions, return_accumulated, causality, batch invariance, prefill + decode, the evictor, determinism
    (a sample for the specs whose kernels are vanilla's, :data:`SHARES_VANILLA`). (N = 127, N = 1,030 and
    float16 in full run in `make conformance-triton`.)"""
    cases = _triton_cases([spec], torch.float32, SMALL_SHAPES)
    if spec in DECLINED:
        kind = _plan(spec).one(Slot.PROBABILITY).kind
        results = runner.run_suite(cases)
        assert results and all(r.status == "unsupported" for r in results), [r.message for r in results][:3]
        assert f"transform '{kind}' (probability) takes key blocks in order 'reverse'" in results[0].message
        return
    if spec in SHARES_VANILLA or spec in SAME_LAUNCH:
        cases = [c for c in cases if c.check.startswith(_SHARED_CHECKS)]
    results = runner.run_suite(cases)
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    unsupported = {r.check for r in results if r.status == "unsupported"}
    assert not unsupported - {"decode", "evictor", "evicted-decode", "padded-decode", "fast-step",
                                "accumulated"}, unsupported


@pytest.mark.parametrize("spec", ["selective"])
def test_packed_documents(spec):
    """A packed row of documents 1, 63 and 200 equals each document alone, outputs, gradients and a packed
    prefill with eviction (float32, the interpreter; every spec: benchmarks/results/conformance-triton-packed.md,
    20 s each)."""
    cases = [c for c in runner.build_cases(get_registry(), [spec], ["triton"], (torch.float32,))
             if c.check.startswith("packed/")]
    results = runner.run_suite(cases)
    assert [r.status for r in results] == ["pass", "pass", "pass"], [r.message for r in results]


@pytest.mark.parametrize("spec", ["selective-ssa", "softcap", "h2o"])
def test_conformance_float16(spec):
    results = runner.run_suite(_triton_cases([spec], torch.float16, SMALL_SHAPES))
    failures = [f"{r.id}: {r.message}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    assert {"outputs/offset-gaps-n45", "gradients/offset-gaps-n45", "decode"} <= {
        r.check for r in results if r.status == "pass"}


class WrongSoftcapDerivative(Softcap):
    def triton(self):
        return TritonLogits(forward=super().triton().forward, derivative="1.0")  # forgets the chain rule


def test_suite_catches_a_broken_lowering():
    reg = registry_replacing("softcap", WrongSoftcapDerivative)
    shapes = [s for s in SMALL_SHAPES if s.id == "gqa-n63"]
    results = {r.check: r for r in runner.run_suite(_triton_cases(["softcap"], torch.float32, shapes, reg))}
    assert results["outputs/gqa-n63"].status == "pass"
    assert results["gradients/gqa-n63"].status == "fail"


def test_return_accumulated_matches_reference():
    q, k, v = torch.randn(3, 1, 4, 40, 8)
    params = None
    _, f_ref = attnzoo.compile("selective-ssa", backend="reference")(q, k, v, params=params, return_accumulated=True)
    _, f = attnzoo.compile("selective-ssa", backend="triton")(q, k, v, params=params, return_accumulated=True)
    torch.testing.assert_close(f, f_ref, rtol=1e-5, atol=1e-5)


def test_unwritten_output_would_show_as_nan(monkeypatch):
    """The backend allocates outputs NaN-filled: a kernel that skips a block leaves NaN, which checks reject."""
    from attnzoo.backends.triton import backend as triton_backend

    real = triton_backend._Run.forward

    def skip_last_rows(self, q, k, v, prm):
        out, lse, total, logits = real(self, q, k, v, prm)
        out[:, :, -1] = float("nan")
        return out, lse, total, logits

    monkeypatch.setattr(triton_backend._Run, "forward", skip_last_rows)
    results = runner.run_suite(_triton_cases(["vanilla"], torch.float32, [SMALL_SHAPES[1]]))
    assert {r.check: r.status for r in results}["outputs/gqa-n63"] == "fail"


def test_decoding_with_gradients_is_refused():
    variant = attnzoo.compile("vanilla", backend="triton")
    cache = variant.new_cache(batch=1)
    q = torch.randn(1, 2, 1, 8, requires_grad=True)
    with pytest.raises(ValueError, match="no_grad"):
        variant.decode(q, q.detach(), q.detach(), cache)


@pytest.mark.parametrize("window", [1, 20, 33])
def test_sliding_window_skips_key_blocks_and_matches_reference(window):
    from attnzoo.backends.triton.backend import _window_bounds

    spec = {"name": "w", "transforms": [{"kind": "sliding_window", "window": window}]}
    ref = attnzoo.compile(spec, backend="reference")
    tri = attnzoo.compile(spec, backend="triton")
    positions = torch.arange(1, 151).expand(2, 150)
    bounds = _window_bounds(tri.plan, positions, 32, 32)
    assert bounds is not None and int(bounds[:5].max()) > 0  # later query blocks start past key 0
    _equal_to_the_reference_150(ref, tri)


def _equal_to_the_reference_150(ref, tri):
    """Outputs and q/k/v gradients of a float32 triton run against the float64 reference, 150 tokens, GQA 4/2."""
    q = torch.randn(2, 4, 150, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 150, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cot = torch.randn(2, 4, 150, 16, dtype=torch.float64)
    want = torch.autograd.grad(ref(q, k, v), [q, k, v], cot)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = tri(*leaves)
    torch.testing.assert_close(out.double(), ref(q, k, v).detach(), rtol=0, atol=1e-5)
    got = torch.autograd.grad(out, leaves, cot.float())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-4)
    return q, k, v


@pytest.mark.parametrize("chunk", [1, 40])
def test_chunked_skips_key_blocks_and_matches_reference(chunk):
    """Chunked local attention: each query block's keys start at the key block holding its first query's chunk
    start (``Plan.earliest_key``: a chunk of 40 ends inside a 32-query block), forward and backward equal the
    reference (the mask's integer division: Triton's ``//`` truncates, equal to floor on these non-negative
    positions), and a left-padded prefill then token-by-token decoding equals the batch form."""
    from attnzoo.backends.triton.backend import _window_bounds

    spec = {"name": "c", "transforms": [{"kind": "chunked", "chunk": chunk}]}
    ref = attnzoo.compile(spec, backend="reference")
    tri = attnzoo.compile(spec, backend="triton")
    positions = torch.arange(1, 151).expand(2, 150)
    bounds = _window_bounds(tri.plan, positions, 32, 32)
    starts = [(p - 1) // chunk * chunk // 32 * 32 for p in range(1, 151, 32)]  # chunk start's key block, 0-based
    assert bounds is not None and bounds[:5].tolist() == starts
    q, k, v = _equal_to_the_reference_150(ref, tri)

    n = 14
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :2] = False
    pos = mask.long().cumsum(-1).clamp(min=1)
    qd, kd, vd = (t.detach()[:, :, :n] for t in (q, k, v))
    want = ref(qd, kd, vd, positions=pos, key_mask=mask)
    cache = tri.new_cache(2)
    with torch.no_grad():
        outs = [tri.prefill(qd[:, :, :5].float(), kd[:, :, :5].float(), vd[:, :, :5].float(), cache,
                            key_mask=mask[:, :5])]
        for i in range(5, n):
            outs.append(tri.decode(qd[:, :, i:i + 1].float(), kd[:, :, i:i + 1].float(), vd[:, :, i:i + 1].float(),
                                   cache))
            assert cache.num_tokens <= chunk - 1 if chunk > 1 else cache.num_tokens == 0
    got = torch.cat(outs, dim=2).double()
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)


def test_composed_spec_with_parameters_through_the_selector():
    """Logits transforms with a learnable per-head parameter, a window and the accumulator: the selector head's
    logits (and so its parameter) also get gradient through F."""
    spec = {"name": "composed", "transforms": [
        {"kind": "softcap", "cap": 5.0}, {"kind": "constant_temperature"}, {"kind": "sliding_window", "window": 40},
        {"kind": "selective_mask", "selector_head": 1}, {"kind": "query_temperature"},
        {"kind": "value_temperature"}]}
    ref = attnzoo.compile(spec, backend="reference")
    tri = attnzoo.compile(spec, backend="triton")
    params = {k: v + 0.2 * torch.randn_like(v) for k, v in
              ref.init_params(num_heads=4, head_dim=16, num_kv_heads=2, dtype=torch.float64).items()}
    q = 2 * torch.randn(2, 4, 70, 16, dtype=torch.float64)
    k, v = (2 * torch.randn(2, 2, 70, 16, dtype=torch.float64) for _ in range(2))
    cot = torch.randn(2, 4, 70, 16, dtype=torch.float64)

    def grads(variant, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        ps = {key: p.to(dtype).requires_grad_() for key, p in params.items()}
        out = variant(*leaves, params=ps)
        return [out.detach(), *torch.autograd.grad(out, [*leaves, *ps.values()], cot.to(dtype))]

    want, got = grads(ref, torch.float64), grads(tri, torch.float32)
    names = ["out", "q", "k", "v", *params]
    for name, w, g in zip(names, want, got, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=name)


def test_compile_for_a_gpu_without_one(tmp_path):
    """Build-time compilation, as far as a CPU allows: Triton's GPU compiler (down to a cubin with its bundled
    ptxas) takes every kernel variant the backend launches for a spec with an accumulator and a learnable logits
    parameter, stores it in the artifact, and, installed into a fresh Triton cache, each launch the backend makes
    on that GPU is found there (Triton's own lookup: nothing is compiled); a launch that was not compiled at
    build time (another head dim) gets the warning that names it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ATTNZOO_CACHE_DIR"] = str(tmp_path)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    spec = tmp_path / "composed.yaml"
    spec.write_text("name: composed\ntransforms:\n  - {kind: constant_temperature}\n  - {kind: softcap, cap: 30.0}\n"
                    "  - {kind: selective_mask}\n  - {kind: query_temperature}\n")
    done = subprocess.run([sys.executable, "-m", "attnzoo.cli", "build", str(spec), "--compile-for", "sm_90",
                           "--dtype", "float16", "--head-dim", "64", "--json"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout)
    kernels = row["compiled"]
    assert {k["kernel"] for k in kernels} == {"_fwd", "_decode", "_sel_carry", "_bwd_dkdv", "_bwd_dq",
                                              "_sel_bwd_dk", "_sel_bwd_dq"}
    assert all(k["error"] is None and 0 < k["shared"] <= k["limit"] for k in kernels), kernels
    cases = {case for k in kernels for case in k["cases"]}
    assert cases == {"batch", "batch with key mask", "prefill", "decode"}
    index = json.loads(next(tmp_path.glob("*/compiled/sm_90/index.json")).read_text())
    assert set(index["entries"]) == {k["hash"] for k in kernels}

    check = os.path.join(os.path.dirname(__file__), os.pardir, "data", "aot", "check_runtime.py")
    done = subprocess.run([sys.executable, check, str(spec)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert "robustness ok" in done.stdout
    assert result["installed"] == len(kernels)
    assert len(result["hits"]) == result["launches"] >= len(kernels) and all(result["hits"]), result
    assert result["warnings_compiled"] == []
    (warning,) = result["warnings_missing"]
    assert warning.startswith("KernelCompileWarning: attnzoo triton: spec 'composed' kernel _sel_carry[")
    assert "BLOCK_D=32" in warning and f"not among the {len(kernels)} kernels compiled for sm_90" in warning
    assert warning.endswith("attnzoo build composed --compile-for 90 --dtype float16 --head-dim 32")


def test_compile_for_refuses_the_interpreter():
    assert main(["build", "vanilla", "--compile-for", "90"]) == 2


def test_gpu_check_runs_the_conformance_suite(capsys):
    """benchmarks/gpu_check.py holds the kernels to the conformance suite itself (here in the interpreter)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    failures = gpu_check.run_checks(["selective"], torch.device("cpu"), [torch.float32], smoke=True)
    assert failures == {"selective": []}
    out = capsys.readouterr().out
    assert f"({len(gpu_check.SMOKE_CHECKS)} pass)" in out

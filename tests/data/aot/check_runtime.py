"""Run by tests/backends/test_triton.py in a process without TRITON_INTERPRET, after ``attnzoo build SPEC --compile-for 90
--dtype float16 --head-dim 64`` into $ATTNZOO_CACHE_DIR. Prints one JSON line:

- ``hits``: for every launch the backend makes for (float16, D = 64) on sm_90, whether ``triton.compile`` found it
  in a fresh Triton cache after :func:`aot.install` (what Triton's launcher calls on a GPU; True: nothing compiled);
- ``seconds``: the time of those lookups;
- ``warnings``: what the compile hook says for a launch that was not compiled at build time (D = 32), and for the
  D = 64 launches (nothing).
"""

import json
import os
import sys
import tempfile
import time
import warnings

import torch
import triton
from triton import knobs
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

from attnzoo.backends.triton import aot
from attnzoo.backends.triton.backend import TritonBackend
from attnzoo.backends.triton.build import SOURCES, build, kernel_module_name
from attnzoo.plan import Plan
from attnzoo.registry import get_registry
from attnzoo.spec import load_spec

registry = get_registry()
plan = Plan.from_spec(load_spec(sys.argv[1], registry=registry), registry)
backend = TritonBackend()
artifact = build(plan.spec, plan=plan)
launches = aot.capture(backend, plan, 90, torch.float16, 64, registry)
fresh = tempfile.mkdtemp()
installed = aot.install(artifact.directory, 90, [kernel_module_name(artifact.key, p, False) for p in SOURCES],
                        plan.spec.name, cache_dir=fresh)
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
start = time.perf_counter()
with aot.triton_cache(fresh):
    for launch in launches:
        comp = aot.specialise(launch, 90)
        triton.compile(comp.src, target=comp.target, options=comp.options.__dict__)
seconds = time.perf_counter() - start
knobs.compilation.listener = None


def hook_says(launch, head_dim):
    """What the compile hook warns when Triton's launcher is about to compile ``launch`` (the arguments Triton
    gives it, made by Triton's own _call_hook)."""
    fn, target = launch.fn, aot.gpu_target(90)
    back = make_backend(target)
    kwargs = dict(launch.kwargs, debug=knobs.runtime.debug, instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    bound, spec, extra = create_function_from_signature(fn.signature, fn.params, back)(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(back, kwargs, bound, spec, extra)
    aot.CALL.case = (torch.float16, head_dim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn._call_hook(knobs.runtime.jit_cache_hook, compute_cache_key({}, spec, extra), signature, target, 0,
                      constexprs, options, [attrs], False)
    return [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, aot.KernelCompileWarning)]


other = aot.capture(backend, plan, 90, torch.float16, 32, registry)
print(json.dumps({"installed": installed, "launches": len(launches), "hits": hits, "seconds": seconds,
                  "warnings_compiled": [m for launch in launches for m in hook_says(launch, 64)],
                  "warnings_missing": hook_says(other[0], 32)}))


# a check that breaks (here: specialisation data Triton no longer writes) warns and never stops the compilation
broken = aot._Expected("composed", 90, set(), "not among the kernels")
aot._EXPECTED["broken_module"] = broken
info = type("Info", (), {"module": "broken_module", "name": "_fwd", "jit_function": launches[0].fn})()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = aot._on_compile(key="k", repr="r", fn=info, compile={"specialization_data": "{}"},
                             is_manual_warmup=False, already_compiled=False)
assert result is None and any("could not check" in str(w.message) for w in caught), [str(w.message) for w in caught]
# a Triton cache that cannot be written (under a regular file, which fails for root too): nothing installed, and
# the reason kept for the warning
blocker = os.path.join(tempfile.mkdtemp(), "a-file")
open(blocker, "w").close()
count = aot.install(artifact.directory, 90, ["unwritable_module"], plan.spec.name,
                    cache_dir=os.path.join(blocker, "cache"))
assert count == 0 and "not installed" in aot._EXPECTED["unwritable_module"].why_missing
print("robustness ok")

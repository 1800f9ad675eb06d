import os
import tempfile

import platformdirs

# Triton kernels run in Triton's interpreter on CPU; the flag is read when kernels are defined, so set it before
# any generated kernel module loads. Artifacts go to a per-run directory, not the user's cache.
os.environ.setdefault("TRITON_INTERPRET", "1")
# the real model (`attnzoo model smollm2`: ~540 MB, converted once in about 20 s) is read from the user's own models
# folder, where the command and the benchmarks keep it, not converted again into each run's directory
os.environ.setdefault("ATTNZOO_MODEL_DIR", os.path.join(
    os.environ.get("ATTNZOO_CACHE_DIR") or platformdirs.user_cache_dir("attnzoo"), "models"))
os.environ.setdefault("ATTNZOO_CACHE_DIR", tempfile.mkdtemp(prefix="attnzoo-test-cache-"))
# the fused decoding steps' library (built by torch.utils.cpp_extension, ~30 s) is keyed by its sources, flags,
# compiler, torch and CPU: a per-user directory keeps one build for every test run on this machine
os.environ.setdefault("ATTNZOO_FUSED_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"attnzoo-fused-{os.getuid()}"))

# xdist runs one worker per core: torch's default of one thread per core in every worker (and in the process groups
# the distributed tests spawn) oversubscribes the cores, and OpenMP's spinning barriers then make small-tensor tests
# ten times slower. One thread per worker; the tests of threaded code set their own count.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rand(*shape, dtype=torch.float64, requires_grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _fused_ops():
    """The fused decoding steps' ops (attnzoo/decode/fused_build.py), built or loaded; a skip where no C++ compiler
    can build them, a failure with the status line where one could and did not."""
    from attnzoo.decode import fused_build

    found = fused_build.library()
    if found is None:
        if fused_build._compiler() is None:
            pytest.skip("no C++ compiler: the fused decoding steps cannot be built here")
        pytest.fail(fused_build.status())
    return found


@pytest.fixture(scope="module")
def ops():
    return _fused_ops()


@pytest.fixture(scope="module")
def smollm2_cached():
    """The real model's checked cache folder (`attnzoo model smollm2`), converted here if it can be; the test is
    skipped, with why, where it is neither cached nor convertible."""
    from attnzoo.integrations.transformers import models

    try:
        return models.ensure(models.SMOLLM2, progress=False)
    except models.ModelError as exc:
        pytest.skip(f"SmolLM2 is not cached and cannot be converted here: {exc}")


@pytest.fixture(params=["fused", "torch"])
def lean_kind(request, monkeypatch):
    """The evicting lean steps in both forms: fused in C++ (torch ops, built once per machine into the build cache)
    and the torch operations that define them. A machine with a C++ compiler must build the fused steps."""
    from attnzoo.decode import fused_build

    if request.param == "torch":
        monkeypatch.setattr(fused_build, "_LOADED", (None, "switched off in this test"))
    else:
        _fused_ops()
    return request.param


TIERS = ("slow", "interpreter", "distributed", "subprocess", "release")


def pytest_collection_modifyitems(config, items):
    """Tiers (pyproject.toml's markers, docs/testing.md): a file marks its tier with ``pytestmark``, a single test
    with a decorator; a test that runs the conformance suite is ``slow`` wherever it lives. ``make test-fast``
    runs what carries no tier mark."""
    for item in items:
        if "conformance" in item.name and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.slow)

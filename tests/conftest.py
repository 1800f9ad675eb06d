import os
import tempfile

# Triton kernels run in Triton's interpreter on CPU; the flag is read when kernels are defined, so set it before
# any generated kernel module loads. Artifacts go to a per-run directory, not the user's cache.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ATTNZOO_CACHE_DIR", tempfile.mkdtemp(prefix="attnzoo-test-cache-"))

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rand(*shape, dtype=torch.float64, requires_grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(requires_grad)


@pytest.fixture(params=["fused", "torch"])
def lean_kind(request, monkeypatch):
    """The evicting lean steps in both forms: fused in C (compiled once per process) and the torch operations
    that define them. A machine with a C compiler must compile the fused steps."""
    from attnzoo.decode import fused as fused_decode

    if request.param == "torch":
        monkeypatch.setattr(fused_decode, "_LOADED", (None, "switched off in this test"))
    elif fused_decode.library() is None:
        if fused_decode._compiler() is None:
            pytest.skip("no C compiler: the fused decoding steps cannot be built here")
        pytest.fail(fused_decode.status())
    return request.param


TIERS = ("slow", "interpreter", "distributed", "subprocess", "release")


def pytest_collection_modifyitems(config, items):
    """Tiers (pyproject.toml's markers, docs/testing.md): a file marks its tier with ``pytestmark``, a single test
    with a decorator; a test that runs the conformance suite is ``slow`` wherever it lives. ``make test-fast``
    runs what carries no tier mark."""
    for item in items:
        if "conformance" in item.name and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.slow)

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

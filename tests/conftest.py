import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rand(*shape, dtype=torch.float64, requires_grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(requires_grad)

"""The positions contract (docs/backends.md): per row, 1-based, strictly increasing (offsets and gaps allowed);
every backend computes those right, and anything else is refused with one line before a backend sees it."""

import pytest
import torch
from conftest import rand

import attnzoo

BACKENDS = ["reference", "blocked", "auto"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["vanilla", "selective", "ssa"])
def test_restarting_positions_are_refused(spec, backend):
    """Two packed documents (1..260 then 1..40): blocked used to slice keys by count and return wrong rows."""
    n = 300
    q, k, v = rand(1, 2, n, 8), rand(1, 2, n, 8), rand(1, 2, n, 8)
    packed = torch.cat([torch.arange(1, 261), torch.arange(1, 41)])
    with pytest.raises(ValueError, match=r"positions must increase strictly .* row 0 goes from 260 to 1 at index 260"):
        attnzoo.compile(spec, backend=backend)(q, k, v, positions=packed)
    with pytest.raises(ValueError, match="increase strictly"):
        attnzoo.compile(spec, backend=backend)(q, k, v, positions=torch.arange(n, 0, -1))
    with pytest.raises(ValueError, match="increase strictly"):
        attnzoo.compile(spec, backend=backend)(q, k, v, positions=torch.ones(n, dtype=torch.long))


@pytest.mark.parametrize("spec", ["vanilla", "selective", "ssa", "local-global", "alibi"])
def test_offsets_and_gaps_match_the_reference(spec):
    """Positions starting near 70,000 with gaps that differ per row, across two 256-query blocks."""
    n = 300
    gaps = torch.stack([1 + torch.arange(n) % 5, 1 + torch.arange(n) % 3])
    positions = 69_990 + gaps.cumsum(-1)
    q, k, v = rand(2, 4, n, 8), rand(2, 2, n, 8), rand(2, 2, n, 8)
    truth = attnzoo.compile(spec, backend="reference")(q, k, v, positions=positions)
    got = attnzoo.compile(spec, backend="blocked")(q, k, v, positions=positions)
    torch.testing.assert_close(got, truth, rtol=1e-9, atol=1e-9)

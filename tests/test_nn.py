"""attnzoo.nn.Attention owns the transforms' parameters and trains them."""

import pytest
import torch

import attnzoo
from attnzoo.nn import Attention


def test_module_matches_functional_form_and_trains_its_parameters():
    layer = Attention("selective-ssa", num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64)
    names = dict(layer.named_parameters())
    assert "transform_params.query_temperature__token_weight" in names
    assert names["transform_params.value_temperature__token_weight"].shape == (2, 8)
    q = torch.randn(2, 4, 19, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 19, 8, dtype=torch.float64)
    want = attnzoo.compile("selective-ssa", backend="reference")(q, k, v, params=layer.params())
    out = layer(q, k, v)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in layer.parameters())
    groups = layer.parameter_groups(lr=0.5)
    assert groups[0]["weight_decay"] == 0.0 and len(groups[0]["params"]) == 4 and groups[0]["lr"] == 0.5


def test_module_decodes_and_round_trips_state_dict():
    layer = Attention("selective-ssa", num_heads=2, head_dim=4)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    clone = Attention("selective-ssa", num_heads=2, head_dim=4)
    assert not torch.equal(clone.params()["query_temperature.token_weight"],
                           layer.params()["query_temperature.token_weight"])
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(1, 2, 10, 4)
    cache = clone.new_cache(batch=1, budget=None)
    steps = torch.cat([clone.decode(x[:, :, i:i + 1], x[:, :, i:i + 1], x[:, :, i:i + 1], cache)
                       for i in range(10)], dim=2)
    torch.testing.assert_close(steps, layer(x, x, x), rtol=1e-5, atol=1e-6)


def graph_size(t: torch.Tensor) -> int:
    """Autograd nodes reachable from ``t`` (through grad_fn.next_functions)."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_decoding_without_no_grad_keeps_no_graph_in_the_cache(backend):
    """Decoding is inference: the cache holds detached rows, positions and F, so the graph behind a step's output
    does not grow with the tokens decoded (it grew 37 -> 397 -> 1,597 nodes at steps 1, 10, 40), while the
    step's own q, k, v and the transform parameters still get gradients."""
    layer = Attention("selective-ssa", num_heads=2, head_dim=4, backend=backend)
    project = torch.nn.Linear(4, 12)  # q, k, v computed from x: they carry graphs of their own
    cache = layer.new_cache(batch=1, budget=None)
    sizes = {}
    for step in range(1, 41):
        q, k, v = project(torch.randn(1, 2, 1, 4)).chunk(3, dim=-1)
        out = layer.decode(q, k, v, cache)
        if step in (1, 10, 40):
            sizes[step] = graph_size(out)
    # the same graph at every step; step 1 has two nodes fewer (its cache is the new rows, not a concatenation)
    assert sizes[10] == sizes[40] and sizes[40] - sizes[1] <= 2, sizes
    held = [cache.keys, cache.values, cache.positions, *cache.state.values()]
    assert all(t.grad_fn is None and not t.requires_grad for t in held)
    out.sum().backward()
    assert project.weight.grad is not None and project.weight.grad.abs().max() > 0
    assert all(p.grad is not None for p in layer.parameters())

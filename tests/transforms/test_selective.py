"""Selective attention (docs/papers.md §2) against hand-computed cases; the known bugs are caught."""

import math

import pytest
import torch
from broken import BosUnprotected, registry_replacing, registry_with_broken_backends

import attnzoo

# Head 0 selects. D = 1 (scale 1): l0[i][j] = Q0[i] * K0[j]
Q0 = [1.0, 1.0, 2.0, -1.0, 1.0]
K0 = [1.0, 2.0, -1.0, 3.0, 0.5]
V0 = [1.0, -1.0, 2.0, 0.5, 3.0]
# Head 1 has all-zero logits, so its attention is exp(-F) over the causal past.
V1 = [1.0, 2.0, 3.0, 4.0, 5.0]

# S[k][j] = ReLU(l0[k][j]) for 1 <= j < k: S[2][1] = 4, S[3][2] = 1, S[4][1] = 2, S[4][3] = 3; F sums rows k < i.
F_DEFAULT = [[0, 0, 0, 0, 0],
             [0, 0, 0, 0, 0],
             [0, 0, 0, 0, 0],
             [0, 4, 0, 0, 0],
             [0, 4, 1, 0, 0]]
# protect_bos: false adds S[k][0] = ReLU(l0[k][0]) for k >= 1: 1, 2, 0, 1
F_BOS = [[0, 0, 0, 0, 0],
         [0, 0, 0, 0, 0],
         [1, 0, 0, 0, 0],
         [3, 4, 0, 0, 0],
         [3, 4, 1, 0, 0]]
# self_mask: true adds S[k][k] = ReLU(l0[k][k]) for k >= 1: 2, 0, 0, 0.5 (only S[1][1] reaches a later row)
F_SELF = [[0, 0, 0, 0, 0],
          [0, 0, 0, 0, 0],
          [0, 2, 0, 0, 0],
          [0, 6, 0, 0, 0],
          [0, 6, 1, 0, 0]]


def tensors():
    q = torch.tensor([Q0, [1.0] * 5], dtype=torch.float64).view(1, 2, 5, 1)
    k = torch.tensor([K0, [0.0] * 5], dtype=torch.float64).view(1, 2, 5, 1)
    v = torch.tensor([V0, V1], dtype=torch.float64).view(1, 2, 5, 1)
    return q, k, v


def selective(**options):
    return {"name": "sel", "transforms": [{"kind": "selective_mask", **options}]}


def run(spec, backend="reference", registry=None):
    q, k, v = tensors()
    out, f = attnzoo.compile(spec, backend=backend, registry=registry)(q, k, v, return_accumulated=True)
    return out[0, :, :, 0], f[0]


def check_hand_case(backend="reference", registry=None):
    out, f = run(selective(), backend, registry)
    assert f.tolist() == F_DEFAULT
    e = math.exp
    # head 1, row 4: weights exp(-F[4]) = [1, e^-4, e^-1, 1, 1]
    want = (1 * 1 + e(-4) * 2 + e(-1) * 3 + 4 + 5) / (1 + e(-4) + e(-1) + 1 + 1)
    assert out[1, 4].item() == pytest.approx(want, abs=1e-14)
    # head 1, row 3: weights [1, e^-4, 1, 1]
    assert out[1, 3].item() == pytest.approx((1 + 2 * e(-4) + 3 + 4) / (3 + e(-4)), abs=1e-14)
    # head 0, row 4: logits l0[4] - F[4] = [1, 2-4, -1-1, 3, 0.5]
    logits = [1.0, -2.0, -2.0, 3.0, 0.5]
    want0 = sum(e(x) * v for x, v in zip(logits, V0, strict=True)) / sum(e(x) for x in logits)
    assert out[0, 4].item() == pytest.approx(want0, abs=1e-14)
    # rows 0..2 have F = 0: head 1 averages its causal past
    assert out[1, :3].tolist() == pytest.approx([1.0, 1.5, 2.0], abs=1e-14)


def test_selection_matrix_and_outputs_hand_case():
    check_hand_case()


def test_bos_and_self_options():
    assert run(selective(protect_bos=False))[1].tolist() == F_BOS
    assert run(selective(self_mask=True))[1].tolist() == F_SELF


def test_selector_head_option():
    q, k, v = tensors()
    variant = attnzoo.compile(selective(selector_head=1))
    _, f = variant(q, k, v, return_accumulated=True)
    assert f.abs().max() == 0  # head 1's logits are all zero: ReLU(0) selects nothing
    with pytest.raises(ValueError, match="selector_head=2 but the call has 2 heads"):
        attnzoo.compile(selective(selector_head=2))(q, k, v)


@pytest.mark.parametrize("backend", ["broken_cumsum_keys", "broken_no_shift"])
def test_wrong_accumulation_axis_or_shift_is_caught(backend):
    with pytest.raises(AssertionError):
        check_hand_case(backend, registry_with_broken_backends())


def test_unprotected_bos_is_caught():
    with pytest.raises(AssertionError):
        check_hand_case(registry=registry_replacing("selective_mask", BosUnprotected))


def test_f_is_shared_by_every_head_and_non_decreasing():
    q, k, v = torch.randn(2, 4, 63, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 63, 8, dtype=torch.float64)
    variant = attnzoo.compile("selective")
    out, f = variant(q, k, v, return_accumulated=True)
    assert f.shape == (2, 63, 63)
    assert bool((f[:, 1:] >= f[:, :-1]).all())  # once masked, a token stays masked
    assert bool((f[:, :, 0] == 0).all())  # BOS never masked
    assert bool((f.triu() == 0).all())  # F[i, j] = 0 for j >= i: only strictly earlier queries count
    # the same F is subtracted in every head: rebuild head 3's output from plain softmax(l - F)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    logits = q[:, 3] @ kk[:, 3].transpose(-1, -2) / math.sqrt(8) - f
    logits = logits.masked_fill(torch.ones(63, 63, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out[:, 3], torch.softmax(logits, -1) @ vv[:, 3], rtol=0, atol=1e-13)


def test_gradients_flow_through_f_into_the_selector_head():
    q = torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    out = attnzoo.attention(q, k, v, "selective")
    out[:, 1].sum().backward()  # only head 1's output: its dependence on head 0 is through F alone
    assert q.grad[:, 0].abs().max() > 0 and k.grad[:, 0].abs().max() > 0


def test_memory_loss_hand_case():
    f1 = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 2.0, 0]], dtype=torch.float64)
    f2 = torch.tensor([[0, 0, 0], [0.5, 0, 0], [0.25, 0.5, 0]], dtype=torch.float64)
    # tau = 0.5: layer 1 M = [1, 2, 3 - 1] -> max 2; layer 2 M = [1, 2 - 1, 3 - (0.5 + 1)] -> max 1.5
    assert attnzoo.memory_counts(f2, tau=0.5).tolist() == [1.0, 1.0, 1.5]
    loss = attnzoo.memory_loss([f1.unsqueeze(0), f2.unsqueeze(0)], tau=0.5, eps=0.1)
    assert loss.item() == pytest.approx(0.1 * (2 + 1.5) / (2 * 3), abs=1e-15)
    # defaults tau = 1, eps = 0.1: layer 1 M = [1, 2, 2]
    assert attnzoo.memory_loss([f1]).item() == pytest.approx(0.1 * 2 / 3, abs=1e-15)


def test_memory_loss_trains_towards_masking():
    q = torch.randn(1, 2, 16, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 16, 4, dtype=torch.float64)
    _, f = attnzoo.compile("selective")(q, k, k, return_accumulated=True)
    attnzoo.memory_loss([f]).backward()
    assert q.grad[:, 0].abs().max() > 0  # the loss reaches the selector head


class SquaredSelection(attnzoo.AccumulatorTransform):
    """A plugin accumulator: S = ReLU(l)^2 on the selector head, BOS and self excluded, written once as the
    transform's selection() and once as its pointwise form (which the fused CPU kernel takes)."""

    kind = "squared_selection"
    slot = attnzoo.Slot.ACCUMULATOR

    def heads(self):
        return [1]

    def selection(self, logits, allowed, ctx, params):
        keep = allowed & (ctx.kpos != 1) & (ctx.kpos != ctx.qpos)
        return torch.where(keep, torch.relu(logits) ** 2, torch.zeros((), dtype=logits.dtype))

    def pointwise(self):
        from attnzoo.transforms.base import PointwiseSelection

        return PointwiseSelection(value=lambda x: torch.relu(x) ** 2, derivative=lambda x: 2 * torch.relu(x),
                                  exclude_first=True, exclude_self=True)


def test_a_plugin_accumulator_with_a_pointwise_selection_takes_the_fused_kernel(monkeypatch):
    """blocked reaches the fused kernel through the accumulator's contract (AccumulatorTransform.pointwise), not
    by knowing selective_mask: a plugin's S = ReLU(l)^2 runs there and equals the reference, outputs and
    gradients (float64, GQA, 3 query blocks)."""
    import types

    from attnzoo.backends import blocked, selective_kernel

    module = types.ModuleType("squared")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(SquaredSelection))
    module.register_backends = attnzoo.hookimpl(lambda register: register(blocked.BlockedBackend(32, "blocked32")))
    reg = attnzoo.new_registry(entry_points=False, extra_plugins=[("squared", module)])
    spec = {"name": "squared", "attention": {"causal": True}, "transforms": [{"kind": "squared_selection"}]}
    calls = []
    fused = selective_kernel.SelectiveCausal.apply
    monkeypatch.setattr(blocked.SelectiveCausal, "apply", lambda *a: calls.append(1) or fused(*a))
    q = torch.randn(2, 4, 70, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 70, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cot = torch.randn(2, 4, 70, 8, dtype=torch.float64)
    results = []
    for backend in ("blocked32", "reference"):
        out = attnzoo.compile(spec, backend=backend, registry=reg)(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), cot)))
    assert calls == [1]
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_the_old_names_of_f_are_gone():
    """F is the accumulated selection: return_accumulated, KVCache.accumulated(), nn.recording_accumulated. The
    names of the unreleased 0.1 that called it "selection" are gone (issue 41)."""
    import attnzoo.nn

    variant = attnzoo.compile("selective")
    q, k, v = torch.randn(3, 1, 2, 9, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="return_selection"):
        variant(q, k, v, return_selection=True)
    assert not hasattr(attnzoo.KVCache, "selection") and not hasattr(attnzoo.nn, "recording_selection")

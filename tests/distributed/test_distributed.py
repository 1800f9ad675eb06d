"""Context-parallel attention (attnzoo.distributed, docs/distributed.md): 2- and 4-rank gloo groups on CPU, in
spawned processes, give the float64 reference's outputs and gradients (q, k, v, every transform parameter summed
over the ranks, per-token inputs) for every shipped spec, at odd lengths, with GQA, batch > 1, given positions
with gaps, both layouts and both exchanges; bad inputs and declined cases raise one line on every rank.

Two process groups in all (importing torch in a fresh process costs seconds): each worker loops over the specs
and cases, records mismatches, and the test reads what every rank recorded."""

from __future__ import annotations

import json
import types
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned import finish

import attnzoo
from attnzoo.builtin_specs import shipped_spec_files
from attnzoo.distributed import (
    ContextParallel,
    Layout,
    ShardedAttention,
    counting,
    shard,
    shard_positions,
    sum_gradients,
    unshard,
    unsupported,
)
from attnzoo.registry import new_registry

pytestmark = pytest.mark.distributed

#: the shipped specs whose map is the softmax (the sharded pairs merge softmax partial results; the others are
#: declined with that reason: test_every_shipped_spec_is_accepted)
MAPPED = {"sigmoid", "softpick", "stick-breaking", "diff"}
SHIPPED = [p.stem for p in shipped_spec_files() if p.stem not in MAPPED]
#: the forgetting gate fed from the layer input: a per-token input (B, H, N) and a cumulative feature
FORGETTING_INPUT = {"name": "forgetting-input", "attention": {"causal": True},
                    "transforms": [{"kind": "forgetting_gate", "source": "input"}]}
#: chunked local attention, chunk 5: a mask whose key bound (earliest_key) jumps at every chunk start
CHUNKED = {"name": "chunked", "attention": {"causal": True}, "transforms": [{"kind": "chunked", "chunk": 5}]}
EXTRA = [FORGETTING_INPUT, CHUNKED]
CASES = {
    2: [dict(name="balanced-ring-gqa", n=37, batch=2, heads=4, kv_heads=2, head_dim=8, method="ring",
             balanced=True, block_size=4, gaps=False),
        dict(name="contiguous-allgather-gaps", n=21, batch=2, heads=2, kv_heads=1, head_dim=8, method="allgather",
             balanced=False, block_size=256, gaps="mixed")],
    4: [dict(name="balanced-ring-gaps", n=45, batch=2, heads=4, kv_heads=1, head_dim=4, method="ring",
             balanced=True, block_size=3, gaps="past"),
        dict(name="balanced-allgather", n=19, batch=1, heads=2, kv_heads=2, head_dim=8, method="allgather",
             balanced=True, block_size=2, gaps=False)],
}
TOL = dict(rtol=1e-9, atol=1e-11)


def _positions(gen, batch, n, gaps):
    """None (1..N), or positions with gaps: ``mixed``, the last row starts past the BOS position (the rows
    disagree on BOS: the fused selective pairs decline, the eager ones run); ``past``, every row does."""
    if not gaps:
        return None
    steps = torch.randint(1, 3, (batch, n), generator=gen)
    steps[:, 0] = 1
    steps[-1 if gaps == "mixed" else slice(None), 0] = 3
    return steps.cumsum(-1)


def _case_tensors(spec_name, case, variant):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{spec_name} {case['name']}".encode()))
    b, h, hkv, n, d = case["batch"], case["heads"], case["kv_heads"], case["n"], case["head_dim"]

    def normal(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    t = {"q": normal(b, h, n, d), "k": normal(b, hkv, n, d), "v": normal(b, hkv, n, d), "cot": normal(b, h, n, d)}
    init = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    params = {key: init[key] + 0.5 * normal(*init[key].shape) for key in sorted(init)}
    inputs = {key: declared.bias_init + normal(b, h, n) for key, (_, declared) in
              sorted(variant.plan.token_inputs().items())}
    return t, params, inputs, _positions(gen, b, n, case["gaps"])


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _check_spec(spec, case, rank, world):
    """Mismatches (names) of the sharded run against the reference, on this rank."""
    reference = attnzoo.compile(spec, backend="reference")
    name = reference.spec.name
    t, params, inputs, positions = _case_tensors(name, case, reference)
    layout = Layout(case["n"], world, case["balanced"])

    q, k, v = (t[x].clone().requires_grad_() for x in "qkv")
    p_ref = {key: value.clone().requires_grad_() for key, value in params.items()}
    i_ref = {key: value.clone().requires_grad_() for key, value in inputs.items()}
    out = reference(q, k, v, params=p_ref, positions=positions, inputs=i_ref or None)
    wrt = [q, k, v, *p_ref.values(), *i_ref.values()]
    truth = torch.autograd.grad(out, wrt, t["cot"], allow_unused=True)
    truth = [g if g is not None else torch.zeros_like(x) for g, x in zip(truth, wrt, strict=True)]

    cp = ContextParallel(spec, method=case["method"], balanced=case["balanced"], block_size=case["block_size"])
    ql, kl, vl = (layout.shard(t[x], rank).requires_grad_() for x in "qkv")
    pl = {key: torch.nn.Parameter(value.clone()) for key, value in params.items()}
    il = {key: layout.shard(value, rank, dim=-1).requires_grad_() for key, value in inputs.items()}
    pos_l = layout.shard(positions, rank, dim=-1) if positions is not None else None
    got = cp(ql, kl, vl, params=pl, positions=pos_l, inputs=il or None)
    got.backward(layout.shard(t["cot"], rank))
    sum_gradients(pl.values())  # each rank holds its own queries' share

    bad = []
    if cp.last_method != case["method"]:
        bad.append(f"method {cp.last_method}")
    plan = reference.plan  # row maps and the sink only: the pairs are the CPU flash kernel's
    inside = plan.many(attnzoo.Slot.LOGITS) or plan.many(attnzoo.Slot.MASK)
    acc = plan.one(attnzoo.Slot.ACCUMULATOR)
    plain = plan.causal and not inside and acc is None
    # a one-head, parameter-free pointwise selection, nothing else inside the pairs, rows agreeing on BOS: the
    # blocked backend's fused selective kernel
    fused = (plan.causal and not inside and acc is not None and acc.pointwise() is not None
             and len(acc.heads()) == 1 and not acc.parameters() and not inputs and case["gaps"] != "mixed")
    if cp.last_pairs != ("flash" if plain else "fused" if fused else "eager"):
        bad.append(f"pairs {cp.last_pairs}")
    if name in ("vanilla", "ssa", "sink", "qk-norm") and not plain:
        bad.append("a plain spec's pairs are not plain")
    if not _close(got.detach(), layout.shard(out.detach(), rank)):
        bad.append("out")
    # without gradients, other ranks' keys arrive in pieces (of 2 tokens here: pieces cut chunks, BOS included)
    pieces = ContextParallel(spec, method=case["method"], balanced=case["balanced"], block_size=case["block_size"],
                             piece_size=2)
    with torch.no_grad():
        lean = pieces(ql, kl, vl, params=pl, positions=pos_l, inputs=il or None)
    if not _close(lean, layout.shard(out.detach(), rank)):
        bad.append("out without gradients, in pieces")
    for label, x, g in zip("qkv", (ql, kl, vl), truth[:3], strict=True):
        if not _close(x.grad, layout.shard(g, rank)):
            bad.append(f"grad.{label}")
    for (key, p), g in zip(pl.items(), truth[3:3 + len(pl)], strict=True):
        if not _close(p.grad if p.grad is not None else torch.zeros_like(p), g):
            bad.append(f"grad.param.{key}")
    for (key, x), g in zip(il.items(), truth[3 + len(pl):], strict=True):
        if not _close(x.grad, layout.shard(g, rank, dim=-1)):
            bad.append(f"grad.input.{key}")
    if reference.plan.one(attnzoo.Slot.ACCUMULATOR) is not None:
        # the carry matters: keys of earlier chunks are selected by queries of chunks after them
        with torch.no_grad():
            _, f = reference(t["q"], t["k"], t["v"], params=params, positions=positions, inputs=inputs or None,
                             return_accumulated=True)
        chunk = torch.zeros(case["n"], dtype=torch.long)
        for c, (start, stop) in enumerate(layout.bounds):
            chunk[start:stop] = c
        across = chunk[:, None] > chunk[None, :]  # F carried from the key's chunk (another rank's) to later ones
        if not bool((f[:, across] > 0.1).any()):
            bad.append("no F across chunks (the case does not test the carry)")
    return bad


def _expect_error(kind, needle, call):
    try:
        call()
    except kind as exc:
        return "" if needle in str(exc) and "\n" not in str(exc) else f"{kind.__name__} without {needle!r}: {exc}"
    return f"no {kind.__name__} ({needle!r})"


def _check_errors(rank, world):
    """Declined cases and bad inputs: one line, on every rank (no rank left waiting)."""
    n = 4 * world + 1
    layout = Layout(n, world)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    ql, kl, vl = (layout.shard(x, rank) for x in (q, k, v))
    cp = ContextParallel("selective")
    problems = [
        _expect_error(attnzoo.UnsupportedError, "key_mask",
                      lambda: cp(ql, kl, vl, key_mask=torch.ones(1, ql.shape[2], dtype=torch.bool))),
        _expect_error(attnzoo.UnsupportedError, "documents", lambda: cp(ql, kl, vl, documents=[ql.shape[2]])),
        _expect_error(attnzoo.UnsupportedError, "'selective'", lambda: cp(ql, kl, vl, return_accumulated=True)),
    ]
    # rank 0 holds one token too many
    extra = (torch.cat([x, x[:, :, :1]], dim=2) if rank == 0 else x for x in (ql, kl, vl))
    problems.append(_expect_error(ValueError, "rank 0 holds", lambda: cp(*extra)))
    # too few tokens for the balanced layout's 2R chunks
    problems.append(_expect_error(ValueError, "cannot be cut", lambda: cp(ql[:, :, :1], kl[:, :, :1], vl[:, :, :1])))
    # positions that go back between ranks' chunks
    back = layout.positions(rank) + (0 if rank else 10 * n)
    problems.append(_expect_error(ValueError, "increase strictly along the whole sequence",
                                  lambda: cp(ql, kl, vl, positions=back)))
    # one rank's bad shape: that rank names it, the others name that rank
    q3 = ql[0] if rank == world - 1 else ql
    problems.append(_expect_error(ValueError, "4 dims" if rank == world - 1 else f"rank {world - 1}'s inputs",
                                  lambda: cp(q3, kl, vl)))
    return [p for p in problems if p]


def _check_nn(rank, world):
    """ShardedAttention: the parameters (names included) of attnzoo.nn.Attention, its forward on the shard,
    gradients summed over the ranks equal to the unsharded layer's; recording F is declined."""
    bad = []
    n, h, hkv, d = 4 * world + 3, 4, 2, 8
    torch.manual_seed(3)
    layer = attnzoo.nn.Attention("selective-ssa", num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    q, k, v, cot = (torch.randn(2, x, n, d, dtype=torch.float64) for x in (h, hkv, hkv, h))
    (layer(q, k, v) * cot).sum().backward()
    truth = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    sharded = ShardedAttention.from_attention(layer, block_size=3)
    if dict(sharded.named_parameters()).keys() != truth.keys():
        bad.append("nn: parameter names differ")
    fresh = ShardedAttention("selective-ssa", num_heads=h, head_dim=d, num_kv_heads=hkv)
    if fresh.state_dict().keys() != layer.state_dict().keys():
        bad.append("nn: state_dict keys differ")
    layout = Layout(n, world)
    out = sharded(*(layout.shard(x, rank) for x in (q, k, v)))
    (out * layout.shard(cot, rank)).sum().backward()
    sum_gradients(sharded.parameters())
    for name, p in sharded.named_parameters():
        if not _close(p.grad, truth[name]):
            bad.append(f"nn: grad {name}")
    with attnzoo.nn.recording_accumulated(sharded):
        bad.append(_expect_error(attnzoo.UnsupportedError, "recording_accumulated",
                                 lambda: sharded(*(layout.shard(x, rank) for x in (q, k, v)))))
    return [x for x in bad if x]


def _check_bytes(rank, world):
    """The ring sends each rank's keys, values and positions R - 1 times, nothing else (vanilla, forward)."""
    b, hkv, d, n = 2, 2, 4, 8 * world
    layout = Layout(n, world)
    x = torch.randn(b, hkv, n, d, dtype=torch.float64)
    cp = ContextParallel("vanilla", method="ring")
    with torch.no_grad(), counting() as counter:
        cp(*(layout.shard(x, rank) for _ in range(3)))
    local = n // world
    want = (world - 1) * (2 * b * hkv * local * d * 8 + b * local * 8)
    return [] if counter.by_kind.get("kv") == want else [f"ring bytes {counter.by_kind} != kv {want}"]


def _check_pruned(rank, world):
    """Selective attention whose F passes the negligible bound within a few queries (keys and the selector
    head's queries all alike): the fused pairs leave the dead keys out (the selector pass, forward and backward),
    a rank sends the others only its keys still live after their own chunk (on the ring, the all-gather, and
    in pieces without gradients), and still gives the reference's outputs and gradients."""
    from attnzoo.backends import selective_kernel
    from attnzoo.distributed import fused

    n, d = 32 * world, 8  # chunks of 16 tokens: a key passes the bound within its own chunk
    gen = torch.Generator().manual_seed(5)
    q, k, v, cot = (torch.randn(2, x, n, d, generator=gen, dtype=torch.float64) for x in (2, 2, 2, 2))
    with torch.no_grad():
        q[:, 0] = 2.0 + 0.1 * q[:, 0]
        k[:, 0] = 2.0 + 0.1 * k[:, 0]
    reference = attnzoo.compile("selective", backend="reference")
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference(qr, kr, vr)
    truth = torch.autograd.grad(out, (qr, kr, vr), cot)
    layout = Layout(n, world)
    ql, kl, vl = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
    left_out = []
    live, live_sent = selective_kernel.Keys.live, fused._Sent

    def recording(*args, **kwargs):
        keys = live(*args, **kwargs)
        left_out.append(keys.index is not None)
        return keys

    sent = []

    class Recorded(fused._Sent):
        def __init__(self, cfg, tables, limit):
            super().__init__(cfg, tables, limit)
            sent.append(sum(self.sizes) < cfg.layout.seq_len)

    selective_kernel.Keys.live, fused._Sent = recording, Recorded
    bad = []
    try:
        for method in ("ring", "allgather"):
            cp = ContextParallel("selective", block_size=8, method=method)
            got = cp(ql, kl, vl)
            got.backward(layout.shard(cot, rank))
            if not (cp.last_pairs == "fused" and any(left_out) and sent and all(sent)):
                bad.append(f"pruned {method}: no key left out or kept home ({cp.last_pairs})")
            if not _close(got.detach(), layout.shard(out.detach(), rank)):
                bad.append(f"pruned {method}: out")
            for label, x, g in zip("qkv", (ql, kl, vl), truth, strict=True):
                if not _close(x.grad, layout.shard(g, rank)):
                    bad.append(f"pruned {method}: grad.{label}")
                x.grad = None
            sent.clear()
        with torch.no_grad():  # other ranks' sent keys in pieces of 3 (pieces cut chunks)
            lean = ContextParallel("selective", block_size=8, piece_size=3)(ql, kl, vl)
        if not (sent and all(sent) and _close(lean, layout.shard(out.detach(), rank))):
            bad.append("pruned: out without gradients, in pieces")
    finally:
        selective_kernel.Keys.live, fused._Sent = live, live_sent
    return bad


def _check_staged(rank, world):
    """Every exchange staged through host memory (as for CUDA tensors on a gloo group: several ranks sharing one
    GPU) gives what the direct exchange gives: the ring, the scans, the all-gathers and all-reduces, and the
    received buffers copied back (tested here by staging CPU tensors)."""
    from attnzoo.distributed import exchange

    bad = []
    n = 19
    layout = Layout(n, world)
    for spec, method in (("selective", "ring"), ("forgetting", "ring"), ("alibi-learnable", "allgather")):
        runs = []
        for staged in (False, True):
            cp = ContextParallel(spec, method=method, block_size=4)
            init = cp.variant.init_params(num_heads=2, head_dim=4, dtype=torch.float64)
            q, k, v = (torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(3 + i),
                                   dtype=torch.float64) for i in range(3))
            ql, kl, vl = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
            pl = {key: torch.nn.Parameter(t.clone()) for key, t in init.items()}
            original = exchange._staged
            if staged:
                exchange._staged = lambda t, group: True
            try:
                out = cp(ql, kl, vl, params=pl)
                out.sum().backward()
                sum_gradients(pl.values())
            finally:
                exchange._staged = original
            runs.append([out.detach(), ql.grad, kl.grad, vl.grad, *(p.grad for p in pl.values())])
        if not all(_close(a, b) for a, b in zip(*runs, strict=True)):
            bad.append(f"staged through host memory: {spec} differs")
    return bad


def _worker(rank, world, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    checked, failures = [], []
    try:
        for case in CASES[world]:
            for spec in [*SHIPPED, *EXTRA]:
                name = spec if isinstance(spec, str) else spec["name"]
                failures += [f"{case['name']} {name}: {m}" for m in _check_spec(spec, case, rank, world)]
                checked.append(f"{case['name']} {name}")
        failures += _check_errors(rank, world) + _check_nn(rank, world) + _check_bytes(rank, world)
        failures += _check_pruned(rank, world) + _check_staged(rank, world)
    finally:
        dist.destroy_process_group()
    finish(out_dir / f"rank{rank}.json", {"checked": checked, "failures": failures})


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_attention_equals_the_reference(world, tmp_path):
    mp.start_processes(_worker, args=(world, tmp_path / "store", tmp_path), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:10]}"
        assert len(result["checked"]) == len(CASES[world]) * (len(SHIPPED) + len(EXTRA))


def test_every_shipped_spec_is_accepted():
    assert len(SHIPPED) >= 20
    assert {name: unsupported(name) for name in SHIPPED} == {name: [] for name in SHIPPED}
    assert {p.stem for p in shipped_spec_files()} - set(SHIPPED) == MAPPED
    for name in MAPPED:  # another probability map than the softmax: declined, saying why
        (reason,) = unsupported(name)
        assert reason.endswith("(probability) replaces the softmax: the sharded pairs merge softmax partial results "
                               "by their log-sum-exp"), reason


class _RowNormalisedSelection(attnzoo.AccumulatorTransform):
    """A selection that depends on every key of its row (not pointwise): S cannot be computed per key block."""

    kind, slot, summary = "row_normalised_selection", attnzoo.Slot.ACCUMULATOR, "S = softmax of the selector row"

    def heads(self):
        return [0]

    def selection(self, logits, allowed, ctx, params):
        return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)


def test_a_non_pointwise_accumulator_is_declined_naming_spec_and_transform():
    module = types.ModuleType("cp_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(_RowNormalisedSelection))
    reg = new_registry(entry_points=False, extra_plugins=[("cp_plugin", module)])
    spec = {"name": "row-selective", "transforms": [{"kind": "row_normalised_selection"}]}
    with pytest.raises(attnzoo.UnsupportedError) as info:
        ContextParallel(spec, registry=reg)
    message = str(info.value)
    assert "'row-selective'" in message and "'row_normalised_selection'" in message and "\n" not in message


def test_bad_options_and_no_process_group_are_one_line():
    with pytest.raises(ValueError, match="method must be one of"):
        ContextParallel("vanilla", method="tree")
    with pytest.raises(ValueError, match="block_size"):
        ContextParallel("vanilla", block_size=0)
    x = torch.randn(1, 1, 4, 2)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        ContextParallel("vanilla")(x, x, x)


def test_layouts_shard_and_unshard():
    layout = Layout(37, 2)
    assert [stop - start for start, stop in layout.bounds] == [10, 9, 9, 9]
    assert layout.owned(0) == [0, 3] and layout.owned(1) == [1, 2]
    assert layout.indices(0).tolist() == list(range(10)) + list(range(28, 37))
    assert layout.positions(1, batch=2).shape == (2, 18) and int(layout.positions(1)[0, 0]) == 11
    assert Layout(10, 3, balanced=False).owned(2) == [2] and Layout(10, 3, balanced=False).local_size(0) == 4
    x = torch.randn(2, 3, 37, 4)
    for world, balanced in ((1, True), (2, True), (4, True), (3, False)):
        pieces = [shard(x, r, world, balanced=balanced) for r in range(world)]
        assert sum(p.shape[2] for p in pieces) == 37
        assert torch.equal(unshard(pieces, balanced=balanced), x)
    pos = torch.arange(1, 38).expand(2, 37)
    assert torch.equal(shard_positions(pos, 1, 2), layout.positions(1, batch=2))
    with pytest.raises(ValueError, match="cannot be cut into the 8 chunks"):
        Layout(7, 4)
    with pytest.raises(ValueError, match="2 shards for a layout over 3 ranks"):
        Layout(9, 3).unshard([x, x])
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        layout.owned(2)

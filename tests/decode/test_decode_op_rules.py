"""The fused decoding ops keep the rules torch's own in-place ops keep (issue 51, "What to build" 1 and 2): sizes,
slots and held counts compared without overflow; no written tensor a leaf (or any tensor) that requires grad under
grad mode, nor an inference tensor outside inference mode; no argument overlapping one the op writes (exactly:
vLLM's ring pages, strided views of one storage interleaved page by page, are accepted); the version counter of
every written tensor bumped. Each refusal is one line naming the argument, with nothing written. And
``KVCache.attach`` checks every buffer it adopts.

The hostile table also runs under AddressSanitizer (docs/decoding.md, "Fused in C on the CPU", says how)."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.core.numerics import accumulator_dtype

B, H, HKV, D, M = 2, 4, 2, 8, 5
BIG = 2**63 - 1


def _args(kernel: str, dtype=torch.float64) -> dict:
    """A fresh, valid argument set of ``kernel``'s op, by name: buffers of M + 1 slots, M held, rows at their own
    next positions."""
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(B, HKV, M + 1, D, generator=gen, dtype=dtype) for _ in range(2))
    args = dict(k=torch.randn(B, HKV, 1, D, generator=gen, dtype=dtype),
                v=torch.randn(B, HKV, 1, D, generator=gen, dtype=dtype), next=0,
                nexts=torch.tensor([M + 1, M + 4]), keys=keys, values=values,
                positions=torch.arange(1, M + 2).repeat(B, HKV, 1))
    if kernel == "append":
        return args | dict(slot=M)
    args["q"] = torch.randn(B, H, 1, D, generator=gen, dtype=dtype)
    scores = torch.rand(B, HKV, M + 1, generator=gen, dtype=dtype)
    if kernel == "selective":
        return args | dict(scores=scores, held=M, scale=0.35, protect_first=True, selector_kv_head=1,
                           selector_in_group=0, selection_rule=1, zero_first_score=True, zero_own_score=False)
    if kernel == "sink_window":
        return args | dict(held=M, scale=0.35, sinks=1)
    return args | dict(scores=scores, held=M, scale=0.35, tova=False, recent=2)


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _q_over_spare_slot(a):
    """q whose every head is a view of keys' spare slot M (the slot the H2O step writes the new key into before
    it reads q)."""
    keys = a["keys"]
    return keys.as_strided((B, H, 1, D), (keys.stride(0), 0, D, 1), keys.storage_offset() + M * D)


#: (id, kernel, change to a valid argument set, what the one-line ValueError says)
HOSTILE = [
    ("append-slot-2**63-1", "append", lambda a: dict(slot=BIG),
     r"keys of shape .* must be \(2, 2, > 9223372036854775807"),
    ("append-slot-2**62", "append", lambda a: dict(slot=2**62), r"keys of shape .* > 4611686018427387904"),
    ("append-slot-negative", "append", lambda a: dict(slot=-1), r"slot must be >= 0"),
    ("append-slot-past-buffers", "append", lambda a: dict(slot=M + 1), r"keys of shape .* > 6"),
    ("scoring-held-2**63-1", "scoring", lambda a: dict(held=BIG), r"keys of shape .* > 9223372036854775807"),
    ("scoring-held-2**62", "scoring", lambda a: dict(held=2**62), r"keys of shape .* > 4611686018427387904"),
    ("scoring-no-spare-slot", "scoring", lambda a: dict(held=M + 1), r"keys of shape .* > 6"),
    ("selective-held-2**63-1", "selective", lambda a: dict(held=BIG), r"keys of shape .* >= 9223372036854775807"),
    ("selective-held-2**62", "selective", lambda a: dict(held=2**62), r"keys of shape .* >= 4611686018427387904"),
    ("selective-rule-none", "selective", lambda a: dict(selection_rule=0), r"selection_rule 0 is not a rule"),
    ("selective-rule-unknown", "selective", lambda a: dict(selection_rule=2), r"selection_rule 2 is not a rule"),
    ("sink-held-2**63-1", "sink_window", lambda a: dict(held=BIG), r"keys of shape .* >= 9223372036854775807"),
    ("scoring-held-0", "scoring", lambda a: dict(held=0), r"held must be >= 1"),
    ("scoring-recent-negative", "scoring", lambda a: dict(recent=-1), r"recent must be >= 0"),
    ("nexts-2**63-1", "scoring", lambda a: dict(nexts=torch.tensor([3, BIG])), r"nexts\[1\] = 9223372036854775807"),
    ("append-nexts-2**63-1", "append", lambda a: dict(nexts=torch.tensor([BIG, 3])),
     r"nexts\[0\] = 9223372036854775807"),
    ("nexts-0", "selective", lambda a: dict(nexts=torch.tensor([0, 3])), r"nexts\[0\] = 0 is not a position"),
    ("next-0", "append", lambda a: dict(nexts=None, next=0), r"next must be a position >= 1"),
    ("next-negative", "sink_window", lambda a: dict(nexts=None, next=-(2**63)), r"next must be a position >= 1"),
    ("keys-as-values", "scoring", lambda a: dict(values=a["keys"]), r"keys and values share memory"),
    ("append-keys-as-values", "append", lambda a: dict(values=a["keys"]), r"keys and values share memory"),
    ("scores-positions-bits", "scoring", lambda a: dict(scores=a["positions"].view(torch.float64)),
     r"positions and scores share memory"),
    ("selective-scores-positions-bits", "selective", lambda a: dict(scores=a["positions"].view(torch.float64)),
     r"positions and scores share memory"),
    ("q-over-the-spare-slot", "scoring", lambda a: dict(q=_q_over_spare_slot(a)), r"keys and q share memory"),
    ("q-over-a-held-slot", "selective", lambda a: dict(q=a["keys"].as_strided((B, H, 1, D), (a["keys"].stride(0), 0,
                                                                                                D, 1))),
     r"keys and q share memory"),
    ("k-a-view-of-values", "sink_window", lambda a: dict(k=a["values"][:, :, 2:3]), r"values and k share memory"),
    ("v-a-view-of-keys", "append", lambda a: dict(v=a["keys"][:, :, :1]), r"keys and v share memory"),
    ("nexts-a-view-of-positions", "scoring", lambda a: dict(nexts=a["positions"][0, 0, 1:3]),
     r"nexts and positions share memory"),
    ("scores-inside-keys", "scoring", lambda a: dict(scores=a["keys"].view(-1)[3:3 + B * HKV * (M + 1)].view(
        B, HKV, M + 1)), r"keys and scores share memory"),
    ("keys-leaf-requires-grad", "scoring", lambda a: dict(keys=_leaf(a["keys"])),
     r"keys requires grad: the op writes it in place and has no backward"),
    ("scores-leaf-requires-grad", "selective", lambda a: dict(scores=_leaf(a["scores"])), r"scores requires grad"),
    ("values-non-leaf-requires-grad", "append", lambda a: dict(values=_leaf(a["values"]) * 1),
     r"values requires grad"),
    ("q-requires-grad", "scoring", lambda a: dict(q=_leaf(a["q"])), r"q requires grad, and the op has no backward"),
    ("v-requires-grad", "append", lambda a: dict(v=_leaf(a["v"])), r"v requires grad, and the op has no backward"),
    ("keys-inference-tensor", "scoring", lambda a: dict(keys=_inference(a["keys"])),
     r"keys is an inference tensor: it can be written in place only inside torch.inference_mode\(\)"),
    ("positions-inference-tensor", "append", lambda a: dict(positions=_inference(a["positions"])),
     r"positions is an inference tensor"),
    ("nexts-inference-tensor", "sink_window", lambda a: dict(nexts=_inference(a["nexts"])),
     r"nexts is an inference tensor"),
]


def _tensors(args: dict) -> dict[str, torch.Tensor]:
    return {name: t for name, t in args.items() if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize(("kernel", "change", "says"), [case[1:] for case in HOSTILE],
                         ids=[case[0] for case in HOSTILE])
def test_a_hostile_argument_set_is_refused_in_one_line_with_nothing_written(ops, kernel, change, says):
    args = _args(kernel)
    args |= change(args)
    given = _tensors(args)
    before = {name: t.detach().clone() for name, t in given.items()}
    versions = {name: t._version for name, t in given.items() if not t.is_inference()}
    with pytest.raises(ValueError, match=says) as caught:
        ops.op(kernel)(**args)
    assert "\n" not in str(caught.value).strip()
    for name, t in given.items():
        assert torch.equal(t.detach(), before[name]), f"{name} was written"
    assert {name: t._version for name, t in given.items() if not t.is_inference()} == versions


def test_too_fragmented_a_layout_is_refused_in_one_line(ops):
    """Two arguments whose address ranges meet are compared run by run, up to 2**20 runs each; beyond, one line."""
    runs = 2**20 + 1
    base = torch.zeros(2 * runs + 8, dtype=torch.float64)
    q = base.as_strided((1, runs, 1, 1), (2 * runs, 2, 1, 1))  # every other element, one element per run
    keys = base.as_strided((1, 1, 4, 1), (4, 4, 1, 1), 1)  # among q's elements: q's span meets it
    args = dict(q=q, k=torch.zeros(1, 1, 1, 1, dtype=torch.float64), v=torch.zeros(1, 1, 1, 1, dtype=torch.float64),
                next=5, nexts=None, keys=keys, values=torch.zeros(1, 1, 4, 1, dtype=torch.float64),
                positions=torch.arange(1, 5).view(1, 1, 4), held=3, scale=1.0, sinks=0)
    with pytest.raises(ValueError, match=r"q and keys lie in one range of memory and q is in more than 1048576 "
                                         r"separate pieces") as caught:
        ops.op("sink_window")(**args)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("kernel", ["selective", "sink_window", "scoring", "append"])
def test_inference_tensors_are_written_inside_inference_mode(ops, kernel):
    """As torch's in-place ops: an inference tensor is refused outside inference mode (the table) and written inside
    it, the same values as the call on normal tensors."""
    want_args, args = _args(kernel), _args(kernel)
    with torch.inference_mode():
        args = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
        got = ops.op(kernel)(**args)
    want = ops.op(kernel)(**want_args)
    if kernel != "append":
        assert torch.equal(got, want)
    for name, t in _tensors(args).items():
        assert t.is_inference() and torch.equal(t, want_args[name])


@pytest.mark.parametrize("kernel", ["selective", "sink_window", "scoring", "append"])
def test_the_op_bumps_the_version_of_every_tensor_it_writes(ops, kernel):
    args = _args(kernel)
    given = _tensors(args)
    before = {name: t._version for name, t in given.items()}
    ops.op(kernel)(**args)
    written = {"keys", "values", "positions", "scores", "nexts"}
    for name, t in given.items():
        assert t._version == before[name] + (name in written), name
    with torch.no_grad():  # a leaf that requires grad may be written under no_grad, as by torch's in-place ops
        args["keys"] = _leaf(args["keys"])
        args["nexts"] = args["nexts"] + 0
        ops.op(kernel)(**args)
    assert args["keys"]._version == 1


@pytest.mark.parametrize("kernel", ["scoring", "append"])
def test_a_backward_through_a_buffer_the_op_overwrote_raises(ops, kernel):
    """``loss = (keys * w).sum(); op(...keys...); loss.backward()``: w's gradient would be the new keys; autograd
    refuses, as after torch's in-place ops."""
    args = _args(kernel)
    w = torch.randn(args["keys"].shape, dtype=torch.float64, requires_grad=True)
    loss = (args["keys"] * w).sum()
    ops.op(kernel)(**args)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss = (args["keys"] * w).sum()
    loss.backward()  # the keys as they are now
    assert torch.equal(w.grad, args["keys"])


def test_q_k_v_that_share_one_storage_are_read(ops):
    """A fused projection's q, k, v (views of one tensor, interleaved per token) are only read: accepted, the same
    output as their copies."""
    args = _args("scoring")
    qkv = torch.randn(B, 1, (H + 2 * HKV) * D, dtype=torch.float64)
    q, k, v = (t.view(B, 1, -1, D).transpose(1, 2) for t in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
    copies = _args("scoring")
    want = ops.op("scoring")(**copies | dict(q=q.clone(), k=k.clone(), v=v.clone()))
    got = ops.op("scoring")(**args | dict(q=q, k=k, v=v))
    assert torch.equal(got, want) and torch.equal(args["keys"], copies["keys"])


# -- vLLM's ring pages: strided views of one storage, interleaved page by page ----------------------------------------
def _ring_pages(blocks: int, slots: int, dtype, state_names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Typed views of every page of one tensor of pages (``attnzoo.decode.paged.PageLayout.all_views``, what the
    vLLM backend's ring pages are): per block a header, then keys, values (blocks, H_kv, S, D), positions and each
    score (blocks, H_kv, S), each section 64-byte aligned, every block's bytes contiguous."""
    from attnzoo.decode.paged import PageLayout

    layout = PageLayout(HKV, D, dtype, slots - 1, state_names, accumulator_dtype(dtype))
    size = torch.empty((), dtype=dtype).element_size()
    return layout.all_views(torch.zeros(blocks, layout.page_bytes // size, dtype=dtype))


@pytest.mark.parametrize("kernel", ["scoring", "selective", "sink_window", "append"])
def test_the_op_writes_interleaved_ring_pages_in_place(ops, kernel):
    """Keys, values, positions and scores of consecutive pages (one strided view each, of one storage, interleaved
    block by block: what the vLLM backend's batched in-place step passes): their address ranges all meet, and no
    byte is shared, so the op takes them; it writes what it writes into separate copies."""
    args = _args(kernel)
    pages = _ring_pages(B + 2, M + 1, torch.float64, ("s",))
    home = {name: pages[name].narrow(0, 1, B) for name in ("keys", "values", "positions", "state.s")}
    for name in ("keys", "values", "positions"):
        home[name].copy_(args[name])
    ring = args | {name: home[name] for name in ("keys", "values", "positions")} | dict(nexts=args["nexts"].clone())
    if "scores" in args:
        home["state.s"].copy_(args["scores"])
        ring["scores"] = home["state.s"]
    untouched = {name: pages[name].select(0, 0).clone() for name in pages}
    want = ops.op(kernel)(**args)
    got = ops.op(kernel)(**ring)
    if kernel != "append":
        assert torch.equal(got, want)
    for name in ("keys", "values", "positions", "scores", "nexts"):
        if name in args:
            assert torch.equal(ring[name], args[name]), name
    for name, t in untouched.items():  # the page before the rows is not written
        assert torch.equal(pages[name].select(0, 0), t), name
    if "scores" not in args:
        return
    # the scores moved on so that each row's last score is the next page's first key: one shared element per row
    scores = home["state.s"]
    delta = pages["keys"][2].data_ptr() - (scores[0].data_ptr() + (HKV * (M + 1) - 1) * 8)
    shifted = scores.as_strided(scores.shape, scores.stride(), scores.storage_offset() + delta // 8)
    before = {name: t.clone() for name, t in pages.items()}
    with pytest.raises(ValueError, match="keys and scores share memory"):
        ops.op(kernel)(**ring | dict(scores=shifted, nexts=torch.tensor([M + 2, M + 5])))
    assert all(torch.equal(pages[name], t) for name, t in before.items())


@pytest.mark.parametrize("spec", ["h2o", "selective-pruned"])
def test_a_batched_step_over_ring_pages_takes_the_fused_op(ops, spec, monkeypatch):
    """The vLLM backend's batched in-place step (``_Layer._decode_full``): a cache attached every step to strided
    views of consecutive pages, its step state kept. Every step after the first takes the fused op (no refusal,
    no torch step), and decodes what one cache of the same rows does (float64)."""
    from attnzoo.decode.state import FastStep

    torch_steps = []
    torch_call = FastStep.__call__
    monkeypatch.setattr(FastStep, "__call__", lambda self, *a: torch_steps.append(1) or torch_call(self, *a))
    variant = attnzoo.compile(spec, backend="blocked")
    rows, budget, prefill, steps = 3, 6, 9, 8
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(rows, H, prefill + steps, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(rows, HKV, prefill + steps, D, generator=gen, dtype=torch.float64) for _ in range(2))
    one, first = variant.new_cache(rows, budget=budget), variant.new_cache(rows, budget=budget)
    for cache in (one, first):
        variant.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache)
    pages = _ring_pages(rows + 2, budget + 1, torch.float64, first.state_names)
    names = ("keys", "values", "positions", *(f"state.{n}" for n in first.state_names))
    home = {name: pages[name].narrow(0, 1, rows) for name in names}  # blocks 1, 2, 3: in place
    for name in names:
        held = first.state[name[6:]] if name.startswith("state.") else getattr(first, name)
        home[name].narrow(2, 0, budget).copy_(held.expand(rows, HKV, budget, *held.shape[3:]))
    nexts, scrambled, state, kinds = first.next_position, False, None, []
    for i in range(prefill, prefill + steps):
        want = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], one)
        cache = variant.new_cache(rows, budget=budget)
        cache.attach(home["keys"], home["values"], home["positions"],
                     {n: home[f"state.{n}"] for n in cache.state_names}, budget, nexts, scrambled=scrambled,
                     step_state=state)
        kinds.append(cache.lean_step_kind)
        got = variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        buffers = cache.buffers()
        for name in names:  # what a step moved out of the pages goes back (the backend's copy)
            held = buffers[name.replace("state.", "held.")]
            if held.data_ptr() != home[name].data_ptr():
                home[name].narrow(2, 0, budget).copy_(held.narrow(2, 0, budget).expand(rows, HKV, budget,
                                                                                      *held.shape[3:]))
        nexts, scrambled, state = cache.next_position, cache.scrambled, cache.step_state
    assert kinds[0] is None and set(kinds[1:]) == {"fused"}, kinds
    assert not torch_steps  # the op refused nothing
    for name, view in pages.items():  # blocks 0 and 4, around the rows, untouched
        assert not bool(view[0].any()) and not bool(view[-1].any()), name


# -- KVCache.attach ----------------------------------------------------------------------------------------------------
def _page(spec="h2o", slots=5, held=4):
    variant = attnzoo.compile(spec, backend="blocked")
    cache = variant.new_cache(1, budget=slots - 1)
    page = dict(keys=torch.zeros(1, HKV, slots, D, dtype=torch.float64),
                values=torch.zeros(1, HKV, slots, D, dtype=torch.float64),
                positions=torch.arange(1, slots + 1).view(1, 1, slots).repeat(1, HKV, 1),
                state={n: torch.zeros(1, HKV, slots, dtype=torch.float64) for n in cache.state_names},
                held=held, next_position=held + 1)
    return variant, cache, page


ATTACH = [
    ("scores-of-2-slots-for-4-held", lambda p: dict(state={"attention": torch.zeros(1, HKV, 2, dtype=torch.float64)}),
     r"the per-token scores 'attention' of shape \(1, 2, 2\) do not fit positions \(1, 2, 5\)"),
    ("scores-of-another-head-count", lambda p: dict(state={"attention": torch.zeros(1, 1, 5, dtype=torch.float64)}),
     r"'attention' of shape \(1, 1, 5\) do not fit"),
    ("scores-in-float32", lambda p: dict(state={"attention": torch.zeros(1, HKV, 5)}),
     r"'attention' must be torch.float64"),
    ("scores-not-a-tensor", lambda p: dict(state={"attention": [0.0] * 5}), r"'attention' must be a tensor"),
    ("scores-missing", lambda p: dict(state={}), r"no buffer for the per-token scores \['attention'\]"),
    ("scores-unknown", lambda p: dict(state=p["state"] | {"F": torch.zeros(1, HKV, 5, dtype=torch.float64)}),
     r"per-token scores this cache does not keep: \['F'\]"),
    ("scores-require-grad", lambda p: dict(state={"attention": torch.zeros(1, HKV, 5, dtype=torch.float64,
                                                                           requires_grad=True)}),
     r"the per-token scores 'attention' requires grad"),
    ("scores-on-meta", lambda p: dict(state={"attention": torch.zeros(1, HKV, 5, dtype=torch.float64,
                                                                      device="meta")}),
     r"'attention' is on meta, keys on cpu"),
    ("values-of-another-dtype", lambda p: dict(values=p["values"].float()), r"keys and values must have one floating"),
    ("keys-of-integers", lambda p: dict(keys=p["positions"].unsqueeze(-1).expand(1, HKV, 5, D).contiguous(),
                                        values=p["positions"].unsqueeze(-1).expand(1, HKV, 5, D).contiguous()),
     r"keys and values must have one floating dtype"),
    ("positions-of-floats", lambda p: dict(positions=p["positions"].double()), r"positions must be int64"),
    ("keys-require-grad", lambda p: dict(keys=p["keys"].clone().requires_grad_()),
     r"keys requires grad: the cache holds detached tokens"),
    ("held-past-the-slots", lambda p: dict(held=6, next_position=7), r"with 6 held do not fit together"),
    ("held-negative", lambda p: dict(held=-1), r"held must be >= 0"),
    ("held-a-float", lambda p: dict(held=4.0), r"held must be an int"),
    ("held-a-bool", lambda p: dict(held=True), r"held must be an int"),
    ("next-before-the-held", lambda p: dict(next_position=3), r"next_position 3 does not come after 4 held tokens"),
    ("next-0", lambda p: dict(next_position=0), r"next_position must be >= 1"),
    ("next-rows-of-another-batch", lambda p: dict(next_position=torch.tensor([5, 6])), r"a \(1,\) tensor"),
    ("next-rows-of-floats", lambda p: dict(next_position=torch.tensor([5.0])), r"must hold integers"),
    ("evicted-negative", lambda p: dict(evicted=-1), r"evicted must be >= 0"),
    ("expired-a-string", lambda p: dict(expired="3"), r"expired must be an int"),
]


@pytest.mark.parametrize(("change", "says"), [case[1:] for case in ATTACH], ids=[case[0] for case in ATTACH])
def test_attach_refuses_a_buffer_or_header_that_does_not_fit_in_one_line(change, says):
    _, cache, page = _page()
    given = page | change(page)
    with pytest.raises(ValueError, match="^attach: .*" + says) as caught:
        cache.attach(given.pop("keys"), given.pop("values"), given.pop("positions"), given.pop("state"),
                     given.pop("held"), given.pop("next_position"), **given)
    assert "\n" not in str(caught.value)
    assert cache.num_tokens == 0 and cache.buffers()["keys"] is None  # nothing adopted


def test_a_score_buffer_too_short_is_refused_at_attach_not_at_the_next_decode():
    """The issue's case: a score buffer of 2 slots for 4 held tokens was adopted, and the next decode raised torch's
    expand error; attached whole, the same page decodes."""
    variant, cache, page = _page()
    with pytest.raises(ValueError, match=r"attach: the per-token scores 'attention' of shape \(1, 2, 2\)"):
        cache.attach(page["keys"], page["values"], page["positions"],
                     {"attention": torch.zeros(1, HKV, 2, dtype=torch.float64)}, 4, 5)
    cache.attach(page["keys"], page["values"], page["positions"], page["state"], 4, 5)
    q = torch.randn(1, H, 1, D, dtype=torch.float64)
    k, v = torch.randn(1, HKV, 1, D, dtype=torch.float64), torch.randn(1, HKV, 1, D, dtype=torch.float64)
    assert variant.decode(q, k, v, cache).shape == (1, H, 1, D) and cache.num_tokens == 4

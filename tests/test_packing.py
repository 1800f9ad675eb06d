"""Packed sequences (docs/packing.md): documents given as cu_seqlens, document ids, lengths or an xformers
block-diagonal bias are each attended alone; errors are one line."""

import pytest
import torch

import attnzoo
from attnzoo.cache import accumulator_dtype

LENGTHS = [1, 63, 200]


def qkv(b=1, n=264, h=4, hkv=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v


def alone(variant, q, k, v, params, lengths, row=0, positions=None):
    outs, start = [], 0
    for length in lengths:
        tokens = slice(start, start + length)
        pos = positions[tokens] if positions is not None else None
        outs.append(variant(q[row:row + 1, :, tokens], k[row:row + 1, :, tokens], v[row:row + 1, :, tokens],
                            params=params, positions=pos))
        start += length
    return torch.cat(outs, dim=2)


def test_cu_seqlens_document_ids_lengths_and_an_xformers_bias_give_the_same_result():
    attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias")
    variant = attnzoo.compile("selective-ssa", backend="blocked")
    q, k, v = qkv()
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS))[None]
    forms = [torch.tensor([0, 1, 64, 264]), ids, LENGTHS, attn_bias.BlockDiagonalCausalMask.from_seqlens(LENGTHS)]
    results = [variant(q, k, v, documents=form) for form in forms]
    want = alone(attnzoo.compile("selective-ssa", backend="reference"), q, k, v, None, LENGTHS)
    for got in results:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_xformers_bias_materialised_on_cpu_is_the_mask_packing_applies():
    """BlockDiagonalCausalMask.materialize() (-inf outside a document's causal block) against the pairs the
    reference lets attend when each document is alone: the same set."""
    attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias")
    bias = attn_bias.BlockDiagonalCausalMask.from_seqlens(LENGTHS).materialize((264, 264), dtype=torch.float32)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS))
    index = torch.arange(264)
    ours = (ids[:, None] == ids[None, :]) & (index[None, :] <= index[:, None])
    assert torch.equal(bias == 0, ours)


def test_two_rows_with_their_own_documents_and_padding():
    """cu_seqlens over the batch flattened (B * N), each row its own documents, tokens after the last offset and
    id -1 are padding: output 0, gradient 0; positions given within documents are kept."""
    variant = attnzoo.compile("forgetting", backend="blocked")
    ref = attnzoo.compile("forgetting", backend="reference")
    q, k, v = qkv(b=2, n=40)
    got = variant(q, k, v, documents=torch.tensor([0, 10, 40, 40 + 25, 40 + 31]))  # row 1: 25, 6, then 9 padding
    torch.testing.assert_close(got[0:1], alone(ref, q, k, v, None, [10, 30]), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1:2, :, :31], alone(ref, q, k, v, None, [25, 6], row=1), rtol=0, atol=1e-12)
    assert float(got[1, :, 31:].detach().abs().max()) == 0.0
    dq, = torch.autograd.grad(got.sum(), [q])
    assert float(dq[1, :, 31:].abs().max()) == 0.0
    ids = torch.tensor([[0] * 10 + [1] * 30, [5] * 25 + [-1] * 15])
    positions = torch.stack([torch.cat([torch.arange(100, 110), torch.arange(7, 37)]), torch.arange(3, 43)])
    got = variant(q, k, v, documents=ids, positions=positions)
    torch.testing.assert_close(got[0:1], alone(ref, q, k, v, None, [10, 30], positions=positions[0]), rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(got[1:2, :, :25], alone(ref, q, k, v, None, [25], row=1, positions=positions[1]),
                               rtol=0, atol=1e-12)


def test_packed_f_is_block_diagonal_and_resets_per_document():
    variant = attnzoo.compile("selective", backend="blocked")
    q, k, v = qkv(n=80)
    _, f = variant(q, k, v, documents=[30, 50], return_accumulated=True)
    _, f1 = variant(q[:, :, :30], k[:, :, :30], v[:, :, :30], return_accumulated=True)
    _, f2 = variant(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], return_accumulated=True)
    torch.testing.assert_close(f, torch.block_diag(f1[0], f2[0])[None], rtol=0, atol=1e-12)
    assert float(f[0, 30:, 30].abs().max()) == 0.0  # the second document's first token is protected


def test_attnzoo_nn_takes_documents():
    import attnzoo.nn

    layer = attnzoo.nn.Attention("ssa", num_heads=4, head_dim=8, num_kv_heads=2, dtype=torch.float64)
    q, k, v = qkv(n=20)
    want = torch.cat([layer(q[:, :, :8], k[:, :, :8], v[:, :, :8]), layer(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:])], 2)
    torch.testing.assert_close(layer(q, k, v, documents=[8, 12]), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("documents, message", [
    (torch.tensor([0, 30, 50]), r"^cu_seqlens: document 1 \(tokens 30\.\.49\) straddles rows 0 and 1 of N = 40$"),
    (torch.tensor([0, 10, 10]), r"^cu_seqlens must increase strictly"),
    (torch.tensor([1, 10]), r"^cu_seqlens must start at 0"),
    (torch.tensor([0, 90]), r"^cu_seqlens ends at 90, past the 80 tokens of a \(2, N = 40\) batch$"),
    (torch.tensor([[0] * 10 + [1] * 20 + [0] * 10, [0] * 40]), r"^document id 0 appears in two separate runs of row 0"),
    (torch.zeros(2, 39, dtype=torch.int64), r"^document ids must have shape \(B, N\) = \(2, 40\)"),
    ([10, 0], r"^document lengths must be >= 1"),
    (torch.zeros(2, 40), r"^documents must be an integer tensor"),
    ("abc", r"^documents must be cu_seqlens"),
    (torch.tensor([0, 30, 20]), r"^cu_seqlens must increase strictly"),
    (torch.tensor([0]), r"^cu_seqlens must start at 0 and hold at least one document, got \[0\]$"),
    (torch.tensor([0, 40], dtype=torch.complex64),
     r"^documents must be an integer tensor \(cu_seqlens or document ids\), got complex64$"),
    (torch.tensor([True, False]), r"^documents must be an integer tensor \(cu_seqlens or document ids\), got bool$"),
    (torch.tensor(40), r"^documents: a 1-D cu_seqlens or \(B, N\) document ids, got shape \(\)$"),
    (torch.zeros(1, 2, 40, dtype=torch.int64), r"^documents: a 1-D cu_seqlens or \(B, N\) document ids, got shape "
                                               r"\(1, 2, 40\)$"),
    (torch.tensor([0, 40], device="meta"),
     r"^cu_seqlens: on the meta device, which holds no values; put it on the CPU or on q's device \(cpu\)$"),
    (torch.zeros(2, 40, dtype=torch.int64, device="meta"), r"^document ids: on the meta device, which holds no "
                                                            r"values; put it on the CPU or on q's device \(cpu\)$"),
])
def test_bad_documents_are_one_line(documents, message):
    q, k, v = qkv(b=2, n=40)
    with pytest.raises(ValueError, match=message):
        attnzoo.compile("vanilla")(q, k, v, documents=documents)


def test_xformers_biases_that_do_not_fit_are_refused_with_one_line():
    attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias")
    q, k, v = qkv(n=40)
    with pytest.raises(ValueError, match=r"^xformers bias BlockDiagonalMask is not causal but the spec is causal: "
                                         r"use BlockDiagonalCausalMask$"):
        attnzoo.compile("vanilla")(q, k, v, documents=attn_bias.BlockDiagonalMask.from_seqlens([20, 20]))
    local = attn_bias.BlockDiagonalCausalMask.from_seqlens([20, 20]).make_local_attention(4)
    with pytest.raises(ValueError, match=r"^xformers bias BlockDiagonalCausalLocalAttentionMask is not supported"):
        attnzoo.compile("vanilla")(q, k, v, documents=local)


def test_documents_with_a_key_mask_or_bad_positions_are_refused():
    q, k, v = qkv(n=40)
    variant = attnzoo.compile("vanilla")
    with pytest.raises(ValueError, match="mark padding tokens as document id -1"):
        variant(q, k, v, documents=[40], key_mask=torch.ones(1, 40, dtype=torch.bool))
    positions = torch.cat([torch.arange(1, 21), torch.arange(1, 21).flip(0)])
    with pytest.raises(ValueError, match=r"^positions must increase strictly within each document: document 1"):
        variant(q, k, v, documents=[20, 20], positions=positions)


def test_documents_of_one_length_back_to_back_are_viewed_not_copied_and_stay_exact():
    """Equal documents that tile a row are handed to the backend as a strided view of the packed tensors; outputs
    and gradients equal the documents run alone."""
    from attnzoo.packing import _Gather

    q, k, v = qkv(n=48)
    view = _Gather.apply(q, ((0, 0, 16), (0, 16, 32), (0, 32, 48)))
    assert view.data_ptr() == q.data_ptr() and view.shape == (3, 4, 16, 8)
    variant = attnzoo.compile("selective", backend="blocked")
    got = variant(q, k, v, documents=[16, 16, 16])
    want = alone(attnzoo.compile("selective", backend="reference"), q, k, v, None, [16, 16, 16])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("spec, budget", [("selective-pruned", 48), ("h2o", 40), ("streaming", 32),
                                          ("forgetting", None), ("selective-ssa", None)])
def test_a_packed_prefill_fills_one_cache_row_per_document_as_if_each_were_alone(spec, budget):
    """Three prompts packed in one row (1, 63, 200 tokens) prefilled into a cache of batch 3, then 4 decoding
    steps with one row per document: outputs and the real tokens each row keeps equal each document prefilled and
    decoded alone with the same budget (selective attention's F, H2O's scores, the forgetting gate's running D)."""
    variant = attnzoo.compile(spec, backend="blocked")
    h, hkv, d = 4, 2, 8
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, h, 264, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, 264, d, generator=gen, dtype=torch.float64) for _ in range(2))
    steps = [torch.randn(3, x, 4, d, generator=gen, dtype=torch.float64) for x in (h, hkv, hkv)]
    cache = variant.new_cache(batch=3, budget=budget)
    packed = [variant.prefill(q, k, v, cache, documents=LENGTHS)]
    packed += [variant.decode(*(t[:, :, i:i + 1] for t in steps), cache) for i in range(4)]
    start = 0
    for row, length in enumerate(LENGTHS):
        tokens = slice(start, start + length)
        own = variant.new_cache(batch=1, budget=budget)
        want = [variant.prefill(q[:, :, tokens], k[:, :, tokens], v[:, :, tokens], own)]
        want += [variant.decode(*(t[row:row + 1, :, i:i + 1] for t in steps), own) for i in range(4)]
        torch.testing.assert_close(packed[0][:, :, tokens], want[0], rtol=0, atol=1e-12)
        for got, expected in zip(packed[1:], want[1:], strict=True):
            torch.testing.assert_close(got[row:row + 1], expected, rtol=0, atol=1e-12)
        real = cache.valid[row, 0] if cache.valid is not None else torch.ones(cache.num_tokens, dtype=torch.bool)
        kept = sorted(cache.positions[row, 0][real].tolist())
        assert kept == sorted(own.positions[0, 0].tolist()), (row, kept)
        start += length


def test_a_packed_prefill_needs_an_empty_cache_with_a_row_per_document():
    variant = attnzoo.compile("vanilla")
    q, k, v = qkv(n=40)
    with pytest.raises(ValueError, match=r"^a packed prefill fills one row of an empty cache per document: make it "
                                         r"with new_cache\(batch=2\), got batch 1 holding 0 tokens$"):
        variant.prefill(q, k, v, variant.new_cache(batch=1), documents=[10, 30])


def test_cu_seqlens_of_any_integer_dtype_give_the_same_documents():
    variant = attnzoo.compile("forgetting", backend="blocked")
    q, k, v = qkv(b=2, n=40)
    want = variant(q, k, v, documents=torch.tensor([0, 10, 40, 65, 71]))
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.uint16):
        got = variant(q, k, v, documents=torch.tensor([0, 10, 40, 65, 71], dtype=dtype))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device: a CUDA GPU")
def test_cu_seqlens_on_another_device_than_q_is_refused_and_on_the_cpu_is_taken():
    q, k, v = (t.detach().cuda() for t in qkv(n=40))
    variant = attnzoo.compile("vanilla", backend="reference")
    with pytest.raises(ValueError, match=r"^cu_seqlens: on cuda:0 but q is on cpu; put it on q's device or on the "
                                         r"CPU$"):
        variant(q.cpu(), k.cpu(), v.cpu(), documents=torch.tensor([0, 10, 40], device="cuda"))
    on_cpu = variant(q, k, v, documents=torch.tensor([0, 10, 40]))
    on_gpu = variant(q, k, v, documents=torch.tensor([0, 10, 40], device="cuda"))
    torch.testing.assert_close(on_cpu, on_gpu, rtol=0, atol=1e-12)


def _padding_case(backend):
    """(spec, dtype, needs grad) of each backend's packed path on CPU: flex computes forward only and takes no
    accumulator; triton (TRITON_INTERPRET=1, from conftest) takes no float64."""
    return {"reference": ("selective-ssa", torch.float64, True), "blocked": ("selective-ssa", torch.float64, True),
            "triton": ("selective-ssa", torch.float32, True), "flex": ("vanilla", torch.float32, False)}[backend]


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton", "flex"])
def test_a_batch_of_nothing_but_padding_gives_zeros_in_the_graph_with_zero_gradients(backend):
    """Every id -1: out is 0 and F is 0 (B, N, N) in the accumulator's dtype, both nodes of the inputs' graph, so
    backward() works and q, k, v and every parameter get a gradient of exactly 0; NaN in the padding never
    leaks (no arithmetic touches it)."""
    if backend == "triton":
        pytest.importorskip("triton")
    spec, dtype, grad = _padding_case(backend)
    variant = attnzoo.compile(spec, backend=backend)
    q, k, v = (t.detach().to(dtype).requires_grad_(grad) for t in qkv(b=2, n=12))
    with torch.no_grad():
        q[0, 0, 0, 0] = float("nan")
    params = {key: p.requires_grad_(grad) for key, p in variant.init_params(4, 8, 2, dtype=dtype).items()}
    ids = torch.full((2, 12), -1)
    out, f = variant(q, k, v, params=params, documents=ids, return_accumulated=True)
    assert out.shape == (2, 4, 12, 8) and out.dtype == dtype and int(torch.count_nonzero(out)) == 0
    if spec == "vanilla":
        assert f is None
    else:
        assert f.shape == (2, 12, 12) and f.dtype == accumulator_dtype(dtype) and int(torch.count_nonzero(f)) == 0
    if not grad:
        return
    assert out.grad_fn is not None and f.grad_fn is not None
    (out.sum() + f.sum()).backward()
    for tensor in (q, k, v, *params.values()):
        assert tensor.grad is not None and tensor.grad.shape == tensor.shape and tensor.grad.dtype == tensor.dtype
        assert int(torch.count_nonzero(tensor.grad)) == 0


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton"])
def test_rows_of_only_padding_beside_rows_with_documents_equal_the_documents_run_alone(backend):
    """Row 1 all padding, rows 0 and 2 with documents (and trailing padding): outputs, F, and the gradients of
    q, k, v and the parameters (summed over documents) equal each document run alone with the reference."""
    if backend == "triton":
        pytest.importorskip("triton")
    spec, dtype, _ = _padding_case(backend)
    variant = attnzoo.compile(spec, backend=backend)
    ref = attnzoo.compile(spec, backend="reference")
    q, k, v = (t.detach().to(dtype).double().requires_grad_() for t in qkv(b=3, n=20, seed=3))
    params = {key: p.requires_grad_() for key, p in ref.init_params(4, 8, 2, dtype=torch.float64).items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    ids = torch.tensor([[0] * 7 + [1] * 13, [-1] * 20, [2] * 16 + [-1] * 4])
    cast = [t.to(dtype) for t in (q, k, v)]
    out, f = variant(*cast, params={key: p.to(dtype) for key, p in params.items()}, documents=ids,
                     return_accumulated=True)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * weight).sum(), (q, k, v, *params.values()))
    want_out = torch.zeros(3, 4, 20, 8, dtype=torch.float64)
    want_f = torch.zeros(3, 20, 20, dtype=torch.float64)
    for row, start, stop in ((0, 0, 7), (0, 7, 20), (2, 0, 16)):
        part, part_f = ref(q[row:row + 1, :, start:stop], k[row:row + 1, :, start:stop],
                           v[row:row + 1, :, start:stop], params=params, return_accumulated=True)
        want_out[row, :, start:stop] = part[0]
        want_f[row, start:stop, start:stop] = part_f[0]
    want = torch.autograd.grad((want_out * weight).sum(), (q, k, v, *params.values()))
    atol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), want_out.detach(), rtol=0, atol=atol)
    torch.testing.assert_close(f.double(), want_f.detach(), rtol=0, atol=atol)
    assert int(torch.count_nonzero(out[1])) == 0 and int(torch.count_nonzero(got[0][1])) == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=50 * atol)

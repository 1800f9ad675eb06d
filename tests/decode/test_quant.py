"""Keys and values held in 8, 4, 3 or 2 bits between decoding steps (attnzoo/decode/quant.py, ``KVCache.pack``;
issue 52).

Every comparison of floats is to a tolerance: the quantizer's bound (half a scale per element), or a loose one where
the whole decode is compared with full precision."""

import gc
import weakref

import pytest
import torch

import attnzoo
from attnzoo.decode import quant

EVICTORS = ["h2o", "tova", "snapkv", "streaming", "knorm", "keydiff", "selective-pruned"]


def within_half_scale(x: torch.Tensor, q: quant.QuantizedRows) -> None:
    """Every element of ``x`` within half its token's scale of its dequantized value (and float32's rounding); for
    rotated codes, in the rotated coordinates (``rotate(x)`` against the codes before they are rotated back)."""
    if q.rotated:
        x, q = quant.rotate(x.double()), q._replace(rotated=False)
    back = quant.dequantize(q, torch.float64)
    half = q.scale.double().unsqueeze(-1) / 2
    slack = 1e-6 * (x.double().abs() + q.zero.double().abs().unsqueeze(-1)) + 1e-12
    assert bool(((back - x.double()).abs() <= half * (1 + 1e-6) + slack).all())


# -- the quantizer, by hand --------------------------------------------------------------------------------------------
def test_8_bits_by_hand():
    # min -2, max -2 + 255 * 0.0625: zero -2 and scale 0.0625 are float16 numbers, so they are exactly these
    x = torch.tensor([-2.0, -2.0 + 0.0625 * 100, -2.0 + 15.9375, 0.03]).view(1, 1, 1, 4)
    q = quant.quantize(x, 8)
    assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    assert float(q.zero) == -2.0 and float(q.scale) == 0.0625
    # 0.03 - (-2) = 2.03 = 32.48 scales: code 32, back at -2 + 2 = 0, 0.03 away (< 0.0625 / 2)
    assert q.codes.view(-1).tolist() == [0, 100, 255, 32]
    back = quant.dequantize(q).view(-1)
    assert back[:3].tolist() == pytest.approx([-2.0, 4.25, 13.9375], abs=1e-6)
    assert float(back[3]) == pytest.approx(0.0, abs=1e-6)
    within_half_scale(x, q)


def test_4_bits_by_hand_and_the_packing():
    x = torch.tensor([0.0, 0.375, 1.875, 1.0, 0.5, 0.06]).view(1, 1, 1, 6)  # scale 1.875 / 15 = 0.125
    q = quant.quantize(x, 4)
    assert float(q.zero) == 0.0 and float(q.scale) == 0.125
    codes = [0, 3, 15, 8, 4, 0]  # 0.06 / 0.125 = 0.48: code 0
    assert q.codes.shape == (1, 1, 1, 3)
    # element 2i in the low nibble, 2i + 1 in the high one
    assert q.codes.view(-1).tolist() == [0 | 3 << 4, 15 | 8 << 4, 4 | 0 << 4]
    assert quant.unpack_nibbles(q.codes).view(-1).tolist() == codes
    assert quant.dequantize(q).view(-1).tolist() == pytest.approx([c * 0.125 for c in codes], abs=1e-7)
    within_half_scale(x, q)


def test_nibbles_by_hand():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert quant.unpack_nibbles(packed).tolist() == codes.tolist()


def test_2_bits_by_hand_and_the_packing():
    # zero 0, scale 3 / 3 = 1 (float16 numbers); 0.4 -> 0, 2.6 -> 3, 1.5 -> 2 (a tie: to even), 0.2 -> 0
    x = torch.tensor([0.0, 1.0, 3.0, 2.0, 0.4, 2.6, 1.5, 0.2]).view(1, 1, 1, 8)
    q = quant.quantize(x, 2)
    assert float(q.zero) == 0.0 and float(q.scale) == 1.0
    codes = [0, 1, 3, 2, 0, 3, 2, 0]
    assert q.codes.shape == (1, 1, 1, 2) and q.codes.dtype == torch.uint8
    # element 4i + j in bits 2j and 2j + 1 of byte i: byte 0 = 00 01 11 10 read from bit 0 up
    assert q.codes.view(-1).tolist() == [0b10_11_01_00, 0b00_10_11_00]
    assert q.codes.view(-1).tolist() == [0 | 1 << 2 | 3 << 4 | 2 << 6, 0 | 3 << 2 | 2 << 4 | 0 << 6]
    assert quant.unpack_codes(q.codes, 2).view(-1).tolist() == codes
    assert quant.dequantize(q).view(-1).tolist() == pytest.approx([float(c) for c in codes], abs=1e-7)
    within_half_scale(x, q)


def test_3_bits_by_hand_and_the_packing():
    # zero 0, scale 7 / 7 = 1; 5.2 -> 5, 1.6 -> 2, 1.4 -> 1, 3.3 -> 3, 3.5 -> 4 (a tie: to even)
    x = torch.tensor([5.2, 0.0, 7.0, 1.6, 1.4, 6.0, 3.3, 3.5]).view(1, 1, 1, 8)
    q = quant.quantize(x, 3)
    assert float(q.zero) == 0.0 and float(q.scale) == 1.0
    codes = [5, 0, 7, 2, 1, 6, 3, 4]
    assert q.codes.shape == (1, 1, 1, 3)
    # one 24-bit string, element j at bits 3j to 3j + 2 (least significant first), byte k its bits 8k to 8k + 7:
    #   bits  0- 7: 5 = 101, 0 = 000, and the low two bits of 7 (11)  -> read from bit 7 down: 11 000 101
    #   bits  8-15: the third bit of 7 (1), 2 = 010, 1 = 001, the low bit of 6 (0)  -> 0 001 010 1
    #   bits 16-23: the two high bits of 6 (11), 3 = 011, 4 = 100  -> 100 011 11
    assert q.codes.view(-1).tolist() == [0b11_000_101, 0b0_001_010_1, 0b100_011_11]
    assert q.codes.view(-1).tolist() == [197, 21, 143]
    assert quant.unpack_codes(q.codes, 3).view(-1).tolist() == codes
    assert quant.dequantize(q).view(-1).tolist() == pytest.approx([float(c) for c in codes], abs=1e-7)
    within_half_scale(x, q)


@pytest.mark.parametrize("bits", quant.BITS)
def test_packed_codes_round_trip_and_every_code_is_its_bits(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 2, 5, 16), generator=g, dtype=torch.uint8)
    packed = quant.pack_codes(codes, bits)
    assert packed.shape == (3, 2, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_codes(packed, bits), codes)
    # the little-endian bit string, read back one bit at a time
    stream = [(byte >> i) & 1 for byte in packed[1, 1, 2].tolist() for i in range(8)]
    for j, c in enumerate(codes[1, 1, 2].tolist()):
        assert sum(stream[j * bits + i] << i for i in range(bits)) == c


@pytest.mark.parametrize(("bits", "d", "words"), [(4, 5, "even"), (3, 12, "a multiple of 8"),
                                                   (2, 6, "a multiple of 4")])
def test_a_head_size_the_packing_cannot_hold_whole_is_refused(bits, d, words):
    with pytest.raises(ValueError, match=f"head size must be {words}, got {d}") as info:
        quant.quantize(torch.randn(1, 1, 2, d), bits)
    assert "\n" not in str(info.value)
    quant.quantize(torch.randn(1, 1, 2, 8), bits)  # a multiple of 8: every width


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_token_is_nan_and_only_that_token_at_3_and_2_bits(bits, bad):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 4, 8)
    x[0, 1, 2, 3] = bad
    for rotate in (False, True):
        q = quant.quantize(x, bits, rotate)
        back = quant.dequantize(q)
        assert bool(back[0, 1, 2].isnan().all()) and bool(q.scale[0, 1, 2].isnan())
        others = torch.ones(1, 2, 4, dtype=torch.bool)
        others[0, 1, 2] = False
        assert bool(back[others].isfinite().all()) and bool(q.scale[others].isfinite().all())
        within_half_scale(x[others].view(1, 1, 7, 8), quant.QuantizedRows(
            q.codes[others].view(1, 1, 7, -1), q.scale[others].view(1, 1, 7), q.zero[others].view(1, 1, 7), bits, 8,
            q.rotated))


def test_the_zero_point_rounds_down_and_the_scale_up_so_the_range_is_covered():
    x = torch.tensor([0.1, 0.7, 0.3, 0.1, 0.1, 0.2, 0.6, 0.5]).view(1, 1, 1, 8)  # 0.1, 0.6 / 255: not float16
    for bits in quant.BITS:
        q = quant.quantize(x, bits)
        z, s = float(q.zero), float(q.scale)
        assert z <= 0.1 and z > 0.1 - 1e-4
        assert z + ((1 << bits) - 1) * s >= 0.7
        within_half_scale(x, q)


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_within_half_a_scale(bits, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 8) * torch.logspace(-4, 3, 17).view(1, 1, 17, 1)
    x[0, 0, 0] = 0.0  # a constant row: scale 0, exact
    x[1, 2, 3] = 1000.0 + torch.randn(8) * 1e-3  # far from 0: the zero point's float16 step sets the scale
    x = x.to(dtype)
    q = quant.quantize(x, bits)
    assert q.scale.shape == x.shape[:3] and bool((q.scale >= 0).all())
    levels = (1 << bits) - 1
    rows = x.double()
    assert bool((q.zero.double() <= rows.amin(-1)).all())
    assert bool((q.zero.double() + levels * q.scale.double() >= rows.amax(-1) * (1 - 1e-7) - 1e-12).all())
    within_half_scale(x, q)
    assert float(quant.dequantize(q)[0, 0, 0].abs().max()) == 0.0


def test_refusals_are_one_line():
    for bad in (1, 5, 16, True, 8.0, "8", None):
        with pytest.raises(ValueError, match="kv_bits must be 8, 4, 3 or 2") as info:
            quant.check_bits(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="head size must be even") as info:
        quant.quantize(torch.randn(1, 1, 2, 5), 4)
    assert "\n" not in str(info.value)
    quant.quantize(torch.randn(1, 1, 2, 5), 8)  # 8 bits: any head size
    for row in ([-7e4, 0.0], [0.0, 7e4 * 255], [1e6, 1e6]):  # a zero point or a scale beyond float16
        with pytest.raises(ValueError, match="beyond float16's range") as info:
            quant.quantize(torch.tensor(row).view(1, 1, 1, 2), 8)
        assert "\n" not in str(info.value)
    assert quant.quantize(torch.tensor([-6e4, 6e4]).view(1, 1, 1, 2), 8).scale.isfinite().all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_token_is_nan_and_only_that_token(bad):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 4, 6)
    x[0, 1, 2, 3] = bad
    for bits in (8, 4):
        q = quant.quantize(x, bits)
        back = quant.dequantize(q)
        assert bool(back[0, 1, 2].isnan().all())
        others = torch.ones(1, 2, 4, dtype=torch.bool)
        others[0, 1, 2] = False
        assert bool(back[others].isfinite().all())
        assert bool(q.scale[others].isfinite().all())
        kept = x.clone()
        kept[0, 1, 2] = 0.0
        within_half_scale(kept[others].view(1, 1, -1, 6), quant.QuantizedRows(
            q.codes[others].view(1, 1, 7, -1), q.scale[others].view(1, 1, 7), q.zero[others].view(1, 1, 7), bits, 6))


# -- rotated (Hadamard) codes -----------------------------------------------------------------------------------------
def test_the_hadamard_rotation_by_hand():
    r = 2 ** -0.5
    assert quant.hadamard(2).view(-1).tolist() == pytest.approx([r, r, r, -r])
    h4 = quant.hadamard(4, torch.float64)
    assert (h4 * 2).tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    assert [quant.rotation_block(d) for d in (64, 80, 96, 6, 5, 1, 0)] == [64, 16, 32, 2, 1, 1, 1]
    # D = 6: three blocks of 2; [3, 1] -> [4, 2] / sqrt 2
    x = torch.tensor([3.0, 1.0, 0.0, 2.0, -1.0, -1.0], dtype=torch.float64)
    assert quant.rotate(x).tolist() == pytest.approx([4 * r, 2 * r, 2 * r, -2 * r, -2 * r, 0.0])
    odd = torch.randn(2, 5)
    assert quant.rotate(odd) is odd  # no power-of-two block: no rotation
    with pytest.raises(ValueError, match="power of two, got 6"):
        quant.hadamard(6)


@pytest.mark.parametrize("d", [64, 80, 6])
def test_rotation_is_orthonormal_and_its_own_inverse(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 2, 7, d, generator=g, dtype=torch.float64)
    y = quant.rotate(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(quant.rotate(y), x, rtol=1e-12, atol=1e-12)
    q = torch.randn(d, dtype=torch.float64, generator=g)  # dot products (attention logits) are kept
    torch.testing.assert_close(y @ quant.rotate(q), x @ q, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bits", quant.BITS)
def test_rotated_codes_round_trip_within_half_a_scale_in_rotated_coordinates(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 9, 64, generator=g)
    q = quant.quantize(x, bits, rotate=True)
    assert q.rotated and q.codes.shape == quant.quantize(x, bits).codes.shape  # the same bytes held
    within_half_scale(x, q)
    # in the head's own coordinates: each token's error has the same Euclidean norm, <= sqrt(D) * scale / 2
    err = (quant.dequantize(q, torch.float64) - x.double()).norm(dim=-1)
    assert bool((err <= 8 * q.scale.double() / 2 * (1 + 1e-5) + 1e-6).all())
    assert quant.quantize(torch.randn(1, 1, 2, 5), 8, rotate=True).rotated is False  # odd D: nothing to rotate


def test_rotation_shrinks_the_error_of_keys_with_outlier_channels():
    # pretrained keys have a few channels far larger than the rest: unrotated, they set every token's scale
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 256, 64, generator=g)
    x[..., [3, 40]] *= 30.0
    for bits in quant.BITS:
        plain = (quant.dequantize(quant.quantize(x, bits)) - x).pow(2).mean()
        rotated = (quant.dequantize(quant.quantize(x, bits, rotate=True)) - x).pow(2).mean()
        assert float(rotated) < 0.25 * float(plain), (bits, float(rotated), float(plain))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_token_rotated_is_nan_and_only_that_token(bad):
    x = torch.randn(1, 1, 5, 8)
    x[0, 0, 2, 1] = bad
    back = quant.dequantize(quant.quantize(x, 4, rotate=True))
    assert bool(back[0, 0, 2].isnan().all())
    others = [0, 1, 3, 4]
    assert bool(back[0, 0, others].isfinite().all())
    torch.testing.assert_close(back[0, 0, others], x[0, 0, others], rtol=0, atol=0.5)


def test_a_cache_packs_rotated_unless_told_otherwise():
    torch.manual_seed(2)
    out, cache = decode_run("h2o", 4)
    assert cache._packed.rotated and cache._packed.values.rotated
    cache.pack(4, rotate=False)  # another layout: unpacked and packed again, unrotated
    assert not cache._packed.rotated and cache.packed_bits == 4
    plain, _ = decode_run("h2o", 4, rotate=False)
    full, _ = decode_run("h2o", None)
    assert float((out - full).abs().max()) < 0.5 and float((plain - full).abs().max()) < 0.5


def test_quantized_nbytes():
    assert quant.quantized_nbytes(2, 3, 5, 64, 8) == 2 * 3 * 5 * (64 + 4)
    assert quant.quantized_nbytes(2, 3, 5, 64, 4) == 2 * 3 * 5 * (32 + 4)
    assert quant.quantized_nbytes(2, 3, 5, 64, 3) == 2 * 3 * 5 * (24 + 4)
    assert quant.quantized_nbytes(2, 3, 5, 64, 2) == 2 * 3 * 5 * (16 + 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.quantized_nbytes(1, 1, 1, 12, 3)
    for bits in quant.BITS:
        assert quant.quantize(torch.randn(2, 3, 5, 64), bits).nbytes == quant.quantized_nbytes(2, 3, 5, 64, bits)


# -- a KVCache packed between steps ------------------------------------------------------------------------------------
def decode_run(spec, bits, *, steps=8, batch=2, budget=10, dtype=torch.float32, seed=0, forget=False, check=None,
               rotate=True):
    """Prefill 16 tokens and decode ``steps`` more, packing after each step when ``bits``; the outputs."""
    torch.manual_seed(seed)
    layer = attnzoo.nn.Attention(spec, num_heads=4, head_dim=16, num_kv_heads=2)
    cache = layer.new_cache(batch=batch, budget=budget)
    g = torch.Generator().manual_seed(seed + 1)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    outs = [layer.prefill(rand(batch, 4, 16, 16), rand(batch, 2, 16, 16), rand(batch, 2, 16, 16), cache)[:, :, -1:]]
    for _ in range(steps):
        if bits:
            cache.pack(bits, rotate)
            if check is not None:
                check(cache)
        if forget:
            cache.step_state.forget()
        outs.append(layer.decode(rand(batch, 4, 1, 16), rand(batch, 2, 1, 16), rand(batch, 2, 1, 16), cache))
    if bits:
        cache.pack(bits, rotate)
    return torch.cat(outs, dim=2), cache


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("spec", EVICTORS)
def test_every_evictor_decodes_packed(spec, bits):
    def packed(cache):
        assert cache.packed_bits == bits and "_k" not in cache.__dict__ and "_v" not in cache.__dict__
        assert cache.num_tokens <= 10

    out, cache = decode_run(spec, bits, check=packed)
    full, _ = decode_run(spec, None)
    assert out.shape == full.shape and bool(out.isfinite().all())
    assert cache.memory()["kv_bits"] == bits and cache.num_tokens == 10
    if spec in ("streaming", "h2o", "tova", "selective-pruned") and bits in (8, 4):  # the same set kept: close
        tol = 0.05 if bits == 8 else 0.5
        assert float((out - full).abs().max()) < tol


@pytest.mark.parametrize("spec", ["h2o", "selective-pruned", "streaming", "snapkv"])
def test_the_fast_steps_decode_packed_as_the_full_path(spec):
    fast, cache = decode_run(spec, 8)
    full, _ = decode_run(spec, 8, forget=True)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-5)
    # packing keeps the fast step that the full path chose (snapkv's is h2o's): still ready once unpacked
    assert cache.step_state.fast is not None
    assert cache.lean_step_kind is not None


@pytest.mark.parametrize("bits", quant.BITS)
def test_nbytes_counts_what_is_held(bits):
    _, cache = decode_run("h2o", bits, batch=3, budget=12)
    b, hkv, m, d = 3, 2, 12, 16
    codes = {8: 16, 4: 8, 3: 6, 2: 4}[bits]  # bytes of a token's codes at D = 16
    for q in (cache._packed.keys, cache._packed.values):
        assert q.codes.shape == (b, hkv, m, codes) and q.codes.dtype == torch.uint8
        assert q.scale.shape == q.zero.shape == (b, hkv, m) and q.scale.dtype == q.zero.dtype == torch.float16
    state = sum(t.numel() * t.element_size() for t in cache.state.values())
    assert state == b * hkv * m * 4 * len(cache.state)  # float32 scores
    expected = 2 * b * hkv * m * (codes + 2 + 2) + b * hkv * m * 8 + state  # K, V (codes, scale, zero), positions
    assert cache.nbytes == expected == cache.memory()["bytes"]
    assert cache.capacity_bytes >= cache.nbytes
    cache.unpack()
    assert cache.nbytes == 2 * b * hkv * m * d * 4 + b * hkv * m * 8 + state


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("spec", ["vanilla", "h2o"])
def test_a_packed_step_attends_over_the_dequantized_rows(spec, bits):
    # what a packed cache attends is its dequantized rows and the step's own token in full precision: softmax(q k^T
    # / sqrt(D)) v written out by hand over them (float64, no budget reached: nothing evicted)
    g = torch.Generator().manual_seed(bits)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    layer = attnzoo.nn.Attention(spec, num_heads=4, head_dim=16, num_kv_heads=2).double()
    cache = layer.new_cache(batch=2, budget=None if spec == "vanilla" else 32)
    layer.prefill(rand(2, 4, 12, 16), rand(2, 2, 12, 16), rand(2, 2, 12, 16), cache)
    for _ in range(3):
        cache.pack(bits)
        held_k, held_v = cache.keys, cache.values  # dequantized; the cache stays packed
        assert cache.packed_bits == bits
        q, k, v = rand(2, 4, 1, 16), rand(2, 2, 1, 16), rand(2, 2, 1, 16)
        out = layer.decode(q, k, v, cache)
        keys = torch.cat([held_k, k], 2).repeat_interleave(2, dim=1)  # two query heads a key/value head
        values = torch.cat([held_v, v], 2).repeat_interleave(2, dim=1)
        expected = torch.softmax(q @ keys.transpose(-1, -2) / 4.0, dim=-1) @ values
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    assert cache.num_tokens == 15


def test_the_float_buffers_are_released_between_steps():
    _, cache = decode_run("h2o", None, steps=3)  # the fused h2o step holds its buffers
    kref, vref = weakref.ref(cache.__dict__["_k"]), weakref.ref(cache.__dict__["_v"])
    before = cache.nbytes
    cache.pack(8)
    gc.collect()
    assert kref() is None and vref() is None
    assert cache.nbytes < before / 2  # D = 16: 16 + 4 bytes a token and head for 64 in float32
    _, cache = decode_run("h2o", 8, steps=3)
    assert "_k" not in cache.__dict__


def codes_recorder():
    """A check for :func:`decode_run` that fails when a token held from one step to the next changes its codes."""
    seen = {}

    def record(cache):
        positions = cache.positions  # in position order: so are the codes then
        keys, values = cache._packed.keys.codes, cache._packed.values.codes
        for b in range(cache.batch):
            for h in range(keys.shape[1]):
                for slot, pos in enumerate(positions[b, h].tolist()):
                    now = (keys[b, h, slot].tolist(), values[b, h, slot].tolist())
                    assert seen.setdefault((b, h, pos), now) == now, (b, h, pos)  # quantized once, never again

    return record


@pytest.mark.parametrize(("spec", "bits"), [("h2o", 4), ("snapkv", 8), ("selective-pruned", 8), ("h2o", 2),
                                            ("snapkv", 3)])
def test_held_tokens_keep_their_codes_from_step_to_step(spec, bits):
    decode_run(spec, bits, steps=12, check=codes_recorder())


def test_views_read_while_packed_are_dequantized_and_leave_it_packed():
    _, cache = decode_run("h2o", 8)
    keys, values = cache.keys, cache.values
    assert cache.packed_bits == 8 and keys.shape == (2, 2, 10, 16) and values.dtype == torch.float32
    q = cache._packed.keys
    torch.testing.assert_close(keys, quant.dequantize(q))
    _ = (cache.positions, cache.state, cache.valid, cache.nbytes, cache.memory(), repr(cache), len(cache),
         cache.next_position, cache.key_mask())
    assert cache.packed_bits == 8 and "_k" not in cache.__dict__  # none of these unpacks
    cache.unpack()
    assert cache.packed_bits is None
    torch.testing.assert_close(cache.keys, keys)
    cache.pack(8)
    cache.keys = keys.clone()  # setting rows unpacks first
    assert cache.packed_bits is None and cache.num_tokens == 10


def test_reading_the_buffers_unpacks():
    _, cache = decode_run("tova", 8)
    assert cache._k.shape[2] >= 11 and cache.packed_bits is None  # room for the step's spare slot


def test_left_padded_rows_decode_packed_as_alone():
    spec, budget, bits = "h2o", 6, 8
    torch.manual_seed(3)
    layer = attnzoo.nn.Attention(spec, num_heads=4, head_dim=16, num_kv_heads=2).double()
    t = 12
    q, k, v = (torch.randn(2, h, t, 16, dtype=torch.float64) for h in (4, 2, 2))
    real = torch.ones(2, t, dtype=torch.bool)
    real[1, :5] = False
    steps = [tuple(torch.randn(2, h, 1, 16, dtype=torch.float64) for h in (4, 2, 2)) for _ in range(6)]
    batch = layer.new_cache(batch=2, budget=budget)
    outs = [layer.prefill(q, k, v, batch, key_mask=real)[:, :, -1:]]
    for qs, ks, vs in steps:
        batch.pack(bits)
        outs.append(layer.decode(qs, ks, vs, batch))
    batch.pack(bits)
    alone = layer.new_cache(batch=1, budget=budget)
    one = [layer.prefill(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], alone)[:, :, -1:]]
    for qs, ks, vs in steps:
        alone.pack(bits)
        one.append(layer.decode(qs[1:], ks[1:], vs[1:], alone))
    alone.pack(bits)
    torch.testing.assert_close(torch.cat(outs, 2)[1:], torch.cat(one, 2), rtol=1e-9, atol=1e-9)
    assert batch.positions[1].tolist() == alone.positions[0].tolist()
    torch.testing.assert_close(batch.keys[1:], alone.keys, rtol=1e-9, atol=1e-9)


def test_beam_reorder_moves_the_codes():
    _, cache = decode_run("h2o", 8, batch=2)
    keys, positions = cache.keys, cache.positions
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.packed_bits == 8 and "_k" not in cache.__dict__ and cache.batch == 3
    torch.testing.assert_close(cache.keys, keys[[1, 1, 0]])
    assert cache.positions.tolist() == positions[[1, 1, 0]].tolist()
    layer = attnzoo.nn.Attention("h2o", num_heads=4, head_dim=16, num_kv_heads=2)
    out = layer.decode(torch.randn(3, 4, 1, 16), torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16), cache)
    cache.pack(8)
    assert out.shape == (3, 4, 1, 16) and bool(out.isfinite().all()) and cache.num_tokens == 10


def test_beam_reorder_between_unpack_and_pack_keeps_the_codes():
    _, cache = decode_run("streaming", 8, batch=2)
    _ = cache.positions  # slots in position order (reorder puts them so)
    codes = cache._packed.keys.codes.clone()
    cache.unpack()
    cache.reorder(torch.tensor([1, 0]))
    cache.pack(8)
    assert torch.equal(cache._packed.keys.codes, codes[[1, 0]])


def test_pack_refusals_leave_the_cache_as_it_was():
    layer = attnzoo.nn.Attention("h2o", num_heads=2, head_dim=5, num_kv_heads=1)
    cache = layer.new_cache(batch=1, budget=4)
    layer.prefill(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5), cache)
    with pytest.raises(ValueError, match="head size must be even"):
        cache.pack(4)
    with pytest.raises(ValueError, match="kv_bits must be 8, 4, 3 or 2"):
        cache.pack(16)
    with pytest.raises(ValueError, match="kv_bits=2 packs four codes a byte: the head size must be a multiple of 4"):
        cache.pack(2)
    assert cache.packed_bits is None and cache.keys.shape == (1, 1, 3, 5)
    cache.pack(8)
    assert cache.packed_bits == 8
    cache.pack(8)  # again: nothing to do
    empty = layer.new_cache(batch=1, budget=4)
    empty.pack(8)
    assert empty.packed_bits is None and empty.nbytes == 0


@pytest.mark.parametrize("spec", ["vanilla", "h2o", "selective"])
def test_without_a_budget_packed_decodes_close_to_full_precision(spec):
    # no budget: the buffers grow by doubling; the positions keep their room while the rows are packed
    out, cache = decode_run(spec, 8, budget=None, steps=20)
    full, _ = decode_run(spec, None, budget=None, steps=20)
    assert cache.num_tokens == 36 and cache.packed_bits == 8
    torch.testing.assert_close(out, full, rtol=0, atol=0.05)


def test_tokens_after_a_rewind_are_quantized_anew():
    from attnzoo.decode.rewind import mark, rewind

    torch.manual_seed(4)
    layer = attnzoo.nn.Attention("h2o", num_heads=4, head_dim=16, num_kv_heads=2)
    cache = layer.new_cache(batch=1, budget=None)
    layer.prefill(torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), cache)
    cache.pack(8)
    at = mark(cache)
    for _ in range(3):  # tokens at positions 7, 8, 9, then dropped
        layer.decode(torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), cache)
        cache.pack(8)
    rewind(cache, at)
    ks = [torch.randn(1, 2, 1, 16) * 5 for _ in range(3)]  # positions 7, 8, 9 again, other rows
    for k in ks:
        layer.decode(torch.randn(1, 4, 1, 16), k, k, cache)
        cache.pack(8)
    assert cache.positions[0, 0].tolist() == list(range(1, 10))
    q = cache._packed.keys
    assert q.rotated  # what a cache packs unless told otherwise
    tail = quant.QuantizedRows(q.codes[:, :, 6:], q.scale[:, :, 6:], q.zero[:, :, 6:], 8, 16, True)
    within_half_scale(torch.cat(ks, dim=2), tail)


# -- the newest tokens at full precision as well (pack(..., recent=N)) ------------------------------------------------
def test_the_newest_tokens_are_read_at_full_precision_and_the_rest_from_their_codes():
    """``pack(bits, recent=3)``: each row's 3 newest tokens (by position) are read exactly as held, every other
    token from the same codes as ``pack(bits)``'s; their rows are counted in nbytes; after a step the token that is
    no longer among the newest is read from the codes it got when first packed (quantized once); a batch reorder
    while packed moves them with their row; a deep copy keeps them."""
    _, cache = decode_run("vanilla", None, steps=0, budget=None)
    plain = cache.copy()
    keys, values = cache.keys.clone(), cache.values.clone()
    plain.pack(4)
    cache.pack(4, recent=3)
    b, h, m, d = keys.shape
    assert torch.equal(cache.keys[:, :, -3:], keys[:, :, -3:])
    assert torch.equal(cache.values[:, :, -3:], values[:, :, -3:])
    assert torch.equal(cache.keys[:, :, :-3], plain.keys[:, :, :-3])
    assert not torch.equal(cache.keys[:, :, -4], keys[:, :, -4])  # 4 bits: not exact
    assert cache.nbytes == plain.nbytes + 2 * b * h * 3 * d * keys.element_size()
    copied = cache.copy()
    assert torch.equal(copied.keys, cache.keys)
    layer = attnzoo.nn.Attention("vanilla", num_heads=4, head_dim=16, num_kv_heads=2)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, n, 1, 16, generator=g) for n in (4, 2, 2))
    for c in (cache, plain):
        layer.decode(q, k, v, c)
    cache.pack(4, recent=3)
    plain.pack(4)
    assert torch.equal(cache.keys[:, :, -1:], k) and torch.equal(cache.keys[:, :, -3:-1], keys[:, :, -2:])
    assert torch.equal(cache.keys[:, :, -4], plain.keys[:, :, -4])  # left the newest: its first codes
    swapped = cache.keys.flip(0)
    cache.reorder(torch.tensor([1, 0]))
    assert cache.packed_bits == 4 and torch.equal(cache.keys, swapped)


def test_the_exact_rows_follow_their_tokens_when_the_slots_are_put_in_order():
    """A fast step leaves the slots out of position order; putting them back in order while packed moves the codes,
    and the exact rows with their tokens (``PackedKV.gather_tokens`` with a permutation)."""
    exact = quant.quantize(torch.randn(1, 1, 5, 16), 4)
    slots = torch.tensor([[[4, 1]]])
    held = (slots, torch.ones(1, 1, 2, 16), torch.full((1, 1, 2, 16), 2.0))
    packed = quant.PackedKV(exact, exact, torch.float32, held)
    order = torch.tensor([[[3, 4, 0, 2, 1]]])  # new slot j takes old slot order[j]
    moved = packed.gather_tokens(order)
    assert moved.exact[0].tolist() == [[[1, 4]]]  # old slot 4 is now slot 1, old slot 1 now slot 4
    rows = moved.dequantized(0)
    assert torch.equal(rows[0, 0, 1], torch.ones(16)) and torch.equal(rows[0, 0, 4], torch.ones(16))
    assert packed.gather_tokens(torch.tensor([[[0, 1, 2]]])).exact is None  # a subset: read from the codes


@pytest.mark.parametrize("bad", [-1, True, 2.0, "3"])
def test_recent_other_than_an_int_at_least_zero_is_refused_in_one_line(bad):
    _, cache = decode_run("vanilla", None, steps=0, budget=None)
    with pytest.raises(ValueError, match="kv_recent must be an int >= 0") as info:
        cache.pack(4, recent=bad)
    assert "\n" not in str(info.value) and cache.packed_bits is None

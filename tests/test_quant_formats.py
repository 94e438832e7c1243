"""Quant types: spec validation, rtn dispatch, exact storage round trips, bits per weight."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from quant import grids
from quant.formats import (QUANT_TYPES, QuantSpec, decode, encode, pack_ternary_dense, quantize_rtn, storage_bytes,
                           stored_shapes, total_bits_per_weight, unpack_ternary_dense)

PACKED = [t for t in QUANT_TYPES if t != "bf16"]


def random_codes(quant_type: str, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = {"tri": (-1, 1), "tri-dense": (-1, 1), "bin": (-1, 1), "int4": (-7, 7), "int8": (-127, 127)}[quant_type]
    codes = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int8)
    if quant_type == "bin":
        codes = torch.where(codes == 0, torch.ones_like(codes), codes)
    return codes


@pytest.mark.parametrize("quant_type", PACKED)
@pytest.mark.parametrize("shape,group", [((8, 64), 8), ((3, 128), 64), ((5, 40), 40)])
def test_storage_round_trip_is_exact(quant_type, shape, group):
    spec = QuantSpec(quant_type, group)
    codes = random_codes(quant_type, shape)
    scales = torch.rand(shape[0], shape[1] // group) * 0.1
    stored_codes, stored_scales = encode(spec, codes, scales)
    assert (tuple(stored_codes.shape), tuple(stored_scales.shape)) == stored_shapes(spec, shape)
    assert stored_scales.dtype == torch.float16
    back_codes, back_scales = decode(spec, stored_codes, stored_scales, shape)
    assert torch.equal(back_codes, codes)
    assert torch.equal(back_scales, scales.half().float())
    assert storage_bytes(spec, shape) == stored_codes.numel() * stored_codes.element_size() + 2 * stored_scales.numel()


def test_dense_ternary_all_243_bytes_and_padding():
    trits = torch.cartesian_prod(*[torch.tensor([-1, 0, 1])] * 5).to(torch.int8)  # [243, 5]
    packed = pack_ternary_dense(trits)  # [243, 1]
    assert packed.shape == (243, 1) and len(set(packed.flatten().tolist())) == 243
    assert torch.equal(unpack_ternary_dense(packed, 5), trits)
    row = torch.tensor([[1, -1, 0, 1, 1, -1, 1]], dtype=torch.int8)  # 7 codes → 2 bytes
    assert torch.equal(unpack_ternary_dense(pack_ternary_dense(row), 7), row)


def test_dense_ternary_byte_code_is_tq1_0s():
    """Five consecutive trits make the same byte as in llama.cpp's TQ1_0 (gguf's reference quantizer)."""
    rng = np.random.default_rng(0)
    trits = rng.integers(-1, 2, size=(1, 256)).astype(np.float32)
    block = gguf_quants.quantize(trits, T.TQ1_0)[0]  # [54]: qs[32] then qs[16], qh[4], d
    # qs[j] holds elements j, 32+j, 64+j, 96+j, 128+j of the first 160
    first = torch.tensor(trits[0, :160].reshape(5, 32).T.copy(), dtype=torch.int8)  # [32, 5]
    assert torch.equal(pack_ternary_dense(first).flatten(), torch.from_numpy(block[:32].copy()))


def test_dense_ternary_is_at_most_1_6_bits():
    spec = QuantSpec("tri-dense", 128)
    assert storage_bytes(spec, (4096, 4096)) * 8 / 4096 ** 2 == pytest.approx(1.6 + 16 / 128, abs=2e-3)  # ceil(K/5) bytes a row
    assert spec.bits_per_weight == pytest.approx(1.725)


@pytest.mark.parametrize("quant_type,reference", [
    ("tri", lambda w, g: grids.ternary_rtn(w, g)), ("tri-dense", lambda w, g: grids.ternary_rtn(w, g)),
    ("bin", lambda w, g: grids.binary_rtn(w, g)), ("int4", lambda w, g: grids.int_rtn(w, 4, g)),
    ("int8", lambda w, g: grids.int_rtn(w, 8, g))])
def test_rtn_dispatches_to_the_grid(quant_type, reference):
    torch.manual_seed(0)
    w = torch.randn(37, 96)
    codes, scales = quantize_rtn(QuantSpec(quant_type, 32), w)
    ref_codes, ref_scales = reference(w, 32)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales, ref_scales.half().float())  # stored precision


def test_rtn_in_row_chunks_equals_one_piece(monkeypatch):
    import quant.formats as formats
    torch.manual_seed(1)
    w = torch.randn(50, 64)
    whole = quantize_rtn(QuantSpec("tri", 16), w)
    monkeypatch.setattr(formats, "_CHUNK_ELEMENTS", 64 * 7)  # 7 rows per chunk
    chunked = quantize_rtn(QuantSpec("tri", 16), w)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown quant type 'tern'"):
        QuantSpec("tern")
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantSpec("bin", 12)
    with pytest.raises(ValueError, match="positive"):
        QuantSpec("int4", 0)
    with pytest.raises(ValueError, match="does not divide the input dimension 576"):
        QuantSpec("tri", 128).check_shape((64, 576))
    assert QuantSpec.from_bits(4, 64) == QuantSpec("int4", 64)
    with pytest.raises(ValueError, match="3 bits"):
        QuantSpec.from_bits(3, 64)


def test_encode_refuses_codes_off_the_grid():
    with pytest.raises(ValueError, match="outside the tri grid"):
        encode(QuantSpec("tri", 4), torch.tensor([[0, 2, 0, 0]], dtype=torch.int8), torch.ones(1, 1))
    with pytest.raises(ValueError, match="outside the bin grid"):
        encode(QuantSpec("bin", 8), torch.zeros(1, 8, dtype=torch.int8), torch.ones(1, 1))
    with pytest.raises(ValueError, match="float16"):
        encode(QuantSpec("int8", 4), torch.ones(1, 4, dtype=torch.int8), torch.full((1, 1), 1e6))


def test_bits_per_weight():
    assert QuantSpec("tri", 128).bits_per_weight == 2.125
    assert QuantSpec("bin", 128).bits_per_weight == 1.125  # Q1_0's
    assert QuantSpec("int4", 32).bits_per_weight == 4.5  # Q4_0's
    assert QuantSpec("bf16").bits_per_weight == 16
    mix = [(QuantSpec("tri", 128), (256, 256)), (QuantSpec("bf16"), (256, 256))]
    assert total_bits_per_weight(mix) == pytest.approx((2.125 + 16) / 2)

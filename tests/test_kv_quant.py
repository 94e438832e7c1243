"""KV-row quantization maths (quant/kv_quant.py): exact codes on hand cases, round-trip bounds, and
storage that costs exactly what quant/kv_format.py says."""
from __future__ import annotations

import pytest
import torch

from quant.kv_format import row_bytes
from quant.kv_quant import (dequantize_int4, dequantize_int8, dequantize_rows, pack_nibbles, quantize_int4,
                            quantize_int8, quantize_rows, row_parts, unpack_nibbles)


def test_int8_codes_by_hand():
    x = torch.tensor([[127.0, -63.5, 0.0, 1.0, 0.49, -127.0]])  # max|x| = 127: scale exactly 1
    codes, scale = quantize_int8(x)
    assert scale.dtype == torch.float16 and scale.item() == 1.0
    assert codes.tolist() == [[127, -63, 0, 1, 0, -127]]  # floor(y + 0.5): -63.5 → -63
    assert dequantize_int8(codes, scale, torch.float32).tolist() == [[127.0, -63.0, 0.0, 1.0, 0.0, -127.0]]


def test_int8_zero_row_and_huge_row():
    codes, scale = quantize_int8(torch.zeros(2, 8))
    assert (codes == 0).all() and (scale == 0).all()
    codes, scale = quantize_int8(torch.tensor([[1e7, -1e7, 0.0, 5e6]]))  # max|x| / 127 > float16 max
    assert torch.isfinite(scale.float()).all() and codes.abs().max() == 127


def test_int4_codes_and_packing_by_hand():
    x = torch.cat([torch.arange(16.0), torch.arange(16.0)]) - 3.0  # one group: min -3, max 12, scale 1
    packed, scale, minimum = quantize_int4(x[None])
    assert scale.tolist() == [[1.0]] and minimum.tolist() == [[-3.0]]
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert packed[0, :3].tolist() == [0 | 1 << 4, 2 | 3 << 4, 4 | 5 << 4]  # low nibble first
    assert torch.equal(dequantize_int4(packed, scale, minimum, torch.float32), x[None])


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@pytest.mark.parametrize("element", ["int8", "int4"])
def test_round_trip_within_half_a_step(element, one_thread):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 50, 64, generator=g) * torch.rand(4, 3, 50, 1, generator=g) * 10  # rows of mixed scale
    x[0, 0, 0] = 0.0
    parts = quantize_rows(element, x, torch.float32)
    back = dequantize_rows(element, parts, torch.float32)
    step = parts["scale"].float()  # [.., 1] or [.., G]
    if element == "int4":
        step = step.repeat_interleave(32, dim=-1)
        err_bound = step / 2 + parts["min"].float().abs().repeat_interleave(32, dim=-1) * 2 ** -11
    else:
        err_bound = step / 2
    assert ((back - x).abs() <= err_bound * (1 + 1e-3) + 1e-6).all()
    assert (back[0, 0, 0] == 0).all()
    rel = ((back - x).norm() / x.norm()).item()
    assert rel < (0.01 if element == "int8" else 0.12), rel  # int8 ~0.5%, int4 ~8% of a Gaussian row's norm


def test_bfloat16_rows_are_quantized_from_their_values():
    x = (torch.randn(5, 64) * 3).bfloat16()
    for element in ("int8", "int4"):
        parts = quantize_rows(element, x, torch.bfloat16)
        assert torch.equal(dequantize_rows(element, parts, torch.bfloat16),
                           dequantize_rows(element, quantize_rows(element, x.float(), torch.float32), torch.bfloat16))


@pytest.mark.parametrize("element", ["float", "int8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_parts_cost_what_the_format_says(element, head_dim):
    parts = row_parts(element, head_dim, torch.bfloat16)
    stored = sum(n * torch.empty(0, dtype=dtype).element_size() for n, dtype in parts.values())
    assert stored == row_bytes(element, head_dim)
    quantized = quantize_rows(element, torch.randn(2, head_dim), torch.bfloat16)
    assert {name: (t.shape[-1], t.dtype) for name, t in quantized.items()} == parts
    with pytest.raises(ValueError):
        row_parts("int4", 48, torch.bfloat16)


def test_offset_is_subtracted_in_float32_before_quantizing():
    x = torch.randn(3, 64).bfloat16()
    offset = torch.randn(64) * 5
    for element in ("int8", "int4"):
        got = quantize_rows(element, x, torch.bfloat16, offset)
        want = quantize_rows(element, x.float() - offset, torch.float32)
        assert all(torch.equal(got[n], want[n]) for n in want)

"""Low-bit grids and bit packing: pure maths, no model."""
from __future__ import annotations

import itertools

import pytest
import torch

from quant.grids import binary_rtn, dequantize, int_rtn, ternary_rtn
from quant.packing import (bits_per_weight, pack_binary, pack_int4, pack_ternary, unpack_binary, unpack_int4,
                           unpack_ternary)


def brute_force_ternary_error(group: torch.Tensor) -> float:
    """Best L2 error over every support size k with the optimal scale for that support."""
    best = float(group.pow(2).sum())
    mags = group.abs().sort(descending=True).values
    for k in range(1, len(group) + 1):
        alpha = mags[:k].mean()
        best = min(best, float((mags[:k] - alpha).pow(2).sum() + mags[k:].pow(2).sum()))
    return best


def test_ternary_is_optimal_per_group():
    torch.manual_seed(0)
    w = torch.randn(6, 32) * torch.rand(6, 1)
    codes, scales = ternary_rtn(w, group_size=8)
    assert set(codes.unique().tolist()) <= {-1, 0, 1}
    err = (dequantize(codes, scales, 8) - w).pow(2).reshape(6, 4, 8).sum(-1)
    for r, g in itertools.product(range(6), range(4)):
        assert err[r, g] == pytest.approx(brute_force_ternary_error(w[r, g * 8:(g + 1) * 8]), rel=1e-5, abs=1e-7)


def test_ternary_beats_the_twn_threshold_and_keeps_signs():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    codes, scales = ternary_rtn(w, 128)
    ours = (dequantize(codes, scales, 128) - w).pow(2).sum()
    g = w.reshape(64, 2, 128)
    thr = 0.7 * g.abs().mean(-1, keepdim=True)
    twn_codes = torch.where(g.abs() > thr, g.sign(), torch.zeros_like(g))
    twn_scale = (g.abs() * twn_codes.abs()).sum(-1, keepdim=True) / twn_codes.abs().sum(-1, keepdim=True)
    twn = (twn_codes * twn_scale - g).pow(2).sum()
    assert ours <= twn
    nz = codes != 0
    assert torch.equal(codes[nz].float(), w[nz].sign())


def test_zero_group_stays_zero():
    w = torch.zeros(2, 16)
    w[1, :8] = torch.arange(1, 9).float()
    for fn in (ternary_rtn, lambda x, g: int_rtn(x, 4, g)):
        codes, scales = fn(w, 8)
        assert torch.equal(dequantize(codes, scales, 8)[0], torch.zeros(16))
        assert torch.isfinite(scales).all()


def test_binary_scale_is_mean_abs():
    w = torch.tensor([[1.0, -3.0, 0.0, 2.0]])
    codes, scales = binary_rtn(w, 4)
    assert codes.tolist() == [[1, -1, 1, 1]] and scales.tolist() == [[1.5]]


@pytest.mark.parametrize("bits", [4, 8])
def test_int_rtn_error_within_half_a_step(bits):
    torch.manual_seed(2)
    w = torch.randn(8, 256)
    codes, scales = int_rtn(w, bits, 128)
    assert codes.abs().max() <= 2 ** (bits - 1) - 1
    step = scales.repeat_interleave(128, dim=1)
    assert ((dequantize(codes, scales, 128) - w).abs() <= step / 2 + 1e-6).all()


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        ternary_rtn(torch.randn(2, 100), 128)


def test_pack_round_trips_are_exact():
    torch.manual_seed(3)
    tern = torch.randint(-1, 2, (5, 64), dtype=torch.int8)
    assert pack_ternary(tern).shape == (5, 16) and torch.equal(unpack_ternary(pack_ternary(tern)), tern)
    binary = torch.randint(0, 2, (5, 64), dtype=torch.int8) * 2 - 1
    assert pack_binary(binary).shape == (5, 8) and torch.equal(unpack_binary(pack_binary(binary)), binary)
    i4 = torch.randint(-7, 8, (5, 64), dtype=torch.int8)
    assert pack_int4(i4).shape == (5, 32) and torch.equal(unpack_int4(pack_int4(i4)), i4)


def test_bit_layouts_are_as_documented():
    assert pack_ternary(torch.tensor([[-1, 0, 1, 1]], dtype=torch.int8)).tolist() == [[0 | 1 << 2 | 2 << 4 | 2 << 6]]
    assert pack_binary(torch.tensor([[1, -1, -1, -1, -1, -1, -1, 1]], dtype=torch.int8)).tolist() == [[0b10000001]]
    assert pack_int4(torch.tensor([[-8 + 1, 7]], dtype=torch.int8)).tolist() == [[0x01 | 0xF0]]


def test_bits_per_weight():
    assert bits_per_weight(2, 128) == 2.125
    assert bits_per_weight(1, 128) == 1.125
    assert bits_per_weight(4, 32) == 4.5

"""The tensor-core kernel for 2..16 rows (quant/kernels/packed_mma.py) against the exact integer reference.

Covers every packed kind, one group per tile and several (groups with fewer than 32 bytes of codes), the
padded row counts (8 and 16), split-K with atomics and accumulation into the output. Runs in Triton's
interpreter on the CPU (the plain-integer plane extraction), compiled on a GPU (the inline-PTX one).
"""
from __future__ import annotations

import pytest
import torch

from quant.kernels.act_quant import quantize_activations
from quant.kernels.packed_gemv import packed_gemv
from quant.kernels.packed_mma import groups_per_tile, mma_launch_config, mma_supported, packed_mma, packed_mma_reference
from quant.packed_layout import PackedWeight, dequantize, random_packed
from tests.perf.gpu_kern import SHAPES as REAL_SHAPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(kind: str, group: int, n: int = 80, k: int = 256, seed: int = 0) -> PackedWeight:
    pw = random_packed(kind, n, k, group, generator=torch.Generator().manual_seed(group + seed))
    pw.scales.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return pw.to(DEVICE)


@pytest.mark.parametrize("kind,group,rows,config", [
    ("tri", 128, 2, (32, 1, 4, 1)), ("tri", 64, 11, (64, 2, 4, 2)),  # one group a tile; two
    ("bin", 128, 16, (32, 2, 4, 1)), ("bin", 64, 3, (32, 1, 4, 1)),  # two groups a tile; four
    ("int4", 32, 9, (32, 2, 4, 1)), ("int8", 128, 5, (64, 1, 2, 2))])
@pytest.mark.parametrize("x_ahead,word_rows", [(0, False), (1, False), (2, False), (1, True), (2, True)])
def test_mma_matches_reference(kind, group, rows, config, x_ahead, word_rows):
    pw = _packed(kind, group)
    x = torch.randn(rows, 256, device=DEVICE)
    xq = quantize_activations(x, group)
    got = packed_mma(*xq, pw, config=config, x_ahead=x_ahead, word_rows=word_rows)
    torch.testing.assert_close(got, packed_mma_reference(*xq, pw), rtol=1e-5, atol=1e-4)
    dense = x.float() @ dequantize(pw).t()  # and it is the real product, up to the int8 rounding of x
    assert (got - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("kind,group,shape,rows", [
    ("tri", 128, "8b gate_up", 8), ("tri", 64, "8b o", 16), ("int4", 128, "8b down", 2), ("int4", 64, "8b gate_up", 16),
    ("tri", 128, "27b o", 5), ("tri", 64, "27b down", 8), ("int4", 128, "27b down 21504", 12), ("int4", 64, "27b qkv", 4),
    ("bin", 64, "27b gate_up", 8), ("bin", 128, "27b o", 16), ("int8", 64, "8b o", 3), ("int8", 128, "27b gate_up", 8)])
@pytest.mark.parametrize("x_ahead,word_rows", [(0, False), (2, False), (2, True)])
def test_mma_at_real_shapes(kind, group, shape, rows, x_ahead, word_rows):
    """The real K with the split-K partition the real matrix launches (a last split of one tile for the
    27B hidden size), on 40 columns in blocks of 32 (the last ragged): the full width runs in
    tests/perf/gpu_kern.py's checks on the GPU. With tiles and activations loaded ahead, a split's last loads
    fall past its end (masked) and a split of one tile loads nothing ahead."""
    n, k = REAL_SHAPES[shape]
    _, split, warps, stages = mma_launch_config(n, k // group // groups_per_tile(kind, group), rows)
    pw = _packed(kind, group, n=40, k=k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows)).to(DEVICE)
    xq = quantize_activations(x, group)
    got = packed_mma(*xq, pw, config=(32, split, warps, stages), x_ahead=x_ahead, word_rows=word_rows)
    want = packed_mma_reference(*xq, pw)  # K/G float32 terms in another order: tolerance ∝ output size
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_mma_comparison_catches_a_plane_bug():
    """Planted: two word rows of one tile swapped (planes meet the wrong inputs); the kernel must disagree."""
    pw = _packed("tri", 128)
    rows = torch.arange(pw.words.shape[0])
    rows[0], rows[1] = 1, 0
    bad = PackedWeight("tri", pw.words[rows.to(pw.words.device)].contiguous(), pw.scales, 80, 256, 128)
    xq = quantize_activations(torch.randn(4, 256, device=DEVICE), 128)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(packed_mma(*xq, bad, config=(32, 1, 4, 1)), packed_mma_reference(*xq, pw))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(packed_mma(*xq, bad, config=(32, 1, 4, 1), x_ahead=2),
                                   packed_mma_reference(*xq, pw))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(packed_mma(*xq, bad, config=(32, 1, 4, 1), word_rows=True),
                                   packed_mma_reference(*xq, pw))


@pytest.mark.parametrize("split", [1, 2])
def test_mma_accumulates_through_packed_gemv(split):
    pw = _packed("int4", 128)
    xq = quantize_activations(torch.randn(4, 256, device=DEVICE), 128)
    residual = torch.randn(4, 80, device=DEVICE)
    out = residual.clone()
    packed_gemv(*xq, pw, out=out, accumulate=True, config=(32, split, 4, 1), variant="mma")
    torch.testing.assert_close(out, residual + packed_mma_reference(*xq, pw), rtol=1e-5, atol=1e-4)


def test_supported_layouts():
    assert mma_supported("tri", 32) and mma_supported("int8", 256) and mma_supported("bin", 64)
    assert not mma_supported("bin", 32)  # eight groups in one 32-byte tile: left to the dp4a kernels
    assert not mma_supported("tri5", 128) and not mma_supported("tri", 512)
    assert mma_supported("tri", 64, 5120) and not mma_supported("tri", 64, 192)  # 3 groups: two to a tile

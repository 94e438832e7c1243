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
from quant.kernels.packed_mma import mma_supported, packed_mma, packed_mma_reference
from quant.packed_layout import PackedWeight, dequantize, random_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(kind: str, group: int, n: int = 80, k: int = 256) -> PackedWeight:
    pw = random_packed(kind, n, k, group, generator=torch.Generator().manual_seed(group))
    pw.scales.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return pw.to(DEVICE)


@pytest.mark.parametrize("kind,group,rows,config", [
    ("tri", 128, 2, (32, 1, 4, 1)), ("tri", 64, 11, (64, 2, 4, 2)),  # one group a tile; two
    ("bin", 128, 16, (32, 2, 4, 1)), ("bin", 64, 3, (32, 1, 4, 1)),  # two groups a tile; four
    ("int4", 32, 9, (32, 2, 4, 1)), ("int8", 128, 5, (64, 1, 2, 2))])
def test_mma_matches_reference(kind, group, rows, config):
    pw = _packed(kind, group)
    x = torch.randn(rows, 256, device=DEVICE)
    xq = quantize_activations(x, group)
    got = packed_mma(*xq, pw, config=config)
    torch.testing.assert_close(got, packed_mma_reference(*xq, pw), rtol=1e-5, atol=1e-4)
    dense = x.float() @ dequantize(pw).t()  # and it is the real product, up to the int8 rounding of x
    assert (got - dense).abs().max() < 0.05 * dense.abs().max()


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

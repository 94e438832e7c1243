"""The base-3 ternary runtime layout (tri5) and its kernels against plain references.

The layout is checked against an independent reading of its documented byte layout (quant/tri5_layout.py),
the conversions against the gguf package's own TQ1_0 decoder, and the kernels (Triton's interpreter on
the CPU, compiled on a GPU) against the exact integer reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quant.kernels.act_quant import quantize_activations
from quant.kernels.packed_dequant import dequantize_t
from quant.kernels.packed_gemv import packed_gemv
from quant.kernels.tri5_dequant import dequantize_tri5_t_reference
from quant.kernels.tri5_gemv import tri5_gemv, tri5_gemv_reference, tri5_launch_config
from quant.packed_layout import (LAYOUTS, PackedWeight, check_packable, dequantize, pack, packed_nbytes,
                                 random_packed, unpack_codes)
from quant.packed_layout import tri5_from_tq1_0, tri5_from_tri
from tests.perf.gpu_kern import SHAPES as REAL_SHAPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# REAL_SHAPES: the projections of the models these kernels serve (Qwen3-8B and the 27B-class model). Their launch
# configs split K unevenly: 20 super-blocks in splits of 3 (the last has 2), 68 in 23 splits of 3.


def _codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def _read_code(words: torch.Tensor, col: int, k: int) -> int:
    """The code of input k of column col, read from the words by the documented layout, one byte at a time."""
    s, r = divmod(k, 256)
    h, r = divmod(r, 64)
    if r >= 60:  # the tail word: 2-bit field at bits 8j + 2h
        word = int(words[13 * s + 12, col]) & 0xFFFFFFFF
        return ((word >> (8 * (r - 60) + 2 * h)) & 3) - 1
    a, r = divmod(r, 20)
    n, j = divmod(r, 4)
    byte = (int(words[13 * s + 4 * a + h, col]) & 0xFFFFFFFF) >> (8 * j) & 0xFF
    q = byte * 243 // 256  # the base-3 number; its digit n, most significant first
    assert (q * 256 + 242) // 243 == byte, "a byte that is not TQ1_0's code of its number"
    return (q // 3 ** (4 - n)) % 3 - 1


def test_layout_is_the_documented_one():
    codes = _codes(3, 512)
    pw = pack("tri5", codes, torch.ones(3, 4), 128)
    assert pw.words.shape == (26, 3) and pw.words.dtype == torch.int32
    got = [[_read_code(pw.words, c, k) for k in range(512)] for c in range(3)]
    assert torch.equal(torch.tensor(got, dtype=torch.int8), codes)


@pytest.mark.parametrize("group", [64, 128, 256])
def test_pack_roundtrip_and_size(group):
    codes, scales = _codes(5, 768, seed=group), torch.rand(5, 768 // group) + 0.5
    pw = pack("tri5", codes, scales, group)
    assert torch.equal(unpack_codes(pw), codes)
    assert torch.equal(dequantize(pw), (codes.float().reshape(5, -1, group) * scales.half().float()[..., None]).reshape(5, 768))
    assert pw.nbytes == packed_nbytes("tri5", 5, 768, group) == 5 * (768 * 13 // 256 * 4 + 768 // group * 2)
    assert pw.nbytes * 8 / (5 * 768) == 1.625 + 16 / group  # bits per weight


def test_random_packed_is_canonical_and_on_the_grid():
    pw = random_packed("tri5", 64, 512, 128, generator=torch.Generator().manual_seed(1))
    codes = unpack_codes(pw)
    assert set(codes.unique().tolist()) == {-1, 0, 1}
    assert abs(codes.float().mean().item()) < 0.05  # uniform trits
    assert torch.equal(pack("tri5", codes, pw.scales.t().float(), 128).words, pw.words)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="64, 128 or 256"):
        check_packable("tri5", 8, 512, 32)
    with pytest.raises(ValueError, match="multiple of 256"):
        check_packable("tri5", 8, 384, 128)
    assert LAYOUTS["tri5"].base3 and "tri5" not in __import__("quant.packed_layout").packed_layout.KINDS


def test_tq1_0_blocks_convert_without_loss():
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    w = (rng.integers(-1, 2, size=(6, 512)) * rng.uniform(0.5, 2.0, size=(6, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ1_0)  # the gguf package's own encoder
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.TQ1_0)  # ... and decoder
    pw = tri5_from_tq1_0(raw, 512, rows_per_slice=4)
    assert pw.group_size == 256 and pw.kind == "tri5"
    assert torch.equal(dequantize(pw), torch.from_numpy(want.astype(np.float32)))


def test_two_bit_ternary_converts_without_loss():
    codes, scales = _codes(130, 512, seed=3), torch.rand(130, 4)
    tri = pack("tri", codes, scales, 128)
    pw = tri5_from_tri(tri, columns_per_slice=64)
    assert torch.equal(unpack_codes(pw), codes) and torch.equal(pw.scales, tri.scales)


def _packed(n=40, k=512, group=128, seed=0) -> PackedWeight:
    pw = random_packed("tri5", n, k, group, generator=torch.Generator().manual_seed(seed))
    pw.scales.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + 1))
    return pw.to(DEVICE)


@pytest.mark.parametrize("group,rows,k,config", [(64, 1, 512, (32, 2, 1)), (128, 1, 256, (32, 1, 1)),
                                                 (256, 1, 512, (64, 2, 1)), (64, 3, 256, (32, 1, 1)),
                                                 (256, 16, 512, (64, 2, 1))])
def test_gemv_matches_reference(group, rows, k, config):
    pw = _packed(group=group, k=k)
    x = torch.randn(rows, k, device=DEVICE)
    xq = quantize_activations(x, group)
    got = tri5_gemv(*xq, pw, config=config)
    torch.testing.assert_close(got, tri5_gemv_reference(*xq, pw), rtol=1e-5, atol=1e-4)
    dense = x.float() @ dequantize(pw).t()  # and it is the real product, up to the int8 rounding of x
    assert (got - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("shape,group,rows", [("27b o", 64, 1), ("27b qkv", 128, 1), ("8b o", 64, 1),
                                              ("27b down", 128, 1), ("8b gate_up", 64, 8),
                                              ("27b gate_up", 128, 16)])
def test_gemv_at_real_shapes(shape, group, rows):
    """The real K with the split-K partition the real matrix launches (a shorter last split for the 27B
    shapes), on 24 of its columns in one block of 32 (a ragged column block): the interpreter's cost is
    per program and step, so the full width runs in tests/perf/gpu_kern.py's checks on the GPU."""
    n, k = REAL_SHAPES[shape]
    _, split, warps = tri5_launch_config(n, k // 256, rows)
    pw = _packed(n=24, k=k, group=group, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows)).to(DEVICE)
    xq = quantize_activations(x, group)
    got = tri5_gemv(*xq, pw, config=(32, split, warps))
    want = tri5_gemv_reference(*xq, pw)  # K/G float32 terms in another order: tolerance ∝ output size
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_accumulates_through_packed_gemv(rows):
    pw = _packed(group=128, k=256)
    xq = quantize_activations(torch.randn(rows, 256, device=DEVICE), 128)
    residual = torch.randn(rows, 40, device=DEVICE)
    out = residual.clone()
    packed_gemv(*xq, pw, out=out, accumulate=True)  # dispatches on the kind
    torch.testing.assert_close(out, residual + tri5_gemv_reference(*xq, pw), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_comparison_catches_a_layout_bug(m):
    """Planted: the five-trit tiles a = 0 and a = 1 swapped in the words; both kernels must disagree."""
    pw = _packed(k=256)
    rows = torch.arange(13)
    rows[0:4], rows[4:8] = torch.arange(4, 8), torch.arange(0, 4)
    bad = PackedWeight("tri5", pw.words[rows.to(pw.words.device)].contiguous(), pw.scales, 40, 256, 128)
    xq = quantize_activations(torch.randn(m, 256, device=DEVICE), 128)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(tri5_gemv(*xq, bad, config=(64, 1, 1)), tri5_gemv_reference(*xq, pw))


@pytest.mark.parametrize("n,k,group,dtype", [(72, 256, 64, torch.float32), (40, 5120, 128, torch.bfloat16),
                                             (24, 4096, 64, torch.float16)])
def test_dequantize_kernel_matches_reference(n, k, group, dtype):
    pw = _packed(n=n, k=k, group=group)
    got = dequantize_t(pw, dtype, config=(64, 4))  # 64 columns a program: the last block ragged
    assert got.shape == (k, n) and got.dtype == dtype
    want = dequantize_tri5_t_reference(pw, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # one rounding of the same float32 value (the interpreter's bf16 cast truncates: a unit apart)
        torch.testing.assert_close(got, want)

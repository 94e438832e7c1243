"""Packed layouts and the packed-weight kernels vs their plain-torch references.

On a machine without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1),
so CI checks the same kernel bodies at small shapes; on a GPU they run compiled (dp4a included).
"""
from __future__ import annotations

import pytest
import torch

from quant import grids
from quant.kernels.act_quant import quantize_activations, quantize_activations_reference
from quant.kernels.packed_gemm import packed_gemm, packed_gemm_reference
from quant.kernels.packed_gemv import packed_gemv, packed_gemv_reference
from quant.packed_layout import KINDS, dequantize, pack, random_packed, unpack_codes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _codes(kind: str, w: torch.Tensor, g: int):
    if kind == "tri":
        return grids.ternary_rtn(w, g)
    if kind == "bin":
        return grids.binary_rtn(w, g)
    return grids.int_rtn(w, 4 if kind == "int4" else 8, g)


def _packed(kind: str, n: int = 48, k: int = 256, g: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(n, k)
    codes, scales = _codes(kind, w, g)
    return w, codes, scales, pack(kind, codes, scales, g)


@pytest.mark.parametrize("kind", list(KINDS))
def test_pack_roundtrip_is_exact(kind):
    _, codes, scales, pw = _packed(kind)
    assert pw.words.dtype == torch.int32 and pw.words.shape == (256 * KINDS[kind].bits // 32, 48)
    assert torch.equal(unpack_codes(pw), codes)
    assert torch.equal(dequantize(pw), grids.dequantize(codes, scales.half().float(), 64))


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_packed_codes_are_on_the_grid(kind):
    pw = random_packed(kind, 32, 256, 128, generator=torch.Generator().manual_seed(1))
    values = set(unpack_codes(pw).unique().tolist())
    allowed = {"tri": {-1, 0, 1}, "bin": {-1, 1}, "int4": set(range(-8, 8)), "int8": set(range(-128, 128))}[kind]
    assert values <= allowed and len(values) >= 2


def test_packing_rejects_bad_group_sizes():
    codes = torch.zeros(8, 96, dtype=torch.int8)
    with pytest.raises(ValueError, match="does not divide"):
        pack("tri", codes, torch.ones(8, 1), 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack("bin", codes, torch.ones(8, 6), 16)


@pytest.mark.parametrize("mode", ["plain", "norm", "gated"])
def test_activation_quantization_kernel_matches_reference(mode):
    torch.manual_seed(0)
    k, g = 256, 64
    x = torch.randn(3, 2 * k if mode == "gated" else k, device=DEVICE)
    norm = torch.rand(k, device=DEVICE) + 0.5 if mode == "norm" else None
    got = quantize_activations(x, g, norm, gated=mode == "gated")
    want = quantize_activations_reference(x, g, norm, gated=mode == "gated")
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1])
    # int8 values reconstruct the (normalized / gated) activations within half a step
    dense = want[0].float().reshape(3, -1, g) * want[1][..., None]
    assert dense.abs().max() > 1.0


def test_activation_quantization_error_is_half_a_step():
    x = torch.randn(2, 128)
    xq, sx, _ = quantize_activations_reference(x, 32)
    back = (xq.float().reshape(2, 4, 32) * sx[..., None]).reshape(2, 128)
    assert ((back - x).abs().reshape(2, 4, 32) <= sx[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows,config,variant", [(1, (32, 1, 4), None), (3, (64, 2, 4), "3d")])
def test_gemv_kernel_matches_reference(kind, rows, config, variant):
    # a launch config belongs to the variant it is given with (3 rows of tri default to the mma kernel,
    # whose configs have four entries: tests/test_packed_mma.py)
    w, _, _, pw = _packed(kind)
    pw = pw.to(DEVICE)
    x = torch.randn(rows, 256, device=DEVICE)
    xq = quantize_activations(x, 64)
    got = packed_gemv(*xq, pw, config=config, variant=variant)
    want = packed_gemv_reference(*xq, pw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # and the maths is the real product: close to x Ŵᵀ up to the int8 rounding of x
    dense = x.float() @ dequantize(pw).t()
    assert (got - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("kind", ["tri", "int8"])
def test_gemv_accumulates_into_the_residual(kind):
    _, _, _, pw = _packed(kind)
    pw = pw.to(DEVICE)
    xq = quantize_activations(torch.randn(2, 256, device=DEVICE), 64)
    residual = torch.randn(2, 48, device=DEVICE)
    for split in (1, 2):
        out = residual.clone()
        packed_gemv(*xq, pw, out=out, accumulate=True, config=(32, split, 4))
        torch.testing.assert_close(out, residual + packed_gemv_reference(*xq, pw), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["tri", "bin"])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_kwarps_gemv_matches_the_reference(kind, split):
    """One row with K split across two warps of a program (quant.kernels.packed_gemv "kwarps"): 7 groups of 128,
    so a program's last step holds one group and (split 3: groups 4 + 3) the last split ends mid-step; 200
    columns (a partial block); added into a residual or stored."""
    _, _, _, pw = _packed(kind, n=200, k=896, g=128, seed=split)
    pw = pw.to(DEVICE)
    xq = quantize_activations(torch.randn(1, 896, device=DEVICE), 128)
    want = packed_gemv_reference(*xq, pw)
    got = packed_gemv(*xq, pw, config=(128, split, 2), variant="kwarps")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    residual = torch.randn(1, 200, device=DEVICE)
    out = residual.clone()
    packed_gemv(*xq, pw, out=out, accumulate=True, config=(128, split, 2), variant="kwarps")
    torch.testing.assert_close(out, residual + want, rtol=1e-5, atol=1e-4)


def test_kwarps_is_the_default_for_one_row_of_large_ternary_matrices_only():
    """The measured rule (H100, tests/perf/gemv_variants.py): the 27B-class gate/up and down and the 8B gate/up
    take it at the split that leaves each warp three or more groups; smaller matrices, other layouts, group
    sizes and row counts keep their kernels."""
    from quant.kernels.packed_gemv import default_variant, kwarps_launch_config
    assert [default_variant("tri", 128, 1, k, n) for n, k in ((34816, 5120), (5120, 17408), (24576, 4096))] \
        == ["kwarps"] * 3
    assert [kwarps_launch_config(n, k // 128)[1] for n, k in ((34816, 5120), (5120, 17408), (24576, 4096))] \
        == [8, 32, 4]
    assert default_variant("tri", 128, 1, 5120, 16384) == "kwarps"  # 84M weights
    assert default_variant("tri", 128, 1, 12288, 4096) == "2d"  # the 8B down projection (50M weights)
    assert default_variant("tri", 64, 1, 5120, 34816) == "2d"
    assert default_variant("int4", 128, 1, 5120, 34816) == "2d"
    assert default_variant("tri", 128, 2, 5120, 34816) == "2d"
    from quant.kernels.packed_gemv import one_row_path  # what bonsai bench reports per shape
    assert one_row_path("tri", 128, 24576, 4096) == "kwarps split 4"
    assert one_row_path("tri", 128, 6144, 4096) == "2d split 16" and one_row_path("tri5", 128, 6144, 4096) == "tri5 split 8"


def test_decode_paths_name_each_packed_shape_of_a_model():
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    from engine.weights.packed_linear import decode_paths
    from tests.test_decode_step import CFG
    paths = decode_paths(load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4")).model)
    assert paths and all(k.startswith(("tri ", "int4 ")) for k in paths) and any(k.startswith("int4 ") for k in paths)
    assert all(v.startswith("2d split ") for v in paths.values())  # tiny matrices: the one-warp kernel


def test_gemv_comparison_catches_a_layout_bug():
    """A planted bug (scales of the wrong group) must make the comparison fail."""
    _, _, _, pw = _packed("tri")
    pw = pw.to(DEVICE)
    xq = quantize_activations(torch.randn(1, 256, device=DEVICE), 64)
    bad = type(pw)("tri", pw.words, pw.scales.roll(1, dims=0).contiguous(), 48, 256, 64)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(packed_gemv(*xq, bad, config=(32, 1, 4)), packed_gemv_reference(*xq, pw))


@pytest.mark.parametrize("kind", list(KINDS))
def test_gemm_kernel_matches_reference(kind):
    _, _, _, pw = _packed(kind, n=80)
    pw = pw.to(DEVICE)
    x = torch.randn(37, 256, device=DEVICE)
    got = packed_gemm(x, pw, config=(16, 32, 32, 4, 1))
    tol = dict(rtol=1e-2, atol=5e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-3)  # GPU dots: tf32
    torch.testing.assert_close(got, packed_gemm_reference(x, pw), **tol)


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantize_kernel_matches_reference(kind):
    from quant.kernels.packed_dequant import dequantize_t, dequantize_t_reference
    _, _, _, pw = _packed(kind, n=80)
    pw = pw.to(DEVICE)
    got = dequantize_t(pw, torch.float32)
    assert got.shape == (256, 80)
    torch.testing.assert_close(got, dequantize_t_reference(pw, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["tri", "int4"])
def test_gemv_rows_as_2d_tiles_match_reference(kind):
    """The per-row 2-D variant for M > 1 (rows_2d=True) gives the same sums as the reference."""
    _, _, _, pw = _packed(kind)
    pw = pw.to(DEVICE)
    xq = quantize_activations(torch.randn(3, 256, device=DEVICE), 64)
    got = packed_gemv(*xq, pw, config=(64, 2, 4), variant="2d")
    torch.testing.assert_close(got, packed_gemv_reference(*xq, pw), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind,rows,split", [("tri", 2, 1), ("int8", 16, 2), ("bin", 5, 2), ("int4", 3, 1)])
def test_row_loop_gemv_matches_reference(kind, rows, split):
    """The word-row-at-a-time kernel for 2..16 rows: same sums as the reference, plain and added in."""
    _, _, _, pw = _packed(kind)
    pw = pw.to(DEVICE)
    xq = quantize_activations(torch.randn(rows, 256, device=DEVICE), 64)
    got = packed_gemv(*xq, pw, config=(32, split, 1), variant="rows")
    torch.testing.assert_close(got, packed_gemv_reference(*xq, pw), rtol=1e-5, atol=1e-4)
    residual = torch.randn(rows, 48, device=DEVICE)
    out = residual.clone()
    packed_gemv(*xq, pw, out=out, accumulate=True, config=(32, split, 1), variant="rows")
    torch.testing.assert_close(out, residual + packed_gemv_reference(*xq, pw), rtol=1e-5, atol=1e-4)

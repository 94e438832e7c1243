"""Many-row calls of a CPU int4 layer through a bfloat16 copy of its matrix (engine.runtime.cpu_int4_prefill): the
packed layout it reads, its values against the float32 reference within bfloat16 rounding, and the decode and
verify widths left on the int4 kernel."""
from __future__ import annotations

import pytest
import torch

import engine.runtime.cpu_int4 as cpu_int4
import engine.runtime.cpu_int4_prefill as prefill
from engine.runtime.cpu_int4 import PREFILL_ROWS, VERIFY_ROWS, Int4CpuLinear, unpack_codes

needs_layout = pytest.mark.skipif(not prefill.layout_known(), reason="the int4 kernel packs another layout here")


def _layer(n: int = 192, k: int = 256, halves: int = 1, seed: int = 0) -> Int4CpuLinear:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, halves * k), generator=gen, dtype=torch.uint8)  # [N, K']
    s = torch.rand(n, halves * k // 32, generator=gen) * 0.02 + 1e-3  # [N, K'/32]
    z = torch.randn(n, halves * k // 32, generator=gen) * 0.02  # [N, K'/32]
    return Int4CpuLinear(codes, s, z, torch.randn(n, generator=gen), in_features=k)


def test_the_layout_check_agrees_with_the_kernel_itself():
    """What `layout_known` concludes from a packing of known codes holds for a layer's codes read back through the
    kernel (unpack_codes multiplies by unit rows)."""
    layer = _layer(n=256, k=512, seed=1)
    codes = unpack_codes(layer.packed, 256, 512)  # [N, K] uint8
    read = prefill._codes_t(layer.packed, 0, 256, 512, torch.float32).t() + 8  # [N, K]
    assert torch.equal(read, codes.float()) == prefill.layout_known()


@needs_layout
@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("rows", [PREFILL_ROWS, 70])
def test_the_gemm_path_is_the_float_product_within_bfloat16_rounding(monkeypatch, halves, rows):
    """Each weight rounded once to bfloat16 (≤ 2^-8 of it), float32 accumulation (≤ K·2^-24 of Σ|x·w|), the output
    rounded to bfloat16 (≤ 2^-8 of it): |y − x·Wᵀ| ≤ 2^-8·|x·Wᵀ| + (2^-8 + K·2^-23)·|x|·|W|ᵀ."""
    layer = _layer(halves=halves, seed=halves)
    monkeypatch.setattr(cpu_int4, "int4_matmul", None)  # the kernel is not called
    monkeypatch.setattr(prefill, "CHUNK", 128 * layer.halves * 256)  # 128-row chunks: one whole, one part
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)).bfloat16().float()  # [M, K]
    w = layer.dequantized()  # [N, K] float32
    ref = x @ w.t() + layer.bias  # [M, N]
    got = layer(x)
    bound = 2 ** -8 * (ref - layer.bias).abs() + (2 ** -8 + 256 * 2 ** -23) * (x.abs() @ w.abs().t()) + 1e-6
    err = (got - ref).abs()
    assert (err <= bound).all()
    assert err.mean() < 0.1 * bound.mean()  # and typically far inside it


@needs_layout
@pytest.mark.parametrize("halves", [1, 2])
def test_the_weights_are_rounded_once_to_bfloat16(halves):
    """One 4-bit matrix: exactly its float32 values rounded; two halves: their float32 sum, within one rounding."""
    layer = _layer(halves=halves, seed=3)
    w = layer.dequantized()[64:]  # [128, K] float32: rows 64..191
    got = prefill.dequantized_t(layer.packed, layer.sz, 64, 192, 256, halves).float().t()  # [128, K]
    assert (got - w).abs().le(2 ** -8 * w.abs()).all()
    if halves == 1:
        assert torch.equal(got, w.bfloat16().float())


def test_decode_and_verify_widths_stay_on_the_int4_kernel(monkeypatch):
    assert VERIFY_ROWS < PREFILL_ROWS
    layer = _layer()
    assert layer.fast_prefill == prefill.layout_known()
    monkeypatch.setattr(cpu_int4, "prefill_matmul", None)  # not called below PREFILL_ROWS rows
    x = torch.randn(PREFILL_ROWS - 1, 256)  # [M, K]
    alone = torch.cat([layer(x[i:i + 1]) for i in range(VERIFY_ROWS)])  # [16, N]
    for m in (2, 5, VERIFY_ROWS):
        assert torch.equal(layer(x[:m]), alone[:m])
    assert layer(x).shape == (PREFILL_ROWS - 1, 192)


def test_rows_in_no_whole_64_row_block_stay_on_the_int4_kernel():
    assert not _layer(n=96).fast_prefill

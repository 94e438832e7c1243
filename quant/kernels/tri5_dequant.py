"""Unpack a tri5 matrix (quant/tri5_layout.py) to a dense Wᵀ [K, N] in bf16/fp16 — the prefill path's first half,
as packed_dequant.dequantize_t does for the other layouts (then cuBLAS's tensor-core GEMM).

One program per (super-block, BLOCK_N columns): its 13 word rows are read once, each five-trit tile
[4 segments, BLOCK_N] is decoded trit plane by trit plane (tri5_gemv._trits: four lanes per word at a
time) and every byte lane of a plane is written as one row of Wᵀ per segment.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.kernels import interpreting
from quant.kernels.tri5_gemv import _trits
from quant.packed_layout import PackedWeight, dequantize


def dequantize_tri5_t_reference(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize(pw, torch.float32).t().contiguous().to(dtype)  # [K, N]


@triton.jit
def _store_lanes(out_ptr, t, rows, scale, offs_n, n_mask, N):
    """Rows rows + j (j = byte lane) of Wᵀ from the trit word t [4, BN]: value (trit − 1) · scale."""
    for j in tl.static_range(4):
        value = (((t >> (8 * j)) & 0xFF) - 1).to(tl.float32) * scale
        tl.store(out_ptr + (rows + j)[:, None] * N + offs_n[None, :], value.to(out_ptr.dtype.element_ty),
                 mask=n_mask[None, :])


@triton.jit
def _dequant_tri5_kernel(w_ptr, s_ptr, out_ptr, N, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    NGS: tl.constexpr = 256 // GROUP
    s = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    h = tl.arange(0, 4)  # segment
    g = s * NGS + h // (4 // NGS)  # [4]: the group of each segment
    scale = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0.0).to(tl.float32)  # [4, BN]
    seg_rows = 256 * s + 64 * h  # [4]: first row of Wᵀ of each segment
    for a in tl.static_range(3):
        w = tl.load(w_ptr + (13 * s + 4 * a + h)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        t0, t1, t2, t3, t4 = _trits(w, USE_ASM)  # [4, BN] each: trit n of the four lanes
        _store_lanes(out_ptr, t0, seg_rows + 20 * a, scale, offs_n, n_mask, N)
        _store_lanes(out_ptr, t1, seg_rows + 20 * a + 4, scale, offs_n, n_mask, N)
        _store_lanes(out_ptr, t2, seg_rows + 20 * a + 8, scale, offs_n, n_mask, N)
        _store_lanes(out_ptr, t3, seg_rows + 20 * a + 12, scale, offs_n, n_mask, N)
        _store_lanes(out_ptr, t4, seg_rows + 20 * a + 16, scale, offs_n, n_mask, N)
    tail = tl.load(w_ptr + (13 * s + 12) * N + offs_n, mask=n_mask, other=0)  # [BN]
    codes = (tail[None, :] >> (2 * h)[:, None]) & 0x03030303  # [4, BN]: step h of the 2-bit tail
    _store_lanes(out_ptr, codes, seg_rows + 60, scale, offs_n, n_mask, N)


def dequantize_tri5_t(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                      config: tuple[int, int] = (128, 4)) -> torch.Tensor:
    """Wᵀ [K, N] in dtype, the values of `dequantize_tri5_t_reference` (up to the dtype's rounding)."""
    assert pw.kind == "tri5"
    k, n = pw.in_features, pw.out_features
    if out is None:
        out = torch.empty(k, n, dtype=dtype, device=pw.words.device)
    block_n, warps = config
    grid = (k // 256, triton.cdiv(n, block_n))
    _dequant_tri5_kernel[grid](pw.words, pw.scales, out, n, GROUP=pw.group_size, BLOCK_N=block_n,
                               USE_ASM=not interpreting(), num_warps=warps)
    return out

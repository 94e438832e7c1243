"""Unpack a packed matrix to a dense bf16/fp16 Wᵀ [K, N] — the first half of the prefill product.

Prefill is compute-bound: the fastest product we measured is to expand a layer's codes once per
forward into a scratch Wᵀ (memory-bound, ~2 bytes written per weight) and hand it to cuBLAS's
tensor-core GEMM; for a 512-token chunk the expansion costs a few percent of the matmul.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.packed_layout import PackedWeight, dequantize, layout_kind


def dequantize_t_reference(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize(pw, torch.float32).t().contiguous().to(dtype)  # [K, N]


@triton.jit
def _dequant_t_kernel(w_ptr, s_ptr, out_ptr, N, BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr,
                      SIGNED: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    E: tl.constexpr = 32 // BITS
    IW: tl.constexpr = BLOCK_K // E
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, IW)
    w = tl.load(w_ptr + (k0 // E + rows)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)  # [IW, BN]
    scale = tl.load(s_ptr + (k0 // GROUP) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
    for c in tl.static_range(E):  # element c of each word: step c // 4, byte c % 4
        shift = 8 * (c % 4) + BITS * (c // 4)
        if SIGNED:
            u = (w << (24 - shift)) >> 24
        else:
            u = (w >> shift) & ((1 << BITS) - 1)
        value = (u * MULT - OFFSET).to(tl.float32) * scale[None, :]
        tl.store(out_ptr + (k0 + E * rows + c)[:, None] * N + offs_n[None, :],
                 value.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def dequantize_t(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                 config: tuple[int, int] = (128, 4)) -> torch.Tensor:
    """Wᵀ [K, N] in dtype, same values as `dequantize_t_reference` (up to the dtype's rounding). A tri5
    matrix runs quant.kernels.tri5_dequant (config: its BLOCK_N, num_warps)."""
    if pw.kind == "tri5":
        from quant.kernels.tri5_dequant import dequantize_tri5_t
        return dequantize_tri5_t(pw, dtype, out, config)
    kind = layout_kind(pw.kind)
    k, n = pw.in_features, pw.out_features
    if out is None:
        out = torch.empty(k, n, dtype=dtype, device=pw.words.device)
    block_k = min(pw.group_size, 128)
    block_n, warps = config  # (BLOCK_N, num_warps)
    grid = (k // block_k, triton.cdiv(n, block_n))
    _dequant_t_kernel[grid](pw.words, pw.scales, out, n, BITS=kind.bits, MULT=kind.mult, OFFSET=kind.offset,
                            SIGNED=kind.signed, GROUP=pw.group_size, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps)
    return out

"""Packed-weight matrix-matrix product for prefill (and wide verify batches): tensor cores.

Each program computes a [BLOCK_M, BLOCK_N] tile of y = x Wᵀ. Per K-tile it loads the packed words
once ([BLOCK_K/E, BLOCK_N] int32), expands them in registers to the grid values (small integers,
exact in bf16) in the order (shift step, byte, word row), loads the matching columns of x in the
same order, and multiplies on tensor cores (`tl.dot`, float32 accumulation); the group scale is
applied to each K-tile's partial product (BLOCK_K divides the group), so codes stay exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.packed_layout import PackedWeight, dequantize, layout_kind


def packed_gemm_reference(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x [M, K] @ dequantize(W)ᵀ → [M, N] in x's dtype (float32 maths)."""
    return (x.float() @ dequantize(pw).t()).to(x.dtype)


@triton.jit
def _packed_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                        BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr, SIGNED: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr):
    E: tl.constexpr = 32 // BITS  # codes per word
    IW: tl.constexpr = BLOCK_K // E  # word rows per K-tile
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_band = SWIZZLE * grid_n  # programs of SWIZZLE row-tiles share weight tiles in L2
    first_m = (pid // per_band) * SWIZZLE
    band = tl.minimum(grid_m - first_m, SWIZZLE)
    pid_m = first_m + (pid % per_band) % band
    pid_n = (pid % per_band) // band
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    n_mask = offs_n < N
    r = tl.arange(0, BLOCK_K)
    c = r // IW  # position inside the word: step j = c // 4, byte b = c % 4
    k_in_tile = E * (r % IW) + c  # the input feature each expanded row stands for
    shift3 = (8 * (tl.arange(0, E) % 4) + BITS * (tl.arange(0, E) // 4))[:, None, None]  # [E, 1, 1]
    rows = tl.arange(0, IW)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + k_in_tile)[None, :],
                    mask=m_mask[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + (k0 // E + rows)[:, None] * N + offs_n[None, :], mask=n_mask[None, :],
                    other=0)  # [IW, BN]
        w3 = tl.broadcast_to(w[None, :, :], [E, IW, BLOCK_N])
        if SIGNED:
            u3 = (w3 << (24 - shift3)) >> 24
        else:
            u3 = (w3 >> shift3) & ((1 << BITS) - 1)
        vals = tl.reshape(u3 * MULT - OFFSET, [BLOCK_K, BLOCK_N]).to(x.dtype)  # [BK, BN]
        part = tl.dot(x, vals)
        scale = tl.load(s_ptr + (k0 // GROUP) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gemm_launch_config(m: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    block_k = min(64, group_size)
    if m <= 32:
        return 32, 128, block_k, 4, 4
    if m <= 64:
        return 64, 128, block_k, 4, 4
    return 128, 128, block_k, 8, 3


def packed_gemm(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows contiguous) @ Wᵀ → [M, N] in x's dtype."""
    m, k = x.shape
    assert k == pw.in_features and x.stride(1) == 1
    kind = layout_kind(pw.kind)
    bm, bn, bk, warps, stages = config or gemm_launch_config(m, pw.group_size)
    assert pw.group_size % bk == 0 and bk % kind.per_word == 0
    if out is None:
        out = torch.empty(m, pw.out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(pw.out_features, bn),)
    _packed_gemm_kernel[grid](x, pw.words, pw.scales, out, m, pw.out_features, k, x.stride(0), out.stride(0),
                              BITS=kind.bits, MULT=kind.mult, OFFSET=kind.offset, SIGNED=kind.signed,
                              GROUP=pw.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWIZZLE=8,
                              num_warps=warps, num_stages=stages)
    return out

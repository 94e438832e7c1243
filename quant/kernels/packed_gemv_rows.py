"""Packed-weight products for a few rows (M = 2..16: batched decode, speculative verification).

Same inputs and maths as `packed_gemv` (int8 per-group activations, dp4a sums), arranged so each
extra row costs only its dp4a: a thread owns a few output columns and keeps every row's running
sum for them in registers; the program walks the weight one word row ([BLOCK_N] words) at a time,
so each word is shifted and masked once and then meets the activation word of every row. (The M = 1
kernel's [words, columns] tiles would need a [rows, words, columns] broadcast here, which spills.)
Split-K programs add their partial sums with atomics, as in `packed_gemv`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.kernels import interpreting, pdl_options
from quant.kernels.packed_gemv import _BYTE_MASK, _dot4
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait
from quant.packed_layout import PackedWeight, layout_kind


@triton.jit
def _packed_gemv_rows_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG, groups_per_split,
                             BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr,
                             BYTE_MASK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, ACCUMULATE: tl.constexpr,
                             USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    STEPS: tl.constexpr = 8 // BITS  # shift steps per word
    GW: tl.constexpr = GROUP * BITS // 32  # word rows per group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < M
    x_words = K // 4
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, NG)
    t_end = g_end * GW
    # word rows t = g·GW + r, two in flight ahead of the one being used; the first loads need
    # nothing from the previous kernel, so with PDL they go out before the wait
    t = g_start * GW
    w_next = tl.load(w_ptr + t * N + offs_n, mask=n_mask & (offs_n * 0 + t < t_end), other=0,
                     eviction_policy="evict_first")  # [BN]
    w_after = tl.load(w_ptr + (t + 1) * N + offs_n, mask=n_mask & (offs_n * 0 + t + 1 < t_end), other=0,
                      eviction_policy="evict_first")  # [BN]
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for t in range(g_start * GW, t_end):
        w = w_next
        w_next = w_after
        w_after = tl.load(w_ptr + (t + 2) * N + offs_n, mask=n_mask & (offs_n * 0 + t + 2 < t_end), other=0,
                          eviction_policy="evict_first")  # [BN]
        for j in tl.static_range(STEPS):
            codes = (w >> (BITS * j)) & BYTE_MASK  # [BN]: four codes as bytes
            xw = tl.load(xq_ptr + offs_m * x_words + STEPS * t + j, mask=m_mask, other=0)  # [BM]
            isum = _dot4(tl.broadcast_to(codes[None, :], [BLOCK_M, BLOCK_N]),
                         tl.broadcast_to(xw[:, None], [BLOCK_M, BLOCK_N]), isum, USE_ASM)
        if t % GW == GW - 1:  # the group is complete: scale it into the float sums
            g = t // GW
            sumx = tl.load(sumx_ptr + offs_m * NG + g, mask=m_mask, other=0)  # [BM]
            sx = tl.load(sx_ptr + offs_m * NG + g, mask=m_mask, other=0.0)  # [BM]
            sw = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            acc += (isum * MULT - OFFSET * sumx[:, None]).to(tl.float32) * sx[:, None] * sw[None, :]
            isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptr + out_offs, acc, mask=mask)
    else:
        if ACCUMULATE:
            acc += tl.load(out_ptr + out_offs, mask=mask, other=0.0)
        tl.store(out_ptr + out_offs, acc, mask=mask)


def gemv_rows_launch_config(n: int, num_groups: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_N, split_k, num_warps): one warp of 128 columns per program and split-K until the
    grid holds ~4096 programs, as for M = 1 (tests/perf/gpu_kernels.py --sections rows)."""
    block_n, warps = 128, 1
    blocks = triton.cdiv(n, block_n)
    split = 1
    while blocks * split < 4096 and split < 32 and split * 2 <= num_groups // 2:
        split *= 2
    del rows
    return block_n, split, warps


def packed_gemv_rows(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
                     out: torch.Tensor | None = None, accumulate: bool = False,
                     config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y = x Wᵀ for M ≤ 16 rows of int8 activations → float32 [M, N] (into out, or added to it)."""
    m, k = xq.shape
    assert m <= 16 and k == pw.in_features and xq.is_contiguous()
    kind = layout_kind(pw.kind)
    ng = k // pw.group_size
    block_n, split, warps = config or gemv_rows_launch_config(pw.out_features, ng, m)
    if out is None:
        out = torch.zeros(m, pw.out_features, dtype=torch.float32, device=xq.device)
    elif not accumulate and split > 1:
        out.zero_()
    per_split = triton.cdiv(ng, split)
    grid = (triton.cdiv(pw.out_features, block_n), triton.cdiv(ng, per_split))
    _packed_gemv_rows_kernel[grid](
        xq.view(torch.int32), sx, sumx, pw.words, pw.scales, out, m, pw.out_features, k, ng, per_split,
        BITS=kind.bits, MULT=kind.mult, OFFSET=kind.offset, BYTE_MASK=_BYTE_MASK[kind.bits],
        GROUP=pw.group_size, BLOCK_M=max(triton.next_power_of_2(m), 2), BLOCK_N=block_n,
        ATOMIC=split > 1, ACCUMULATE=accumulate, USE_ASM=not interpreting(), num_warps=warps,
        **pdl_options(xq.device))
    return out

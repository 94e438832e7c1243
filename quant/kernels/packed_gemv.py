"""Packed-weight matrix-vector product for decode and small batches (M = 1..16 rows).

y [M, N] (float32) = x Wᵀ with W a `PackedWeight` and x given as int8 per-group activations
(`act_quant`). Per group g of G input features and output column n:
    y[m, n] += sw[g, n] · sx[m, g] · (MULT · Σ_k u[k, n]·xq[m, k] − OFFSET · sumx[m, g])
The integer sums are `dp4a` (four byte products per instruction) on words that hold four codes per
byte lane after one shift and mask. Split-K programs add their partial sums with atomics, which
also lets a projection add itself straight into the float32 residual stream (`accumulate=True`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait

from quant.kernels import interpreting, pdl_options
from quant.kernels.gemv_parts import (_dot4, _dot4_bytes, _program_tile, _write_out, packed_gemv_reference,  # noqa: F401
                                      result_buffer, split_k)
from quant.packed_layout import PackedWeight, layout_kind

_BYTE_MASK = {1: 0x01010101, 2: 0x03030303, 4: 0x0F0F0F0F, 8: -1}
# M > 1: the M = 1 tiles once per row ("2-D"), broadcast over rows in 3-D, or the word-row loop of
# the row loop. Measured on an H200 (tests/perf/gpu_kernels.py --sections rows, Qwen3-8B ternary
# shapes, µs summed over qkv/o/gate_up/down): M = 2: 2-D 40.4, 3-D 47.4, rows 50.8; M = 3: 3-D 61.3,
# rows 66.4; M = 4: 3-D 64.6, rows 69.0; M = 8: 3-D 191, rows 97 (the 3-D tiles spill from there).
ROWS_2D_MAX = 2
ROW_LOOP_FROM = 5
# From this many rows the tensor-core kernel (quant.kernels.packed_mma) takes a layout's products, where it
# supports the layout and group size; 17 = never (at most 16 rows). Measured on an H200 (tests/perf/
# gpu_issue20.py --sections paths, g128, µs summed over the 8B and 27B-class q/k/v, o, gate/up, down):
# tri 3 rows dp4a 146 / mma 138, 4: 156 / 140, 8: 259 / 150, 16: 553 / 214 (2 rows: 88 / 136);
# int4 4 rows 205 / 270, 5: 295 / 279, 8: 319 / 286, 16: 552 / 344. bin and int8: not measured, dp4a.
MMA_FROM_ROWS = {"tri": 3, "bin": 17, "int4": 5, "int8": 17}


# One row of a large matrix: two warps a program, each its own groups of the program's K range (one atomic per
# column a program, half the split-K atomics at the same warps in flight). Measured on an H100 (tests/perf/
# gemv_variants.py, 2026-12-05, µs, the 2-bit g128 kernel at its split rule → two warps): 27B-class gate/up
# 34816×5120 22.17 → 20.63, down 5120×17408 11.50 → 9.73, a 16384×5120 matrix 12.18 → 9.36 (the hybrid's DeltaNet
# q/k/v 10240 and z 6144 rows run apart: not taken), Qwen3-8B gate/up 24576×4096 13.70 → 11.47; under 80M weights it
# loses (8B down 6.96 → 7.25, q/k/v 4.61 → 6.96).
# Each warp gets ≥ 3 groups (fewer lost). 1-bit: mixed (27B down 0.78x, 8B gate/up 1.39x): not taken. Two steps
# in flight instead of one measured slower (27B down 12.67 µs, 16384×5120 11.68).
KWARPS = {"tri": (128, 80_000_000)}  # kind: (group size, least weights N·K)
KWARPS_GROUPS = 3


def default_variant(kind: str, group_size: int, rows: int, in_features: int, out_features: int = 0,
                    cuda: bool = False) -> str:
    """The kernel packed_gemv runs for `rows` rows of a layout when the caller names none; cuda: the CUDA C++
    one-row kernel may run (quant.kernels.cuda_gemv.enabled), taken for the shapes it was measured faster on."""
    from quant.kernels.cuda_gemv import config_for
    from quant.kernels.packed_mma import mma_supported
    if rows == 1 and cuda and config_for(kind, group_size, out_features, in_features) is not None:
        return "cuda"
    if rows >= MMA_FROM_ROWS.get(kind, 17) and mma_supported(kind, group_size, in_features):
        return "mma"
    if rows == 1 and kind in KWARPS:
        group, least = KWARPS[kind]
        if group_size == group and out_features * in_features >= least:
            return "kwarps"
    return "2d" if rows <= ROWS_2D_MAX else "rows" if rows >= ROW_LOOP_FROM else "3d"


def one_row_path(kind: str, group_size: int, out_features: int, in_features: int, cuda: bool = False) -> str:
    """The kernel and split-K a one-row (decode) product of this matrix runs by default, e.g. "kwarps split 8"
    (what `bonsai bench` reports per shape); cuda: as default_variant's."""
    if kind == "tri5":
        from quant.kernels.tri5_gemv import tri5_launch_config
        return f"tri5 split {tri5_launch_config(out_features, in_features // 256)[1]}"
    variant = default_variant(kind, group_size, 1, in_features, out_features, cuda)
    if variant == "cuda":
        from quant.kernels.cuda_gemv import describe
        return describe(kind, group_size, out_features, in_features)
    ng = in_features // group_size
    split = (kwarps_launch_config(out_features, ng) if variant == "kwarps"
             else gemv_launch_config(out_features, ng, kind))[1]
    return f"{variant} split {split}"


def kwarps_launch_config(n: int, num_groups: int, warps: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, split_k, warps) of the "kwarps" kernel: the most splits of K (a power of two, at most 32) that
    leave each warp at least KWARPS_GROUPS groups (a split's groups rounded up to a multiple of the warps)."""
    split = 1
    while split < 32 and _kwarps_per_split(num_groups, 2 * split, warps) >= KWARPS_GROUPS * warps:
        split *= 2
    return 128, split, warps


def _kwarps_per_split(num_groups: int, split: int, warps: int) -> int:
    return triton.cdiv(triton.cdiv(num_groups, split), warps) * warps


@triton.jit
def _group_dot(w, xq_ptr, g, offs_m, m_mask, M, rows, x_words, BITS: tl.constexpr, BYTE_MASK: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
               ROWS_2D: tl.constexpr):
    """Σ_k u[k, n]·xq[m, k] over group g: int32 [BLOCK_M, BLOCK_N] (w: the group's words [GW, BN])."""
    STEPS: tl.constexpr = 8 // BITS  # shift steps per word
    GW: tl.constexpr = GROUP * BITS // 32  # words per group (per column)
    if BLOCK_M == 1:  # decode: 2-D tiles, no broadcast over rows (and no layout conversion)
        isum = tl.zeros([GW, BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(STEPS):
            codes = (w >> (BITS * j)) & BYTE_MASK  # [GW, BN]: four codes as bytes
            xw = tl.load(xq_ptr + g * (GROUP // 4) + STEPS * rows + j)  # [GW]: the activations they meet
            isum = _dot4(codes, tl.broadcast_to(xw[:, None], [GW, BLOCK_N]), isum, USE_ASM)
        return tl.sum(isum, axis=0)[None, :]  # [1, BN]
    elif ROWS_2D:  # a few rows: the M = 1 tiles once per row, placed into the [BM, BN] result
        out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for m in tl.static_range(BLOCK_M):
            isum = tl.zeros([GW, BLOCK_N], dtype=tl.int32)
            for j in tl.static_range(STEPS):
                codes = (w >> (BITS * j)) & BYTE_MASK  # [GW, BN]
                xw = tl.load(xq_ptr + m * x_words + g * (GROUP // 4) + STEPS * rows + j,
                             mask=(rows * 0 + m) < M, other=0)  # [GW]
                isum = _dot4(codes, tl.broadcast_to(xw[:, None], [GW, BLOCK_N]), isum, USE_ASM)
            out += tl.where(offs_m[:, None] == m, tl.sum(isum, axis=0)[None, :], 0)
        return out  # [BM, BN]
    else:
        isum3 = tl.zeros([BLOCK_M, GW, BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(STEPS):
            codes = (w >> (BITS * j)) & BYTE_MASK  # [GW, BN]
            xw = tl.load(xq_ptr + offs_m[:, None] * x_words + g * (GROUP // 4) + (STEPS * rows + j)[None, :],
                         mask=m_mask[:, None], other=0)  # [BM, GW]
            isum3 = _dot4(tl.broadcast_to(codes[None, :, :], [BLOCK_M, GW, BLOCK_N]),
                          tl.broadcast_to(xw[:, :, None], [BLOCK_M, GW, BLOCK_N]), isum3, USE_ASM)
        return tl.sum(isum3, axis=1)  # [BM, BN]


@triton.jit
def _packed_gemv_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG, groups_per_split,
                        BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr, BYTE_MASK: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        ATOMIC: tl.constexpr, ACCUMULATE: tl.constexpr, USE_ASM: tl.constexpr,
                        ROWS_2D: tl.constexpr, USE_PDL: tl.constexpr):
    GW: tl.constexpr = GROUP * BITS // 32  # words per group (per column)
    DEEP: tl.constexpr = GW <= 8  # two groups in flight when their words fit in registers (≤ 2-bit)
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(M, N, BLOCK_M, BLOCK_N)  # [BM], [BN]
    rows = tl.arange(0, GW)  # [GW]
    x_words = K // 4
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, NG)
    # Software pipeline, two groups deep: the next two groups' words are in flight while one is
    # computed. The first loads need nothing from the previous kernel, so with PDL they are issued
    # before the wait (most programs own two groups: their whole slice is then in flight early).
    w_next = tl.load(w_ptr + (g_start * GW + rows)[:, None] * N + offs_n[None, :],
                     mask=n_mask[None, :] & ((rows * 0 + g_start) < g_end)[:, None], other=0,
                     eviction_policy="evict_first")  # [GW, BN]
    if DEEP:
        w_after = tl.load(w_ptr + ((g_start + 1) * GW + rows)[:, None] * N + offs_n[None, :],
                          mask=n_mask[None, :] & ((rows * 0 + g_start + 1) < g_end)[:, None], other=0,
                          eviction_policy="evict_first")  # [GW, BN]
    else:
        w_after = w_next
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_start, g_end):
        w = w_next
        if DEEP:
            w_next = w_after
            w_after = tl.load(w_ptr + ((g + 2) * GW + rows)[:, None] * N + offs_n[None, :],
                              mask=n_mask[None, :] & ((rows * 0 + g + 2) < g_end)[:, None], other=0,
                              eviction_policy="evict_first")
        else:
            w_next = tl.load(w_ptr + ((g + 1) * GW + rows)[:, None] * N + offs_n[None, :],
                             mask=n_mask[None, :] & ((rows * 0 + g + 1) < g_end)[:, None], other=0,
                             eviction_policy="evict_first")
            w_after = w_next
        dot = _group_dot(w, xq_ptr, g, offs_m, m_mask, M, rows, x_words, BITS, BYTE_MASK, GROUP, BLOCK_M,
                         BLOCK_N, USE_ASM, ROWS_2D)  # [BM, BN]
        sumx = tl.load(sumx_ptr + offs_m * NG + g, mask=m_mask, other=0)  # [BM]
        sx = tl.load(sx_ptr + offs_m * NG + g, mask=m_mask, other=0.0)  # [BM]
        sw = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        corrected = (dot * MULT - OFFSET * sumx[:, None]).to(tl.float32)
        acc += corrected * sx[:, None] * sw[None, :]
    _write_out(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)


@triton.jit
def _packed_gemv_kwarps_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, N, NG, groups_per_split,
                               BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr, BYTE_MASK: tl.constexpr,
                               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, WK: tl.constexpr, ATOMIC: tl.constexpr,
                               ACCUMULATE: tl.constexpr, USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """One row, WK warps a program: each step loads WK consecutive groups as a [WK, GW, BLOCK_N] tile (a warp a
    group; the next step's tile in flight while this one is summed), the groups are summed once at the end."""
    STEPS: tl.constexpr = 8 // BITS  # shift steps per word
    GW: tl.constexpr = GROUP * BITS // 32  # words per group (per column)
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(1, N, 1, BLOCK_N)  # [1], [BN]
    gi = tl.arange(0, WK)  # [WK] the groups of a step
    rows = tl.arange(0, GW)  # [GW]
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, NG)
    word_rows = (gi[:, None] * GW + rows[None, :])[:, :, None]  # [WK, GW, 1]
    cols = offs_n[None, None, :]  # [1, 1, BN]
    col_ok = n_mask[None, None, :] & (word_rows >= 0)  # [WK, GW, BN]
    w_next = tl.load(w_ptr + (g_start * GW + word_rows) * N + cols,
                     mask=col_ok & ((g_start + gi)[:, None, None] < g_end), other=0,
                     eviction_policy="evict_first")  # [WK, GW, BN]
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([WK, BLOCK_N], dtype=tl.float32)
    for g0 in range(g_start, g_end, WK):
        w = w_next
        w_next = tl.load(w_ptr + ((g0 + WK) * GW + word_rows) * N + cols,
                         mask=col_ok & ((g0 + WK + gi)[:, None, None] < g_end), other=0,
                         eviction_policy="evict_first")  # [WK, GW, BN]
        g = g0 + gi  # [WK]
        ok = g < g_end
        isum = tl.zeros([WK, GW, BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(STEPS):
            codes = (w >> (BITS * j)) & BYTE_MASK  # [WK, GW, BN]: four codes as bytes
            xw = tl.load(xq_ptr + g[:, None] * (GROUP // 4) + STEPS * rows[None, :] + j, mask=ok[:, None],
                         other=0)  # [WK, GW]: the activations they meet
            isum = _dot4(codes, tl.broadcast_to(xw[:, :, None], [WK, GW, BLOCK_N]), isum, USE_ASM)
        dot = tl.sum(isum, axis=1)  # [WK, BN]
        sumx = tl.load(sumx_ptr + g, mask=ok, other=0)  # [WK]
        sx = tl.load(sx_ptr + g, mask=ok, other=0.0)  # [WK]
        sw = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok[:, None] & n_mask[None, :],
                     other=0.0).to(tl.float32)  # [WK, BN]
        acc += (dot * MULT - OFFSET * sumx[:, None]).to(tl.float32) * sx[:, None] * sw
    _write_out(out_ptr, tl.sum(acc, axis=0)[None, :], offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)


# The row loop (M = 5..16: batched decode, speculative verification): a thread owns a few output
# columns and keeps every row's running sum for them in registers; the program walks the weight one
# word row ([BLOCK_N] words) at a time, so each word is shifted and masked once and then meets the
# activation word of every row: an extra row costs only its dp4a. (The M = 1 kernel's [words,
# columns] tiles would need a [rows, words, columns] broadcast here, which spills.)
@triton.jit
def _packed_gemv_rows_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG, groups_per_split,
                             BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr,
                             BYTE_MASK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, ACCUMULATE: tl.constexpr,
                             USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    STEPS: tl.constexpr = 8 // BITS  # shift steps per word
    GW: tl.constexpr = GROUP * BITS // 32  # word rows per group
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(M, N, BLOCK_M, BLOCK_N)  # [BM], [BN]
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
    _write_out(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)


# One row of a 1-bit matrix under 100M weights: programs of 32 columns (48 registers a thread against 165 at 128
# columns: more programs a SM). Measured on an H100 (tests/perf/gemv_configs.py, 2026-12-06, µs, 128 → 32 columns
# at the split rule): 8B q/k/v 5.98 → 4.87, o 5.42 → 3.96, down 7.43 → 7.46; 27B-class q/k/v 5.97 → 5.23, o 7.32 →
# 4.93, down 12.26 → 9.15; gate/up (≥ 100M) stays at 128 (8B 8.85 against 10.03). Ternary: within ±5% either way.
NARROW_COLUMNS = {"bin": (32, 100_000_000 // 128)}  # kind: (BLOCK_N, below this many columns × groups)


def gemv_launch_config(n: int, num_groups: int, kind: str, num_sms: int = 132, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, split_k, num_warps). Measured on an H200 (tests/perf/gpu_kernels.py sweep): one warp
    of 128 columns per program (each thread owns four neighbouring columns and every word of a group,
    so per-group sums stay inside the thread) and split-K until the grid holds ~4096 programs (at
    most 32 splits, at least two groups each) beat wider programs at every Qwen3-8B shape; one row of a
    smaller 1-bit matrix takes narrower programs (NARROW_COLUMNS)."""
    block_n, warps = 128, 1
    narrow = NARROW_COLUMNS.get(kind)
    if rows == 1 and narrow is not None and n * num_groups < narrow[1]:
        block_n = narrow[0]
    return block_n, split_k(triton.cdiv(n, block_n), num_groups, 4096), warps


def packed_gemv(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
                out: torch.Tensor | None = None, accumulate: bool = False,
                config: tuple[int, int, int] | None = None, num_sms: int = 132, variant: str | None = None
                ) -> torch.Tensor:
    """y = x Wᵀ for M ≤ 16 rows of int8 activations → float32 [M, N]; with accumulate, out += y.
    variant (default by row count and size: default_variant): "cuda" (one row of a tri / bin matrix in CUDA C++:
    quant.kernels.cuda_gemv, config (warps, groups a warp)), "2d" (the M = 1 tiles once per row), "3d"
    (broadcast over rows), "rows" (the word-row loop, from ROW_LOOP_FROM rows), "mma" (tensor cores:
    quant.kernels.packed_mma, its own config), "kwarps" (one row of a ≤ 2-bit layout: warps split K in a
    program; config (BLOCK_N, split_k, warps)). A tri5 matrix runs quant.kernels.tri5_gemv (its config)."""
    if pw.kind == "tri5":
        from quant.kernels.tri5_gemv import tri5_gemv
        return tri5_gemv(xq, sx, sumx, pw, out, accumulate, config)
    m, k = xq.shape
    if variant is None:
        from quant.kernels.cuda_gemv import enabled
        variant = default_variant(pw.kind, pw.group_size, m, k, pw.out_features,
                                  m == 1 and config is None and enabled(xq.device))
    if variant == "cuda":
        from quant.kernels.cuda_gemv import cuda_gemv
        return cuda_gemv(xq, sx, sumx, pw, out, accumulate, config)
    if variant == "mma":
        from quant.kernels.packed_mma import packed_mma
        return packed_mma(xq, sx, sumx, pw, out, accumulate, config)
    assert m <= 16 and k == pw.in_features and xq.is_contiguous()
    row_loop = variant == "rows" and m > 1
    kind = layout_kind(pw.kind)
    ng = k // pw.group_size
    if variant == "kwarps" and m == 1 and kind.bits <= 2:
        return _kwarps(xq, sx, sumx, pw, out, accumulate, config or kwarps_launch_config(pw.out_features, ng))
    block_n, split, warps = config or gemv_launch_config(pw.out_features, ng, pw.kind, num_sms, m)
    out = result_buffer(out, m, pw.out_features, xq.device, accumulate, split)
    per_split = triton.cdiv(ng, split)
    grid = (triton.cdiv(pw.out_features, block_n), triton.cdiv(ng, per_split))
    kernel, extra = ((_packed_gemv_rows_kernel, {}) if row_loop
                     else (_packed_gemv_kernel, {"ROWS_2D": m > 1 and variant == "2d"}))
    kernel[grid](
        xq.view(torch.int32), sx, sumx, pw.words, pw.scales, out, m, pw.out_features, k, ng, per_split,
        BITS=kind.bits, MULT=kind.mult, OFFSET=kind.offset, BYTE_MASK=_BYTE_MASK[kind.bits],
        GROUP=pw.group_size, BLOCK_M=max(triton.next_power_of_2(m), 2 if row_loop else 1), BLOCK_N=block_n,
        ATOMIC=split > 1, ACCUMULATE=accumulate, USE_ASM=not interpreting(), num_warps=warps,
        **extra, **pdl_options(xq.device))
    return out


def _kwarps(xq, sx, sumx, pw: PackedWeight, out, accumulate: bool, config: tuple[int, int, int]) -> torch.Tensor:
    """One row through _packed_gemv_kwarps_kernel (config: BLOCK_N, split_k, warps)."""
    kind, ng = layout_kind(pw.kind), pw.in_features // pw.group_size
    block_n, split, warps = config
    per_split = _kwarps_per_split(ng, split, warps)
    grid = (triton.cdiv(pw.out_features, block_n), triton.cdiv(ng, per_split))
    out = result_buffer(out, 1, pw.out_features, xq.device, accumulate, grid[1])
    _packed_gemv_kwarps_kernel[grid](
        xq.view(torch.int32), sx, sumx, pw.words, pw.scales, out, pw.out_features, ng, per_split, BITS=kind.bits,
        MULT=kind.mult, OFFSET=kind.offset, BYTE_MASK=_BYTE_MASK[kind.bits], GROUP=pw.group_size, BLOCK_N=block_n,
        WK=warps, ATOMIC=grid[1] > 1, ACCUMULATE=accumulate, USE_ASM=not interpreting(), num_warps=warps,
        **pdl_options(xq.device))
    return out

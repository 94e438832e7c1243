"""Packed-weight product for 2..16 rows on tensor cores: int8 × int8 → int32 MMA, weight bytes the only cost.

Same contract as `packed_gemv` (xq, sx, sumx, PackedWeight of kind tri/bin/int4/int8, out, accumulate;
split-K programs add with atomics; PDL), and the same integer sums per group, so the engine can switch
between the two per row count. Why int8 and not bf16: the activations are already int8 (no conversion),
a code plane comes out of the packed bytes as int8 directly (bf16 would need an integer → float convert
per code, a quarter-rate instruction on Hopper), int8 MMA has twice bf16's rate, and the int32 sums are
bit-identical to the dp4a kernels'.

The product is computed transposed, y[m, n] = (W xᵀ)[n, m]: the weight is the MMA's big operand (its
M = BLOCK_N columns of W), the rows are the small one (N = BLOCK_M, padded in registers: masked rows load
zeros and are never stored); Triton 3.6 emits mma.sync m16n8k32 for it on sm_90 (read in the PTX). The
program loads the packed bytes of a tile of BLOCK_N columns × KD bytes (one group, or R = 32 /
bytes-per-group groups when a group has fewer than 32 bytes of codes) as int8 [BLOCK_N, KD] (tri and int4
by default read by word rows — a thread copies 16 bytes and a warp 512 contiguous bytes of one row of the
words, where a [BLOCK_N, KD] load gives a thread 4 bytes and a warp 16-byte pieces of 8 rows — and a tile's
activations for all its planes loaded at the start of its step), and for each bit plane j (shift BITS·j) takes
    A_j = (bytes >> BITS·j) & field mask          (one shift and one and per four codes: `_plane`)
which is elementwise on the packed bytes, so it is right in whatever register layout Triton gives the
MMA operand. Byte p of word w, plane j holds input k = E·w + 4j + p % 4 (E codes per word): the
activations are gathered in that order, [KD, BLOCK_M], zero outside the group being summed; each group's
int32 sums are scaled once into the float accumulator, as in packed_gemv:
    y[m, n] += sw[g, n] · sx[m, g] · (MULT · Σ u·x − OFFSET · sumx[m, g]).
The int32 → float conversion is exact and cheap: bitcast(d + 0x4B400000) = 12582912 + d for |d| < 2^22.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.kernels import interpreting, pdl_options
from quant.kernels.gemv_parts import _program_tile, _write_out, packed_gemv_reference, result_buffer, split_k
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait
from quant.packed_layout import PackedWeight, layout_kind

MAGIC = 0x4B400000  # float32 bits of 2^23 + 2^22
MAGIC_F = 12582912.0
MAX_GROUPS_PER_TILE = 4  # R; 1-bit codes in groups of 32 (R = 8) stay on the dp4a kernels
_FIELD = {1: 0x01010101, 2: 0x03030303, 4: 0x0F0F0F0F}


def packed_mma_reference(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
                         out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """The same maths in plain torch: packed_gemv_reference (exact integer sums)."""
    return packed_gemv_reference(xq, sx, sumx, pw, out, accumulate)


def groups_per_tile(kind: str, group_size: int) -> int:
    """R: the groups of one 32-byte tile when a group has fewer than 32 bytes of codes, else 1."""
    group_bytes = group_size * layout_kind(kind).bits // 8
    return max(32, group_bytes) // group_bytes


def mma_supported(kind: str, group_size: int, in_features: int | None = None) -> bool:
    """Whether packed_mma takes this layout and group size (else the dp4a kernels do the rows), and, given
    in_features, whether its groups fill whole tiles (a tile never straddles the end of K)."""
    if layout_kind(kind).base3 or group_size > 256:
        return False
    r = groups_per_tile(kind, group_size)
    return r <= MAX_GROUPS_PER_TILE and (in_features is None or (in_features // group_size) % r == 0)


def joinable(kind: str, group_size: int) -> bool:
    """Whether a tile's planes can go into one product: one group a tile, 2 or 4 planes (tri, int4)."""
    k = layout_kind(kind)
    return not k.signed and not k.base3 and 8 // k.bits in (2, 4) and groups_per_tile(kind, group_size) == 1


@triton.jit
def _plane(t, SHIFT: tl.constexpr, FIELD: tl.constexpr, USE_ASM: tl.constexpr):
    """Codes of bit plane SHIFT of the packed bytes t (int8, any shape): (t >> SHIFT) & field, four bytes
    per instruction pair."""
    if USE_ASM:
        return tl.inline_asm_elementwise("{ .reg .b32 r; shr.b32 r, $1, $2; and.b32 $0, r, $6; }",
                                         "=r,r,r,r,r,r,r,r,r,r",
                                         [t, tl.full(t.shape, SHIFT, tl.int32), tl.full(t.shape, FIELD, tl.int32)],
                                         dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (t >> SHIFT) & (FIELD & 0xFF)


@triton.jit
def _joined_planes(codes, BITS: tl.constexpr, STEPS: tl.constexpr, FIELD: tl.constexpr, USE_ASM: tl.constexpr):
    """The STEPS bit planes of codes [BN, KD] side by side: [BN, KD·STEPS], element (b, p·STEPS + q) from
    byte p, plane q (STEPS = 2) or plane 2·(q % 2) + q // 2 (STEPS = 4: tl.join nests the pairs)."""
    p0 = _plane(codes, 0, FIELD, USE_ASM)
    p1 = _plane(codes, BITS, FIELD, USE_ASM)
    if STEPS == 2:
        both = tl.join(p0, p1)  # [BN, KD, 2]
    else:
        both = tl.join(tl.join(p0, p1), tl.join(_plane(codes, 2 * BITS, FIELD, USE_ASM),
                                                _plane(codes, 3 * BITS, FIELD, USE_ASM)))  # [BN, KD, 2, 2]
    return tl.reshape(both, [codes.shape[0], codes.shape[1] * STEPS])


@triton.jit
def _group_epilogue(acc, d, g, sw, sx_ptr, sumx_ptr, offs_m, m_mask, NG,
                    MULT: tl.constexpr, OFFSET: tl.constexpr, EXACT_MAGIC: tl.constexpr):
    """acc [BN, BM] + group g's int32 sums d [BN, BM], corrected and scaled (sw [BN]: its weight scales)."""
    sumx = tl.load(sumx_ptr + offs_m * NG + g, mask=m_mask, other=0).to(tl.float32)  # [BM]
    sx = tl.load(sx_ptr + offs_m * NG + g, mask=m_mask, other=0.0)  # [BM]
    if EXACT_MAGIC:
        f = (d + 0x4B400000).to(tl.float32, bitcast=True)  # 12582912 + d, exactly
        if MULT == 1:  # 12582912 + OFFSET·sumx < 2^24: an exact float, one subtraction
            v = f - (12582912.0 + OFFSET * sumx)[None, :]
        else:
            v = (f - 12582912.0) * MULT - (OFFSET * sumx)[None, :]
    else:
        v = d.to(tl.float32) * MULT - (OFFSET * sumx)[None, :]
    return acc + v * sx[None, :] * sw[:, None]


@triton.jit
def _scales(s_ptr, g, N, offs_n, n_mask):
    """Group g's weight scales [BN] as float32."""
    return tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def _x_tile(xq_ptr, t, t_end, offs_m, m_mask, K, p, E: tl.constexpr, KD: tl.constexpr, STEPS: tl.constexpr):
    """The activations the STEPS bit planes of tile t meet: eight [KD, BM] int8 tensors (those past STEPS repeat
    the first; zeros past the split's last tile t_end - 1), loaded together (one memory round trip)."""
    k0 = E * (t * (KD // 4) + p // 4) + p % 4  # [KD]: the input of plane 0 of each byte
    base = xq_ptr + offs_m[None, :] * K + k0[:, None]  # [KD, BM]
    ok = m_mask[None, :] & ((p * 0 + t) < t_end)[:, None]
    x0 = tl.load(base, mask=ok, other=0)
    x1 = x0
    x2 = x0
    x3 = x0
    x4 = x0
    x5 = x0
    x6 = x0
    x7 = x0
    if STEPS > 1:
        x1 = tl.load(base + 4, mask=ok, other=0)
    if STEPS > 2:
        x2 = tl.load(base + 8, mask=ok, other=0)
        x3 = tl.load(base + 12, mask=ok, other=0)
    if STEPS > 4:
        x4 = tl.load(base + 16, mask=ok, other=0)
        x5 = tl.load(base + 20, mask=ok, other=0)
        x6 = tl.load(base + 24, mask=ok, other=0)
        x7 = tl.load(base + 28, mask=ok, other=0)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _pick(j: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7):
    """x_j of eight (j a compile-time constant)."""
    if j == 0:
        return x0
    elif j == 1:
        return x1
    elif j == 2:
        return x2
    elif j == 3:
        return x3
    elif j == 4:
        return x4
    elif j == 5:
        return x5
    elif j == 6:
        return x6
    else:
        return x7


@triton.jit
def _packed_mma_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG, tiles_per_split,
                       BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr, SIGNED: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr,
                       ACCUMULATE: tl.constexpr, EXACT_MAGIC: tl.constexpr, USE_ASM: tl.constexpr,
                       JOIN: tl.constexpr, X_AHEAD: tl.constexpr, WORD_ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    E: tl.constexpr = 32 // BITS  # codes per word
    STEPS: tl.constexpr = 8 // BITS  # bit planes per byte
    FIELD: tl.constexpr = 0x01010101 if BITS == 1 else (0x03030303 if BITS == 2 else 0x0F0F0F0F)
    GB: tl.constexpr = GROUP * BITS // 8  # bytes of codes per column per group
    KD: tl.constexpr = 32 if GB < 32 else GB  # bytes per tile (the MMA's K is 32 for int8)
    R: tl.constexpr = KD // GB  # groups per tile
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(M, N, BLOCK_M, BLOCK_N)  # [BM], [BN]
    p = tl.arange(0, KD)  # byte of the tile
    n_tiles = NG // R
    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, n_tiles)
    w_bytes = w_ptr.to(tl.pointer_type(tl.int8))
    byte_offs = (p // 4)[None, :] * (4 * N) + (p % 4)[None, :] + 4 * offs_n[:, None]  # [BN, KD]
    # WORD_ROWS: the tile loaded as [word row, column·byte] so that a warp reads whole rows of the words (the [BN, KD]
    # load gives a warp 16-byte pieces of 8 word rows), then viewed as [BN, KD]
    row_bytes = tl.program_id(0) * BLOCK_N * 4 + tl.arange(0, BLOCK_N * 4)  # [BN·4] of a word row, contiguous
    offs_rows = tl.arange(0, KD // 4)[:, None] * (4 * N) + row_bytes[None, :]  # [KD / 4, BN·4]
    tile_bytes = (KD // 4) * (4 * N)
    # X_AHEAD: each plane's activations loaded where its product needs them (0), all of a tile's at the start of
    # its step (1), or a tile ahead (2)
    if X_AHEAD == 2:
        xn0, xn1, xn2, xn3, xn4, xn5, xn6, xn7 = _x_tile(xq_ptr, t_start, t_end, offs_m, m_mask, K, p, E, KD, STEPS)
    if USE_PDL:  # the weights need nothing from the previous kernel: bring the first tile into L2 meanwhile
        first = w_ptr + (t_start * (KD // 4) + tl.arange(0, KD // 4))[:, None] * N + offs_n[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [first], dtype=tl.int32,
                                  is_pure=False, pack=1)
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(t_start, t_end):
        g = t * R
        if WORD_ROWS:
            words = tl.load(w_bytes + t * tile_bytes + offs_rows, mask=(row_bytes < 4 * N)[None, :], other=0,
                            eviction_policy="evict_first")  # [KD / 4, BN·4]
            codes = tl.reshape(tl.permute(tl.reshape(words, [KD // 4, BLOCK_N, 4]), (1, 0, 2)),
                               [BLOCK_N, KD])  # [BN, KD] packed bytes
        else:
            codes = tl.load(w_bytes + t * tile_bytes + byte_offs, mask=n_mask[:, None], other=0,
                            eviction_policy="evict_first")  # [BN, KD] packed bytes
        sw0 = _scales(s_ptr, g, N, offs_n, n_mask)  # [BN]
        if R > 1:
            sw1 = _scales(s_ptr, g + 1, N, offs_n, n_mask)
        if R > 2:
            sw2 = _scales(s_ptr, g + 2, N, offs_n, n_mask)
            sw3 = _scales(s_ptr, g + 3, N, offs_n, n_mask)
        if X_AHEAD == 1:
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_tile(xq_ptr, t, t_end, offs_m, m_mask, K, p, E, KD, STEPS)
        elif X_AHEAD == 2:
            x0, x1, x2, x3, x4, x5, x6, x7 = xn0, xn1, xn2, xn3, xn4, xn5, xn6, xn7
            xn0, xn1, xn2, xn3, xn4, xn5, xn6, xn7 = _x_tile(xq_ptr, t + 1, t_end, offs_m, m_mask, K, p, E, KD, STEPS)
        k_of = E * (t * (KD // 4) + p // 4) + p % 4  # [KD]: input of plane 0 of each byte
        d0 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        d1 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        d2 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        d3 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        if JOIN:  # one group a tile: all its planes side by side along K, one product [BN, STEPS·KD] x [STEPS·KD, BM]
            a = _joined_planes(codes, BITS, STEPS, FIELD, USE_ASM)  # [BN, STEPS * KD] int8 codes
            kk = tl.arange(0, STEPS * KD)
            pb = kk // STEPS  # the byte each code comes from
            q = kk % STEPS
            j = q if STEPS == 2 else 2 * (q % 2) + q // 2  # its plane (the order _joined_planes interleaves them)
            k_all = E * (t * (KD // 4) + pb // 4) + pb % 4 + 4 * j  # [STEPS * KD]
            x = tl.load(xq_ptr + offs_m[None, :] * K + k_all[:, None], mask=m_mask[None, :], other=0)  # [S·KD, BM]
            d0 = tl.dot(a, x, d0, out_dtype=tl.int32)
        else:
            for j in tl.static_range(STEPS):
                if SIGNED:
                    a = codes
                else:
                    a = _plane(codes, BITS * j, FIELD, USE_ASM)  # [BN, KD] int8 codes
                x_offs = offs_m[None, :] * K + (k_of + 4 * j)[:, None]  # [KD, BM]
                for r in tl.static_range(R):
                    in_group = ((p // GB) == r)[:, None]  # [KD, 1]: the bytes of the tile's group r
                    if X_AHEAD == 0:
                        x = tl.load(xq_ptr + x_offs, mask=m_mask[None, :] & in_group, other=0)  # [KD, BM]
                    elif R == 1:
                        x = _pick(j, x0, x1, x2, x3, x4, x5, x6, x7)  # [KD, BM]
                    else:
                        x = tl.where(in_group, _pick(j, x0, x1, x2, x3, x4, x5, x6, x7), 0).to(tl.int8)
                    if r == 0:
                        d0 = tl.dot(a, x, d0, out_dtype=tl.int32)
                    elif r == 1:
                        d1 = tl.dot(a, x, d1, out_dtype=tl.int32)
                    elif r == 2:
                        d2 = tl.dot(a, x, d2, out_dtype=tl.int32)
                    else:
                        d3 = tl.dot(a, x, d3, out_dtype=tl.int32)
        acc = _group_epilogue(acc, d0, g, sw0, sx_ptr, sumx_ptr, offs_m, m_mask, NG, MULT, OFFSET, EXACT_MAGIC)
        if R > 1:
            acc = _group_epilogue(acc, d1, g + 1, sw1, sx_ptr, sumx_ptr, offs_m, m_mask, NG, MULT, OFFSET, EXACT_MAGIC)
        if R > 2:
            acc = _group_epilogue(acc, d2, g + 2, sw2, sx_ptr, sumx_ptr, offs_m, m_mask, NG, MULT, OFFSET, EXACT_MAGIC)
            acc = _group_epilogue(acc, d3, g + 3, sw3, sx_ptr, sumx_ptr, offs_m, m_mask, NG, MULT, OFFSET, EXACT_MAGIC)
    _write_out(out_ptr, tl.trans(acc), offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)  # y [BM, BN]


# Per layout: (BLOCK_N, num_warps, num_stages, programs split-K aims for), and whether a tile's planes go into
# one product (`joinable` layouts only). The tensor core op is mma.sync m16n8k32 (N = the 8 or 16 padded rows).
# Swept on an H100 (session 25, tests/perf/gpu_issue20.py --sections sweep --grid ref,rows: 8 rows, 8B gate/up +
# down, g128, µs): the packed bytes read by word rows (WORD_ROWS: 16-byte copies, a warp on one 512-byte row)
# took tri from 40.4 (the session-9 config, (128, 4, 2, 512)) to 33.9 at (128, 4, 3, 512) with the activations
# loaded together (X_AHEAD 1), and int4 from 84.3 ((128, 4, 2, 1024)) to 41.5 at (128, 4, 3, 512); ncu on the
# gate/up product: L1/TEX throughput 68% → 58%, DRAM 30% → 37%, 28.6 → 22.5 µs. Tiles held in registers 1-2 ahead
# (built, measured, removed: docs/perf.md session 25), one- or two-warp programs and 1,024-2,048 programs lost or
# tied. bin / int8 rows stay on the dp4a kernels (MMA_FROM_ROWS), their entries untouched.
MMA_LAUNCH = {"tri": (128, 4, 3, 512), "bin": (128, 4, 3, 1024), "int4": (128, 4, 3, 512), "int8": (128, 4, 3, 1024)}
JOIN_PLANES = {"tri": False, "int4": False}
# How a tile's activations are loaded (packed_mma's x_ahead): 1, all planes' together at the start of its step.
X_AHEAD = {"tri": 1, "bin": 0, "int4": 1, "int8": 0}
# Whether the packed bytes are loaded a word row at a time (packed_mma's word_rows).
WORD_ROWS = {"tri": True, "bin": False, "int4": True, "int8": False}


def mma_launch_config(n: int, tiles: int, rows: int, kind: str = "tri") -> tuple[int, int, int, int]:
    """(BLOCK_N, split_k, num_warps, num_stages) for an [n, K] matrix of `tiles` K tiles: MMA_LAUNCH's
    shape, split-K until about its number of programs with at least two tiles each."""
    block_n, warps, stages, programs = MMA_LAUNCH[kind]
    return block_n, split_k(triton.cdiv(n, block_n), tiles, programs), warps, stages


def packed_mma(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
               out: torch.Tensor | None = None, accumulate: bool = False,
               config: tuple[int, int, int, int] | None = None, join: bool | None = None,
               x_ahead: int | None = None, word_rows: bool | None = None) -> torch.Tensor:
    """y = x Wᵀ for M ≤ 16 rows of int8 activations on tensor cores → float32 [M, N]; with accumulate,
    out += y. Same results as packed_gemv (the same integer sums; float sums in another order).
    join: a tile's bit planes in one product (`joinable` layouts; default JOIN_PLANES) or one per plane.
    x_ahead: a tile's activations loaded per plane where used (0), together at its step's start (1), or a tile
    ahead (2) (default X_AHEAD). word_rows: the packed bytes loaded a word row at a time (default WORD_ROWS)."""
    m, k = xq.shape
    assert m <= 16 and k == pw.in_features and xq.is_contiguous() and mma_supported(pw.kind, pw.group_size, k)
    kind = layout_kind(pw.kind)
    ng = k // pw.group_size
    tiles = ng // groups_per_tile(pw.kind, pw.group_size)
    block_n, split, warps, stages = config or mma_launch_config(pw.out_features, tiles, m, pw.kind)
    out = result_buffer(out, m, pw.out_features, xq.device, accumulate, split)
    per_split = triton.cdiv(tiles, split)
    grid = (triton.cdiv(pw.out_features, block_n), triton.cdiv(tiles, per_split))
    max_code = 128 if kind.signed else (1 << kind.bits) - 1
    join = JOIN_PLANES.get(pw.kind, False) if join is None else join
    x_ahead = X_AHEAD.get(pw.kind, 0) if x_ahead is None else x_ahead
    word_rows = WORD_ROWS.get(pw.kind, False) if word_rows is None else word_rows
    assert x_ahead in (0, 1, 2)
    _packed_mma_kernel[grid](
        xq, sx, sumx, pw.words, pw.scales, out, m, pw.out_features, k, ng, per_split,
        BITS=kind.bits, MULT=kind.mult, OFFSET=kind.offset, SIGNED=kind.signed, GROUP=pw.group_size,
        BLOCK_M=16 if m > 8 else 8, BLOCK_N=block_n, ATOMIC=split > 1, ACCUMULATE=accumulate,
        EXACT_MAGIC=pw.group_size * max_code * 127 < 2 ** 22, USE_ASM=not interpreting(),
        JOIN=join and joinable(pw.kind, pw.group_size), X_AHEAD=x_ahead, WORD_ROWS=word_rows,
        num_warps=warps, num_stages=stages, **pdl_options(xq.device))
    return out

"""Matrix-vector product with base-3 ternary weights (tri5, quant/tri5_layout.py) for decode and small batches.

Same contract as `packed_gemv`: int8 per-group activations (xq, sx, sumx) → y [M, N] float32, split-K
programs adding with atomics (accumulate=True adds into out), PDL as the other GEMVs. Per group g:
    y[m, n] += sw[g, n] · sx[m, g] · (Σ_k t[k, n]·xq[m, k] − sumx[m, g]),  t = code + 1 ∈ {0, 1, 2}.

Decoding four lanes of a five-trit word w at once: even lanes e = w & 0x00FF00FF and odd lanes
o = (w >> 8) & 0x00FF00FF are two bytes in 16-bit halves; e·3^(n+1) cannot carry between halves
(255·243 < 2^16), and byte 1 / byte 3 of each half is Q_n = floor(b·3^(n+1)/256), the first n+1 trits
read as a base-3 number. One byte permute (`prmt`) puts the four lanes' Q_n into one word.
  M = 1 (`_tri5_gemv_kernel`): Σ_n t_n·x_n = Σ_n Q_n·x_n − 3·Σ_{n<4} Q_n·x_{n+1} (t_n = Q_n − 3·Q_{n-1}):
        per word 2 masks, 10 multiplies, 5 permutes and 9 dp4a = 26 instructions for 20 weights.
  M ≥ 2 (`_tri5_rows_kernel`, a word row at a time as packed_gemv's row loop): the trits themselves,
        t_n = floor(3·(b·3^n mod 256)/256): the remainder of each half is kept by a mask, ×3 moves the
        next trit into byte 1 / 3; per word 25 instructions once, then 5 dp4a per row.
The tail word of each super-block is a 2-bit tri word: shift + mask + dp4a as in packed_gemv.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.kernels import interpreting, pdl_options
from quant.kernels.gemv_parts import (_dot4, _dot4_bytes, _program_tile, _write_out, packed_gemv_reference,
                                       result_buffer, split_k)
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait
from quant.packed_layout import PackedWeight

EVEN = 0x00FF00FF
ODD_HI = -16711936  # 0xFF00FF00 as an int32
TAIL_MASK = 0x03030303


def tri5_gemv_reference(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
                        out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """The plain-torch maths (exact integer sums of the decoded codes): packed_gemv_reference."""
    assert pw.kind == "tri5"
    return packed_gemv_reference(xq, sx, sumx, pw, out, accumulate)


@triton.jit
def _high_bytes(pe, po, USE_ASM: tl.constexpr):
    """[pe.byte1, po.byte1, pe.byte3, po.byte3]: the four lanes' digit bytes in one word."""
    if USE_ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7351;", "=r,r,r", [pe, po], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return ((pe >> 8) & 0x00FF00FF) | (po & -16711936)


@triton.jit
def _five_trit_sums(w, x_ptrs, qa, qb, USE_ASM: tl.constexpr):
    """Q-sums of one tile of five-trit words w [4, BN] against the activation words x_ptrs[h] + n:
    qa += Σ_n Q_n·x_n, qb += Σ_{n<4} Q_n·x_{n+1} (so Σ t·x = qa − 3·qb)."""
    pe = (w & 0x00FF00FF) * 3  # even lanes · 3^(n+1), n = 0
    po = ((w >> 8) & 0x00FF00FF) * 3  # odd lanes
    xn = tl.broadcast_to(tl.load(x_ptrs)[:, None], w.shape)
    for n in tl.static_range(5):
        q = _high_bytes(pe, po, USE_ASM)  # [4, BN]: Q_n of the four lanes
        qa = _dot4_bytes(q, xn, qa, True, USE_ASM)
        if n < 4:
            xn = tl.broadcast_to(tl.load(x_ptrs + n + 1)[:, None], w.shape)
            qb = _dot4_bytes(q, xn, qb, True, USE_ASM)
            pe = pe * 3
            po = po * 3
    return qa, qb


@triton.jit
def _load_superblock(w_ptr, s, s_end, h, offs_n, n_mask, N):
    """The three five-trit tiles [4 (segment h), BN] and the tail word row [BN] of super-block s."""
    ok = n_mask & ((offs_n * 0 + s) < s_end)
    rows = 13 * s + h  # [4]
    w0 = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=ok[None, :], other=0, eviction_policy="evict_first")
    w1 = tl.load(w_ptr + (rows + 4)[:, None] * N + offs_n[None, :], mask=ok[None, :], other=0,
                 eviction_policy="evict_first")
    w2 = tl.load(w_ptr + (rows + 8)[:, None] * N + offs_n[None, :], mask=ok[None, :], other=0,
                 eviction_policy="evict_first")
    tail = tl.load(w_ptr + (13 * s + 12) * N + offs_n, mask=ok, other=0, eviction_policy="evict_first")
    return w0, w1, w2, tail


@triton.jit
def _tri5_gemv_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, N, NG, NS, supers_per_split,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, ACCUMULATE: tl.constexpr,
                      USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    NGS: tl.constexpr = 256 // GROUP  # groups per super-block
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(1, N, 1, BLOCK_N)  # [1], [BN]
    h = tl.arange(0, 4)  # segment of the super-block
    s_start = pid_k * supers_per_split
    s_end = tl.minimum(s_start + supers_per_split, NS)
    # the first super-block's words need nothing from the previous kernel: with PDL, loaded before the wait
    w0n, w1n, w2n, tn = _load_superblock(w_ptr, s_start, s_end, h, offs_n, n_mask, N)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([NGS, BLOCK_N], dtype=tl.float32)
    for s in range(s_start, s_end):
        w0, w1, w2, tail = w0n, w1n, w2n, tn
        w0n, w1n, w2n, tn = _load_superblock(w_ptr, s + 1, s_end, h, offs_n, n_mask, N)
        x_ptrs = xq_ptr + 64 * s + 16 * h  # [4]: int32 activation word of (segment h, a = 0, n = 0)
        qa = tl.zeros([4, BLOCK_N], dtype=tl.int32)
        qb = tl.zeros([4, BLOCK_N], dtype=tl.int32)
        qa, qb = _five_trit_sums(w0, x_ptrs, qa, qb, USE_ASM)
        qa, qb = _five_trit_sums(w1, x_ptrs + 5, qa, qb, USE_ASM)
        qa, qb = _five_trit_sums(w2, x_ptrs + 10, qa, qb, USE_ASM)
        codes = (tail[None, :] >> (2 * h)[:, None]) & 0x03030303  # [4, BN]: the tail's step h
        xt = tl.broadcast_to(tl.load(x_ptrs + 15)[:, None], [4, BLOCK_N])
        qa = _dot4(codes, xt, qa, USE_ASM)
        isum = tl.sum(tl.reshape(qa - 3 * qb, [NGS, 4 // NGS, BLOCK_N]), axis=1)  # [NGS, BN]: Σ t·x per group
        g = s * NGS + tl.arange(0, NGS)  # [NGS]
        sumx = tl.load(sumx_ptr + g)
        sx = tl.load(sx_ptr + g)
        sw = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0.0).to(tl.float32)
        acc += (isum - sumx[:, None]).to(tl.float32) * sx[:, None] * sw
    total = tl.sum(acc, axis=0)[None, :]  # [1, BN]
    _write_out(out_ptr, total, offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)


@triton.jit
def _next_trit(pe, po, USE_ASM: tl.constexpr):
    """(the next trit of the four lanes, as bytes; the halves for the one after): the remainders of the
    halves kept, ×3 moves the next trit into byte 1 / byte 3."""
    pe = (pe & 0x00FF00FF) * 3
    po = (po & 0x00FF00FF) * 3
    return _high_bytes(pe, po, USE_ASM), pe, po


@triton.jit
def _trits(w, USE_ASM: tl.constexpr):
    """The five trit words of a five-trit word row w [BN]: trit n of each lane as bytes (0..2)."""
    t0, pe, po = _next_trit(w, w >> 8, USE_ASM)  # even / odd lanes: remainders b·3^n mod 256 in 16-bit halves
    t1, pe, po = _next_trit(pe, po, USE_ASM)
    t2, pe, po = _next_trit(pe, po, USE_ASM)
    t3, pe, po = _next_trit(pe, po, USE_ASM)
    t4, pe, po = _next_trit(pe, po, USE_ASM)
    return t0, t1, t2, t3, t4


@triton.jit
def _rows_dot(codes, x_ptrs, m_mask, isum, USE_ASM: tl.constexpr):
    """isum [BM, BN] + every row's dp4a of the code word row [BN] with its activation word (x_ptrs [BM])."""
    xw = tl.load(x_ptrs, mask=m_mask, other=0)  # [BM]
    return _dot4(tl.broadcast_to(codes[None, :], isum.shape), tl.broadcast_to(xw[:, None], isum.shape), isum, USE_ASM)


@triton.jit
def _load_segment(w_ptr, seg, seg_end, offs_n, n_mask, N):
    """The three five-trit word rows [BN] of segment seg (= 4·s + h) and its super-block's tail word row."""
    ok = n_mask & ((offs_n * 0 + seg) < seg_end)
    row = 13 * (seg // 4) + seg % 4
    w0 = tl.load(w_ptr + row * N + offs_n, mask=ok, other=0, eviction_policy="evict_first")
    w1 = tl.load(w_ptr + (row + 4) * N + offs_n, mask=ok, other=0, eviction_policy="evict_first")
    w2 = tl.load(w_ptr + (row + 8) * N + offs_n, mask=ok, other=0, eviction_policy="evict_first")
    tail = tl.load(w_ptr + (13 * (seg // 4) + 12) * N + offs_n, mask=ok, other=0)  # read again by each segment (L1)
    return w0, w1, w2, tail


@triton.jit
def _segment_dot(w, x_ptrs, m_mask, isum, USE_ASM: tl.constexpr):
    """isum [BM, BN] + the five trit words of the five-trit word row w against x_ptrs + n (every row)."""
    t0, t1, t2, t3, t4 = _trits(w, USE_ASM)
    isum = _rows_dot(t0, x_ptrs, m_mask, isum, USE_ASM)
    isum = _rows_dot(t1, x_ptrs + 1, m_mask, isum, USE_ASM)
    isum = _rows_dot(t2, x_ptrs + 2, m_mask, isum, USE_ASM)
    isum = _rows_dot(t3, x_ptrs + 3, m_mask, isum, USE_ASM)
    return _rows_dot(t4, x_ptrs + 4, m_mask, isum, USE_ASM)


@triton.jit
def _tri5_rows_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG, NS, supers_per_split,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr,
                      ACCUMULATE: tl.constexpr, USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    SEGS: tl.constexpr = GROUP // 64  # segments per group
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(M, N, BLOCK_M, BLOCK_N)  # [BM], [BN]
    x_words = K // 4
    seg_start = 4 * pid_k * supers_per_split
    seg_end = 4 * tl.minimum(pid_k * supers_per_split + supers_per_split, NS)
    # segment by segment (three five-trit word rows and the tail's step), the next one's words in flight;
    # the first segment's words need nothing from the previous kernel: with PDL, loaded before the wait
    w0n, w1n, w2n, tn = _load_segment(w_ptr, seg_start, seg_end, offs_n, n_mask, N)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for seg in range(seg_start, seg_end):
        w0, w1, w2, tail = w0n, w1n, w2n, tn
        w0n, w1n, w2n, tn = _load_segment(w_ptr, seg + 1, seg_end, offs_n, n_mask, N)
        x_ptrs = xq_ptr + offs_m * x_words + 16 * seg  # [BM]: activation word 64s + 16h of every row
        isum = _segment_dot(w0, x_ptrs, m_mask, isum, USE_ASM)
        isum = _segment_dot(w1, x_ptrs + 5, m_mask, isum, USE_ASM)
        isum = _segment_dot(w2, x_ptrs + 10, m_mask, isum, USE_ASM)
        isum = _rows_dot((tail >> (2 * (seg % 4))) & 0x03030303, x_ptrs + 15, m_mask, isum, USE_ASM)
        if seg % SEGS == SEGS - 1:  # the group is complete: scale it into the float sums
            g = seg // SEGS
            sumx = tl.load(sumx_ptr + offs_m * NG + g, mask=m_mask, other=0)  # [BM]
            sx = tl.load(sx_ptr + offs_m * NG + g, mask=m_mask, other=0.0)  # [BM]
            sw = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            acc += (isum - sumx[:, None]).to(tl.float32) * sx[:, None] * sw[None, :]
            isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    _write_out(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)


def tri5_launch_config(n: int, supers: int, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, split_k, num_warps): packed_gemv's rule (128 columns a program, split-K until ~4096
    programs, at least two super-blocks a split), one warp for one row; for the row loop 2 warps up to 8
    rows and 4 above (one warp spills at 16 rows: 255 registers + 344 bytes of stack on sm_90). Not swept
    yet for tri5 (tests/perf/gpu_kern.py times this default)."""
    block_n, warps = 128, 1 if rows == 1 else 2 if rows <= 8 else 4
    return block_n, split_k(triton.cdiv(n, block_n), supers, 4096), warps


def tri5_gemv(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
              out: torch.Tensor | None = None, accumulate: bool = False,
              config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y = x Wᵀ for M ≤ 16 rows of int8 activations and a tri5 matrix → float32 [M, N]; with accumulate,
    out += y. One row: the Q-sum kernel; more: the word-row loop."""
    m, k = xq.shape
    assert pw.kind == "tri5" and m <= 16 and k == pw.in_features and xq.is_contiguous()
    ng, ns = k // pw.group_size, k // 256
    block_n, split, warps = config or tri5_launch_config(pw.out_features, ns, m)
    out = result_buffer(out, m, pw.out_features, xq.device, accumulate, split)
    per_split = triton.cdiv(ns, split)
    grid = (triton.cdiv(pw.out_features, block_n), triton.cdiv(ns, per_split))
    common = dict(GROUP=pw.group_size, BLOCK_N=block_n, ATOMIC=split > 1, ACCUMULATE=accumulate,
                  USE_ASM=not interpreting(), num_warps=warps, **pdl_options(xq.device))
    if m == 1:
        _tri5_gemv_kernel[grid](xq.view(torch.int32), sx, sumx, pw.words, pw.scales, out, pw.out_features, ng, ns,
                                per_split, **common)
    else:
        _tri5_rows_kernel[grid](xq.view(torch.int32), sx, sumx, pw.words, pw.scales, out, m, pw.out_features, k,
                                ng, ns, per_split, BLOCK_M=max(triton.next_power_of_2(m), 2), **common)
    return out

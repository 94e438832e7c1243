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
from quant.kernels.packed_gemv import _dot4, _write_out, packed_gemv_reference
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
def _dot4u(a, b, acc, USE_ASM: tl.constexpr):
    """acc + Σ over the four bytes of a (unsigned) times the four signed bytes of b (dp4a.u32.s32)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = acc
        for byte in tl.static_range(4):
            r += ((a >> (8 * byte)) & 0xFF) * ((b << (24 - 8 * byte)) >> 24)
        return r


@triton.jit
def _five_trit_sums(w, x_ptrs, qa, qb, USE_ASM: tl.constexpr):
    """Q-sums of one tile of five-trit words w [4, BN] against the activation words x_ptrs[h] + n:
    qa += Σ_n Q_n·x_n, qb += Σ_{n<4} Q_n·x_{n+1} (so Σ t·x = qa − 3·qb)."""
    pe = (w & 0x00FF00FF) * 3  # even lanes · 3^(n+1), n = 0
    po = ((w >> 8) & 0x00FF00FF) * 3  # odd lanes
    xn = tl.broadcast_to(tl.load(x_ptrs)[:, None], w.shape)
    for n in tl.static_range(5):
        q = _high_bytes(pe, po, USE_ASM)  # [4, BN]: Q_n of the four lanes
        qa = _dot4u(q, xn, qa, USE_ASM)
        if n < 4:
            xn = tl.broadcast_to(tl.load(x_ptrs + n + 1)[:, None], w.shape)
            qb = _dot4u(q, xn, qb, USE_ASM)
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
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
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
    offs_m = tl.arange(0, 1)
    _write_out(out_ptr, total, offs_m, offs_n, offs_m < 1, n_mask, N, ATOMIC, ACCUMULATE)


@triton.jit
def _trits(w, USE_ASM: tl.constexpr):
    """The five trit words of a five-trit word row w [BN]: trit n of each lane as bytes (0..2)."""
    ve = w & 0x00FF00FF  # remainders b·3^n mod 256 of the even lanes, in 16-bit halves
    vo = (w >> 8) & 0x00FF00FF
    pe = ve * 3
    po = vo * 3
    t0 = _high_bytes(pe, po, USE_ASM)
    pe = (pe & 0x00FF00FF) * 3
    po = (po & 0x00FF00FF) * 3
    t1 = _high_bytes(pe, po, USE_ASM)
    pe = (pe & 0x00FF00FF) * 3
    po = (po & 0x00FF00FF) * 3
    t2 = _high_bytes(pe, po, USE_ASM)
    pe = (pe & 0x00FF00FF) * 3
    po = (po & 0x00FF00FF) * 3
    t3 = _high_bytes(pe, po, USE_ASM)
    pe = (pe & 0x00FF00FF) * 3
    po = (po & 0x00FF00FF) * 3
    t4 = _high_bytes(pe, po, USE_ASM)
    return t0, t1, t2, t3, t4


@triton.jit
def _rows_dot(codes, x_ptrs, m_mask, isum, USE_ASM: tl.constexpr):
    """isum [BM, BN] + every row's dp4a of the code word row [BN] with its activation word (x_ptrs [BM])."""
    xw = tl.load(x_ptrs, mask=m_mask, other=0)  # [BM]
    return _dot4(tl.broadcast_to(codes[None, :], isum.shape), tl.broadcast_to(xw[:, None], isum.shape), isum, USE_ASM)


@triton.jit
def _tri5_rows_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG, NS, supers_per_split,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr,
                      ACCUMULATE: tl.constexpr, USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    NGS: tl.constexpr = 256 // GROUP
    SEGS: tl.constexpr = GROUP // 64  # segments per group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < M
    x_words = K // 4
    s_start = pid_k * supers_per_split
    s_end = tl.minimum(s_start + supers_per_split, NS)
    ok = n_mask & ((offs_n * 0 + s_start) < s_end)
    tail_first = tl.load(w_ptr + (13 * s_start + 12) * N + offs_n, mask=ok, other=0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    tail = tail_first
    for s in range(s_start, s_end):
        x_ptrs = xq_ptr + offs_m * x_words + 64 * s  # [BM]
        for h in tl.static_range(4):  # segment h: three five-trit word rows, then the tail's step h
            for a in tl.static_range(3):
                w = tl.load(w_ptr + (13 * s + 4 * a + h) * N + offs_n, mask=n_mask, other=0,
                            eviction_policy="evict_first")  # [BN]
                t0, t1, t2, t3, t4 = _trits(w, USE_ASM)
                base = x_ptrs + 16 * h + 5 * a
                isum = _rows_dot(t0, base, m_mask, isum, USE_ASM)
                isum = _rows_dot(t1, base + 1, m_mask, isum, USE_ASM)
                isum = _rows_dot(t2, base + 2, m_mask, isum, USE_ASM)
                isum = _rows_dot(t3, base + 3, m_mask, isum, USE_ASM)
                isum = _rows_dot(t4, base + 4, m_mask, isum, USE_ASM)
            isum = _rows_dot((tail >> (2 * h)) & 0x03030303, x_ptrs + 16 * h + 15, m_mask, isum, USE_ASM)
            if h % SEGS == SEGS - 1:  # the group is complete: scale it into the float sums
                g = s * NGS + h // SEGS
                sumx = tl.load(sumx_ptr + offs_m * NG + g, mask=m_mask, other=0)  # [BM]
                sx = tl.load(sx_ptr + offs_m * NG + g, mask=m_mask, other=0.0)  # [BM]
                sw = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
                acc += (isum - sumx[:, None]).to(tl.float32) * sx[:, None] * sw[None, :]
                isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        tail = tl.load(w_ptr + (13 * s + 25) * N + offs_n, mask=n_mask & ((offs_n * 0 + s + 1) < s_end), other=0,
                       eviction_policy="evict_first")  # the next super-block's tail word
    _write_out(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, ATOMIC, ACCUMULATE)


def tri5_launch_config(n: int, supers: int, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, split_k, num_warps): packed_gemv's rule (one warp of 128 columns, split-K until ~4096
    programs, at least two super-blocks a split); not yet measured for tri5 (tests/perf/gpu_kernel_variants.py)."""
    block_n, warps = 128, 1
    blocks = triton.cdiv(n, block_n)
    split = 1
    while blocks * split < 4096 and split < 32 and split * 2 <= supers // 2:
        split *= 2
    return block_n, split, warps


def tri5_gemv(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
              out: torch.Tensor | None = None, accumulate: bool = False,
              config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y = x Wᵀ for M ≤ 16 rows of int8 activations and a tri5 matrix → float32 [M, N]; with accumulate,
    out += y. One row: the Q-sum kernel; more: the word-row loop."""
    m, k = xq.shape
    assert pw.kind == "tri5" and m <= 16 and k == pw.in_features and xq.is_contiguous()
    ng, ns = k // pw.group_size, k // 256
    block_n, split, warps = config or tri5_launch_config(pw.out_features, ns, m)
    if out is None:
        out = torch.zeros(m, pw.out_features, dtype=torch.float32, device=xq.device)
    elif not accumulate and split > 1:
        out.zero_()
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

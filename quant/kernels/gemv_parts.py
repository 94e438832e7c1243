"""The pieces the packed GEMV kernels share (quant.kernels.packed_gemv, tri5_gemv, packed_mma): the exact
torch reference, the dp4a helpers, the program tile, the split-K rule, the result buffer and the output write.
Its own module so that packed_gemv can dispatch to the other two kernels without an import cycle."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.packed_layout import PackedWeight, layout_kind


def packed_gemv_reference(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
                          out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """The same maths in plain torch (float64 integer sums, exact): y [M, N] float32 (into out, or
    added to it with accumulate)."""
    from quant.packed_layout import unpack_codes
    kind = layout_kind(pw.kind)
    m, k = xq.shape
    g = pw.group_size
    values = unpack_codes(pw).to(torch.float64)  # [N, K] grid values
    xg = xq.to(torch.float64).reshape(m, k // g, g)  # [M, K/G, G]
    wg = values.reshape(pw.out_features, k // g, g)  # [N, K/G, G]
    isum = torch.einsum("mgk,ngk->mgn", xg, wg)  # [M, K/G, N]: Σ value·x per group
    y = (isum * sx.double()[..., None] * pw.scales.double()[None]).sum(1).float()  # [M, N]
    del kind, sumx  # the reference uses the grid values directly (no offset correction needed)
    if out is None:
        return y
    if accumulate:
        out += y
    else:
        out.copy_(y)
    return out


@triton.jit
def _dot4(a, b, acc, USE_ASM: tl.constexpr):
    """acc + Σ over the four signed bytes of a·b (dp4a)."""
    return _dot4_bytes(a, b, acc, False, USE_ASM)


@triton.jit
def _dot4_bytes(a, b, acc, A_UNSIGNED: tl.constexpr, USE_ASM: tl.constexpr):
    """acc + Σ over the four bytes of a (signed, or unsigned: dp4a.u32.s32) times the four signed bytes of b."""
    if USE_ASM:
        if A_UNSIGNED:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = acc
        for byte in tl.static_range(4):
            if A_UNSIGNED:
                a_byte = (a >> (8 * byte)) & 0xFF
            else:
                a_byte = (a << (24 - 8 * byte)) >> 24
            r += a_byte * ((b << (24 - 8 * byte)) >> 24)
        return r


@triton.jit
def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns (its K split is program_id(1)): offs_m [BM], m_mask, offs_n [BN], n_mask."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    return offs_m, offs_m < M, offs_n, offs_n < N


def split_k(blocks: int, steps: int, programs: int) -> int:
    """Splits of K: doubled until the grid holds `programs` programs, at most 32, at least two K steps
    (groups, super-blocks, tiles) each."""
    split = 1
    while blocks * split < programs and split < 32 and split * 2 <= steps // 2:
        split *= 2
    return split


def result_buffer(out: torch.Tensor | None, m: int, n: int, device, accumulate: bool, split: int) -> torch.Tensor:
    """The float32 [m, n] result: a new zeroed buffer, or out (zeroed first when split-K programs add into it
    and it is not accumulated into)."""
    if out is None:
        return torch.zeros(m, n, dtype=torch.float32, device=device)
    if not accumulate and split > 1:
        out.zero_()
    return out


@triton.jit
def _write_out(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, N, ATOMIC: tl.constexpr, ACCUMULATE: tl.constexpr):
    """The program's [BM, BN] sums into out: added with atomics (split-K), added in place, or stored."""
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptr + out_offs, acc, mask=mask)
    else:
        if ACCUMULATE:
            acc += tl.load(out_ptr + out_offs, mask=mask, other=0.0)
        tl.store(out_ptr + out_offs, acc, mask=mask)

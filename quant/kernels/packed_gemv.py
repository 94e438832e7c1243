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

from quant.kernels import interpreting
from quant.packed_layout import PackedWeight, layout_kind

_BYTE_MASK = {1: 0x01010101, 2: 0x03030303, 4: 0x0F0F0F0F, 8: -1}


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
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = acc
        for byte in tl.static_range(4):
            r += ((a << (24 - 8 * byte)) >> 24) * ((b << (24 - 8 * byte)) >> 24)
        return r


@triton.jit
def _packed_gemv_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG,
                        BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr, BYTE_MASK: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GPP: tl.constexpr,
                        CHUNKS: tl.constexpr, USE_ASM: tl.constexpr):
    """Program (n-block, k-split) handles CHUNKS chunks of GPP groups; each chunk is one load of
    [GPP * GW, BLOCK_N] words (many bytes in flight per thread), summed per group in registers."""
    STEPS: tl.constexpr = 8 // BITS  # shift steps per word
    GW: tl.constexpr = GROUP * BITS // 32  # words per group (per column)
    R: tl.constexpr = GPP * GW  # word rows per chunk
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < M
    rows = tl.arange(0, R)  # [R]
    gi = tl.arange(0, GPP)  # [GPP]
    x_words = K // 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        g0 = (pid_k * CHUNKS + c) * GPP  # first group of this chunk
        row_ok = g0 * GW + rows < NG * GW  # [R]
        w = tl.load(w_ptr + (g0 * GW + rows)[:, None] * N + offs_n[None, :], mask=row_ok[:, None] & n_mask[None, :],
                    other=0, eviction_policy="evict_first")  # [R, BN] int32
        isum = tl.zeros([BLOCK_M, R, BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(STEPS):
            codes = (w >> (BITS * j)) & BYTE_MASK  # [R, BN]: four codes as bytes
            xw = tl.load(xq_ptr + offs_m[:, None] * x_words + g0 * (GROUP // 4) + (STEPS * rows + j)[None, :],
                         mask=m_mask[:, None] & row_ok[None, :], other=0)  # [BM, R]: the int8 activations they meet
            isum = _dot4(tl.broadcast_to(codes[None, :, :], [BLOCK_M, R, BLOCK_N]),
                         tl.broadcast_to(xw[:, :, None], [BLOCK_M, R, BLOCK_N]), isum, USE_ASM)
        dot = tl.reshape(tl.sum(tl.reshape(isum, [BLOCK_M * GPP, GW, BLOCK_N]), axis=1), [BLOCK_M, GPP, BLOCK_N])
        g_ok = g0 + gi < NG  # [GPP]
        gm = m_mask[:, None] & g_ok[None, :]
        sumx = tl.load(sumx_ptr + offs_m[:, None] * NG + g0 + gi[None, :], mask=gm, other=0)  # [BM, GPP]
        sx = tl.load(sx_ptr + offs_m[:, None] * NG + g0 + gi[None, :], mask=gm, other=0.0)  # [BM, GPP]
        sw = tl.load(s_ptr + (g0 + gi)[:, None] * N + offs_n[None, :], mask=g_ok[:, None] & n_mask[None, :],
                     other=0.0).to(tl.float32)  # [GPP, BN]
        corrected = (dot * MULT - OFFSET * sumx[:, :, None]).to(tl.float32)  # [BM, GPP, BN]
        acc += tl.sum(corrected * sx[:, :, None] * sw[None, :, :], axis=1)
    tl.atomic_add(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def _autotune_configs() -> list:
    return [triton.Config({"BLOCK_N": 128 * w, "GPP": gpp, "CHUNKS": chunks}, num_warps=w)
            for w in (1, 2) for gpp in (1, 2, 4) for chunks in (1, 2, 4)]


def _prune(configs, named_args, **kwargs):
    ng = named_args["NG"]
    kept = [c for c in configs if c.kwargs["GPP"] * c.kwargs["CHUNKS"] <= max(ng // 2, 1)]
    return kept or configs[:1]


def _quick_bench(fn, quantiles=None):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


# The same kernel, with its launch shape chosen by timing on first use per shape (on the GPU; the
# graphed decode step warms up before capture). Benchmark runs restore the output they add into.
_packed_gemv_tuned = triton.autotune(_autotune_configs(), key=["M", "N", "K", "BITS"], restore_value=["out_ptr"],
                                     prune_configs_by={"early_config_prune": _prune}, do_bench=_quick_bench
                                     )(_packed_gemv_kernel)


def packed_gemv(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
                out: torch.Tensor | None = None, accumulate: bool = False,
                config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y = x Wᵀ for M ≤ 16 rows of int8 activations → float32 [M, N]; with accumulate, out += y.
    config (BLOCK_N, GPP, CHUNKS, num_warps) fixes the launch; by default it is tuned per shape
    (in Triton's interpreter: (128, 1, 2, 1))."""
    m, k = xq.shape
    assert m <= 16 and k == pw.in_features and xq.is_contiguous()
    kind = layout_kind(pw.kind)
    ng = k // pw.group_size
    if out is None:
        out = torch.zeros(m, pw.out_features, dtype=torch.float32, device=xq.device)
    elif not accumulate:
        out.zero_()
    args = (xq.view(torch.int32), sx, sumx, pw.words, pw.scales, out, m, pw.out_features, k, ng)
    consts = dict(BITS=kind.bits, MULT=kind.mult, OFFSET=kind.offset, BYTE_MASK=_BYTE_MASK[kind.bits],
                  GROUP=pw.group_size, BLOCK_M=max(triton.next_power_of_2(m), 1), USE_ASM=not interpreting())
    if config is None and interpreting():
        config = (128, 1, 2, 1)
    if config is not None:
        block_n, gpp, chunks, warps = config
        grid = (triton.cdiv(pw.out_features, block_n), triton.cdiv(ng, gpp * chunks))
        _packed_gemv_kernel[grid](*args, **consts, BLOCK_N=block_n, GPP=gpp, CHUNKS=chunks, num_warps=warps)
        return out

    def grid(meta):
        return triton.cdiv(pw.out_features, meta["BLOCK_N"]), triton.cdiv(ng, meta["GPP"] * meta["CHUNKS"])
    _packed_gemv_tuned[grid](*args, **consts)
    return out

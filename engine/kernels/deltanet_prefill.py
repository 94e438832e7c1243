"""Prefill of a hybrid's Gated DeltaNet layer on the GPU: the chunked gated delta rule in three Triton kernels,
the maths of engine.runtime.deltanet.chunk_gated_delta_rule (the WY / UT-transform form, as fla's
chunk_gated_delta_rule does it; our own code). Per chunk of C = 64 positions and value head, q and k
L2-normalized (q scaled by 1/√Dk), cum = cumsum(g) in the chunk:

- `_chunk_prepare_kernel`, one program per (chunk, value head, sequence), in blocks of 16 rows (registers
  only, no scratch round trip): A = strictly-lower(kβ kᵀ ⊙ exp(cum_i − cum_j)) block by block,
  T = (I + A)⁻¹ — each 16x16 diagonal block inverted by forward substitution, the blocks below it by
  T_ij = −T_ii Σ_{j≤l<i} A_il T_lj — then w = T (kβ ⊙ exp(cum)), u = T (vβ) and kd = k ⊙ exp(cum_last − cum),
  into float32 scratch;
- `_chunk_state_kernel`, one program per (value block of BV columns, value head, sequence), the state block
  S [Dk, BV] in registers, the chunk loop inside: keeps S (the state before the chunk), v' = u − w S,
  S ← exp(cum_last) S + kdᵀ v'. The state tensor is read at the start and written at the end (in place);
- `_chunk_output_kernel`, one program per (chunk, value head, sequence and value block), all in parallel:
  o = (q ⊙ exp(cum)) S_chunk + lower(q kᵀ ⊙ exp(cum_i − cum_j)) v'.

Every sequence of the batch has T positions; positions past T in the last chunk are zero rows (g = 0, β = 0),
as the torch path pads. `dot_precision` of the large tl.dot products: "tf32" (the default for bf16 / fp16 inputs),
"tf32x3" (the default for float32 inputs: within float32 rounding, where its tiles fit shared memory) or
"ieee" (float32 inputs on RTX 30 / 40 cards; on an H200 15x slower than "tf32": docs/perf.md); the 16x16 inverse and its combination are plain fp32 ("ieee").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2, target_shared_memory
from engine.kernels.deltanet_ref import CHUNK, prefill_scratch_bytes

__all__ = ["chunk_gated_delta_rule_triton", "prefill_scratch_bytes", "CHUNK"]
SUB = 16  # rows of the blocks the chunk's inverse is built from (CHUNK = 4 · SUB)
VALUE_BLOCK = 32  # value columns of the state per program of the state pass
OUT_BLOCK = 64  # value columns per program of the output pass
PREPARE_WARPS = 8


@triton.jit
def _key_rows(k_ptr, g_ptr, b_ptr, t0, T, skt, sgt, sbt, DK: tl.constexpr, BK: tl.constexpr, B: tl.constexpr):
    """Rows t0..t0+B of one head: k L2-normalized [B, BK] float32, its 1/‖k‖ [B], log decay g and β [B]."""
    t = t0 + tl.arange(0, B)
    ks = tl.arange(0, BK)
    tmask = t < T
    k = tl.load(k_ptr + t[:, None] * skt + ks[None, :], mask=tmask[:, None] & (ks[None, :] < DK),
                other=0.0).to(tl.float32)
    rk = 1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6)
    g = tl.load(g_ptr + t * sgt, mask=tmask, other=0.0)
    beta = tl.load(b_ptr + t * sbt, mask=tmask, other=0.0)
    return k * rk[:, None], g, beta


@triton.jit
def _kkt(ki, bi, ci, kj, cj, DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    """Block (i, j) of A: (k_i β_i) k_jᵀ ⊙ exp(cum_i − cum_j) [B, B]; a diagonal block strictly lower."""
    a = tl.dot(ki * bi[:, None], tl.trans(kj), input_precision=PRECISION)
    diff = ci[:, None] - cj[None, :]
    if DIAGONAL:
        r = tl.arange(0, ki.shape[0])
        lower = r[:, None] > r[None, :]
        return tl.where(lower, a * tl.exp(tl.where(lower, diff, 0.0)), 0.0)
    return a * tl.exp(diff)


@triton.jit
def _unit_lower_inverse(d, B: tl.constexpr):
    """(I + D)⁻¹ of a strictly lower [B, B] block, row by row (forward substitution, fp32)."""
    r = tl.arange(0, B)
    dt = tl.trans(d)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, B):
        d_i = tl.sum(tl.where(r[None, :] == i, dt, 0.0), 1)  # [B]: D[i, j] along j
        row = tl.where(r == i, 1.0, 0.0) - tl.sum(d_i[:, None] * inv, 0)  # [B]
        inv = tl.where(r[:, None] == i, row[None, :], inv)
    return inv


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_rows(ptr, t0, x, width, B: tl.constexpr, W: tl.constexpr):
    """x [B, W] into rows t0.. of a row-major scratch of `width` columns."""
    r = t0 + tl.arange(0, B)
    tl.store(ptr + r[:, None] * width + tl.arange(0, W)[None, :], x)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _value_rows(v_ptr, t0, T, svt, beta, DV: tl.constexpr, BV: tl.constexpr, B: tl.constexpr):
    """v β of rows t0..t0+B of one value head [B, BV] float32."""
    t = t0 + tl.arange(0, B)
    vs = tl.arange(0, BV)
    v = tl.load(v_ptr + t[:, None] * svt + vs[None, :], mask=(t < T)[:, None] & (vs[None, :] < DV),
                other=0.0).to(tl.float32)
    return v * beta[:, None]


@triton.jit
def _chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, kd_ptr, cum_ptr, T, skb, skt, skh, svb, svt,
                          svh, sgb, sgt, sbb, sbt, NT, GROUPS: tl.constexpr, C: tl.constexpr, B: tl.constexpr,
                          DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PRECISION: tl.constexpr):
    n, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kp = k_ptr + b * skb + (h // GROUPS) * skh
    gp, bp = g_ptr + b * sgb + h, b_ptr + b * sbb + h
    t0 = n * C
    k0, g0, b0 = _key_rows(kp, gp, bp, t0, T, skt, sgt, sbt, DK, BK, B)  # [B, BK], [B], [B]
    k1, g1, b1 = _key_rows(kp, gp, bp, t0 + B, T, skt, sgt, sbt, DK, BK, B)
    k2, g2, b2 = _key_rows(kp, gp, bp, t0 + 2 * B, T, skt, sgt, sbt, DK, BK, B)
    k3, g3, b3 = _key_rows(kp, gp, bp, t0 + 3 * B, T, skt, sgt, sbt, DK, BK, B)
    s0, s1, s2 = tl.sum(g0, 0), tl.sum(g1, 0), tl.sum(g2, 0)
    c0, c1 = tl.cumsum(g0, 0), tl.cumsum(g1, 0) + s0  # [B] each: cum over the chunk
    c2, c3 = tl.cumsum(g2, 0) + (s0 + s1), tl.cumsum(g3, 0) + (s0 + s1 + s2)
    last = s0 + s1 + s2 + tl.sum(g3, 0)
    # T = (I + A)⁻¹, block lower triangular: the diagonal blocks by substitution, then the blocks below them
    x00 = _unit_lower_inverse(_kkt(k0, b0, c0, k0, c0, True, PRECISION), B)  # [B, B]
    x11 = _unit_lower_inverse(_kkt(k1, b1, c1, k1, c1, True, PRECISION), B)
    x22 = _unit_lower_inverse(_kkt(k2, b2, c2, k2, c2, True, PRECISION), B)
    x33 = _unit_lower_inverse(_kkt(k3, b3, c3, k3, c3, True, PRECISION), B)
    a10, a21 = _kkt(k1, b1, c1, k0, c0, False, PRECISION), _kkt(k2, b2, c2, k1, c1, False, PRECISION)
    a20, a32 = _kkt(k2, b2, c2, k0, c0, False, PRECISION), _kkt(k3, b3, c3, k2, c2, False, PRECISION)
    a30, a31 = _kkt(k3, b3, c3, k0, c0, False, PRECISION), _kkt(k3, b3, c3, k1, c1, False, PRECISION)
    x10 = -_mm(x11, _mm(a10, x00))
    x21 = -_mm(x22, _mm(a21, x11))
    x20 = -_mm(x22, _mm(a20, x00) + _mm(a21, x10))
    x32 = -_mm(x33, _mm(a32, x22))
    x31 = -_mm(x33, _mm(a31, x11) + _mm(a32, x21))
    x30 = -_mm(x33, _mm(a30, x00) + _mm(a31, x10) + _mm(a32, x20))
    base = (b * tl.num_programs(1) + h).to(tl.int64) * NT + t0  # scratch row of the chunk's first position
    wp, kdp, up = w_ptr + base * BK, kd_ptr + base * BK, u_ptr + base * BV
    rows = tl.arange(0, B)
    for i in tl.static_range(4):  # cum and kd = k ⊙ exp(cum_last − cum) per block
        ci = c0 if i == 0 else (c1 if i == 1 else (c2 if i == 2 else c3))
        ki = k0 if i == 0 else (k1 if i == 1 else (k2 if i == 2 else k3))
        tl.store(cum_ptr + base + i * B + rows, ci)
        _store_rows(kdp, i * B, ki * tl.exp(last - ci)[:, None], BK, B, BK)
    e0, e1 = k0 * (b0 * tl.exp(c0))[:, None], k1 * (b1 * tl.exp(c1))[:, None]  # kβ ⊙ exp(cum) [B, BK]
    e2, e3 = k2 * (b2 * tl.exp(c2))[:, None], k3 * (b3 * tl.exp(c3))[:, None]
    _store_rows(wp, 0, _dot(x00, e0, PRECISION), BK, B, BK)  # w = T (kβ ⊙ exp(cum))
    _store_rows(wp, B, _dot(x10, e0, PRECISION) + _dot(x11, e1, PRECISION), BK, B, BK)
    _store_rows(wp, 2 * B, _dot(x20, e0, PRECISION) + _dot(x21, e1, PRECISION) + _dot(x22, e2, PRECISION),
                BK, B, BK)
    _store_rows(wp, 3 * B, _dot(x30, e0, PRECISION) + _dot(x31, e1, PRECISION) + _dot(x32, e2, PRECISION)
                + _dot(x33, e3, PRECISION), BK, B, BK)
    vp = v_ptr + b * svb + h * svh
    f0 = _value_rows(vp, t0, T, svt, b0, DV, BV, B)  # v β [B, BV]
    f1 = _value_rows(vp, t0 + B, T, svt, b1, DV, BV, B)
    f2 = _value_rows(vp, t0 + 2 * B, T, svt, b2, DV, BV, B)
    f3 = _value_rows(vp, t0 + 3 * B, T, svt, b3, DV, BV, B)
    _store_rows(up, 0, _dot(x00, f0, PRECISION), BV, B, BV)  # u = T (vβ)
    _store_rows(up, B, _dot(x10, f0, PRECISION) + _dot(x11, f1, PRECISION), BV, B, BV)
    _store_rows(up, 2 * B, _dot(x20, f0, PRECISION) + _dot(x21, f1, PRECISION) + _dot(x22, f2, PRECISION),
                BV, B, BV)
    _store_rows(up, 3 * B, _dot(x30, f0, PRECISION) + _dot(x31, f1, PRECISION) + _dot(x32, f2, PRECISION)
                + _dot(x33, f3, PRECISION), BV, B, BV)


@triton.jit
def _chunk_state_kernel(w_ptr, u_ptr, kd_ptr, cum_ptr, s_ptr, hs_ptr, vn_ptr, ssb, ssh, ssk, NT, C: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVS: tl.constexpr, BV: tl.constexpr,
                        PRECISION: tl.constexpr):
    j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, ks = tl.arange(0, C), tl.arange(0, BK)
    cols = j * BV + tl.arange(0, BV)  # [BV] this program's value columns
    cmask = cols < DV
    s_ptrs = s_ptr + b * ssb + h * ssh + ks[:, None] * ssk + cols[None, :]  # [BK, BV]
    smask = (ks[:, None] < DK) & cmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)  # [BK, BV] float32
    bh = (b * tl.num_programs(1) + h).to(tl.int64)
    chunks = NT // C
    for n in range(0, chunks):
        tp = bh * NT + n * C + rows  # [C] scratch rows
        tl.store(hs_ptr + (bh * chunks + n) * BK * BVS + ks[:, None] * BVS + cols[None, :], s, mask=cmask[None, :])
        w = tl.load(w_ptr + tp[:, None] * BK + ks[None, :])  # [C, BK]
        kdt = tl.load(kd_ptr + tp[None, :] * BK + ks[:, None])  # [BK, C]
        u = tl.load(u_ptr + tp[:, None] * BVS + cols[None, :], mask=cmask[None, :], other=0.0)  # [C, BV]
        last = tl.load(cum_ptr + bh * NT + n * C + C - 1)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)  # [C, BV]
        tl.store(vn_ptr + tp[:, None] * BVS + cols[None, :], v_new, mask=cmask[None, :])
        s = s * tl.exp(last) + tl.dot(kdt, v_new, input_precision=PRECISION)
    tl.store(s_ptrs, s, mask=smask)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, cum_ptr, hs_ptr, vn_ptr, o_ptr, T, sqb, sqt, sqh, skb, skt, skh, sob, sot,
                         soh, scale, NT, GROUPS: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BK: tl.constexpr, BVS: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    n, h, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    blocks: tl.constexpr = (DV + BV - 1) // BV
    b, vb = z // blocks, z % blocks
    hk = h // GROUPS
    rows, ks = tl.arange(0, C), tl.arange(0, BK)
    t = n * C + rows
    tmask = t < T
    kmask = tmask[:, None] & (ks[None, :] < DK)
    q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + hk * sqh + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * skb + t[:, None] * skt + hk * skh + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    q = q * (scale / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None]  # [C, BK]
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]
    bh = (b * tl.num_programs(1) + h).to(tl.int64)
    tp = bh * NT + t  # [C] scratch rows
    cum = tl.load(cum_ptr + tp)  # [C]
    causal = rows[:, None] >= rows[None, :]
    p = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [C, C]
    p = tl.where(causal, p * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
    cols = vb * BV + tl.arange(0, BV)
    cmask = cols < DV
    hs = tl.load(hs_ptr + (bh * (NT // C) + n) * BK * BVS + ks[:, None] * BVS + cols[None, :], mask=cmask[None, :],
                 other=0.0)  # [BK, BV]: the state before this chunk
    v_new = tl.load(vn_ptr + tp[:, None] * BVS + cols[None, :], mask=cmask[None, :], other=0.0)  # [C, BV]
    o = tl.dot(q * tl.exp(cum)[:, None], hs, input_precision=PRECISION) + tl.dot(p, v_new, input_precision=PRECISION)
    tl.store(o_ptr + b * sob + t[:, None] * sot + h * soh + cols[None, :], o, mask=tmask[:, None] & cmask[None, :])


def chunk_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, state: torch.Tensor, dot_precision: str | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, Hk, Dk] (not normalized), v [B, T, Hv, Dv] (last dims contiguous, any other strides), g (log
    decay) and beta float32 [B, T, Hv]; state float32 [B, Hv, Dk, Dv], contiguous, updated in place to the final
    state. Returns (out [B, T, Hv, Dv] float32, state), as engine.runtime.deltanet.chunk_gated_delta_rule."""
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    _check(q, k, v, g, beta, state)
    if dot_precision is None:  # a float32 model keeps float32 accuracy; bf16/fp16 inputs are far coarser than tf32
        dot_precision = "tf32" if q.dtype != torch.float32 else (  # 3xTF32 tiles need ~130 KB of shared memory
            "tf32x3" if target_shared_memory() >= 160 << 10 else "ieee")
    bk, bvs = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    nt = triton.cdiv(t, CHUNK) * CHUNK
    chunks = nt // CHUNK
    dev = v.device
    w = torch.empty(bsz, hv, nt, bk, dtype=torch.float32, device=dev)  # scratch [B, Hv, NT, BK]
    kd = torch.empty(bsz, hv, nt, bk, dtype=torch.float32, device=dev)  # [B, Hv, NT, BK]
    u = torch.empty(bsz, hv, nt, bvs, dtype=torch.float32, device=dev)  # [B, Hv, NT, BVs]
    v_new = torch.empty(bsz, hv, nt, bvs, dtype=torch.float32, device=dev)  # [B, Hv, NT, BVs]
    cum = torch.empty(bsz, hv, nt, dtype=torch.float32, device=dev)  # [B, Hv, NT]
    states = torch.empty(bsz, hv, chunks, bk, bvs, dtype=torch.float32, device=dev)  # [B, Hv, N, BK, BVs]
    out = torch.empty(bsz, t, hv, dv, dtype=torch.float32, device=dev)  # [B, T, Hv, Dv]
    scale, groups = dk ** -0.5, hv // hk
    _chunk_prepare_kernel[(chunks, hv, bsz)](
        k, v, g, beta, w, u, kd, cum, t, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), nt, GROUPS=groups, C=CHUNK, B=SUB,
        DK=dk, DV=dv, BK=bk, BV=bvs, PRECISION=dot_precision, num_warps=PREPARE_WARPS)
    bv = min(VALUE_BLOCK, bvs)
    _chunk_state_kernel[(triton.cdiv(dv, bv), hv, bsz)](
        w, u, kd, cum, state, states, v_new, state.stride(0), state.stride(1), state.stride(2), nt, C=CHUNK, DK=dk,
        DV=dv, BK=bk, BVS=bvs, BV=bv, PRECISION=dot_precision, num_warps=4, num_stages=2)
    ob = min(OUT_BLOCK, bvs)
    _chunk_output_kernel[(chunks, hv, bsz * triton.cdiv(dv, ob))](
        q, k, cum, states, v_new, out, t, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), out.stride(0), out.stride(1), out.stride(2), scale, nt, GROUPS=groups, C=CHUNK, DK=dk, DV=dv,
        BK=bk, BVS=bvs, BV=ob, PRECISION=dot_precision, num_warps=4)
    return out, state


def _check(q, k, v, g, beta, state) -> None:
    bsz, t, hk, dk = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != (bsz, t) or v.shape[2] % max(hk, 1):
        raise UnsupportedKernelShape(f"chunk_gated_delta_rule_triton needs q, k [B, T, Hk, Dk], v [B, T, Hv, Dv]; "
                                     f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hv, dv = v.shape[2], v.shape[3]
    if g.shape != (bsz, t, hv) or beta.shape != g.shape or g.dtype != torch.float32 or beta.dtype != torch.float32:
        raise UnsupportedKernelShape(f"chunk_gated_delta_rule_triton needs float32 g and beta [{bsz}, {t}, {hv}]")
    if state.shape != (bsz, hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise UnsupportedKernelShape(f"chunk_gated_delta_rule_triton needs a contiguous float32 state "
                                     f"[{bsz}, {hv}, {dk}, {dv}]; got {tuple(state.shape)} {state.dtype}")
    if any(x.stride(-1) != 1 for x in (q, k, v)) or g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise UnsupportedKernelShape("chunk_gated_delta_rule_triton needs the last dim of every input contiguous")

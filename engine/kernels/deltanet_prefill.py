"""Prefill of a hybrid's Gated DeltaNet layer on the GPU: the chunked gated delta rule in two Triton kernels,
the maths of engine.runtime.deltanet.chunk_gated_delta_rule (the WY / UT-transform form, as fla's
chunk_gated_delta_rule does it; our own code):

- `_chunk_prepare_kernel`, one program per (chunk of C positions, value head, sequence): q, k L2-normalized
  (q scaled by 1/√Dk), cum = cumsum(g) in the chunk, A = strictly-lower(kβ kᵀ ⊙ exp(cum_i − cum_j)),
  T = (I + A)⁻¹ by forward substitution (fp32, in registers), then w = T (kβ ⊙ exp(cum)), u = T (vβ) and the
  intra-chunk scores P = lower(q kᵀ ⊙ exp(cum_i − cum_j)) into float32 scratch;
- `_chunk_state_kernel`, one program per (value block of BV columns, value head, sequence), the state block
  S [Dk, BV] in registers, the chunk loop inside: v' = u − w S;  o = (q ⊙ exp(cum)) S + P v';
  S ← exp(cum_last) S + (k ⊙ exp(cum_last − cum))ᵀ v'. The state tensor is read at the start and written
  at the end (in place).

Every sequence of the batch has T positions; positions past T in the last chunk are zero rows (g = 0, β = 0),
as the torch path pads. `dot_precision` "tf32" (default on the GPU) or "ieee" for the tl.dot products; the
forward substitution is plain fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2

CHUNK = 64
VALUE_BLOCK = 32  # value columns of the state per program of the state pass


@triton.jit
def _chunk_prepare_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, p_ptr, cum_ptr, T,
                          sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sbb, sbt, scale, NT,
                          GROUPS: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    n, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // GROUPS
    rows = tl.arange(0, C)  # [C]
    t = n * C + rows
    tmask = t < T
    ks, vs = tl.arange(0, BK), tl.arange(0, BV)
    kmask = tmask[:, None] & (ks[None, :] < DK)
    vmask = tmask[:, None] & (vs[None, :] < DV)
    q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + hk * sqh + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * skb + t[:, None] * skt + hk * skh + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * svb + t[:, None] * svt + h * svh + vs[None, :], mask=vmask, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None] * scale  # [C, BK]
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]
    g = tl.load(g_ptr + b * sgb + t * sgt + h, mask=tmask, other=0.0)  # [C] float32 log decay
    beta = tl.load(b_ptr + b * sbb + t * sbt + h, mask=tmask, other=0.0)
    cum = tl.cumsum(g, 0)  # [C]
    diff = cum[:, None] - cum[None, :]  # [C, C]
    lower = rows[:, None] > rows[None, :]
    kb = k * beta[:, None]
    a = tl.dot(kb, tl.trans(k), input_precision=PRECISION)  # [C, C]
    a = tl.where(lower, a * tl.exp(tl.where(lower, diff, 0.0)), 0.0)
    at = tl.trans(a)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)  # [C, C]: (I + A)⁻¹ row by row
    for i in range(1, C):
        a_i = tl.sum(tl.where(rows[None, :] == i, at, 0.0), 1)  # [C]: A[i, j] along j
        row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, 0)  # [C]
        inv = tl.where(rows[:, None] == i, row[None, :], inv)
    w = tl.dot(inv, kb * tl.exp(cum)[:, None], input_precision=PRECISION)  # [C, BK]
    u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)  # [C, BV]
    causal = rows[:, None] >= rows[None, :]
    p = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    p = tl.where(causal, p * tl.exp(tl.where(causal, diff, 0.0)), 0.0)  # [C, C]
    base = (b * tl.num_programs(1) + h).to(tl.int64) * NT  # scratch row of (b, h, position 0)
    tp = base + n * C + rows  # [C]
    tl.store(w_ptr + tp[:, None] * BK + ks[None, :], w)
    tl.store(u_ptr + tp[:, None] * BV + vs[None, :], u)
    tl.store(p_ptr + tp[:, None] * C + rows[None, :], p)
    tl.store(cum_ptr + tp, cum)


@triton.jit
def _chunk_state_kernel(q_ptr, k_ptr, w_ptr, u_ptr, p_ptr, cum_ptr, s_ptr, o_ptr, T, sqb, sqt, sqh, skb, skt,
                        skh, ssb, ssh, ssk, sob, sot, soh, scale, NT, GROUPS: tl.constexpr, C: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVS: tl.constexpr,
                        BV: tl.constexpr, PRECISION: tl.constexpr):
    j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // GROUPS
    rows, ks = tl.arange(0, C), tl.arange(0, BK)
    cols = j * BV + tl.arange(0, BV)  # [BV] this program's value columns
    cmask = cols < DV
    s_ptrs = s_ptr + b * ssb + h * ssh + ks[:, None] * ssk + cols[None, :]  # [BK, BV]
    smask = (ks[:, None] < DK) & cmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)  # [BK, BV] float32
    base = (b * tl.num_programs(1) + h).to(tl.int64) * NT
    for n in range(0, NT // C):
        t = n * C + rows
        tmask = t < T
        kmask = tmask[:, None] & (ks[None, :] < DK)
        q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + hk * sqh + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * skb + t[:, None] * skt + hk * skh + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None] * scale  # [C, BK]
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]
        tp = base + n * C + rows
        cum = tl.load(cum_ptr + tp)  # [C]
        last = tl.load(cum_ptr + base + n * C + C - 1)
        w = tl.load(w_ptr + tp[:, None] * BK + ks[None, :])  # [C, BK]
        u = tl.load(u_ptr + tp[:, None] * BVS + cols[None, :], mask=cmask[None, :], other=0.0)  # [C, BV]
        p = tl.load(p_ptr + tp[:, None] * C + rows[None, :])  # [C, C]
        v_new = u - tl.dot(w, s, input_precision=PRECISION)  # [C, BV]
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PRECISION) + tl.dot(p, v_new,
                                                                                   input_precision=PRECISION)
        tl.store(o_ptr + b * sob + t[:, None] * sot + h * soh + cols[None, :], o, mask=tmask[:, None] & cmask[None, :])
        kd = k * tl.exp(last - cum)[:, None]  # [C, BK]
        s = s * tl.exp(last) + tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
    tl.store(s_ptrs, s, mask=smask)


def chunk_gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, state: torch.Tensor, dot_precision: str | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, Hk, Dk] (not normalized), v [B, T, Hv, Dv] (last dims contiguous, any other strides), g (log
    decay) and beta float32 [B, T, Hv]; state float32 [B, Hv, Dk, Dv], contiguous, updated in place to the final
    state. Returns (out [B, T, Hv, Dv] float32, state), as engine.runtime.deltanet.chunk_gated_delta_rule."""
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    _check(q, k, v, g, beta, state)
    if dot_precision is None:
        dot_precision = "tf32" if q.is_cuda else "ieee"
    bk, bvs = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    nt = triton.cdiv(t, CHUNK) * CHUNK
    dev = v.device
    w = torch.empty(bsz, hv, nt, bk, dtype=torch.float32, device=dev)  # scratch [B, Hv, NT, BK]
    u = torch.empty(bsz, hv, nt, bvs, dtype=torch.float32, device=dev)  # [B, Hv, NT, BVs]
    p = torch.empty(bsz, hv, nt, CHUNK, dtype=torch.float32, device=dev)  # [B, Hv, NT, C]
    cum = torch.empty(bsz, hv, nt, dtype=torch.float32, device=dev)  # [B, Hv, NT]
    out = torch.empty(bsz, t, hv, dv, dtype=torch.float32, device=dev)  # [B, T, Hv, Dv]
    scale, groups = dk ** -0.5, hv // hk
    _chunk_prepare_kernel[(nt // CHUNK, hv, bsz)](
        q, k, v, g, beta, w, u, p, cum, t, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        scale, nt, GROUPS=groups, C=CHUNK, DK=dk, DV=dv, BK=bk, BV=bvs, PRECISION=dot_precision, num_warps=8)
    bv = min(VALUE_BLOCK, bvs)
    _chunk_state_kernel[(triton.cdiv(dv, bv), hv, bsz)](
        q, k, w, u, p, cum, state, out, t, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1), out.stride(2),
        scale, nt, GROUPS=groups, C=CHUNK, DK=dk, DV=dv, BK=bk, BVS=bvs, BV=bv, PRECISION=dot_precision,
        num_warps=4)
    return out, state


def prefill_scratch_bytes(batch: int, rows: int, value_heads: int, key_dim: int, value_dim: int) -> int:
    """Bytes `chunk_gated_delta_rule_triton` allocates for `rows` positions of `batch` sequences (the plan's term)."""
    nt = -(-rows // CHUNK) * CHUNK
    bk, bvs = max(16, next_power_of_2(key_dim)), max(16, next_power_of_2(value_dim))
    return 4 * batch * value_heads * (nt * (bk + bvs + CHUNK + 1) + rows * value_dim)


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

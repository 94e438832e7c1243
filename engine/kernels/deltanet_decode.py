"""One decode token per slot of a hybrid's Gated DeltaNet layer (engine.runtime.deltanet), in two kernels:

- `conv_update`: the causal depthwise conv (kernel K) + SiLU of one new input per row, the slot's window
  (its last K-1 inputs) read and shifted in place;
- `recurrent_update`: the gated delta rule for one token per row and value head (one program each), the slot's
  float32 state [Hv, Dk, Dv] updated in place: the gates β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias),
  q, k L2-normalized (q also scaled by 1/√Dk), then
      S ← exp(g)·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq
  (the maths of `recurrent_gated_delta_rule`, as fla's fused_recurrent_gated_delta_rule does it with
  use_qk_l2norm_in_kernel), and the layer's gated RMSNorm of o with its output gate z — one launch for what
  the torch path does in ~20.

Rows are addressed by slot index; a row whose position is 0 starts from the zero state (window and S),
whatever the slot held, as HybridStates.read does. Without `run_len` the rows name distinct slots (each program
reads then writes its slot's state). With `run_len` / `snap_idx` (a verify pass: rows of one slot consecutive at
consecutive positions) the program of a slot's first row steps all of its rows in order — the same maths and
roundings as that many one-row steps — and keeps the state after each row where snap_idx says (the rollback
points); the programs of the other rows do nothing. No host sync, no allocation but the outputs: capturable in a
CUDA graph. The plain-torch references beside them are the CPU path and the tests' oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2

CONV_BLOCK = 256  # channels per program of conv_update


@triton.jit
def _conv_update_kernel(x_ptr, win_ptr, w_ptr, slot_ptr, pos_ptr, out_ptr, run_ptr, snap_idx_ptr, snap_ptr, channels,
                        stride_xm, stride_ws, stride_wc, stride_om, stride_ps, stride_pc, K: tl.constexpr,
                        BLOCK: tl.constexpr, RUNS: tl.constexpr):
    m = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    valid = c < channels
    n = 1  # rows this program steps in order: its own, then (RUNS) the next n - 1 rows of the same slot
    if RUNS:
        n = tl.load(run_ptr + m)
    slot = tl.load(slot_ptr + m).to(tl.int64)
    keep = (tl.load(pos_ptr + m) + c * 0) > 0  # [BLOCK]: a row at position 0 starts from a zero window
    win = win_ptr + slot * stride_ws + c * stride_wc  # [BLOCK] pointers to each channel's window
    for j in range(0, n):
        r = m + j
        x = tl.load(x_ptr + r * stride_xm + c, mask=valid, other=0.0).to(tl.float32)  # [BLOCK]
        acc = x * tl.load(w_ptr + c * K + (K - 1), mask=valid, other=0.0).to(tl.float32)
        for i in tl.static_range(K - 1):  # (a later row reads what this program stored for the one before)
            prev = tl.load(win + i, mask=valid & (keep | ((c * 0 + j) > 0)), other=0.0).to(tl.float32)
            acc += prev * tl.load(w_ptr + c * K + i, mask=valid, other=0.0).to(tl.float32)
            if i > 0:  # shift the window left by one: input i moves to i - 1
                tl.store(win + (i - 1), prev.to(win_ptr.dtype.element_ty), mask=valid)
        tl.store(win + (K - 2), x.to(win_ptr.dtype.element_ty), mask=valid)
        out = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(out_ptr + r * stride_om + c, out.to(out_ptr.dtype.element_ty), mask=valid)
        if RUNS:  # the window after this row, kept for a rollback to it
            idx = tl.load(snap_idx_ptr + r)
            dst = snap_ptr + tl.maximum(idx, 0).to(tl.int64) * stride_ps + c * stride_pc
            for i in tl.static_range(K - 1):
                tl.store(dst + i, tl.load(win + i, mask=valid, other=0.0), mask=valid & ((c * 0 + idx) >= 0))


def conv_update(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, slot_ids: torch.Tensor,
                positions: torch.Tensor, out_dtype: torch.dtype = torch.float32, run_len: torch.Tensor | None = None,
                snap_idx: torch.Tensor | None = None, snap: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, C] the rows' new conv inputs; window [slots, C, K-1] (updated in place: the rows' slots get
    their new last K-1 inputs, rounded to its dtype); weight [C, K]; slot_ids, positions [M] integers.
    run_len, snap_idx [M] int32 (runs of rows, see the module doc): at a slot's first row the count of its
    rows (consecutive in the step, at consecutive positions), 0 at its others; the window after each row kept in
    snap [R, C, K-1] at snap_idx (-1: not kept). Returns SiLU(conv) [M, C] in out_dtype (float32 maths)."""
    m, c = _check_conv(x, window, weight, slot_ids, positions)
    out = torch.empty(m, c, dtype=out_dtype, device=x.device)  # [M, C]
    grid = (m, triton.cdiv(c, CONV_BLOCK))
    snap = window if snap is None else snap  # (never written without runs)
    _conv_update_kernel[grid](x, window, weight.contiguous(), slot_ids, positions, out,
                              slot_ids if run_len is None else run_len, slot_ids if snap_idx is None else snap_idx,
                              snap, c, x.stride(0), window.stride(0), window.stride(1), out.stride(0), snap.stride(0),
                              snap.stride(1), K=weight.shape[1], BLOCK=CONV_BLOCK, RUNS=run_len is not None)
    return out


def conv_update_reference(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, slot_ids: torch.Tensor,
                          positions: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                          run_len: torch.Tensor | None = None, snap_idx: torch.Tensor | None = None,
                          snap: torch.Tensor | None = None) -> torch.Tensor:
    if run_len is not None:  # row by row, in order: each row of a run reads the window the row before left
        outs = []
        for r in range(x.shape[0]):
            outs.append(conv_update_reference(x[r:r + 1], window, weight, slot_ids[r:r + 1], positions[r:r + 1],
                                              out_dtype))  # [1, C]
            if int(snap_idx[r]) >= 0:
                snap[int(snap_idx[r])] = window[int(slot_ids[r])]
        return torch.cat(outs)  # [M, C]
    rows = slot_ids.long()
    prev = window[rows].float() * (positions > 0).float()[:, None, None]  # [M, C, K-1]
    seen = torch.cat([prev, x.float()[:, :, None]], dim=-1)  # [M, C, K]
    out = (seen * weight.float()).sum(-1)  # [M, C]
    window[rows] = seen[:, :, 1:].to(window.dtype)
    return torch.nn.functional.silu(out).to(out_dtype)


def _check_conv(x, window, weight, slot_ids, positions) -> tuple[int, int]:
    if x.dim() != 2 or window.dim() != 3 or weight.dim() != 2:
        raise UnsupportedKernelShape(f"conv_update needs x [M, C], window [slots, C, K-1], weight [C, K]; got "
                                     f"{tuple(x.shape)}, {tuple(window.shape)}, {tuple(weight.shape)}")
    m, c = x.shape
    if window.shape[1] != c or weight.shape != (c, window.shape[2] + 1) or window.stride(2) != 1 or x.stride(1) != 1:
        raise UnsupportedKernelShape(f"conv_update: window {tuple(window.shape)} (contiguous last dim) and weight "
                                     f"{tuple(weight.shape)} do not fit x {tuple(x.shape)}")
    _check_rows("conv_update", m, slot_ids, positions)
    return m, c


def _check_rows(name: str, m: int, slot_ids: torch.Tensor, positions: torch.Tensor) -> None:
    for what, t in (("slot_ids", slot_ids), ("positions", positions)):
        if t.shape != (m,) or t.dtype.is_floating_point:
            raise UnsupportedKernelShape(f"{name} needs integer {what} of shape [{m}]; got {tuple(t.shape)} {t.dtype}")


@triton.jit
def _recurrent_update_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, z_ptr, norm_ptr, state_ptr,
                             slot_ptr, pos_ptr, out_ptr, run_ptr, snap_idx_ptr, snap_ptr, stride_qm, stride_qh,
                             stride_km, stride_kh, stride_vm, stride_vh, stride_am, stride_bm, stride_zm, stride_zh,
                             stride_ss, stride_sh, stride_sk, stride_om, stride_oh, stride_ps, stride_ph, stride_pk,
                             scale, eps, GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, RUNS: tl.constexpr):
    m, h = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BV)  # [BV] every value column: the gated norm reduces over them
    ks = tl.arange(0, BK)  # [BK]
    kmask, vmask = ks < DK, cols < DV
    hk = h // GROUPS  # the key head of value head h
    n = 1  # rows this program steps in order: its own, then (RUNS) the next n - 1 rows of the same slot
    if RUNS:
        n = tl.load(run_ptr + m)
    slot = tl.load(slot_ptr + m).to(tl.int64)
    keep = (tl.load(pos_ptr + m) + ks * 0) > 0  # [BK]: position 0 starts from the zero state
    a_log = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    norm = tl.load(norm_ptr + cols, mask=vmask, other=0.0).to(tl.float32)  # [BV]
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + ks[:, None] * stride_sk + cols[None, :]  # [BK, BV]
    smask = kmask[:, None] & vmask[None, :]
    live = (ks * 0 + n) > 0  # [BK]: the program steps rows (with runs, only at a slot's first row)
    s = tl.load(s_ptrs, mask=smask & (keep & live)[:, None], other=0.0)  # [BK, BV] float32
    for j in range(0, n):
        r = m + j
        q = tl.load(q_ptr + r * stride_qm + hk * stride_qh + ks, mask=kmask, other=0.0).to(tl.float32)  # [BK]
        k = tl.load(k_ptr + r * stride_km + hk * stride_kh + ks, mask=kmask, other=0.0).to(tl.float32)  # [BK]
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
        v = tl.load(v_ptr + r * stride_vm + h * stride_vh + cols, mask=vmask, other=0.0).to(tl.float32)  # [BV]
        # the gates: beta = sigmoid(b), log decay g = -exp(A_log) * softplus(a + dt_bias) (softplus linear above 20)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + r * stride_bm + h).to(tl.float32)))
        x = tl.load(a_ptr + r * stride_am + h).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        s = s * tl.exp(-a_log * softplus)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta  # [BV]
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)  # [BV]
        # gated RMSNorm over the head's DV values: weight · o / rms(o) · SiLU(z)
        o = o / tl.sqrt(tl.sum(o * o, 0) / DV + eps) * norm
        z = tl.load(z_ptr + r * stride_zm + h * stride_zh + cols, mask=vmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * stride_om + h * stride_oh + cols, o * z / (1.0 + tl.exp(-z)), mask=vmask)
        if RUNS:  # the state after this row, kept for a rollback to it
            idx = tl.load(snap_idx_ptr + r)
            dst = snap_ptr + tl.maximum(idx, 0).to(tl.int64) * stride_ps + h * stride_ph
            kept = (ks * 0 + idx) >= 0  # [BK]
            tl.store(dst + ks[:, None] * stride_pk + cols[None, :], s, mask=smask & kept[:, None])
    tl.store(s_ptrs, s, mask=smask & live[:, None])


def recurrent_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, state: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                     run_len: torch.Tensor | None = None, snap_idx: torch.Tensor | None = None,
                     snap: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of a DeltaNet layer after its conv: q, k [M, Hk, Dk] (not normalized), v and the output
    gate z [M, Hv, Dv], the gate projections a, b [M, Hv] (before softplus / sigmoid) with the layer's A_log and
    dt_bias [Hv]; state float32 [slots, Hv, Dk, Dv] updated in place at the rows' slots. run_len, snap_idx: runs of
    rows of one slot stepped in order (as conv_update), the state after each kept in snap [R, Hv, Dk, Dv].
    Returns the gated-RMSNorm output (norm_weight [Dv], eps) [M, Hv, Dv] float32."""
    m, hv, dk, dv = _check_recurrent(q, k, v, a, b, z, state, slot_ids, positions)
    out = torch.empty(m, hv, dv, dtype=torch.float32, device=v.device)  # [M, Hv, Dv]
    bk, bv = next_power_of_2(dk), next_power_of_2(dv)
    snap = state if snap is None else snap  # (never written without runs)
    _recurrent_update_kernel[(m, hv)](q, k, v, a, b, A_log, dt_bias, z, norm_weight, state, slot_ids, positions, out,
                                      slot_ids if run_len is None else run_len,
                                      slot_ids if snap_idx is None else snap_idx, snap,
                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                      a.stride(0), b.stride(0), z.stride(0), z.stride(1), state.stride(0),
                                      state.stride(1), state.stride(2), out.stride(0), out.stride(1), snap.stride(0),
                                      snap.stride(1), snap.stride(2), dk ** -0.5, eps,
                                      GROUPS=hv // q.shape[1], DK=dk, DV=dv, BK=bk, BV=bv, RUNS=run_len is not None,
                                      num_warps=8 if bk * bv >= 8192 else 4)
    return out


def recurrent_update_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                               A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                               eps: float, state: torch.Tensor, slot_ids: torch.Tensor,
                               positions: torch.Tensor, run_len: torch.Tensor | None = None,
                               snap_idx: torch.Tensor | None = None, snap: torch.Tensor | None = None) -> torch.Tensor:
    from engine.runtime.deltanet import _gated_norm, recurrent_gated_delta_rule
    if run_len is not None:  # row by row, in order: each row of a run steps the state the row before left
        outs = []
        for r in range(q.shape[0]):
            one = slice(r, r + 1)
            outs.append(recurrent_update_reference(q[one], k[one], v[one], a[one], b[one], A_log, dt_bias, z[one],
                                                   norm_weight, eps, state, slot_ids[one], positions[one]))
            if int(snap_idx[r]) >= 0:
                snap[int(snap_idx[r])] = state[int(slot_ids[r])]
        return torch.cat(outs)  # [M, Hv, Dv]
    rows = slot_ids.long()
    beta = b.float().sigmoid()  # [M, Hv]
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())  # [M, Hv]
    s = state[rows] * (positions > 0).float()[:, None, None, None]  # [M, Hv, Dk, Dv]
    out, s, _ = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], s)
    state[rows] = s
    return _gated_norm(out[:, 0], z.float(), norm_weight, eps)  # [M, Hv, Dv] float32


def _check_recurrent(q, k, v, a, b, z, state, slot_ids, positions) -> tuple[int, int, int, int]:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or state.dim() != 4:
        raise UnsupportedKernelShape(f"recurrent_update needs q, k [M, Hk, Dk], v [M, Hv, Dv], state "
                                     f"[slots, Hv, Dk, Dv]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                                     f"{tuple(v.shape)}, {tuple(state.shape)}")
    m, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if v.shape[0] != m or hv % hk or state.shape[1:] != (hv, dk, dv) or state.dtype != torch.float32:
        raise UnsupportedKernelShape(f"recurrent_update: state {tuple(state.shape)} {state.dtype} (float32 "
                                     f"[slots, {hv}, {dk}, {dv}]) or v {tuple(v.shape)} does not fit q {tuple(q.shape)}")
    if a.shape != (m, hv) or b.shape != (m, hv) or z.shape != v.shape:
        raise UnsupportedKernelShape(f"recurrent_update needs a and b [{m}, {hv}] and z like v; got {tuple(a.shape)}, "
                                     f"{tuple(b.shape)}, {tuple(z.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, z, state, a, b)):
        raise UnsupportedKernelShape("recurrent_update needs the last dim of every input contiguous")
    _check_rows("recurrent_update", m, slot_ids, positions)
    return m, hv, dk, dv

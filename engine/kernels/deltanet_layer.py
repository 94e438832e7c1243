"""The elementwise parts of a hybrid's Gated DeltaNet layer over a prefill chunk, one kernel each (the torch path
runs each as 5-10 elementwise ops over [T, C] or [T, Hv, Dv]: on an H200 ~38 launches a layer in a 27B prompt
chunk, docs/perf.md):

- `causal_conv`: the depthwise causal conv (kernel K) + SiLU of a chunk's q/k/v projection x [B, T, C] after the
  slot's window of its last K-1 inputs, float32 maths, out [B, T, C] in x's dtype (q, k, v are then views of it
  with contiguous heads: no copy before the chunked rule), and the next window;
- `gated_rms_norm`: the layer's output norm, RMSNorm over each head's Dv values times SiLU(z), in z's dtype.

The plain-torch references beside them are the layer's own maths (engine.kernels.deltanet_ref: the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2

CONV_T, CONV_C = 32, 128  # positions and channels per program of the conv
NORM_ROWS = 16  # head rows per program of the gated norm


@triton.jit
def _causal_conv_kernel(x_ptr, win_ptr, w_ptr, out_ptr, T, C, sxb, sxt, swb, swc, sob, sot, K: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr):
    i, j, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i * BT + tl.arange(0, BT)  # [BT]
    c = j * BC + tl.arange(0, BC)  # [BC]
    cmask = c < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(K):
        src = t - (K - 1) + s  # [BT]: the input this tap reads; < 0: from the window (its column K-1+src)
        from_x = (src >= 0) & (src < T)
        xv = tl.load(x_ptr + b * sxb + src[:, None] * sxt + c[None, :], mask=from_x[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        wcol = tl.maximum(src + (K - 1), 0)
        wv = tl.load(win_ptr + b * swb + c[None, :] * swc + wcol[:, None], mask=(src < 0)[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        acc += (xv + wv) * tl.load(w_ptr + c * K + s, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + b * sob + t[:, None] * sot + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & cmask[None, :])


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C] (last dim contiguous), window [B, C, K-1], weight [C, K] → SiLU(conv) [B, T, C] in x's dtype and
    the next window [B, C, K-1] (the last K-1 inputs, in the window's dtype)."""
    bsz, t, c = _check_conv(x, window, weight)
    k = weight.shape[1]
    window = window.contiguous() if window.stride(2) != 1 else window
    out = torch.empty(bsz, t, c, dtype=x.dtype, device=x.device)  # [B, T, C]
    grid = (triton.cdiv(t, CONV_T), triton.cdiv(c, CONV_C), bsz)
    _causal_conv_kernel[grid](x, window, weight.contiguous(), out, t, c, x.stride(0), x.stride(1), window.stride(0),
                              window.stride(1), out.stride(0), out.stride(1), K=k, BT=CONV_T, BC=CONV_C)
    tail = torch.cat([window, x[:, -(k - 1):].transpose(1, 2).to(window.dtype)], dim=-1)  # [B, C, ≤ 2(K-1)]
    return out, tail[..., tail.shape[-1] - (k - 1):]


def causal_conv_reference(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.kernels.deltanet_ref import causal_conv as torch_conv
    out, seen = torch_conv(x.transpose(1, 2), window, weight)  # [B, C, T], [B, C, K-1+T]
    return out.transpose(1, 2), seen[..., seen.shape[-1] - (weight.shape[1] - 1):]


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, N, eps, D: tl.constexpr, BD: tl.constexpr,
                       ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] head rows
    cols = tl.arange(0, BD)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BD]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # [ROWS]
    out = w[None, :] * (x * rstd[:, None]) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (float32), gate [..., D] like it, weight [D] → weight · x / rms(x) · SiLU(gate) in gate's dtype
    (float32 maths); both inputs contiguous."""
    d = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (d,) or not (x.is_contiguous() and gate.is_contiguous()):
        raise UnsupportedKernelShape(f"gated_rms_norm needs contiguous x and gate of one shape, weight [{d}]; got "
                                     f"{tuple(x.shape)}, {tuple(gate.shape)}, {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=gate.dtype, device=x.device)  # [..., D]
    n = x.numel() // d
    _gated_norm_kernel[(triton.cdiv(n, NORM_ROWS),)](x, gate, weight, out, n, eps, D=d, BD=next_power_of_2(d),
                                                      ROWS=NORM_ROWS)
    return out


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from engine.kernels.deltanet_ref import _gated_norm
    return _gated_norm(x, gate, weight, eps)


def _check_conv(x, window, weight) -> tuple[int, int, int]:
    if x.dim() != 3 or window.dim() != 3 or weight.dim() != 2 or x.stride(2) != 1:
        raise UnsupportedKernelShape(f"causal_conv needs x [B, T, C] (contiguous channels), window [B, C, K-1], "
                                     f"weight [C, K]; got {tuple(x.shape)}, {tuple(window.shape)}, {tuple(weight.shape)}")
    bsz, t, c = x.shape
    if window.shape != (bsz, c, weight.shape[1] - 1) or weight.shape[0] != c or weight.shape[1] < 2:
        raise UnsupportedKernelShape(f"causal_conv: window {tuple(window.shape)} and weight {tuple(weight.shape)} "
                                     f"do not fit x {tuple(x.shape)}")
    return bsz, t, c

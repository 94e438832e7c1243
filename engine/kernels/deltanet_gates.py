"""The gate projections of a hybrid's Gated DeltaNet layer in the decode step, in one kernel: the layer's input
RMSNorm of the float32 residual rows and the product with in_proj_b / in_proj_a joined into one [2·Hv, H]
matrix (engine.runtime.deltanet.GatedDeltaNet.join_gates), float32 maths. It replaces an RMSNorm, two casts and
a cuBLAS split-K matmul with its reduction (~15 µs a layer on an H200 for 0.5 MB of weights: docs/perf.md).

    out[m, r] = rstd(x[m]) · Σ_k W[r, k] · w_norm[k] · x[m, k],    rstd(x) = 1 / sqrt(mean(x²) + eps)

One program per (row, block of GATE_ROWS outputs) reads the row once (in one step up to GATE_K columns: a loop of
dependent loads was latency-bound, 5.5 µs a layer on the H200), summing its squares and the products in the
same pass (the norm's scale is one scalar per row). The plain-torch reference beside it is the CPU path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2

GATE_ROWS = 2  # outputs per program (the 27B's 96 gate rows: 48 programs a row)
GATE_K = 8192  # input columns per step of the program's loop at most (a 5120-wide row in one step)


@triton.jit
def _gate_project_kernel(x_ptr, norm_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om, eps,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m, j = tl.program_id(0), tl.program_id(1)
    rows = j * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        kmask = ks < K
        x = tl.load(x_ptr + m * stride_xm + ks, mask=kmask, other=0.0).to(tl.float32)  # [BK]
        squares += x * x
        xn = x * tl.load(norm_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)  # [BN, BK]
        acc += w * xn[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    tl.store(out_ptr + m * stride_om + rows, tl.sum(acc, 1) * rstd, mask=rmask)


def gate_project(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (the residual rows), norm_weight [H], weight [N, H] (float of any width) → float32 [M, N]:
    weight · RMSNorm(x)."""
    m, k = _check(x, norm_weight, weight)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)  # [M, N]
    block_k = min(GATE_K, next_power_of_2(k))
    _gate_project_kernel[(m, triton.cdiv(n, GATE_ROWS))](x, norm_weight, weight, out, n, k, x.stride(0),
                                                          weight.stride(0), out.stride(0), eps, BLOCK_N=GATE_ROWS,
                                                          BLOCK_K=block_k, num_warps=8 if block_k >= 4096 else 4)
    return out


def gate_project_reference(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    normed = torch.nn.functional.rms_norm(x.float(), norm_weight.shape, norm_weight.float(), eps)  # [M, H]
    return torch.nn.functional.linear(normed, weight.float())  # [M, N] float32


def _check(x, norm_weight, weight) -> tuple[int, int]:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or norm_weight.shape != (x.shape[1],):
        raise UnsupportedKernelShape(f"gate_project needs x [M, H], norm [H], weight [N, H]; got {tuple(x.shape)}, "
                                     f"{tuple(norm_weight.shape)}, {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or norm_weight.stride(0) != 1:
        raise UnsupportedKernelShape("gate_project needs the last dim of x, norm and weight contiguous")
    return x.shape

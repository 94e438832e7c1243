"""Activations to int8 per group (optionally after RMSNorm), in the form the packed GEMV reads.

x [M, K] → xq int8 [M, K], sx float32 [M, K/G] (absmax / 127) and sumx int32 [M, K/G] (Σ of the
int8 values of each group: the packed GEMV subtracts OFFSET·sumx once per group). Rounding is
floor(v + 0.5) in both the kernel and the reference so they agree bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant.kernels import pdl_options
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait


def quantize_activations_reference(x: torch.Tensor, group_size: int, norm_weight: torch.Tensor | None = None,
                                   eps: float = 1e-6, gated: bool = False, zero_input: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gated: x [M, 2K] holds gate and up halves; the activations are silu(gate) * up.
    zero_input: x is left all zeros (a split-K accumulation buffer, ready for the next product)."""
    source = x
    if gated:
        gate, up = x.float().chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up  # [M, K]
    m, k = x.shape
    y = x.float()
    if norm_weight is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    g = y.reshape(m, k // group_size, group_size)  # [M, K/G, G]
    sx = g.abs().amax(-1) / 127.0  # [M, K/G]
    inv = torch.where(sx > 0, 1.0 / sx, torch.zeros_like(sx))
    q = torch.floor(g * inv[..., None] + 0.5).clamp(-127, 127)
    if zero_input:
        source.zero_()
    return q.to(torch.int8).reshape(m, k), sx, q.sum(-1).to(torch.int32)


@triton.jit
def _quantize_kernel(x_ptr, w_ptr, xq_ptr, sx_ptr, sumx_ptr, K, NG, eps,
                     GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, HAS_NORM: tl.constexpr,
                     NORM_BLOCK: tl.constexpr, GATED: tl.constexpr, ZERO_INPUT: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: let the next kernel start, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    first = tl.program_id(1) * GROUPS_PER_PROG
    rstd = 1.0
    if HAS_NORM:  # every program reads the whole row for its sum of squares (rows are short)
        acc = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for start in range(0, K, NORM_BLOCK):
            offs = start + tl.arange(0, NORM_BLOCK)
            v = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
    gi = first + tl.arange(0, GROUPS_PER_PROG)  # [P]
    cols = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [P, G]
    mask = (gi < NG)[:, None]
    if GATED:  # row of x = [gate (K) | up (K)]: y = silu(gate) * up
        gate = tl.load(x_ptr + row * 2 * K + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * K + K + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_INPUT:
            tl.store(x_ptr + row * 2 * K + cols, tl.zeros_like(gate), mask=mask)
            tl.store(x_ptr + row * 2 * K + K + cols, tl.zeros_like(up), mask=mask)
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        y = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32) * rstd
    if HAS_NORM:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    sx = tl.max(tl.abs(y), axis=1) / 127.0  # [P]
    inv = tl.where(sx > 0, 1.0 / sx, 0.0)
    q = tl.minimum(tl.maximum(tl.floor(y * inv[:, None] + 0.5), -127.0), 127.0)
    tl.store(xq_ptr + row * K + cols, q.to(tl.int8), mask=mask)
    tl.store(sx_ptr + row * NG + gi, sx, mask=gi < NG)
    tl.store(sumx_ptr + row * NG + gi, tl.sum(q, axis=1).to(tl.int32), mask=gi < NG)


def quantize_activations(x: torch.Tensor, group_size: int, norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         gated: bool = False, zero_input: bool = False, groups_per_program: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel: same results as `quantize_activations_reference`. x [M, K] ([M, 2K] gated), contiguous."""
    m, k = x.shape
    k = k // 2 if gated else k
    assert k % group_size == 0 and x.is_contiguous() and not (gated and norm_weight is not None)
    assert gated or not zero_input, "zero_input is implemented for the gated (SwiGLU) input"
    ng = k // group_size
    if out is None:
        out = (torch.empty(m, k, dtype=torch.int8, device=x.device),
               torch.empty(m, ng, dtype=torch.float32, device=x.device),
               torch.empty(m, ng, dtype=torch.int32, device=x.device))
    xq, sx, sumx = out
    # Four groups per program (measured on an H200, tests/perf/gpu_kernels.py --sections small): a
    # whole 4096-wide row in one program took 2.5 µs with RMSNorm, 8 programs of 4 groups 1.9 µs.
    per_prog = groups_per_program or max(1, min(triton.next_power_of_2(ng), 4))
    grid = (m, triton.cdiv(ng, per_prog))
    w = norm_weight if norm_weight is not None else x
    _quantize_kernel[grid](x, w, xq, sx, sumx, k, ng, eps, GROUP=group_size, GROUPS_PER_PROG=per_prog,
                           HAS_NORM=norm_weight is not None,
                           NORM_BLOCK=min(triton.next_power_of_2(k), 4096), GATED=gated,
                           ZERO_INPUT=zero_input, num_warps=4, **pdl_options(x.device))
    return xq, sx, sumx

"""The dense linear layer: y = x Wᵀ (+ b) with the weight in any float dtype, and the CPU rules that
keep a speculative verify pass's rows bit-identical to the one-row decode step's."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x Wᵀ (+ b). The weight may be stored narrower than the activations (float16 weights with
    float32 activations on the CPU): a single row then goes through a gemv that reads the narrow
    weight directly (half the memory traffic of float32 on a CPU), and so do up to NARROW_GEMV_ROWS
    rows, one single-row call each; more rows widen it. bfloat16 weights on a CPU with bf16
    dot products (AVX512-BF16, AMX) run one bf16 GEMM at every row count instead (see linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# Up to this many rows, a narrow weight (float16 under float32 activations on the CPU) is applied
# one single-row call per row: the weight stays in cache after the first row, widening it costs more, and each
# row's result is bit-identical to the single-row decode step's (speculative verification).
NARROW_GEMV_ROWS = 8


@functools.cache
def cpu_bf16_gemm() -> bool:
    """Whether this CPU multiplies bfloat16 natively (oneDNN's bf16 GEMM; else it is emulated, slowly)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def cpu_fp16_gemm() -> bool:
    """Whether oneDNN multiplies float16 natively on this CPU (AVX512-FP16 / AVX512 with F16C)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported())


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., K] @ w[N, K]ᵀ → [.., N] in x's dtype, whatever w's dtype."""
    if w.dtype == x.dtype:
        return F.linear(x, w, bias)
    rows = x.numel() // x.shape[-1]
    if w.dtype == torch.bfloat16 and x.device.type == "cpu" and cpu_bf16_gemm():
        # One bf16 GEMM whatever the rows: on AVX512-BF16 it costs about the same for 2..16 rows (a
        # speculative verify pass ~ one decode step, where float16 gemvs cost a pass per row), and a
        # row's result does not depend on how many rows share the call from two up, so a lone decode
        # row runs as two: verified rows equal the decode step's bit for bit.
        flat = x.reshape(rows, -1).to(torch.bfloat16)  # [rows, K]
        if rows == 1:
            flat = flat.repeat(2, 1)  # [2, K]
        y = F.linear(flat, w)[:rows].to(x.dtype).view(*x.shape[:-1], w.shape[0])
    elif rows <= NARROW_GEMV_ROWS:
        # one narrow [1, K] x [K, N] GEMM per row (oneDNN's: ~3x torch.mv's float16 gemv on AVX512 CPUs,
        # docs/perf.md 2026-12-03): a decode step's row, and each row of a speculative verify pass as the
        # decode step computes it (one call shape, so bit-identical), for a pass over the weight per row
        flat = x.reshape(rows, -1).to(w.dtype)  # [rows, K]
        if w.dtype == torch.float16 and x.device.type == "cpu" and cpu_fp16_gemm():
            y = torch.cat([F.linear(flat[i:i + 1], w) for i in range(rows)])  # [rows, N]
        else:  # no native float16 GEMM (AVX2 CPUs): torch's gemv, one per row
            y = torch.stack([torch.mv(w, r) for r in flat])  # [rows, N]
        y = y.to(x.dtype).view(*x.shape[:-1], w.shape[0])
    else:
        y = F.linear(x, w.to(x.dtype))
    return y if bias is None else y + bias.to(x.dtype)

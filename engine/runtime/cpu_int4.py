"""A GGUF 4-bit matrix (Q4_0 / Q4_1 / Q4_K) run on the CPU as stored: torch's int4 kernel reads 4.5
bits a weight instead of float16's 16 (`_weight_int4pack_mm_for_cpu`: unsigned codes, one affine pair
(s, z) per 32 weights, w = (q − 8)·s + z; quant.gguf_int4 decodes the blocks into that form). Q5_0 / Q5_1 /
Q8_0 codes run as two 4-bit halves side by side along K, fed [x, x]: one call, 9 bits a weight.

The kernel is fast only in bfloat16: activations, the (s, z) pairs and its output are bfloat16 (8
mantissa bits; llama.cpp quantizes its activations to int8 blocks for the same dot products). A row's
result does not depend on how many rows share the call (checked once per process by
`rows_independent`; where it does, rows run one call each), so a speculative verify pass gives the
one-row decode step's values bit for bit. Quality against float16 matrices: docs/quality.md.

The kernel's time grows with the rows (it runs as a GEMV per row): from PREFILL_ROWS rows on (prompt chunks),
a call decodes its matrix to bfloat16 and runs bfloat16 GEMMs instead (engine.runtime.cpu_int4_prefill).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.runtime.cpu_int4_prefill import fast_prefill_usable, prefill_matmul
from quant.gguf_int4 import GROUP, dense_weights

# Up to this many rows (decode, verify widths) a call's rows must equal one-row calls bit for bit.
VERIFY_ROWS = 16
# From this many rows on, decode + one bfloat16 GEMM beats the int4 kernel: measured break-even 40-48 rows for
# the 0.5B / 1.5B matrices at 1 and 2 threads (~64 for a 256x1536 one, whose time is small either way); docs/perf.md
# session 24. Must stay above VERIFY_ROWS: those calls keep the kernel's row-for-row results.
PREFILL_ROWS = 48


@functools.cache
def int4_kernel_available() -> bool:
    """Whether this torch has the CPU int4 kernel (torch ≥ 2.5)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 → the kernel's packed layout (uint8 [N, K/2])."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def scales_and_zeros(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """s, z float32 [N, K/32] → the kernel's bfloat16 [K/32, N, 2]."""
    return torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x [M, K] (any float dtype) → bfloat16 [M, N]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, GROUP, sz)


@functools.cache
def rows_independent() -> bool:
    """Whether a row of a 2..VERIFY_ROWS-row call equals the same row alone, bit for bit, on this CPU
    (a fixed random matrix wide enough for the kernel's column blocks and threads)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 512, 1024
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3  # [N, K/32]
    z = torch.randn(n, k // GROUP, generator=gen) * 0.01  # [N, K/32]
    packed, sz = pack_codes(codes), scales_and_zeros(s, z)
    x = torch.randn(VERIFY_ROWS, k, generator=gen)  # [16, K]
    alone = torch.cat([int4_matmul(x[i:i + 1], packed, sz) for i in range(VERIFY_ROWS)])  # [16, N]
    return all(torch.equal(int4_matmul(x[:m], packed, sz), alone[:m]) for m in range(2, VERIFY_ROWS + 1))


class Int4CpuLinear(nn.Module):
    """y = x Wᵀ (+ b) with W held as the int4 kernel's packed codes and bfloat16 (s, z) pairs."""

    def __init__(self, codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bias: torch.Tensor | None = None,
                 in_features: int | None = None):
        """codes [N, K] (or [N, 2K]: two halves of wider codes, quant.gguf_int4 — give in_features K)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], in_features or codes.shape[1]
        self.halves = codes.shape[1] // self.in_features  # 2: the input is fed twice, [x, x]
        assert self.halves * self.in_features == codes.shape[1] and self.halves in (1, 2), codes.shape
        self.register_buffer("packed", pack_codes(codes))  # [N, K/2] uint8
        self.register_buffer("sz", scales_and_zeros(s, z))  # [K/32, N, 2] bfloat16
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.split_rows = not rows_independent()
        self.fast_prefill = fast_prefill_usable(self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.sz.numel() * self.sz.element_size()

    def dequantized(self) -> torch.Tensor:
        """The float32 [N, K] matrix this layer multiplies by (from its bfloat16 pairs), for references."""
        s, z = self.sz.float().transpose(0, 1).unbind(-1)  # [N, K'/32] each
        codes = unpack_codes(self.packed, self.out_features, self.halves * self.in_features)
        return dense_weights(codes, s.contiguous(), z.contiguous(), self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)  # [M, K]
        if rows >= PREFILL_ROWS and self.fast_prefill:
            return self._out(prefill_matmul(flat.to(torch.bfloat16), self.packed, self.sz, self.out_features,
                                            self.halves), x)  # [M, N]: the halves summed in the weights
        if self.halves == 2:
            flat = torch.cat([flat, flat], dim=-1)  # [M, 2K]: each half of the codes sees the whole input
        if self.split_rows and 1 < rows <= VERIFY_ROWS:
            y = torch.cat([int4_matmul(flat[i:i + 1], self.packed, self.sz) for i in range(rows)])  # [M, N]
        else:
            y = int4_matmul(flat, self.packed, self.sz)  # [M, N]
        return self._out(y, x)

    def _out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """bfloat16 y [M, N] → x's dtype and leading shape, plus the bias."""
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def unpack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernel's packed layout → codes uint8 [N, K], by multiplying with unit rows (the layout is the
    kernel's own and may change between torch versions; this asks the kernel itself)."""
    eye = torch.eye(k, dtype=torch.bfloat16)  # [K, K]
    sz = torch.zeros(k // GROUP, n, 2, dtype=torch.bfloat16)
    sz[..., 0] = 1.0  # s = 1, z = 0: w = q − 8, exact in bfloat16
    out = torch.cat([torch.ops.aten._weight_int4pack_mm_for_cpu(eye[i:i + 256], packed, GROUP, sz)
                     for i in range(0, k, 256)])  # [K, N]
    return (out.float().t() + 8.0).round().to(torch.uint8).contiguous()

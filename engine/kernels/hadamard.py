"""The orthonormal Hadamard rotation of KV rows in registers (Triton device functions, no kernel here).

Fast Walsh-Hadamard transform: butterflies (a + b, a − b) on pairs (i, i + h) for h = N/2, N/4, .., 1, then
× N^-1/2, in the order of quant/kv_quant.hadamard_rows (its torch reference: same float32 bits). Each stage
reshapes the row to [N/2h, 2, h], moves the pair axis last, splits it and joins the sums and differences.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fwht(x, N: tl.constexpr):
    """x [N] float32 → x·H_N, unnormalized (Sylvester's ±1 matrix)."""
    for stage in tl.static_range(N.bit_length() - 1):
        h: tl.constexpr = N >> (stage + 1)
        pairs = tl.permute(tl.reshape(x, [N // (2 * h), 2, h]), (0, 2, 1))  # [N/2h, h, 2]
        a, b = tl.split(pairs)  # [N/2h, h] each
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [N])
    return x


@triton.jit
def fwht_rows(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, N] float32 → each row times H_N, unnormalized."""
    for stage in tl.static_range(N.bit_length() - 1):
        h: tl.constexpr = N >> (stage + 1)
        pairs = tl.permute(tl.reshape(x, [R, N // (2 * h), 2, h]), (0, 1, 3, 2))  # [R, N/2h, h, 2]
        a, b = tl.split(pairs)  # [R, N/2h, h] each
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, N])
    return x


@triton.jit
def hadamard_halves(a1, a2, HALF: tl.constexpr):
    """The two halves a1, a2 [HALF] (float32) of a row x → the two halves of x·H (H orthonormal, order
    2·HALF): the first butterfly pairs element i with i + HALF, the rest run within each half."""
    norm: tl.constexpr = (2.0 * HALF) ** -0.5
    return fwht(a1 + a2, HALF) * norm, fwht(a1 - a2, HALF) * norm

"""The orthonormal Hadamard rotation of KV rows in registers (Triton device functions, no kernel here).

Fast Walsh-Hadamard transform: butterflies (a + b, a − b) on pairs (i, i + h) for h = N/2, N/4, .., 1, then
× N^-1/2, in the order of quant/kv_quant.hadamard_rows (its torch reference: same float32 bits). Each stage
reshapes the row to [N/2h, 2, h], moves the pair axis last, splits it and joins the sums and differences.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _butterflies(x, R: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One stage on x [R, N]: pairs (i, i + H) inside each block of 2H become (a + b, a − b). H is a
    parameter, not a name bound in the caller's loop: Triton forbids rebinding a constexpr."""
    pairs = tl.permute(tl.reshape(x, [R, N // (2 * H), 2, H]), (0, 1, 3, 2))  # [R, N/2H, H, 2]
    a, b = tl.split(pairs)  # [R, N/2H, H] each
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, N])


@triton.jit
def fwht_rows(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, N] float32 → each row times H_N, unnormalized (Sylvester's ±1 matrix)."""
    for stage in tl.static_range(N.bit_length() - 1):
        x = _butterflies(x, R, N, N >> (stage + 1))
    return x


@triton.jit
def fwht(x, N: tl.constexpr):
    """x [N] float32 → x·H_N, unnormalized."""
    return tl.reshape(fwht_rows(tl.reshape(x, [1, N]), 1, N), [N])


@triton.jit
def hadamard_halves(a1, a2, HALF: tl.constexpr):
    """The two halves a1, a2 [HALF] (float32) of a row x → the two halves of x·H (H orthonormal, order
    2·HALF): the first butterfly pairs element i with i + HALF, the rest run within each half."""
    norm: tl.constexpr = (2.0 * HALF) ** -0.5
    return fwht(a1 + a2, HALF) * norm, fwht(a1 - a2, HALF) * norm

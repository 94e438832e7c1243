"""Hadamard rotations folded into a transformer's weights (QuaRot / SpinQuant style): the maths.

Orthogonal Q [H, H] rotates the residual stream: every vector x becomes x·Q. A linear y = x Wᵀ that
reads the stream takes W·Q (x Q (W Q)ᵀ = x Wᵀ), one that writes into it Qᵀ·W (its output y·Q), the
embedding rows E·Q. RMSNorm with unit weight commutes with Q (‖xQ‖ = ‖x‖), so a norm's weight is
first folded into the linears that read it (W·diag(g)) and set to 1. Rotated weights spread
outliers over all input features, which is what low-bit grids need.

Q is a randomized Hadamard matrix H·diag(±1)/√n. Hadamard matrices of order n are built by Sylvester
doubling ([[H, H], [H, -H]]), Paley's construction (order q + 1 for a prime q ≡ 3 mod 4: 12, 20, 24,
32, 44, 48, 60, 68, 72, 80, 84, ...) and Kronecker products of those; 576 = 4 · 144 = ... works
through Paley 72. Orders no product of those reaches are refused (`hadamard_matrix` raises).

An online Hadamard (applied at run time, not foldable) on an input: W·Hᵀ folded, the activations
multiplied by H before the product. `block_hadamard` applies I ⊗ H_b (H_b the Sylvester matrix of a
power of two b) to the last dimension as two small matrix products, H_b = H_b1 ⊗ H_b2. Sylvester
matrices are symmetric, so H = Hᵀ there. This module imports nothing else of bonsai.
"""
from __future__ import annotations

from functools import lru_cache

import torch


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _paley(order: int) -> torch.Tensor | None:
    """Paley construction I: a ±1 Hadamard matrix of order q + 1 for a prime q ≡ 3 (mod 4)."""
    q = order - 1
    if not (q % 4 == 3 and _is_prime(q)):
        return None
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if i in squares else -1 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]  # [q, q], antisymmetric
    s = torch.zeros(order, order, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, jacobsthal
    return torch.eye(order, dtype=torch.float64) + s


@lru_cache(maxsize=None)
def _hadamard_pm1(n: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order n (float64), or None if none of our constructions reaches n."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n % 2 == 0 and (half := _hadamard_pm1(n // 2)) is not None:
        return torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0)
    for order in range(4, n + 1, 4):
        if n % order == 0 and (p := _paley(order)) is not None and (rest := _hadamard_pm1(n // order)) is not None:
            return torch.kron(p, rest)
    return None


def has_hadamard(n: int) -> bool:
    return n >= 1 and _hadamard_pm1(n) is not None


def hadamard_matrix(n: int) -> torch.Tensor:
    """Orthonormal Hadamard matrix H [n, n] float64 (H Hᵀ = I); for a power of two, Sylvester's (symmetric)."""
    h = _hadamard_pm1(n) if n >= 1 else None
    if h is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here (orders 2^k times products of Paley "
                         "orders 12, 20, 24, 44, 48, 60, 72, ... are)")
    return h / n ** 0.5


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal Q = H · diag(s) [n, n] float64 with random signs s (randomized Hadamard, QuaRot)."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1  # [n]
    return hadamard_matrix(n) * signs[None, :]


def power_of_two_block(n: int) -> int:
    """The largest power of two dividing n (1536 = 3 · 512 → 512)."""
    return n & -n


def _kron_factors(block: int) -> tuple[int, int]:
    """block = b1 · b2, both powers of two, b1 ≤ b2."""
    bits = block.bit_length() - 1
    b1 = 1 << (bits // 2)
    return b1, block // b1


def block_hadamard_factors(block: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sylvester H_b1, H_b2 (orthonormal) with H_block = H_b1 ⊗ H_b2: what `block_hadamard` multiplies by."""
    assert block >= 1 and block & (block - 1) == 0, f"block {block} is not a power of two"
    b1, b2 = _kron_factors(block)
    return hadamard_matrix(b1).to(device, dtype), hadamard_matrix(b2).to(device, dtype)


def block_hadamard(x: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """x [..., n] → x · (I_{n/b} ⊗ H_b) with H_b = h1 ⊗ h2 (b = b1·b2 dividing n), in float32 (or
    h1's dtype), returned in x's dtype. Two products with matrices of about √b rows: O(n √b)."""
    b1, b2 = h1.shape[0], h2.shape[0]
    n = x.shape[-1]
    assert n % (b1 * b2) == 0, f"block {b1 * b2} does not divide {n}"
    dtype = torch.float64 if h1.dtype == torch.float64 else torch.float32
    y = x.to(dtype).reshape(*x.shape[:-1], n // (b1 * b2), b1, b2)  # [..., n/b, b1, b2]
    y = torch.matmul(torch.matmul(h1.to(dtype), y), h2.to(dtype))  # H_b1 Y H_b2 (both symmetric): row-major kron
    return y.reshape(x.shape).to(x.dtype)


def signed_block_hadamard(x: torch.Tensor, signs: torch.Tensor | None, h1: torch.Tensor, h2: torch.Tensor,
                          inverse: bool = False) -> torch.Tensor:
    """R(x) = (x ⊙ s) · (I ⊗ H_b) on the last dimension (signs None: all +1), in float32, returned in x's
    dtype; inverse: R⁻¹(x) = (x · (I ⊗ H_b)) ⊙ s (H_b symmetric and orthonormal: its own inverse)."""
    y = x.float()  # [..., n]
    if signs is not None and not inverse:
        y = y * signs.float()
    y = block_hadamard(y, h1, h2)  # [..., n] float32
    if signs is not None and inverse:
        y = y * signs.float()
    return y.to(x.dtype)


def block_hadamard_matrix(n: int, block: int) -> torch.Tensor:
    """The dense I_{n/block} ⊗ H_block [n, n] float64 that `block_hadamard` multiplies by (for folding)."""
    assert n % block == 0
    return torch.kron(torch.eye(n // block, dtype=torch.float64), hadamard_matrix(block))


def fold_norm(w: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] reading RMSNorm(x) · g → W · diag(g) reading the unit-weight norm."""
    return w * norm_weight.to(w.dtype)[None, :]


def rotate_input(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """W [N, K] reading x → W·Q [N, K] reading x·Q (also the embedding: rows E·Q)."""
    return w @ q.to(w.dtype)


def rotate_output(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """W [N, K] writing y → Qᵀ·W [N, K] writing y·Q."""
    return q.to(w.dtype).T @ w

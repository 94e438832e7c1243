"""Rounding weights onto low-bit grids, one scale per group of `group_size` input features.

Pure functions of tensors (no model): w [N, K] → integer codes [N, K] and scales [N, K/G].
Value of a weight = code * scale of its group. Grids:
  ternary: codes in {-1, 0, +1}, the L2-optimal scale and support per group (exact, see below)
  binary:  codes in {-1, +1}, scale = mean |w| of the group (L2-optimal for fixed signs)
  int4 / int8: symmetric, codes in [-(2^(b-1)-1), 2^(b-1)-1], scale = absmax / (2^(b-1)-1)
"""
from __future__ import annotations

import torch


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    return w.float().reshape(n, k // group_size, group_size)  # [N, K/G, G]


def ternary_rtn(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact L2-optimal ternary rounding of each group.

    For a fixed support S of k weights set to sign(w)·α, the best α is mean(|w| over S) and the
    error reduction is (Σ_S |w|)² / k, maximized by taking S = the k largest |w|. So: sort |w|
    descending, pick k maximizing (cumsum_k)² / k, α = cumsum_k / k. O(G log G) per group.
    Returns codes int8 [N, K] in {-1, 0, 1} and scales float32 [N, K/G].
    """
    g = _groups(w, group_size)
    mag = g.abs()
    sorted_mag, order = torch.sort(mag, dim=-1, descending=True)  # [N, K/G, G]
    csum = sorted_mag.cumsum(-1)
    counts = torch.arange(1, group_size + 1, device=w.device, dtype=torch.float32)
    best = torch.argmax(csum * csum / counts, dim=-1, keepdim=True)  # [N, K/G, 1]: k* - 1
    scale = csum.gather(-1, best) / (best + 1).float()  # [N, K/G, 1]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(group_size, device=w.device).expand_as(order))
    keep = rank <= best  # the k* largest magnitudes
    codes = torch.where(keep, torch.sign(g), torch.zeros_like(g))
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))  # an all-zero group stays zero
    return codes.reshape(w.shape).to(torch.int8), scale.squeeze(-1)


def binary_rtn(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs (0 counts as +1) with scale = mean |w| per group: codes int8 [N, K] in {-1, 1}."""
    g = _groups(w, group_size)
    codes = torch.where(g >= 0, 1, -1).to(torch.int8)
    return codes.reshape(w.shape), g.abs().mean(-1)


def int_rtn(w: torch.Tensor, bits: int, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax rounding to `bits` (2..8): codes int8 [N, K], scales [N, K/G]."""
    if not 2 <= bits <= 8:
        raise ValueError(f"integer grids take 2 to 8 bits, not {bits}")
    qmax = 2 ** (bits - 1) - 1
    g = _groups(w, group_size)
    scale = g.abs().amax(-1) / qmax  # [N, K/G]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(g / safe[..., None]), -qmax, qmax).to(torch.int8)
    return codes.reshape(w.shape), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """codes [N, K] (any integer grid) and scales [N, K/G] → float32 weights [N, K]."""
    n, k = codes.shape
    g = codes.float().reshape(n, k // group_size, group_size) * scales.float()[..., None]
    return g.reshape(n, k)

"""Bit packing of integer codes for storage: exact, invertible, little-endian within a byte.

  2-bit (ternary): code + 1 ∈ {0, 1, 2}, four per byte, element i at bits 2*(i % 4)
  1-bit (binary):  bit 1 = +1, bit 0 = -1, eight per byte, element i at bit i % 8 (Q1_0's order)
  4-bit (int4):    code + 8 ∈ [1, 15], two per byte, even element in the low nibble
Packing runs along the last dimension, which must be a multiple of the codes per byte.
"""
from __future__ import annotations

import torch


def _check(codes: torch.Tensor, per_byte: int) -> None:
    if codes.shape[-1] % per_byte:
        raise ValueError(f"the last dimension ({codes.shape[-1]}) must be a multiple of {per_byte}")


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in {-1, 0, 1} [.., K] → uint8 [.., K/4]."""
    _check(codes, 4)
    c = (codes.to(torch.int16) + 1).reshape(*codes.shape[:-1], -1, 4)  # [.., K/4, 4]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int16, device=codes.device)
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K/4] → int8 codes [.., K]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int16, device=packed.device)
    c = (packed.to(torch.int16)[..., None] >> shifts) & 0x3  # [.., K/4, 4]
    return (c - 1).reshape(*packed.shape[:-1], -1).to(torch.int8)


def pack_binary(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in {-1, 1} [.., K] → uint8 [.., K/8]."""
    _check(codes, 8)
    bits = (codes > 0).to(torch.int16).reshape(*codes.shape[:-1], -1, 8)  # [.., K/8, 8]
    shifts = torch.arange(8, dtype=torch.int16, device=codes.device)
    return (bits << shifts).sum(-1).to(torch.uint8)


def unpack_binary(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K/8] → int8 codes [.., K] in {-1, 1}."""
    shifts = torch.arange(8, dtype=torch.int16, device=packed.device)
    bits = (packed.to(torch.int16)[..., None] >> shifts) & 0x1  # [.., K/8, 8]
    return (2 * bits - 1).reshape(*packed.shape[:-1], -1).to(torch.int8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] [.., K] → uint8 [.., K/2]."""
    _check(codes, 2)
    c = (codes.to(torch.int16) + 8).reshape(*codes.shape[:-1], -1, 2)  # [.., K/2, 2]
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K/2] → int8 codes [.., K] in [-8, 7]."""
    p = packed.to(torch.int16)
    c = torch.stack([p & 0xF, p >> 4], dim=-1) - 8  # [.., K/2, 2]
    return c.reshape(*packed.shape[:-1], -1).to(torch.int8)


def bits_per_weight(code_bits: float, group_size: int, scale_bits: int = 16) -> float:
    """Storage bits per weight: the code plus the group's scale spread over the group."""
    return code_bits + scale_bits / group_size

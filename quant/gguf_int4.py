"""GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) → unsigned 4-bit codes with one affine pair per 32 weights.

Every weight of these types is w = (q − 8)·s + z for its code q ∈ 0..15 and its 32-weight group's pair
(s, z), which is the form torch's CPU int4 kernel takes (`_weight_int4pack_mm_for_cpu`):
  Q4_0  (32-blocks: d fp16, 16 bytes of codes)           w = d·(q − 8)        → s = d,    z = 0
  Q4_1  (32-blocks: d, m fp16, 16 bytes of codes)        w = d·q + m          → s = d,    z = 8d + m
  Q4_K  (256-blocks: d, dmin fp16, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of codes)
        sub-block j of 32:                              w = d·sc_j·q − dmin·m_j → s = d·sc_j, z = 8s − dmin·m_j
Byte layouts are llama.cpp's (ggml-quants.c `dequantize_row_q4_*`; the gguf package's reference
dequantizers agree). Raw bytes are numpy uint8 [rows, bytes per row]. Imports nothing else of bonsai.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

GROUP = 32  # weights per (s, z) pair, for every type here
# type id → (weights per block, bytes per block)
INT4_TYPES = {int(T.Q4_0): (32, 18), int(T.Q4_1): (32, 20), int(T.Q4_K): (256, 144)}


def _blocks(raw: np.ndarray, type_id: int, k: int) -> np.ndarray:
    block, size = INT4_TYPES[type_id]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if k % block or raw.shape[-1] != k // block * size:
        raise ValueError(f"{raw.shape[-1]} bytes per row do not hold {k} weights of GGUF type {type_id}")
    return raw.reshape(raw.shape[0], k // block, size)  # [N, K/B, bytes]


def _fp16(b: np.ndarray) -> np.ndarray:
    """Two bytes per element (little endian) → float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] codes: the low nibbles are weights 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[.., 12] packed bytes → (sc, m) [.., 8] each, 6 bits: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles plus the top 2 bits of bytes 0-7."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_int4(raw: np.ndarray, type_id: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensor's rows → (codes uint8 [N, K] in 0..15, s float32 [N, K/32], z float32 [N, K/32]) with
    w = (q − 8)·s + z; s is exact and z within one float32 rounding of the stored values."""
    blocks = _blocks(raw, type_id, k)  # [N, B, bytes]
    n = blocks.shape[0]
    if type_id == int(T.Q4_K):
        d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [N, B]
        sc, mn = _q4k_scale_min(blocks[..., 4:16])  # [N, B, 8]
        qs = blocks[..., 16:144].reshape(n, -1, 4, 32)  # [N, B, 4 chunks of 64 weights, 32 bytes]
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [N, B, 4, 2, 32]: sub-block 2c low, 2c+1 high
        s = d[..., None] * sc.astype(np.float32)  # [N, B, 8]
        z = 8.0 * s - dmin[..., None] * mn.astype(np.float32)  # [N, B, 8]
    else:
        d = _fp16(blocks[..., 0:2])  # [N, B]
        start = 2 if type_id == int(T.Q4_0) else 4
        codes = _nibbles32(blocks[..., start:start + 16])  # [N, B, 32]
        s = d
        z = np.zeros_like(d) if type_id == int(T.Q4_0) else 8.0 * d + _fp16(blocks[..., 2:4])
    return (torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
            torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(n, k // GROUP)),
            torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32).reshape(n, k // GROUP)))


def affine_weights(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """(codes [N, K], s, z [N, K/32]) → float32 [N, K]: w = (q − 8)·s + z."""
    n, k = codes.shape
    q = codes.float().view(n, k // GROUP, GROUP) - 8.0  # [N, K/32, 32]
    return (q * s[..., None] + z[..., None]).view(n, k)

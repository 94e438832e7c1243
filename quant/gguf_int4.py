"""GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) → unsigned 4-bit codes with one affine pair per 32 weights.

Every weight of these types is w = (q − 8)·s + z for its code q ∈ 0..15 and its 32-weight group's pair
(s, z), which is the form torch's CPU int4 kernel takes (`_weight_int4pack_mm_for_cpu`):
  Q4_0  (32-blocks: d fp16, 16 bytes of codes)           w = d·(q − 8)        → s = d,    z = 0
  Q4_1  (32-blocks: d, m fp16, 16 bytes of codes)        w = d·q + m          → s = d,    z = 8d + m
  Q4_K  (256-blocks: d, dmin fp16, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of codes)
        sub-block j of 32:                              w = d·sc_j·q − dmin·m_j → s = d·sc_j, z = 8s − dmin·m_j
Wider codes are split into two 4-bit halves, each a (q − 8)·s + z form, laid side by side along K (the
product then takes [x, x] as its input: one kernel call, 9 bits a weight instead of float16's 16):
  Q5_0  w = d·(q − 16), q = 16h + l            → [l: s = d, z = 0]      [8 + (2h − 1): s = 8d, z = 0]
  Q5_1  w = d·q + m,    q = 16h + l            → [l: s = d, z = 8d + m] [8 + h: s = 16d, z = 0]
  Q8_0  w = d·q,        q = 16·hi + lo (hi ∈ −8..7) → [lo: s = d, z = 8d] [hi + 8: s = 16d, z = 0]
Byte layouts are llama.cpp's (ggml-quants.c `dequantize_row_q*`; the gguf package's reference
dequantizers agree). Raw bytes are numpy uint8 [rows, bytes per row]. Imports nothing of bonsai outside quant.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from quant.gguf_codec import row_blocks

GROUP = 32  # weights per (s, z) pair, for every type here
# type id → (weights per block, bytes per block)
INT4_TYPES = {int(T.Q4_0): (32, 18), int(T.Q4_1): (32, 20), int(T.Q4_K): (256, 144)}
WIDE_TYPES = {int(T.Q5_0): (32, 22), int(T.Q5_1): (32, 24), int(T.Q8_0): (32, 34)}  # two 4-bit halves
BLOCKS = {**INT4_TYPES, **WIDE_TYPES}


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


def _wide(blocks: np.ndarray, type_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0 / Q5_1 / Q8_0 blocks [N, B, bytes] → (codes [N, 2, B, 32], s [N, 2, B], z [N, 2, B]): the halves."""
    d = _fp16(blocks[..., 0:2])  # [N, B]
    zero = np.zeros_like(d)
    if type_id == int(T.Q8_0):
        q = blocks[..., 2:34].view(np.int8).astype(np.int16)  # [N, B, 32]
        hi = np.floor_divide(q, 16)  # −8..7
        codes = np.stack([q - 16 * hi, hi + 8]).astype(np.uint8)  # [2, N, B, 32]
        s, z = np.stack([d, 16.0 * d]), np.stack([8.0 * d, zero])
    else:
        start = 2 if type_id == int(T.Q5_0) else 4
        qh = np.ascontiguousarray(blocks[..., start:start + 4]).view(np.uint32)  # [N, B, 1]: bit i = weight i's
        h = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
        low = _nibbles32(blocks[..., start + 4:start + 20])  # [N, B, 32]
        if type_id == int(T.Q5_0):
            codes, s, z = np.stack([low, 7 + 2 * h]), np.stack([d, 8.0 * d]), np.stack([zero, zero])
        else:
            m = _fp16(blocks[..., 2:4])
            codes, s, z = np.stack([low, 8 + h]), np.stack([d, 16.0 * d]), np.stack([8.0 * d + m, zero])
    return codes.transpose(1, 0, 2, 3), s.transpose(1, 0, 2), z.transpose(1, 0, 2)


def decode_int4(raw: np.ndarray, type_id: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensor's rows → (codes uint8 [N, K'] in 0..15, s float32 [N, K'/32], z float32 [N, K'/32]) with
    w = (q − 8)·s + z; s is exact and z within one float32 rounding of the stored values. K' = K for the
    INT4_TYPES, 2K for the WIDE_TYPES (two halves side by side: w = half 1 + half 2, `dense_weights`)."""
    blocks = row_blocks(raw, type_id, k, *BLOCKS[type_id])  # [N, B, bytes]
    n = blocks.shape[0]
    if type_id in WIDE_TYPES:
        codes, s, z = _wide(blocks, type_id)  # [N, 2, B, 32], [N, 2, B] x2
        k *= 2
    elif type_id == int(T.Q4_K):
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


def widen(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-half tensor in the two-half form (a second half of zeros), to stack with wide ones."""
    return (torch.cat([codes, torch.full_like(codes, 8)], 1), torch.cat([s, torch.zeros_like(s)], 1),
            torch.cat([z, torch.zeros_like(z)], 1))


def dense_weights(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [N, K] of either form (the two halves summed)."""
    w = affine_weights(codes, s, z)  # [N, K']
    return w if w.shape[1] == k else w[:, :k] + w[:, k:]


def affine_weights(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """(codes [N, K], s, z [N, K/32]) → float32 [N, K]: w = (q − 8)·s + z."""
    n, k = codes.shape
    q = codes.float().view(n, k // GROUP, GROUP) - 8.0  # [N, K/32, 32]
    return (q * s[..., None] + z[..., None]).view(n, k)


def affine_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] (K a multiple of 32) → (codes uint8 [N, K], s, z float32 [N, K/32]) of this module's form,
    w ≈ (q − 8)·s + z: each 32-weight group's minimum and maximum are codes 0 and 15 (round to nearest)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)  # [N, K/32, 32]
    lo, hi = g.amin(-1), g.amax(-1)  # [N, K/32] each
    s = ((hi - lo) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)  # [N, K/32]
    q = ((g - lo[..., None]) / s[..., None]).round().clamp_(0, 15)  # [N, K/32, 32]
    return q.to(torch.uint8).view(n, k), s, lo + 8.0 * s

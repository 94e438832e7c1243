"""GGUF block matrices repacked, value for value, into the layouts of the CPU kernels in
quant/kernels/cpu_kquant.c (bytes described there): every weight keeps its stored code and scales, only the
order of the bytes changes so that one 64-byte load gives 64 or 128 neighbouring weights' codes.

  Q4_K → q4k (4.625 bits a weight: the 6-bit scales and mins stored as bytes)   Q6_K → q6k (6.5625 bits, as stored)
  (both with each 256-block's codes permuted into the kernel's order, NATURAL, and its activations to match)
  Q4_0 / Q4_1 → a4 (5 bits: fp16 d and m per 32)     Q5_0 / Q5_1 → a5 (6 bits: a4's nibbles, a plane of high bits)
  Q8_0 → a8 (9 bits: a byte a code, fp16 d and m)

An a4 / a5 / a8 matrix's width is padded to a multiple of 128 with zero codes and zero scales (the activations'
padding is zero too). `dequantize` reads a packed matrix back as float32 (the reference the kernels are tested
against; equal to gguf's own dequantization up to float32 rounding). Raw rows are numpy uint8 [N, bytes per row].
Imports nothing of bonsai outside quant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from quant.gguf_codec import row_blocks

FORMATS = {"q4k": 0, "q6k": 1, "a4": 2, "a8": 3, "a5": 4}  # kq_matmul's format ids
ACT_ORDER = {"q4k": 1, "q6k": 2, "a4": 0, "a8": 0, "a5": 0}  # the order kq_quantize gives a format's activations


def _natural(order: int) -> np.ndarray:
    """[256]: the natural index of the weight at each kernel position p = 64v + 4l + j (cpu_kquant.c)."""
    p = np.arange(256)
    v, lane, j = p >> 6, (p >> 2) & 15, p & 3
    return (lane & 7) * 32 + (2 * v + (lane >> 3)) * 4 + j if order == 1 else lane * 16 + v * 4 + j


NATURAL = {fmt: _natural(order) for fmt, order in ACT_ORDER.items() if order}  # kernel position → weight
# GGUF type → (its format here, weights per block, bytes per block)
PACKABLE = {int(T.Q4_K): ("q4k", 256, 144), int(T.Q6_K): ("q6k", 256, 210), int(T.Q4_0): ("a4", 32, 18),
            int(T.Q4_1): ("a4", 32, 20), int(T.Q5_0): ("a5", 32, 22), int(T.Q5_1): ("a5", 32, 24),
            int(T.Q8_0): ("a8", 32, 34)}
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Packed:
    """One matrix in a kernel layout: qs (codes), qh (Q6_K's high bits, else an empty array), meta (scales)."""
    fmt: str
    n: int
    k: int  # the matrix's width
    kp: int  # the width the kernel runs (k padded to the format's chunk)
    qs: np.ndarray  # uint8 [N, kp/2] (4-bit codes: the low 4 of a5's) or [N, kp] (a8)
    qh: np.ndarray  # uint8 [N, kp/4] (q6k), [N, kp/8] (a5: _high_plane) or [0]
    meta: np.ndarray  # uint8 [N, kp/256, 20 | 18] (q4k | q6k) or [N, kp/32, 4] (fp16 d, m)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.qh.nbytes + self.meta.nbytes


def padded_width(fmt: str, k: int) -> int:
    chunk = 256 if fmt in ("q4k", "q6k") else 128
    return -(-k // chunk) * chunk


def _fp16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [...] → [..., 2] uint8 (little-endian fp16)."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(*v.shape, 2)


def _nibble_pairs(codes: np.ndarray, half: int) -> np.ndarray:
    """codes [N, C·2·half] (values < 16) → bytes [N, C·half]: per chunk of 2·half, byte i = code i | code half+i."""
    c = codes.reshape(codes.shape[0], -1, 2, half)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1).astype(np.uint8)


def _q4k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K blocks [N, B, 144] → (codes [N, B·256] in natural order, meta [N, B, 20])."""
    n, nb = blocks.shape[:2]
    a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [N, B, 8]
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)  # [N, B, 8]
    qs = blocks[..., 16:144].reshape(n, nb, 4, 32)  # [N, B, chunk of 64 weights, 32 bytes]
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * 256)  # sub-block 2c low, 2c+1 high
    return codes, np.concatenate([blocks[..., 0:4], sc, mn], axis=-1)


def _q6k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks [N, B, 210] (ql 128, qh 64, int8 scales 16, fp16 d) → (codes 0..63 [N, B·256], meta [N, B, 18])."""
    n, nb = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(n, nb, 2, 2, 32)  # [.., half of 128 weights, l + 0 | l + 32, 32]
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)  # [.., half, 32]
    lo = np.stack([ql & 0x0F, ql >> 4], axis=3)  # [.., half, (low, high nibble), (l, l + 32), 32]
    shifts = np.array([[0, 2], [4, 6]], dtype=np.uint8).reshape(1, 1, 1, 2, 2, 1)
    hi = (qh[:, :, :, None] >> shifts) & 3  # [.., half, nibble, l | l + 32, 32]
    codes = (lo | (hi << 4)).reshape(n, nb * 256)  # weight 128h + 64·nibble + 32·(l+32) + l
    return codes, np.concatenate([blocks[..., 208:210], blocks[..., 192:208]], axis=-1)


def _affine(blocks: np.ndarray, type_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks [N, B, bytes] → (codes [N, B·32] unsigned, d, m float32 [N, B]): w = d·q + m."""
    n, nb = blocks.shape[:2]
    d = _fp16(blocks[..., 0:2])  # [N, B]
    if type_id == int(T.Q8_0):
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(n, -1), d, -128.0 * d
    start = 2 if type_id in (int(T.Q4_0), int(T.Q5_0)) else 4
    m = _fp16(blocks[..., 2:4]) if start == 4 else None
    if type_id in (int(T.Q4_0), int(T.Q4_1)):
        qs = blocks[..., start:start + 16]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, B, 32]
        return codes.reshape(n, -1), d, (-8.0 * d if m is None else m)
    qh = np.ascontiguousarray(blocks[..., start:start + 4]).view(np.uint32)  # [N, B, 1]: bit i = weight i's bit 4
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
    qs = blocks[..., start + 4:start + 20]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high << 4)  # [N, B, 32] in 0..31
    return codes.reshape(n, -1), d, (-16.0 * d if m is None else m)


def _high_plane(codes: np.ndarray) -> np.ndarray:
    """5-bit codes [N, Kp] → a5's plane [N, Kp/8]: per 128 weights 16 bytes, bit t of byte j = bit 4 of weight 16t + j
    (one vector shift per 32-block puts a block's bits at bit 4 of its code bytes: cpu_kquant_avx2.h)."""
    high = (codes >> 4).astype(np.uint8).reshape(codes.shape[0], -1, 8, 16)  # [N, C, t, j]
    plane = (high << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).sum(axis=2, dtype=np.uint8)  # [N, C, 16]
    return plane.reshape(codes.shape[0], -1)


def pack(raw: np.ndarray, type_id: int, k: int) -> Packed | None:
    """A GGUF matrix's raw rows → its kernel layout; None for a type (or values) the kernels do not take."""
    if type_id not in PACKABLE:
        return None
    fmt, block, size = PACKABLE[type_id]
    blocks = row_blocks(raw, type_id, k, block, size)  # [N, K/B, bytes]
    n, kp = blocks.shape[0], padded_width(fmt, k)
    if fmt == "q4k":
        codes, meta = _q4k(blocks)
        codes = codes.reshape(n, -1, 256)[..., NATURAL[fmt]].reshape(n, -1)  # [N, K] in kernel positions
        return Packed(fmt, n, k, kp, _nibble_pairs(codes, 64), np.zeros(0, np.uint8), np.ascontiguousarray(meta))
    if fmt == "q6k":
        codes, meta = _q6k(blocks)
        codes = codes.reshape(n, -1, 256)[..., NATURAL[fmt]].reshape(n, -1)  # [N, K] in kernel positions
        high = (codes >> 4).reshape(n, -1, 4, 64)  # [N, B, v, 64]: bits 4-5 of position 64v + i
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).astype(np.uint8)
        return Packed(fmt, n, k, kp, _nibble_pairs(codes & 0x0F, 64), qh.reshape(n, -1), np.ascontiguousarray(meta))
    codes, d, m = _affine(blocks, type_id)
    if not (np.isfinite(m).all() and np.abs(m).max(initial=0.0) <= _FP16_MAX):
        return None  # m = −128·d (Q8_0) or −16·d (Q5_0) out of fp16's range: not representable here
    pad = kp - k
    codes = np.pad(codes, ((0, 0), (0, pad)))  # [N, Kp]: zero codes
    d, m = (np.pad(v, ((0, 0), (0, pad // 32))) for v in (d, m))  # [N, Kp/32]: zero scales
    meta = np.concatenate([_fp16_bytes(d), _fp16_bytes(m)], axis=-1)  # [N, Kp/32, 4]
    qs = codes.astype(np.uint8) if fmt == "a8" else _nibble_pairs(codes & 0x0F, 64)
    qh = _high_plane(codes) if fmt == "a5" else np.zeros(0, np.uint8)  # [N, Kp/8]
    return Packed(fmt, n, k, kp, np.ascontiguousarray(qs), qh, np.ascontiguousarray(meta))


def from_affine(codes: np.ndarray, s: np.ndarray, z: np.ndarray) -> Packed:
    """4-bit codes [N, K] with w = (q − 8)·s + z per 32 (quant.gguf_int4.affine_rtn's form) → an a4 matrix
    (d = s, m = z − 8s, each rounded to fp16)."""
    n, k = codes.shape
    kp = padded_width("a4", k)
    codes = np.pad(codes.astype(np.uint8), ((0, 0), (0, kp - k)))  # [N, Kp]
    d, m = (np.pad(v.astype(np.float32), ((0, 0), (0, (kp - k) // 32))) for v in (s, z - 8.0 * s))  # [N, Kp/32]
    meta = np.concatenate([_fp16_bytes(d), _fp16_bytes(m)], axis=-1)  # [N, Kp/32, 4]
    return Packed("a4", n, k, kp, _nibble_pairs(codes, 64), np.zeros(0, np.uint8), np.ascontiguousarray(meta))


def unpack_codes(p: Packed) -> np.ndarray:
    """The codes of a packed matrix, [N, kp] uint8 in natural (weight) order."""
    if p.fmt == "a8":
        return p.qs
    q = p.qs.reshape(p.n, -1, 64)  # [N, chunk of 128, 64]
    codes = np.stack([q & 0x0F, q >> 4], axis=2).reshape(p.n, p.kp)  # byte i: weight i (low), 64 + i (high)
    if p.fmt == "a5":  # byte j of a chunk's 16, bit t → weight 16t + j
        bits = (p.qh.reshape(p.n, -1, 1, 16) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [N, C, t, j]
        codes = codes | (bits.reshape(p.n, p.kp) << 4)
    if p.fmt == "q6k":
        h = p.qh.reshape(p.n, -1, 1, 64)  # [N, B, 1, 64]
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
        codes = codes | ((((h >> shifts) & 3) << 4).reshape(p.n, p.kp))
    if p.fmt in NATURAL:  # kernel positions → natural order
        natural = np.empty_like(codes).reshape(p.n, -1, 256)
        natural[..., NATURAL[p.fmt]] = codes.reshape(p.n, -1, 256)
        codes = natural.reshape(p.n, p.kp)
    return codes


def dequantize(p: Packed) -> np.ndarray:
    """A packed matrix's weights, float32 [N, k]."""
    codes = unpack_codes(p).astype(np.float32)
    if p.fmt == "q4k":
        d, dmin = _fp16(p.meta[..., 0:2]), _fp16(p.meta[..., 2:4])  # [N, B]
        sc, mn = p.meta[..., 4:12].astype(np.float32), p.meta[..., 12:20].astype(np.float32)  # [N, B, 8]
        w = (d[..., None, None] * sc[..., None]) * codes.reshape(p.n, -1, 8, 32) - (dmin[..., None] * mn)[..., None]
    elif p.fmt == "q6k":
        d = _fp16(p.meta[..., 0:2])  # [N, B]
        sc = p.meta[..., 2:18].view(np.int8).astype(np.float32)  # [N, B, 16]
        w = (d[..., None, None] * sc[..., None]) * (codes.reshape(p.n, -1, 16, 16) - 32.0)
    else:
        d, m = _fp16(p.meta[..., 0:2]), _fp16(p.meta[..., 2:4])  # [N, Kp/32]
        w = d[..., None] * codes.reshape(p.n, -1, 32) + m[..., None]
    return np.ascontiguousarray(w.reshape(p.n, p.kp)[:, :p.k], dtype=np.float32)

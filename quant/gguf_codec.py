"""GGUF blocks ↔ codes and scales, byte for byte (layouts: shared/field-notes.md §1).

Import (no requantization): TQ2_0, TQ1_0 (ternary, 256-blocks), Q1_0 (1-bit, 128-blocks), Q2_0
(codes {-1, 0, 1, 2}, 64-blocks) and PrismML's PQ2_0 (Q2_0's block at 128) and PTQ1_0 (base-3 at 128,
d last) → codes int8 [N, K] and scales float32 [N, K/B]. The Prism layouts are their llama.cpp fork's
`dequantize_row_pq2_0` / `dequantize_row_ptq1_0` (shared/field-notes.md §13); upstream llama.cpp
reads neither, so nothing exports them.
Export: codes + group scales → TQ2_0, TQ1_0, Q1_0, Q2_0, Q4_0, Q8_0 blocks (`export_type` picks the
one that holds a tensor exactly: a block inside a group repeats its scale). When a block spans several
groups (group 128 into a 256-block) it gets one scale: the least-squares best for its fixed codes,
d = Σ c·ŵ / Σ c², and the weight error this costs is returned. Raw bytes are numpy uint8
[rows, bytes per row]; codes and scales are torch tensors. Imports nothing else of bonsai.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

Q2_0_ID = 42  # upstream llama.cpp; not in the gguf package's enum (0.19)
PQ2_0_ID, PTQ1_0_ID = 142, 143  # PrismML's llama.cpp fork (Ternary-Bonsai files)
NAMES = {Q2_0_ID: "Q2_0", PQ2_0_ID: "PQ2_0", PTQ1_0_ID: "PTQ1_0"}  # the ids the gguf package lacks
# (block size, bytes per block) of the types this module reads or writes
BLOCKS = {int(T.TQ2_0): (256, 66), int(T.TQ1_0): (256, 54), int(T.Q1_0): (128, 18), Q2_0_ID: (64, 18),
          PQ2_0_ID: (128, 34), PTQ1_0_ID: (128, 28), int(T.Q4_0): (32, 18), int(T.Q8_0): (32, 34)}
IMPORTABLE = {int(T.TQ2_0): "tri", int(T.TQ1_0): "tri-dense", int(T.Q1_0): "bin", Q2_0_ID: "q2_0",
              PQ2_0_ID: "q2_0", PTQ1_0_ID: "tri-dense"}
_SHIFTS2 = np.array([0, 2, 4, 6], dtype=np.uint8)
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _blocks(raw: np.ndarray, type_id: int, k: int) -> np.ndarray:
    return row_blocks(raw, type_id, k, *BLOCKS[type_id])


def row_blocks(raw: np.ndarray, type_id: int, k: int, block: int, size: int) -> np.ndarray:
    """Raw rows [N, bytes] of `k` weights in blocks of `block` weights and `size` bytes → [N, K/B, bytes]."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if k % block or raw.shape[-1] != k // block * size:
        raise ValueError(f"{raw.shape[-1]} bytes per row do not hold {k} weights of GGUF type {type_id}")
    return raw.reshape(raw.shape[0], k // block, size)  # [N, K/B, bytes]


def _fp16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _trits(b: np.ndarray, n: int) -> np.ndarray:
    """The first n base-3 digits of TQ1_0 bytes: trit i = ((uint8)(b * 3^i) * 3) >> 8, in 0..2."""
    prod = b[..., None] * _POW3[:n]  # uint8 arithmetic wraps, as in C
    return (prod.astype(np.uint16) * 3 >> 8).astype(np.int8)


def decode(raw: np.ndarray, type_id: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw blocks [N, bytes] of an importable type → codes int8 [N, K], scales float32 [N, K/B]."""
    b = _blocks(raw, type_id, k)
    rows, nb = b.shape[:2]
    if type_id == T.TQ2_0:  # qs[64], d: element e at byte 32*(e//128) + e%32, shift 2*((e%128)//32)
        qs = b[..., :64].reshape(rows, nb, 2, 1, 32) >> _SHIFTS2.reshape(4, 1)
        codes = (qs & 3).astype(np.int8).reshape(rows, nb * 256) - 1
        scales = _fp16(b[..., 64:66])
    elif type_id == T.TQ1_0:  # qs[48] (5 trits a byte), qh[4] (4 trits a byte), d
        first = _trits(b[..., :32], 5).transpose(0, 1, 3, 2).reshape(rows, nb, 160)  # element n*32 + j
        second = _trits(b[..., 32:48], 5).transpose(0, 1, 3, 2).reshape(rows, nb, 80)
        last = _trits(b[..., 48:52], 4).transpose(0, 1, 3, 2).reshape(rows, nb, 16)
        codes = np.concatenate([first, second, last], axis=-1).reshape(rows, nb * 256) - 1
        scales = _fp16(b[..., 52:54])
    elif type_id == T.Q1_0:  # d, qs[16]: element 8j+i at bit i of byte j; 1 → +d, 0 → -d
        bits = (b[..., 2:18, None] >> np.arange(8, dtype=np.uint8)) & 1
        codes = bits.astype(np.int8).reshape(rows, nb * 128) * 2 - 1
        scales = _fp16(b[..., 0:2])
    elif type_id in (Q2_0_ID, PQ2_0_ID):  # d, qs[B/4]: element 4j+i at bits 2i of byte j; 0..3 → -1, 0, 1, 2
        block = BLOCKS[type_id][0]
        q = (b[..., 2:2 + block // 4, None] >> _SHIFTS2) & 3
        codes = q.astype(np.int8).reshape(rows, nb * block) - 1
        scales = _fp16(b[..., 0:2])
    elif type_id == PTQ1_0_ID:  # qs[24] (5 trits a byte: 16 bytes, then 8), qh[2] (4 trits a byte), d
        first = _trits(b[..., :16], 5).transpose(0, 1, 3, 2).reshape(rows, nb, 80)  # element n*16 + j
        second = _trits(b[..., 16:24], 5).transpose(0, 1, 3, 2).reshape(rows, nb, 40)  # 80 + n*8 + j
        last = _trits(b[..., 24:26], 4).transpose(0, 1, 3, 2).reshape(rows, nb, 8)  # 120 + n*2 + j
        codes = np.concatenate([first, second, last], axis=-1).reshape(rows, nb * 128) - 1
        scales = _fp16(b[..., 26:28])
    else:
        raise ValueError(f"GGUF type {type_id} is not a ternary / 1-bit type")
    return torch.from_numpy(np.ascontiguousarray(codes)), scales


def block_scales(codes: torch.Tensor, scales: torch.Tensor, group_size: int, block: int
                 ) -> tuple[torch.Tensor, float, float]:
    """One float16 scale per block of `block` weights for fixed codes; (scales float32 [N, K/B],
    Σ squared weight error, Σ squared weight). Exact when the group size is a multiple of the block."""
    n, k = codes.shape
    c = codes.float()
    target = (c.reshape(n, k // group_size, group_size) * scales.float()[..., None]).reshape(n, k)  # [N, K]
    if group_size % block == 0:
        d = scales.float().repeat_interleave(group_size // block, dim=1)  # [N, K/B]
    else:
        cb, tb = c.reshape(n, k // block, block), target.reshape(n, k // block, block)
        num, den = (cb * tb).sum(-1), (cb * cb).sum(-1)
        d = torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num))
    d = d.to(torch.float16).float()
    back = (c.reshape(n, k // block, block) * d[..., None]).reshape(n, k)
    return d, float((back - target).pow(2).sum()), float(target.pow(2).sum())


def _fp16_bytes(d: torch.Tensor) -> np.ndarray:
    return d.to(torch.float16).numpy().view(np.uint8).reshape(*d.shape, 2)


def encode(codes: torch.Tensor, scales: torch.Tensor, group_size: int, type_id: int
           ) -> tuple[np.ndarray, float, float]:
    """Codes int8 [N, K] + group scales [N, K/G] → raw blocks uint8 [N, bytes per row] of type_id,
    with (Σ squared error, Σ squared weight) of the export against codes * scales."""
    block, size = BLOCKS[type_id]
    n, k = codes.shape
    if k % block:
        raise ValueError(f"a row of {k} weights does not split into {block}-blocks")
    d, err, ref = block_scales(codes, scales, group_size, block)
    c = codes.numpy().astype(np.int16).reshape(n, k // block, block)
    if type_id == T.TQ2_0:
        q = (c + 1).astype(np.uint8).reshape(n, -1, 2, 4, 32) << _SHIFTS2.reshape(4, 1)
        body = np.bitwise_or.reduce(q, axis=-2).reshape(n, -1, 64)
        out = np.concatenate([body, _fp16_bytes(d)], axis=-1)
    elif type_id == T.TQ1_0:
        t = (c + 1).astype(np.uint16)
        parts = [t[..., :160].reshape(n, -1, 5, 32), t[..., 160:240].reshape(n, -1, 5, 16),
                 np.concatenate([t[..., 240:].reshape(n, -1, 4, 4), np.zeros((n, k // 256, 1, 4), np.uint16)], -2)]
        weights = np.array([81, 27, 9, 3, 1], dtype=np.uint16).reshape(5, 1)
        q = np.concatenate([(p * weights).sum(-2) for p in parts], axis=-1)  # [N, K/256, 52]
        body = ((q * 256 + 242) // 243).astype(np.uint8)
        out = np.concatenate([body, _fp16_bytes(d)], axis=-1)
    elif type_id in (Q2_0_ID, PQ2_0_ID):  # d, qs[B/4]: element 4j+i at bits 2i of byte j, code + 1
        q = (c + 1).astype(np.uint8).reshape(n, -1, block // 4, 4) << _SHIFTS2
        out = np.concatenate([_fp16_bytes(d), np.bitwise_or.reduce(q, axis=-1)], axis=-1)
    elif type_id == PTQ1_0_ID:
        t = (c + 1).astype(np.uint16)
        parts = [t[..., :80].reshape(n, -1, 5, 16), t[..., 80:120].reshape(n, -1, 5, 8),
                 np.concatenate([t[..., 120:].reshape(n, -1, 4, 2), np.zeros((n, k // 128, 1, 2), np.uint16)], -2)]
        weights = np.array([81, 27, 9, 3, 1], dtype=np.uint16).reshape(5, 1)
        q = np.concatenate([(p * weights).sum(-2) for p in parts], axis=-1)  # [N, K/128, 26]
        out = np.concatenate([((q * 256 + 242) // 243).astype(np.uint8), _fp16_bytes(d)], axis=-1)
    elif type_id == T.Q1_0:
        bits = (c > 0).astype(np.uint8).reshape(n, -1, 16, 8) << np.arange(8, dtype=np.uint8)
        out = np.concatenate([_fp16_bytes(d), np.bitwise_or.reduce(bits, axis=-1)], axis=-1)
    elif type_id == T.Q4_0:  # d, qs[16]: byte j = (c_j + 8) | (c_{j+16} + 8) << 4
        q = (c + 8).astype(np.uint8)
        out = np.concatenate([_fp16_bytes(d), q[..., :16] | (q[..., 16:] << 4)], axis=-1)
    elif type_id == T.Q8_0:
        out = np.concatenate([_fp16_bytes(d), c.astype(np.int8).view(np.uint8)], axis=-1)
    else:
        raise ValueError(f"cannot export to GGUF type {type_id}")
    assert out.shape[-1] == size
    return np.ascontiguousarray(out.reshape(n, -1)), err, ref


# the types that hold each grid's codes exactly, fewest bits first; one holds a tensor losslessly when its
# block divides the group size (each group scale written once per block: repeated, never merged)
EXACT_TARGETS = {"tri": (int(T.TQ2_0), Q2_0_ID, int(T.Q4_0)), "tri-dense": (int(T.TQ1_0), int(T.TQ2_0), Q2_0_ID, int(T.Q4_0)),
                 "bin": (int(T.Q1_0), int(T.Q4_0)), "int4": (int(T.Q4_0),), "int8": (int(T.Q8_0),)}


def export_type(quant_type: str, k: int, group_size: int) -> tuple[int, bool]:
    """(GGUF type, exact) for a tensor of quant_type, input dimension k and group size: the fewest-bit
    type that holds its codes and scales exactly (tri g64/g128 → Q2_0, tri g256 → TQ2_0, bin g128 →
    Q1_0, int4 → Q4_0, int8 → Q8_0, any of them → Q4_0 / Q8_0 at group 32); where none does, the first
    whose blocks split the row (scales merged, `block_scales`) or F16 of the weights, not exact."""
    candidates = EXACT_TARGETS.get(quant_type, ())
    for type_id in candidates:
        block = BLOCKS[type_id][0]
        if group_size % block == 0 and k % block == 0:
            return type_id, True
    for type_id in candidates:
        if k % BLOCKS[type_id][0] == 0:
            return type_id, False
    return int(T.F16), False

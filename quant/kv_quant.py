"""Quantize and dequantize KV-cache rows in the formats of quant/kv_format.py (the torch reference).

A row is the last dimension of a tensor (one key or value vector of `head_dim` elements). The
stored parts of a row, by element format:
- "float": {"": the values} in the cache's float dtype.
- "int8": {"": codes int8 [.., D], "scale": float16 [.., 1]}; x ≈ code · scale, scale = max|x| / 127.
- "int4": {"": two codes per byte uint8 [.., D/2] (low nibble first), "scale", "min": float16
  [.., D/32]}; per group of 32 elements x ≈ code · scale + min, code in 0..15.
The maths is done in float32 on the row's values; the Triton kernels that quantize on write
(engine/kernels/rope_cache.py) and dequantize on read (engine/kernels/attention_decode.py) follow
these functions operation by operation: scales are rounded to float16 first and the codes are
computed from the rounded scale (so a row dequantizes to within half a step of its value), and a
code is floor(y + 0.5) of y = x / scale computed as x · (1 / scale).
"""
from __future__ import annotations

import torch

from quant.kv_format import INT4_GROUP

FLOAT16_MAX = 65504.0


def row_parts(element: str, head_dim: int, float_dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
    """The stored parts of one row: {part name: (elements per row, dtype)}; "" is the codes (or values)."""
    if element == "float":
        return {"": (head_dim, float_dtype)}
    if element == "int8":
        return {"": (head_dim, torch.int8), "scale": (1, torch.float16)}
    if element == "int4":
        if head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {head_dim}")
        groups = head_dim // INT4_GROUP
        return {"": (head_dim // 2, torch.uint8), "scale": (groups, torch.float16), "min": (groups, torch.float16)}
    raise ValueError(f"unknown KV element format {element!r}")


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., D] → (codes int8 [.., D], scale float16 [.., 1]), symmetric per row."""
    y = x.float()
    scale = (y.abs().amax(-1, keepdim=True) / 127.0).clamp(max=FLOAT16_MAX).half()  # [.., 1]
    codes = torch.floor(y * _inverse(scale.float()) + 0.5).clamp(-127, 127)  # [.., D]
    return codes.to(torch.int8), scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 [.., D], scale [.., 1] → values [.., D] in dtype."""
    return (codes.float() * scale.float()).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes in 0..15 [.., D] (D even) → uint8 [.., D/2]: element 2j in the low nibble, 2j+1 in the high."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., D/2] → codes uint8 [.., D] (inverse of pack_nibbles)."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)  # [.., D/2, 2] → [.., D]


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [.., D] → (packed uint8 [.., D/2], scale float16 [.., D/32], min float16 [.., D/32]),
    asymmetric per group of 32. The scale spans from the float16-rounded minimum to the maximum."""
    d = x.shape[-1]
    assert d % INT4_GROUP == 0, d
    y = x.float().unflatten(-1, (d // INT4_GROUP, INT4_GROUP))  # [.., G, 32]
    minimum = y.amin(-1).clamp(-FLOAT16_MAX, FLOAT16_MAX).half()  # [.., G]
    top = y.amax(-1)  # [.., G]
    scale = ((top - minimum.float()) / 15.0).clamp(max=FLOAT16_MAX).half()  # [.., G]
    codes = torch.floor((y - minimum.float()[..., None]) * _inverse(scale.float())[..., None] + 0.5)
    codes = codes.clamp(0, 15).flatten(-2)  # [.., D]
    return pack_nibbles(codes), scale, minimum


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [.., D/2], scale and min [.., D/32] → values [.., D] in dtype."""
    codes = unpack_nibbles(packed).float()  # [.., D]
    groups = codes.unflatten(-1, (scale.shape[-1], INT4_GROUP))  # [.., G, 32]
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).flatten(-2).to(dtype)


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """x [.., D] (D a power of two) → x·H in float32, H the orthonormal Sylvester Hadamard matrix
    (symmetric, H·H = I). Butterflies (a + b, a − b) on pairs (i, i + h) for h = D/2, D/4, .., 1, then
    × D^-1/2: the order of operations of the Triton kernels (engine/kernels/rope_cache.py), so both
    give the same float32 bits."""
    d = x.shape[-1]
    assert d > 0 and d & (d - 1) == 0, f"the Hadamard rotation needs a power-of-two head_dim, got {d}"
    y = x.float()
    h = d // 2
    while h >= 1:
        pairs = y.unflatten(-1, (d // (2 * h), 2, h))  # [.., D/2h, 2, h]
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)  # [.., D]
        h //= 2
    return y * d ** -0.5


def transform_keys(k: torch.Tensor, offset: torch.Tensor | None, rotate: bool) -> torch.Tensor:
    """Keys [.., D] as a quantized cache stores them, in float32: (k − offset), then ·H if rotate.
    Attention is unchanged when queries get the same rotation (`transform_queries`): every score of a
    query shifts by the same q·offset, and (qH)·(kH) = q·k."""
    y = k.float()
    if offset is not None:
        y = y - offset.float()
    return hadamard_rows(y) if rotate else y


def transform_queries(q: torch.Tensor, rotate: bool) -> torch.Tensor:
    """Queries [.., D] in the space of keys stored by `transform_keys` (q·H if rotate), in q's dtype."""
    return hadamard_rows(q).to(q.dtype) if rotate else q


def quantize_rows(element: str, x: torch.Tensor, float_dtype: torch.dtype,
                  offset: torch.Tensor | None = None, rotate: bool = False) -> dict[str, torch.Tensor]:
    """x [.., D] → the stored parts of its rows (names as in row_parts). The rows are first rounded
    to float_dtype: a quantized cache quantizes the values a float cache would hold. offset
    (float32, broadcast to x): subtracted in float32 before quantizing (see KVCache.key_offset);
    rotate: then rotated by the Hadamard matrix (`transform_keys`)."""
    x = x.to(float_dtype)
    if element == "float":
        assert offset is None and not rotate, "a float cache stores its rows as they are"
        return {"": x}
    if offset is not None or rotate:
        x = transform_keys(x, offset, rotate)
    if element == "int8":
        codes, scale = quantize_int8(x)
        return {"": codes, "scale": scale}
    if element == "int4":
        packed, scale, minimum = quantize_int4(x)
        return {"": packed, "scale": scale, "min": minimum}
    raise ValueError(f"unknown KV element format {element!r}")


def dequantize_rows(element: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The stored parts of rows → values [.., D] in dtype."""
    if element == "float":
        return parts[""].to(dtype)
    if element == "int8":
        return dequantize_int8(parts[""], parts["scale"], dtype)
    if element == "int4":
        return dequantize_int4(parts[""], parts["scale"], parts["min"], dtype)
    raise ValueError(f"unknown KV element format {element!r}")

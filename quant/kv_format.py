"""KV-cache element types: what one cached key or value row costs and how it is stored.

The contract between the KV cache (engine/runtime/kv_cache.py), the attention kernels and the memory
plan. Per (layer, slot, kv_head, position) a key row and a value row of `head_dim` elements:
- bf16 / f16 / f32: the values themselves (the model's dtype).
- int8: symmetric, one float16 scale per row (scale = max|x| / 127, x ≈ q · scale).
- int4: asymmetric per group of `INT4_GROUP` elements along head_dim, two codes per byte (low
  nibble first), a float16 scale and a float16 minimum per group (x ≈ q · scale + min, q in 0..15).
- k8v4: keys as int8, values as int4 (keys decide which positions matter: they keep more bits).
What is quantized is a transformed row (engine/runtime/kv_cache.py, quant/kv_quant.py): quantized keys minus a
calibrated mean key, rotated by the orthonormal Hadamard matrix over head_dim (queries are rotated alike
when they read them); the formats above do not change.
"""
from __future__ import annotations

from dataclasses import dataclass

INT4_GROUP = 32  # elements per int4 group along head_dim
SCALE_BYTES = 2  # float16 scales and minima


@dataclass(frozen=True)
class KVType:
    name: str
    key: str  # element format of keys: "float", "int8" or "int4"
    value: str  # element format of values

    @property
    def quantized(self) -> bool:
        return self.key != "float" or self.value != "float"


KV_TYPES: dict[str, KVType] = {
    "bf16": KVType("bf16", "float", "float"),
    "int8": KVType("int8", "int8", "int8"),
    "int4": KVType("int4", "int4", "int4"),
    "k8v4": KVType("k8v4", "int8", "int4"),
}


def row_bytes(element: str, head_dim: int, float_bytes: int = 2) -> int:
    """Bytes one cached row of `head_dim` elements takes in the given element format, scales included."""
    if element == "float":
        return head_dim * float_bytes
    if element == "int8":
        return head_dim + SCALE_BYTES
    if element == "int4":
        if head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {head_dim}")
        return head_dim // 2 + 2 * SCALE_BYTES * (head_dim // INT4_GROUP)
    raise ValueError(f"unknown KV element format {element!r}")


def kv_bytes_per_token(kv_type: KVType, num_layers: int, num_kv_heads: int, head_dim: int,
                       float_bytes: int = 2) -> int:
    """Bytes the cache holds per token of one sequence: keys and values of every layer and KV head."""
    per_head = row_bytes(kv_type.key, head_dim, float_bytes) + row_bytes(kv_type.value, head_dim, float_bytes)
    return num_layers * num_kv_heads * per_head

"""Decoding of GGUF tensor types into float tensors.

The byte layouts are llama.cpp's (see shared/field-notes.md §1); decoding is done by the `gguf`
package's reference dequantizers, which are exact. This module imports nothing else of bonsai.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf import quants as gguf_quants

# Types a GGUF may hold that we decode (dequantized on load; native packed execution is separate).
DECODABLE_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0,
})


class UnsupportedTensorType(ValueError):
    """A tensor type this version cannot decode."""


def bits_per_weight(type_id: int) -> float:
    """Storage bits per weight of a GGUF type (block bytes * 8 / block size)."""
    block, nbytes = GGML_QUANT_SIZES[T(type_id)]
    return nbytes * 8 / block


def type_name(type_id: int) -> str:
    try:
        return T(type_id).name
    except ValueError:
        return f"type#{type_id}"


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one tensor's raw bytes (uint8, [rows, bytes per row]) into float32 of `shape`."""
    qtype = T(type_id)
    if qtype not in DECODABLE_TYPES:
        raise UnsupportedTensorType(f"GGUF tensor type {qtype.name} is not supported "
                                    f"(supported: {', '.join(sorted(t.name for t in DECODABLE_TYPES))})")
    raw = np.asarray(raw, dtype=np.uint8)
    if qtype == T.F32:
        values = raw.view(np.float32)
    elif qtype == T.F16:
        values = raw.view(np.float16)
    else:
        values = gguf_quants.dequantize(raw, qtype)
    if not values.flags.writeable:  # a view of a memory-mapped file: copy out of it
        values = values.copy()
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if tensor.dtype != torch.float32:
        tensor = tensor.float()
    return tensor.reshape(shape)

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

from quant import gguf_codec

# Types a GGUF may hold that we decode (dequantized on load; native packed execution is separate).
DECODABLE_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0, T.Q1_0,
})
# decoded by quant.gguf_codec (the gguf package has no dequantizer for them); Q2_0 is not in its enum
CODEC_TYPES: frozenset[int] = frozenset({int(T.Q1_0), gguf_codec.Q2_0_ID, gguf_codec.PQ2_0_ID, gguf_codec.PTQ1_0_ID})


_CHUNK_BYTES = 1 << 20


class UnsupportedTensorType(ValueError):
    """A tensor type this version cannot decode."""


def bits_per_weight(type_id: int) -> float:
    """Storage bits per weight of a GGUF type (block bytes * 8 / block size)."""
    block, nbytes = block_size(type_id)
    return nbytes * 8 / block


def block_size(type_id: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type, including Q2_0 which the gguf package lacks."""
    if type_id in gguf_codec.BLOCKS:
        return gguf_codec.BLOCKS[type_id]
    return GGML_QUANT_SIZES[T(type_id)]


def type_name(type_id: int) -> str:
    if type_id in gguf_codec.NAMES:
        return gguf_codec.NAMES[type_id]
    try:
        return T(type_id).name
    except ValueError:
        return f"type#{type_id}"


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one tensor's raw bytes (uint8, [rows, bytes per row]) into float32 of `shape`."""
    if type_id in CODEC_TYPES:
        codes, scales = gguf_codec.decode(np.asarray(raw).reshape(-1, np.asarray(raw).shape[-1]), type_id, shape[-1])
        group = shape[-1] // scales.shape[-1]
        return (codes.float().reshape(codes.shape[0], -1, group) * scales[..., None]).reshape(shape)
    qtype = T(type_id)
    if qtype not in DECODABLE_TYPES:
        raise UnsupportedTensorType(f"GGUF tensor type {qtype.name} is not supported "
                                    f"(supported: {', '.join(sorted(t.name for t in DECODABLE_TYPES))})")
    raw = np.asarray(raw, dtype=np.uint8)
    if qtype == T.F32:
        values = raw.view(np.float32)
    elif qtype == T.F16:
        values = raw.view(np.float16)
    else:  # in row chunks: the reference dequantizers make several temporaries of their input's size
        values = np.empty((raw.shape[0], int(np.prod(shape)) // max(raw.shape[0], 1)), dtype=np.float32)
        step = max(1, _CHUNK_BYTES // max(raw.shape[-1], 1))
        for start in range(0, raw.shape[0], step):
            values[start:start + step] = gguf_quants.dequantize(raw[start:start + step], qtype)
    if not values.flags.writeable:  # a view of a memory-mapped file: copy out of it
        values = values.copy()
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if tensor.dtype != torch.float32:
        tensor = tensor.float()
    return tensor.reshape(shape)

"""How the KV kernels see one layer of a (possibly quantized) cache, and its torch references.

A layer's keys (and values) are a code tensor [slots, KV, S, X] plus, when quantized, float16 scale
(and min) tensors [slots, KV, S, G] (engine/runtime/kv_cache.py, quant/kv_format.py). The element format
follows from the code tensor's dtype: a float dtype holds the values, int8 the int8 codes (one
scale per row), uint8 two int4 codes per byte (scale and min per group of 32). No triton here.
"""
from __future__ import annotations

import torch

from engine.kernels import UnsupportedKernelShape
from quant.kv_format import INT4_GROUP
from quant.kv_quant import dequantize_rows, quantize_rows

FLOAT, INT8, INT4 = 0, 1, 2  # the kernels' constexpr codes of the element formats
ELEMENTS = {FLOAT: "float", INT8: "int8", INT4: "int4"}


def cache_format(name: str, codes: torch.Tensor, scale: torch.Tensor | None, minimum: torch.Tensor | None,
                 head_dim: int) -> int:
    """FLOAT, INT8 or INT4 for a layer's code tensor [slots, KV, S, X] and its scale/min tensors;
    UnsupportedKernelShape (a ValueError) when they do not form one of the formats."""
    lead = tuple(codes.shape[:3]) if codes.dim() == 4 else None
    if codes.dtype == torch.int8:
        fmt, width, groups = INT8, head_dim, 1
    elif codes.dtype == torch.uint8:
        fmt, width, groups = INT4, head_dim // 2, head_dim // INT4_GROUP
        if head_dim % (2 * INT4_GROUP):  # the write kernel quantizes each rotary half by whole groups
            raise UnsupportedKernelShape(f"int4 {name} cache needs head_dim a multiple of {2 * INT4_GROUP}; "
                                         f"got {head_dim}")
    else:
        if scale is not None or minimum is not None:
            raise UnsupportedKernelShape(f"a float {name} cache takes no scale or min tensors")
        return FLOAT
    if lead is None or codes.shape[3] != width or codes.stride(3) != 1:
        raise UnsupportedKernelShape(f"{ELEMENTS[fmt]} {name} cache needs codes [slots, KV, S, {width}] with a "
                                     f"contiguous last dim; got {tuple(codes.shape)}")
    wanted = {"scale": scale} if fmt == INT8 else {"scale": scale, "min": minimum}
    if fmt == INT8 and minimum is not None:
        raise UnsupportedKernelShape(f"an int8 {name} cache takes no min tensor")
    for part, t in wanted.items():
        if t is None or tuple(t.shape) != (*lead, groups) or t.dtype != torch.float16 or t.stride(3) != 1:
            got = "none" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise UnsupportedKernelShape(f"{ELEMENTS[fmt]} {name} cache needs {name}_{part} float16 "
                                         f"{(*lead, groups)}; got {got}")
    if minimum is not None and minimum.stride() != scale.stride():
        raise UnsupportedKernelShape(f"{name}_scale and {name}_min must have the same strides")
    return fmt


def scale_strides(fmt: int, scale: torch.Tensor | None) -> tuple[int, int, int]:
    """Slot, head and position strides of a scale tensor (zeros for a float cache)."""
    return (0, 0, 0) if fmt == FLOAT else tuple(scale.stride()[:3])


def dequantize_layer(codes: torch.Tensor, scale: torch.Tensor | None, minimum: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """Rows of a layer's cache (any leading index) in dtype [.., D]: the torch reference of what the
    attention kernel dequantizes in registers."""
    element = "int8" if codes.dtype == torch.int8 else "int4" if codes.dtype == torch.uint8 else "float"
    return dequantize_rows(element, {"": codes, "scale": scale, "min": minimum}, dtype)


def write_rows(codes: torch.Tensor, scale: torch.Tensor | None, minimum: torch.Tensor | None,
               index: tuple, rows: torch.Tensor, dtype: torch.dtype, offset: torch.Tensor | None = None,
               rotate: bool = False) -> None:
    """Quantize rows [.., D] (rounded to dtype first, minus offset broadcast to them, rotated by the
    Hadamard matrix if rotate) into a layer's cache at index (slots, heads, positions): the torch
    reference of the write kernel."""
    element = "int8" if codes.dtype == torch.int8 else "int4" if codes.dtype == torch.uint8 else "float"
    if element == "float":
        codes.index_put_(index, rows.to(dtype).to(codes.dtype))
        return
    parts = quantize_rows(element, rows.to(dtype), dtype, offset, rotate)
    for part, target in (("", codes), ("scale", scale), ("min", minimum)):
        if part in parts:
            target.index_put_(index, parts[part])

"""Quantized weight formats: what a tensor's quant type means, how it is rounded and stored.

A quantized weight w [N, K] is integer codes [N, K] and one scale per group of `group_size` inputs
[N, K/G]; value = code * scale of its group. Storage per type (scales always float16 [N, K/G]):
  tri        codes {-1, 0, 1}, 2 bits each, four per byte (quant.packing.pack_ternary)
  tri-dense  codes {-1, 0, 1}, base 3, five per byte (1.6 bits; TQ1_0's byte code, see below)
  bin        codes {-1, 1}, 1 bit each, eight per byte (quant.packing.pack_binary)
  int4       codes [-7, 7], 4 bits each, two per byte (quant.packing.pack_int4)
  int8       codes [-127, 127] stored as int8
  bf16       no codes: the float weight itself, stored bfloat16
This module imports nothing else of bonsai.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quant import grids, packing

QUANT_TYPES = ("tri", "tri-dense", "bin", "int4", "int8", "bf16")
CODE_BITS = {"tri": 2.0, "tri-dense": 1.6, "bin": 1.0, "int4": 4.0, "int8": 8.0, "bf16": 16.0}
CODE_RANGE = {"tri": (-1, 1), "tri-dense": (-1, 1), "bin": (-1, 1), "int4": (-7, 7), "int8": (-127, 127)}
# codes per storage byte: the group size must be a multiple, so every row packs into whole bytes
_PER_BYTE = {"tri": 4, "bin": 8, "int4": 2}
BITS_TO_TYPE = {1: "bin", 2: "tri", 4: "int4", 8: "int8", 16: "bf16"}
SCALE_BITS = 16
_CHUNK_ELEMENTS = 1 << 18  # rows are rounded in chunks of about this many weights (bounded memory)


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized: its type and the group size along the input dimension."""
    quant_type: str
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"unknown quant type '{self.quant_type}': use one of {', '.join(QUANT_TYPES)}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group size must be a positive integer, not {self.group_size!r}")
        per_byte = _PER_BYTE.get(self.quant_type, 1)
        if self.group_size % per_byte:
            raise ValueError(f"group size {self.group_size} of a {self.quant_type} tensor must be a multiple "
                             f"of {per_byte} (codes per byte)")

    @property
    def is_float(self) -> bool:
        return self.quant_type == "bf16"

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight: code bits plus the float16 scale spread over its group."""
        if self.is_float:
            return 16.0
        return CODE_BITS[self.quant_type] + SCALE_BITS / self.group_size

    @staticmethod
    def from_bits(bits: int, group_size: int) -> "QuantSpec":
        """--embed-bits / --sensitive-bits N as a spec: 1 bin, 2 tri, 4 int4, 8 int8, 16 bf16."""
        if bits not in BITS_TO_TYPE:
            raise ValueError(f"{bits} bits is not a format: use one of {', '.join(map(str, BITS_TO_TYPE))}")
        return QuantSpec(BITS_TO_TYPE[bits], group_size)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """ValueError if a weight of this shape cannot be stored in this format."""
        if self.is_float:
            return
        if len(shape) != 2:
            raise ValueError(f"only 2-D weights are quantized, not shape {tuple(shape)}")
        if shape[1] % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide the input dimension {shape[1]}")


def quantize_rtn(spec: QuantSpec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round w [N, K] to the nearest point of spec's grid: codes int8 [N, K], scales float32 [N, K/G].

    Scales are rounded through float16 (as they are stored), so dequantize(codes, scales) is exactly
    what a reader of the checkpoint gets. Rows are processed in chunks to bound memory.
    """
    assert not spec.is_float, "bf16 tensors are not rounded"
    spec.check_shape(tuple(w.shape))
    rounders = {"tri": grids.ternary_rtn, "tri-dense": grids.ternary_rtn, "bin": grids.binary_rtn,
                "int4": lambda x, g: grids.int_rtn(x, 4, g), "int8": lambda x, g: grids.int_rtn(x, 8, g)}
    rows = max(1, _CHUNK_ELEMENTS // max(w.shape[1], 1))
    codes, scales = [], []
    for start in range(0, w.shape[0], rows):
        c, s = rounders[spec.quant_type](w[start:start + rows], spec.group_size)  # [n, K], [n, K/G]
        codes.append(c)
        scales.append(s)
    return torch.cat(codes), fp16_scales(torch.cat(scales))


def fp16_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales as float32 values that float16 represents exactly (how they are stored)."""
    half = scales.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError("a group scale does not fit float16 (weights above 65504 in magnitude)")
    return half.float()


def relative_error(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[float, float]:
    """(Σ (w - ŵ)², Σ w²) for ŵ = dequantized codes: the two sums of a relative Frobenius error."""
    rows = max(1, _CHUNK_ELEMENTS // max(w.shape[1], 1))
    err = ref = 0.0
    for start in range(0, w.shape[0], rows):
        part = w[start:start + rows].float()  # [n, K]
        diff = grids.dequantize(codes[start:start + rows], scales[start:start + rows], group_size) - part
        err += float(diff.pow(2).sum(dtype=torch.float64))
        ref += float(part.pow(2).sum(dtype=torch.float64))
    return err, ref


def rounding_error(w: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(Σ (w - w.to(dtype))², Σ w²): the error of storing float weights in a narrower float type."""
    flat = w.reshape(w.shape[0], -1) if w.dim() > 1 else w.reshape(1, -1)
    rows = max(1, _CHUNK_ELEMENTS // max(flat.shape[1], 1))
    err = ref = 0.0
    for start in range(0, flat.shape[0], rows):
        part = flat[start:start + rows].float()
        err += float((part.to(dtype).float() - part).pow(2).sum(dtype=torch.float64))
        ref += float(part.pow(2).sum(dtype=torch.float64))
    return err, ref


# ---- tri-dense: five trits per byte, TQ1_0's byte code ----
# q = Σ t_i 3^(4-i) (t = code + 1, first trit most significant), stored byte = ceil(q * 256 / 243), so
# trit n is ((uint8)(byte * 3^n) * 3) >> 8: decoding needs only multiplications and shifts.
_POW3 = torch.tensor([81, 27, 9, 3, 1], dtype=torch.int32)


def pack_ternary_dense(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in {-1, 0, 1} [.., K] → uint8 [.., ceil(K/5)] (a partial last byte is padded with 0s)."""
    k = codes.shape[-1]
    pad = (-k) % 5
    t = codes.to(torch.int32) + 1
    if pad:
        t = torch.cat([t, torch.ones(*t.shape[:-1], pad, dtype=torch.int32, device=t.device)], dim=-1)
    q = (t.reshape(*t.shape[:-1], -1, 5) * _POW3.to(t.device)).sum(-1)  # [.., ceil(K/5)] in 0..242
    return ((q * 256 + 242) // 243).to(torch.uint8)


def unpack_ternary_dense(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [.., ceil(K/5)] → int8 codes [.., K]."""
    mult = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=packed.device)
    b = ((packed.to(torch.int32)[..., None] * mult) & 0xFF) * 3 >> 8  # [.., ceil(K/5), 5] in 0..2
    return (b - 1).reshape(*packed.shape[:-1], -1)[..., :k].to(torch.int8)


# ---- storage encode / decode ----

def encode(spec: QuantSpec, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [N, K], scales [N, K/G] → (stored codes, float16 scales [N, K/G])."""
    assert not spec.is_float
    n, k = codes.shape
    spec.check_shape((n, k))
    if tuple(scales.shape) != (n, k // spec.group_size):
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes {tuple(codes.shape)} "
                         f"with group size {spec.group_size}")
    lo, hi = CODE_RANGE[spec.quant_type]
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi or
                          (spec.quant_type == "bin" and bool((codes == 0).any()))):
        raise ValueError(f"codes outside the {spec.quant_type} grid")
    codes = codes.to(torch.int8).cpu()
    packers = {"tri": packing.pack_ternary, "tri-dense": pack_ternary_dense, "bin": packing.pack_binary,
               "int4": packing.pack_int4, "int8": lambda c: c.contiguous()}
    return packers[spec.quant_type](codes), fp16_scales(scales.cpu()).to(torch.float16)


def decode(spec: QuantSpec, stored_codes: torch.Tensor, stored_scales: torch.Tensor,
           shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of encode: (codes int8 [N, K], scales float32 [N, K/G])."""
    n, k = shape
    unpackers = {"tri": packing.unpack_ternary, "tri-dense": lambda p: unpack_ternary_dense(p, k),
                 "bin": packing.unpack_binary, "int4": packing.unpack_int4, "int8": lambda c: c.to(torch.int8)}
    codes = unpackers[spec.quant_type](stored_codes)
    if tuple(codes.shape) != (n, k) or tuple(stored_scales.shape) != (n, k // spec.group_size):
        raise ValueError(f"stored codes {tuple(stored_codes.shape)} / scales {tuple(stored_scales.shape)} "
                         f"do not fit a {spec.quant_type} tensor of shape {(n, k)} with group size {spec.group_size}")
    return codes, stored_scales.float()


def stored_shapes(spec: QuantSpec, shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the stored codes and scales of a tensor of `shape`."""
    n, k = shape
    per_byte = {"tri": 4, "bin": 8, "int4": 2, "int8": 1}
    code_cols = -(-k // 5) if spec.quant_type == "tri-dense" else k // per_byte[spec.quant_type]
    return (n, code_cols), (n, k // spec.group_size)


def storage_bytes(spec: QuantSpec, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` takes in the checkpoint (codes + scales, or bfloat16)."""
    numel = 1
    for s in shape:
        numel *= s
    if spec.is_float:
        return 2 * numel
    (n, cols), (_, groups) = stored_shapes(spec, (shape[0], shape[1]))
    return n * cols + 2 * n * groups


def total_bits_per_weight(tensors: list[tuple[QuantSpec, tuple[int, ...]]]) -> float:
    """Bits per weight over several tensors, from their exact storage bytes."""
    bits = sum(8 * storage_bytes(spec, shape) for spec, shape in tensors)
    numel = sum(int(torch.Size(shape).numel()) for _, shape in tensors)
    return bits / max(numel, 1)

"""Many rows through a CPU int4 layer (engine.runtime.cpu_int4): its matrix decoded to bfloat16 for the call, then
one bfloat16 GEMM, instead of torch's int4 kernel.

The int4 kernel's time grows with the rows (~0.3 ms a row for an 8960x1536 matrix on one thread), while a
bfloat16 GEMM runs on the CPU's matrix units (AMX: ~0.02 ms a row there). Decoding the matrix costs ~0.7 ns a
weight (a few torch passes over bytes, ~9.5 ms for that matrix), so from a few dozen rows on (a prompt chunk, not
a decode or verify step) decode + GEMM wins: 1.5x at 64 rows, 3x at 157, 7x at 512 (docs/perf.md, session 24).

The decode reads the kernel's packed layout directly (no second copy of the codes): on an AVX-512 CPU,
`_convert_weight_to_int4pack_for_cpu` packs each block of 64 rows as [K, 32] bytes, byte j of column k holding
row j in its low nibble and row 32 + j in its high one. That layout is the kernel's own and may differ between
torch versions and CPUs (AVX2 packs 32-row blocks), so `layout_known` checks it once per process against a
packing of known codes; where it differs, or N is no multiple of 64, every call stays on the int4 kernel.

Each weight is (q − 8)·s + z computed in float32 and rounded once to bfloat16 (within 2^-8 of its value; the int4
kernel keeps it in float32); a two-half layer (Q5 / Q8 codes) sums its halves in float32 before that rounding,
so the GEMM takes x once. The decoded matrix is not kept (16 bits a weight, 3.5x the codes: 1.85 GB more for
the 1.5B's 84 int4 matrices): each call decodes it again, CHUNK weights at a time, a few MB whatever the matrix.
"""
from __future__ import annotations

import functools

import torch

from quant.gguf_int4 import GROUP

BLOCK = 64  # rows per packed block
# Weights decoded at a time, then one GEMM for those output columns: ~3.5 bytes a weight of temporaries (~7 MB;
# two halves: ~2x). 1M-8M measured within noise of each other; a whole 17920x1536 matrix at once 1.5x slower.
CHUNK = 1 << 21


def fast_prefill_usable(n: int) -> bool:
    """Whether an [N, ·] layer's packed codes can be decoded here (the layout checked, whole 64-row blocks)."""
    return n % BLOCK == 0 and layout_known()


@functools.cache
def layout_known() -> bool:
    """Whether the int4 kernel packs codes as `_codes_t` reads them, on this CPU and torch."""
    gen = torch.Generator().manual_seed(0)
    n, k = 3 * BLOCK, 4 * GROUP
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)  # [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    if packed.dtype != torch.uint8 or packed.shape != (n, k // 2):
        return False
    return torch.equal(_codes_t(packed, 0, n, k, torch.float32).t() + 8, codes.float())


def _codes_t(packed: torch.Tensor, start: int, stop: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..stop (whole blocks) of the packed codes → q − 8 as `dtype` [K, stop − start] (transposed)."""
    blocks = packed.view(-1, k, BLOCK // 2)[start // BLOCK:stop // BLOCK]  # [B, K, 32] bytes
    flipped = blocks.permute(1, 0, 2).contiguous().bitwise_xor_(0x88)  # [K, B, 32]; nibble q ^ 8: signed, q − 8
    low = (flipped << 4).view(torch.int8) >> 4  # [K, B, 32]: rows 0..31 of each block, sign-extended
    high = flipped.view(torch.int8).bitwise_right_shift_(4)  # [K, B, 32]: rows 32..63
    q = torch.empty(k, stop - start, dtype=dtype)  # [K, n]
    block_rows = q.view(k, -1, 2, BLOCK // 2)  # [K, B, 2, 32]: each block's rows 0..31, then 32..63
    block_rows[:, :, 0].copy_(low)
    block_rows[:, :, 1].copy_(high)
    return q


def dequantized_t(packed: torch.Tensor, sz: torch.Tensor, start: int, stop: int, k: int, halves: int) -> torch.Tensor:
    """Rows start..stop of the layer's weights, bfloat16 [K, stop − start] (transposed), two halves summed."""
    wide = halves * k  # K': the codes' width
    s, z = sz[:, start:stop].unbind(-1)  # [K'/32, n] each: strided; contiguous copies broadcast ~4x faster
    s, z = s.contiguous().unsqueeze(1), z.contiguous().unsqueeze(1)  # [K'/32, 1, n]
    if halves == 1:
        w = _codes_t(packed, start, stop, wide, torch.bfloat16).view(wide // GROUP, GROUP, -1)  # [K/32, 32, n]
        return torch.addcmul(z, w, s, out=w).view(k, -1)  # float32 arithmetic, one rounding
    w = _codes_t(packed, start, stop, wide, torch.float32).view(wide // GROUP, GROUP, -1)  # [K'/32, 32, n]
    w = torch.addcmul(z.float(), w, s.float(), out=w).view(2, k, -1)  # [2, K, n]
    return torch.add(w[0], w[1]).to(torch.bfloat16)  # [K, n]


def prefill_matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, n: int, halves: int) -> torch.Tensor:
    """x [M, K] bfloat16 → bfloat16 [M, N] through bfloat16 GEMMs over decoded column chunks of the matrix."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
    rows = max(BLOCK, CHUNK // (halves * k) // BLOCK * BLOCK)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        torch.mm(x, dequantized_t(packed, sz, start, stop, k, halves), out=y[:, start:stop])
    return y

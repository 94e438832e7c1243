"""Runtime weight layouts for the GPU kernels: integer codes packed into int32 words along K.

A matrix W [N, K] (y = x Wᵀ) with one scale per group of G input features is stored as
  words  int32 [K/E, N]  — E = 32 / bits codes per word; column n's words are neighbours in memory
                           of column n+1's, so lanes of a warp that own neighbouring columns read
                           neighbouring addresses;
  scales float16 [K/G, N].
Inside a word, element k = E*i + 4*j + b (word row i, shift step j, byte b) sits at bit 8*b + bits*j,
so `(word >> bits*j) & mask_per_byte` yields the codes of four consecutive k as four bytes: one
`dp4a` against four int8 activations packed the same way.

Stored code u and its value (value of a weight = value(u) * scale of its group):
  tri  (2 bits): u ∈ {0, 1, 2},  value = u - 1
  bin  (1 bit):  u ∈ {0, 1},     value = 2u - 1
  int4 (4 bits): u ∈ [0, 15],    value = u - 8
  int8 (8 bits): u = the signed byte itself
i.e. value = MULT * u - OFFSET with (MULT, OFFSET) below; integer dot products are corrected once
per group: Σ value·x = MULT·Σ u·x − OFFSET·Σ x.

Besides these word layouts (KINDS, the engine's weight types), LAYOUTS holds the base-3 ternary layout
  tri5 (five trits per byte, 1.625 bits): u = c + 1 ∈ {0, 1, 2}, words [13·K/256, N] (quant/tri5_layout.py)
which PackedWeight carries the same way (words [rows, N], scales [K/G, N]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quant import tri5_layout


@dataclass(frozen=True)
class LayoutKind:
    name: str
    bits: int
    mult: int
    offset: int
    signed: bool  # the stored byte is a signed code (int8) rather than an unsigned one
    base3: bool = False  # five trits per byte (tri5), not `per_word` codes of `bits` bits

    @property
    def per_word(self) -> int:
        assert not self.base3, "tri5 words hold 20 or 16 codes: use word_rows()"
        return 32 // self.bits

    @property
    def bits_per_weight_codes(self) -> int:
        return self.bits


KINDS = {
    "tri": LayoutKind("tri", 2, 1, 1, False),
    "bin": LayoutKind("bin", 1, 2, 1, False),
    "int4": LayoutKind("int4", 4, 1, 8, False),
    "int8": LayoutKind("int8", 8, 1, 0, True),
}


LAYOUTS = {**KINDS, "tri5": LayoutKind("tri5", 2, 1, 1, False, base3=True)}


def layout_kind(name: str) -> LayoutKind:
    if name not in LAYOUTS:
        raise ValueError(f"no packed runtime layout for '{name}' (known: {', '.join(LAYOUTS)})")
    return LAYOUTS[name]


def word_rows(kind: str, in_features: int) -> int:
    """Rows of a packed matrix's words tensor [rows, N]."""
    if layout_kind(kind).base3:
        return tri5_layout.word_rows(in_features)
    return in_features // layout_kind(kind).per_word


def packed_nbytes(kind: str, out_features: int, in_features: int, group_size: int) -> int:
    """Bytes of a packed [N, K] matrix: int32 words + float16 scales (PackedWeight.nbytes before it exists)."""
    return word_rows(kind, in_features) * out_features * 4 + in_features // group_size * out_features * 2


@dataclass
class PackedWeight:
    """One packed matrix: words [K/E, N] int32, scales [K/G, N] float16."""
    kind: str
    words: torch.Tensor  # [K/E, N] int32
    scales: torch.Tensor  # [K/G, N] float16
    out_features: int  # N
    in_features: int  # K
    group_size: int  # G

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() * self.scales.element_size()

    def to(self, device: torch.device | str) -> "PackedWeight":
        return PackedWeight(self.kind, self.words.to(device), self.scales.to(device), self.out_features,
                            self.in_features, self.group_size)


def check_packable(kind: str, out_features: int, in_features: int, group_size: int) -> None:
    k = layout_kind(kind)
    if k.base3:
        return tri5_layout.check_tri5(out_features, in_features, group_size)
    if group_size % k.per_word or group_size % 4:
        raise ValueError(f"group size {group_size} must be a multiple of {max(k.per_word, 4)} for {kind}")
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {in_features}")


def _stored_codes(kind: LayoutKind, codes: torch.Tensor) -> torch.Tensor:
    """Grid codes (value = code) → stored unsigned field u, as int64."""
    c = codes.to(torch.int64)
    if kind.name == "bin":
        return (c > 0).to(torch.int64)
    if kind.name == "int8":
        return c & 0xFF
    return c + kind.offset


def pack(kind_name: str, codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> PackedWeight:
    """codes int8 [N, K] on the kind's grid, scales [N, K/G] → PackedWeight (on codes' device)."""
    kind = layout_kind(kind_name)
    n, k = codes.shape
    check_packable(kind_name, n, k, group_size)
    if kind.base3:
        return PackedWeight(kind_name, tri5_layout.pack_tri5_words(codes),
                            scales.to(torch.float16).t().contiguous(), n, k, group_size)
    e, steps = kind.per_word, 8 // kind.bits
    u = _stored_codes(kind, codes).reshape(n, k // e, steps, 4)  # [N, K/E, j, b]
    shifts = (8 * torch.arange(4, device=codes.device)[None, :]
              + kind.bits * torch.arange(steps, device=codes.device)[:, None])  # [j, b]
    words = (u << shifts).sum(dim=(-2, -1))  # [N, K/E] in [0, 2^32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return PackedWeight(kind_name, words.t().contiguous(), scales.to(torch.float16).t().contiguous(),
                        n, k, group_size)


def unpack_codes(pw: PackedWeight) -> torch.Tensor:
    """PackedWeight → grid codes int8 [N, K] (exact inverse of `pack`)."""
    kind = layout_kind(pw.kind)
    if kind.base3:
        return tri5_layout.unpack_tri5_codes(pw.words, pw.out_features, pw.in_features)
    steps = 8 // kind.bits
    w = pw.words.t().to(torch.int64) & 0xFFFFFFFF  # [N, K/E]
    shifts = (8 * torch.arange(4, device=w.device)[None, :]
              + kind.bits * torch.arange(steps, device=w.device)[:, None])  # [j, b]
    u = (w[..., None, None] >> shifts) & ((1 << kind.bits) - 1)  # [N, K/E, j, b]
    if kind.signed:
        u = torch.where(u >= 128, u - 256, u)
        values = u
    else:
        values = kind.mult * u - kind.offset
    return values.reshape(pw.out_features, pw.in_features).to(torch.int8)


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PackedWeight → dense W [N, K]."""
    codes = unpack_codes(pw).float()  # [N, K]
    g = pw.group_size
    scales = pw.scales.t().float()  # [N, K/G]
    w = codes.reshape(pw.out_features, -1, g) * scales[..., None]
    return w.reshape(pw.out_features, pw.in_features).to(dtype)


GENERATE_SLICE_WORDS = 1 << 22  # ternary fix-up of generated words: this many int32 words at a time (16 MiB)


def random_packed(kind_name: str, out_features: int, in_features: int, group_size: int,
                  device: torch.device | str = "cpu", std: float = 0.02,
                  generator: torch.Generator | None = None) -> PackedWeight:
    """Random weights of the right format and size, made directly in the packed layout on `device`
    (`load_format: dummy`): uniform codes, scales ≈ std of a float layer of that fan-in. The words
    are drawn in place in their final buffer; the ternary fix-up runs on column slices of at most
    GENERATE_SLICE_WORDS words, so the temporaries stay small (`random_packed_transient`)."""
    kind = layout_kind(kind_name)
    check_packable(kind_name, out_features, in_features, group_size)
    if kind.base3:
        scales = torch.full((in_features // group_size, out_features), std, dtype=torch.float16, device=device)
        return PackedWeight(kind_name, tri5_layout.random_tri5_words(out_features, in_features, device, generator),
                            scales, out_features, in_features, group_size)
    e = kind.per_word
    words = torch.empty(in_features // e, out_features, dtype=torch.int32, device=device)  # [K/E, N]
    words.random_(-2 ** 31, 2 ** 31, generator=generator)
    if kind.name == "tri":  # a 2-bit field of 3 is not a ternary code: map 3 → 2 in every field
        cols = max(1, GENERATE_SLICE_WORDS // words.shape[0])
        for n0 in range(0, out_features, cols):
            part = words[:, n0:n0 + cols]  # [K/E, cols] view
            hi, lo = (part >> 1) & 0x55555555, part & 0x55555555
            part &= ~(hi & lo)  # fields 11 → 10
            del hi, lo
    scale = std * (1.0 if kind.name in ("tri", "bin") else 1.0 / (2 ** (kind.bits - 1)))
    scales = torch.full((in_features // group_size, out_features), scale, dtype=torch.float16, device=device)
    return PackedWeight(kind_name, words, scales, out_features, in_features, group_size)


def random_packed_transient(kind_name: str, out_features: int, in_features: int) -> int:
    """Peak bytes of random_packed's temporaries beyond its result: for ternary words, the slice's
    two masks, their product and its complement (int32 each); for tri5, `random_tri5_transient`; none
    for the other kinds."""
    if kind_name == "tri5":
        return tri5_layout.random_tri5_transient(out_features, in_features)
    if kind_name != "tri":
        return 0
    rows = in_features // layout_kind(kind_name).per_word
    cols = min(out_features, max(1, GENERATE_SLICE_WORDS // rows))
    return 4 * rows * cols * 4


# ---- lossless conversions into tri5 (the scales are kept bit for bit) ----

def tri5_from_tq1_0(raw, in_features: int, rows_per_slice: int = 4096):
    """TQ1_0 GGUF blocks (uint8 [N, K/256·54]: qs[48], qh[4], fp16 d per 256 weights) → a tri5
    PackedWeight with group size 256: the same trits and the same scale per block, re-laid out."""
    from quant.gguf_codec import decode
    from gguf import GGMLQuantizationType
    n = raw.shape[0]
    words = torch.empty(tri5_layout.word_rows(in_features), n, dtype=torch.int32)
    scales = torch.empty(in_features // tri5_layout.SUPER, n, dtype=torch.float16)
    for r0 in range(0, n, rows_per_slice):
        codes, d = decode(raw[r0:r0 + rows_per_slice], int(GGMLQuantizationType.TQ1_0), in_features)
        words[:, r0:r0 + codes.shape[0]] = tri5_layout.pack_tri5_words(codes)
        scales[:, r0:r0 + codes.shape[0]] = d.t().to(torch.float16)  # exact: d was read from float16
    return PackedWeight("tri5", words, scales, n, in_features, tri5_layout.SUPER)


def tri5_from_tri(pw, columns_per_slice: int = 4096):
    """A 2-bit `tri` PackedWeight → the same codes and scales in tri5 (group size kept; on pw's device)."""
    tri5_layout.check_tri5(pw.out_features, pw.in_features, pw.group_size)
    words = torch.empty(tri5_layout.word_rows(pw.in_features), pw.out_features, dtype=torch.int32, device=pw.words.device)
    for n0 in range(0, pw.out_features, columns_per_slice):
        n1 = min(n0 + columns_per_slice, pw.out_features)
        part = PackedWeight("tri", pw.words[:, n0:n1], pw.scales[:, n0:n1], n1 - n0, pw.in_features, pw.group_size)
        words[:, n0:n1] = tri5_layout.pack_tri5_words(unpack_codes(part))
    return PackedWeight("tri5", words, pw.scales.clone(), pw.out_features, pw.in_features, pw.group_size)

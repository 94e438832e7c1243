"""The base-3 ternary runtime layout "tri5": five trits per byte, 1.625 bits per code (+ 16/G for scales).

A matrix W [N, K] (y = x Wᵀ), codes c ∈ {-1, 0, 1}, one float16 scale per group of G ∈ {64, 128, 256}
input features, K a multiple of 256, is stored as
  words  int32 [13·K/256, N]   column n's words neighbour column n+1's (as in the other layouts)
  scales float16 [K/G, N]
Super-block s covers k0 = 256·s .. k0 + 255 in 13 word rows; it is four segments h = 0..3 of 64 inputs
(every group is a whole number of segments):
  row 13s + 4a + h  (a = 0..2): a five-trit word. Byte lane j (bits 8j..8j+7) holds the trits
                    t_n = c + 1 of k = k0 + 64h + 20a + 4n + j, n = 0..4, as TQ1_0's byte code:
                    q = Σ_n t_n·3^(4-n) (first trit most significant), byte = ceil(q·256/243).
  row 13s + 12:     the tail word, in the 2-bit `tri` layout: u = c + 1 of k = k0 + 64h + 60 + j at bits 8j + 2h.
So trit n of the four lanes of one word is the code of four consecutive inputs: one dp4a against the
int8 activation word k/4 = 64s + 16h + 5a + n (the tail's step h meets word 64s + 16h + 15).

Decoding a byte b (any of the 256 values decodes; the 243 canonical ones are what `pack` writes):
  trit n = ((b·3^n mod 256)·3) >> 8 (TQ1_0's rule), or, with Q_n = floor(b·3^(n+1) / 256) (the number
  formed by the first n+1 trits), t_n = Q_n − 3·Q_{n-1}. Four lanes at a time: the even lanes (w & 0x00FF00FF)
  and the odd lanes ((w >> 8) & 0x00FF00FF) as 16-bit halves, multiplied by 3^(n+1) without carries between
  halves; Q_n of each lane is then byte 1 / byte 3 of its half (quant/kernels/tri5_gemv.py).
"""
from __future__ import annotations

import torch

SUPER = 256  # inputs per super-block
ROWS = 13  # word rows per super-block
GROUPS = (64, 128, 256)
_POW3_DESC = (81, 27, 9, 3, 1)
_M8 = 0xFF
GENERATE_SLICE_WORDS = 1 << 22  # random_tri5 works on column slices of at most this many words


def word_rows(in_features: int) -> int:
    return in_features // SUPER * ROWS


def check_tri5(out_features: int, in_features: int, group_size: int) -> None:
    if group_size not in GROUPS:
        raise ValueError(f"group size {group_size} is not one tri5 takes (64, 128 or 256)")
    if in_features % SUPER:
        raise ValueError(f"tri5 needs an input dimension that is a multiple of {SUPER}, not {in_features}")


def byte_code(q: torch.Tensor) -> torch.Tensor:
    """Base-3 numbers q ∈ [0, 243) → TQ1_0's byte code ceil(q·256/243) (int64)."""
    return (q * 256 + 242) // 243


def decode_trits(b: torch.Tensor, count: int = 5) -> torch.Tensor:
    """Bytes (int64, any of 0..255) → their first `count` trits [.., count] in 0..2, by TQ1_0's rule."""
    mult = torch.tensor([3 ** n for n in range(count)], dtype=torch.int64, device=b.device)
    return ((b[..., None] * mult) & _M8) * 3 >> 8


def _signed32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_tri5_words(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K] in {-1, 0, 1} → words int32 [13·K/256, N] (the layout above)."""
    n, k = codes.shape
    s = k // SUPER
    t = (codes.to(torch.int64) + 1).reshape(n, s, 4, 64)  # [N, S, h, 64]
    five = t[..., :60].reshape(n, s, 4, 3, 5, 4)  # [N, S, h, a, trit n, lane j]
    pow3 = torch.tensor(_POW3_DESC, dtype=torch.int64, device=codes.device)[:, None]  # [n, 1]
    b = byte_code((five * pow3).sum(-2))  # [N, S, h, a, j]
    lanes = 8 * torch.arange(4, device=codes.device)
    five_words = (b << lanes).sum(-1).transpose(2, 3).reshape(n, s, 12)  # [N, S, 4a + h]
    tail = t[..., 60:]  # [N, S, h, j]
    tail_shift = lanes[None, :] + 2 * torch.arange(4, device=codes.device)[:, None]  # [h, j]
    tail_word = (tail << tail_shift).sum(dim=(-2, -1))  # [N, S]
    words = torch.cat([five_words, tail_word[..., None]], dim=-1).reshape(n, s * ROWS)  # [N, 13S]
    return _signed32(words).t().contiguous()


def unpack_tri5_codes(words: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """words int32 [13·K/256, N] → codes int8 [N, K] (the exact inverse of pack_tri5_words on its output)."""
    n, s = out_features, in_features // SUPER
    w = (words.t().to(torch.int64) & 0xFFFFFFFF).reshape(n, s, ROWS)  # [N, S, 13]
    lanes = 8 * torch.arange(4, device=w.device)
    b = (w[..., :12, None] >> lanes) & _M8  # [N, S, 4a + h, j]
    trits = decode_trits(b)  # [N, S, 4a + h, j, n]
    five = trits.reshape(n, s, 3, 4, 4, 5).permute(0, 1, 3, 2, 5, 4).reshape(n, s, 4, 60)  # [N, S, h, 20a + 4n + j]
    tail_shift = lanes[None, :] + 2 * torch.arange(4, device=w.device)[:, None]  # [h, j]
    tail = (w[..., 12, None, None] >> tail_shift) & 3  # [N, S, h, j]
    t = torch.cat([five, tail], dim=-1)  # [N, S, h, 64]
    return (t - 1).reshape(n, in_features).to(torch.int8)


def random_tri5_words(out_features: int, in_features: int, device: torch.device | str = "cpu",
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniformly random words of the layout, drawn in place in their final buffer [13·K/256, N]: every
    five-trit byte mapped to a canonical code (q = b·243 >> 8), every tail field 3 to 2; the fix-ups run
    on column slices of at most GENERATE_SLICE_WORDS words (`random_tri5_transient`)."""
    rows = word_rows(in_features)
    words = torch.empty(rows, out_features, dtype=torch.int32, device=device)  # [13S, N]
    words.random_(-2 ** 31, 2 ** 31, generator=generator)
    grid = words.view(rows // ROWS, ROWS, out_features)  # [S, 13, N]
    cols = max(1, GENERATE_SLICE_WORDS // rows)
    for n0 in range(0, out_features, cols):
        five = grid[:, :12, n0:n0 + cols]  # [S, 12, cols] view
        fixed = torch.zeros_like(five)
        for lane in range(4):  # in place: one byte temporary besides `fixed`
            b = five >> 8 * lane
            b &= _M8
            b *= 243
            b >>= 8  # q
            b *= 256
            b += 242
            b //= 243  # ceil(q·256/243)
            b <<= 8 * lane
            fixed |= b
            del b
        five.copy_(fixed)
        del fixed
        tail = grid[:, 12, n0:n0 + cols]  # [S, cols] view
        hi, lo = (tail >> 1) & 0x55555555, tail & 0x55555555
        tail &= ~(hi & lo)  # 2-bit fields 11 → 10
        del hi, lo
    return words


def random_tri5_transient(out_features: int, in_features: int) -> int:
    """Peak bytes of random_tri5_words' temporaries beyond its result: a slice's fixed five-trit words and
    one byte temporary of the same size (int32 each; the tail fix-up's four temporaries are 1/12 of that)."""
    rows = word_rows(in_features)
    return 2 * 4 * rows // ROWS * 12 * min(out_features, max(1, GENERATE_SLICE_WORDS // rows))

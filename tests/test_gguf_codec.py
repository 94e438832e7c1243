"""GGUF blocks ↔ codes + scales: bit-exact import, exact or measured-loss export, GGUF files served packed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from quant import gguf_codec
from quant.formats import QuantSpec, quantize_rtn
from quant.grids import dequantize

RNG = np.random.default_rng(0)


def reference_q1_0(raw: np.ndarray) -> np.ndarray:
    """Q1_0 by the field notes, one block at a time: fp16 d, qs[16], bit i of byte j = element 8j+i."""
    out = []
    for block in raw.reshape(-1, 18):
        d = float(block[:2].view(np.float16)[0])
        for j in range(16):
            for i in range(8):
                out.append(d if (block[2 + j] >> i) & 1 else -d)
    return np.array(out, dtype=np.float32).reshape(raw.shape[0], -1)


def reference_q2_0(raw: np.ndarray) -> np.ndarray:
    """Q2_0 by the field notes: fp16 d, qs[16], 4 codes a byte LSB-first, 0..3 → {-1, 0, 1, 2}·d."""
    out = []
    for block in raw.reshape(-1, 18):
        d = float(block[:2].view(np.float16)[0])
        for j in range(16):
            for i in range(4):
                out.append(((int(block[2 + j]) >> (2 * i)) & 3) - 1)
                out[-1] = out[-1] * d
    return np.array(out, dtype=np.float32).reshape(raw.shape[0], -1)


def random_blocks(type_id: int, rows: int, k: int) -> np.ndarray:
    block, size = gguf_codec.BLOCKS[type_id]
    raw = RNG.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    d = RNG.uniform(0.001, 0.1, size=(rows, k // block)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    raw[..., 0:2] = d  # Q1_0 and Q2_0 start with d
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.TQ2_0, T.TQ1_0])
def test_ternary_import_is_bit_exact_against_gguf(qtype):
    w = (RNG.standard_normal((6, 512)) * RNG.uniform(0.01, 1, (6, 1))).astype(np.float32)
    raw = gguf_quants.quantize(w, qtype)  # [6, bytes]
    codes, scales = gguf_codec.decode(raw, int(qtype), 512)
    assert codes.shape == (6, 512) and scales.shape == (6, 2) and set(codes.unique().tolist()) <= {-1, 0, 1}
    assert np.array_equal(dequantize(codes, scales, 256).numpy(), gguf_quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype,reference", [(T.Q1_0, reference_q1_0), (gguf_codec.Q2_0_ID, reference_q2_0)])
def test_q1_q2_import_matches_the_byte_layout(qtype, reference):
    raw = random_blocks(int(qtype), 3, 256)
    codes, scales = gguf_codec.decode(raw, int(qtype), 256)
    block = gguf_codec.BLOCKS[int(qtype)][0]
    assert np.array_equal(dequantize(codes, scales, block).numpy(), reference(raw))


@pytest.mark.parametrize("qtype", [T.TQ2_0, T.TQ1_0, T.Q1_0, T.Q4_0, T.Q8_0])
def test_export_is_exact_when_groups_are_whole_blocks(qtype):
    quant_type = {T.TQ2_0: "tri", T.TQ1_0: "tri-dense", T.Q1_0: "bin", T.Q4_0: "int4", T.Q8_0: "int8"}[qtype]
    group = 256 if qtype in (T.TQ2_0, T.TQ1_0) else 128
    codes, scales = quantize_rtn(QuantSpec(quant_type, group), torch.randn(5, 512))
    raw, err, ref = gguf_codec.encode(codes, scales, group, int(qtype))
    assert raw.shape == (5, 512 // gguf_codec.BLOCKS[int(qtype)][0] * gguf_codec.BLOCKS[int(qtype)][1])
    assert err == 0 and ref > 0
    want = dequantize(codes, scales, group).numpy()
    if qtype == T.Q1_0:  # no gguf dequantizer: our decoder, itself checked against the byte layout
        got = dequantize(*gguf_codec.decode(raw, int(qtype), 512), 128).numpy()
        assert np.array_equal(got, reference_q1_0(raw))
    else:
        got = gguf_quants.dequantize(raw, qtype)
    assert np.array_equal(got, want)


def test_group_128_into_256_blocks_uses_the_best_common_scale():
    torch.manual_seed(0)
    codes, scales = quantize_rtn(QuantSpec("tri", 128), torch.randn(4, 512) * torch.tensor([1.0, 3.0]).repeat(256))
    raw, err, ref = gguf_codec.encode(codes, scales, 128, int(T.TQ2_0))
    target = dequantize(codes, scales, 128).numpy()
    got = gguf_quants.dequantize(raw, T.TQ2_0)
    assert np.isclose(((got - target) ** 2).sum(), err, rtol=1e-4) and 0.01 < (err / ref) ** 0.5 < 0.9
    # any other scale for a block does worse (the exported one is the least-squares optimum, up to fp16)
    c = codes.float().numpy()[0, :256]
    d = float(got[0, :256][c != 0][0] / c[c != 0][0])
    for factor in (0.97, 1.03):
        assert ((c * d * factor - target[0, :256]) ** 2).sum() > ((c * d - target[0, :256]) ** 2).sum()
    assert np.array_equal(gguf_codec.decode(raw, int(T.TQ2_0), 512)[0].numpy(), codes.numpy())  # codes kept


def test_int4_group_16_into_q4_0_reports_its_loss():
    codes, scales = quantize_rtn(QuantSpec("int4", 16), torch.randn(3, 64))
    raw, err, ref = gguf_codec.encode(codes, scales, 16, int(T.Q4_0))
    target = dequantize(codes, scales, 16).numpy()
    assert np.isclose(((gguf_quants.dequantize(raw, T.Q4_0) - target) ** 2).sum(), err, rtol=1e-4) and err > 0


def test_export_types_and_fallbacks():
    assert gguf_codec.export_type("tri", 1536) == T.TQ2_0
    assert gguf_codec.export_type("tri", 576) == T.Q4_0  # 576 is not a multiple of 256
    assert gguf_codec.export_type("tri-dense", 512) == T.TQ1_0
    assert gguf_codec.export_type("bin", 384) == T.Q1_0 and gguf_codec.export_type("bin", 576) == T.Q4_0
    assert gguf_codec.export_type("int8", 64) == T.Q8_0 and gguf_codec.export_type("int4", 48) == T.F16
    assert gguf_codec.export_type("bf16", 64) == T.F16


def test_bad_row_lengths_are_refused():
    with pytest.raises(ValueError, match="do not hold"):
        gguf_codec.decode(np.zeros((1, 60), np.uint8), int(T.TQ2_0), 256)
    with pytest.raises(ValueError, match="256-blocks"):
        gguf_codec.encode(torch.zeros(1, 128, dtype=torch.int8), torch.ones(1, 1), 128, int(T.TQ2_0))

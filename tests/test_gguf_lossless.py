"""`--gguf` writes every tensor losslessly: read by a header parser and decoded by a decoder written here
from the GGUF specification and llama.cpp's block layouts (ggml-common.h / ggml-quants.c of the llama.cpp inside
llama-cpp-python 0.3.36), every tensor equals the checkpoint's codes × scales exactly; the model's
logits from the GGUF equal those from the checkpoint; a lossy export is refused unless allowed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
import struct

from engine.sources.checkpoint_file import BonsaiCheckpoint, canonical_name
from engine.errors import BonsaiError
from engine.sources.gguf_file import gguf_name, permute_rotary
from engine.quantization.quantize import QuantizeOptions, quantize
from quant.formats import QuantSpec
from quant.recipe import Recipe, Rule
from tests.gguf_tiny import HEADS, KV_HEADS, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
Q2_0 = 42


def read_tensors(path) -> dict[str, tuple[int, tuple[int, ...], np.ndarray]]:
    """name → (type id, dimensions innermost first, raw bytes) of a GGUF v3 file (the gguf package's reader
    does not know type 42)."""
    data = open(path, "rb").read()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n:pos].decode()
    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            itype, n = take("I"), take("Q")
            for _ in range(n):
                skip(itype)
        else:
            pos += struct.calcsize(sizes[vtype])
    assert take("4s") == b"GGUF" and take("I") == 3
    n_tensors, n_kv = take("Q"), take("Q")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if key == "general.alignment":
            alignment = take("I")
        else:
            skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("Q") for _ in range(take("I")))
        infos.append((name, dims, take("I"), take("Q")))
    start = -(-pos // alignment) * alignment
    ends = sorted(o for *_, o in infos)[1:] + [len(data) - start]
    size_of = dict(zip(sorted(o for *_, o in infos), ends))
    return {name: (type_id, dims, np.frombuffer(data, np.uint8, size_of[offset] - offset, start + offset))
            for name, dims, type_id, offset in infos}


def _fp16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float64)[..., 0]  # [.., 1]


def decode(raw: np.ndarray, type_id: int, k: int) -> np.ndarray:
    """One GGUF tensor's bytes [rows, bytes] → float64 [rows, k], block by block as llama.cpp lays them out."""
    rows = raw.shape[0]
    if type_id == T.F32:
        return raw.view(np.float32).astype(np.float64).reshape(rows, k)
    if type_id == T.BF16:  # the upper half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(rows, k)
    size = {int(T.Q4_0): (32, 18), int(T.Q8_0): (32, 34), int(T.Q1_0): (128, 18), Q2_0: (64, 18),
            int(T.TQ2_0): (256, 66)}[type_id]
    b = raw.reshape(rows, k // size[0], size[1])
    if type_id == T.TQ2_0:  # qs[64] then d; element 32·(e/128) + e%32 at shift 2·((e%128)/32), value (q - 1)·d
        d = _fp16(b[..., 64:66])[..., None]
        out = np.empty((rows, k // 256, 256))
        for e in range(256):
            q = (b[..., 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3
            out[..., e] = (q.astype(np.float64) - 1) * d[..., 0]
        return out.reshape(rows, k)
    d = _fp16(b[..., 0:2])  # [rows, blocks]
    qs = b[..., 2:].astype(np.int64)
    if type_id == T.Q4_0:  # byte j: element j in the low nibble, element j + 16 in the high one; (q - 8)·d
        q = np.concatenate([qs & 15, qs >> 4], axis=-1) - 8
    elif type_id == T.Q8_0:
        q = b[..., 2:].view(np.int8).astype(np.int64)
    elif type_id == T.Q1_0:  # element j at bit j%8 of byte j/8: 1 → +d, 0 → -d
        q = ((qs[..., :, None] >> np.arange(8)) & 1).reshape(rows, -1, 128) * 2 - 1
    else:  # Q2_0: element j at bits 2·(j%4) of byte j/4: {0, 1, 2, 3} → {-1, 0, 1, 2}
        q = ((qs[..., :, None] >> (2 * np.arange(4))) & 3).reshape(rows, -1, 64) - 1
    return (q * d[..., None]).reshape(rows, k)


def _row_bytes(type_id: int, k: int) -> int:
    block, size = {int(T.F32): (1, 4), int(T.BF16): (1, 2), int(T.Q4_0): (32, 18), int(T.Q8_0): (32, 34),
                   int(T.Q1_0): (128, 18), Q2_0: (64, 18), int(T.TQ2_0): (256, 66)}[type_id]
    return k // block * size


RECIPE = Recipe(QuantSpec("tri", 64), rules=(Rule("q_proj|k_proj", QuantSpec("int4", 32)),
                                             Rule("v_proj", QuantSpec("int8", 64)),
                                             Rule(r"layers\.0\.mlp\.down_proj", QuantSpec("bin", 128)),
                                             Rule(r"layers\.1\.mlp", QuantSpec("tri", 128)),
                                             Rule("o_proj", QuantSpec("tri", 256))),
                embed=QuantSpec("bf16"), head=QuantSpec("int4", 128))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("lossless")
    src = write_tiny_gguf(d / "src.gguf", smollm2_gguf, T.F32)
    report = quantize(src, d / "ckpt", QuantizeOptions(RECIPE, gguf=d / "out.gguf", evaluate=False))
    return d, report


def test_every_tensor_decodes_to_codes_times_scales(exported):
    d, report = exported
    types = {t.name: t.gguf_type for t in report.gguf.tensors}
    assert {types[n] for n in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight",
                               "blk.1.ffn_up.weight", "blk.0.ffn_gate.weight", "blk.0.attn_output.weight",
                               "token_embd.weight", "output.weight", "blk.0.attn_norm.weight")} == {
        "Q4_0", "Q8_0", "Q1_0", "Q2_0", "TQ2_0", "BF16", "F32"}
    assert report.gguf.lossless
    checkpoint = BonsaiCheckpoint(d / "ckpt").checkpoint
    tensors = read_tensors(d / "out.gguf")
    assert set(tensors) == {gguf_name(canonical_name(n)) for n in checkpoint.entries}
    for name, entry in checkpoint.entries.items():
        type_id, dims, data = tensors[gguf_name(canonical_name(name))]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        got = decode(data[:len(data) // rows * rows].reshape(rows, -1)[:, :_row_bytes(type_id, dims[0])], type_id,
                     dims[0])  # [rows, K] (the data of the last tensor may carry alignment padding)
        want = checkpoint.read_dequantized(name).double().reshape(got.shape)  # codes × scales (or the floats)
        heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(name.split(".")[-2])
        if heads is not None:  # llama.cpp's rotary row order
            want = permute_rotary(want, heads)
        assert np.array_equal(got, want.numpy()), name


def test_logits_of_the_gguf_equal_the_checkpoints(exported):
    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    d, _ = exported
    ids = [1, 100, 200, 1000, 5, 77, 409, 12]
    logits = []
    for path in (d / "ckpt", d / "out.gguf"):
        runner = ModelRunner(load_model(path, weight_dtype=torch.float32), max_seq_len=16)
        logits.append(runner.forward(runner.slot(), ids, num_logits=None))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_a_lossy_export_is_refused_unless_allowed(tmp_path, smollm2_gguf):
    src = write_tiny_gguf(tmp_path / "src.gguf", smollm2_gguf, T.F32)
    recipe = Recipe(QuantSpec("int4", 16))  # Q4_0's 32-blocks span two groups: no exact type
    with pytest.raises(BonsaiError, match=r"--gguf: 14 tensors have no llama.cpp type that holds their codes exactly, "
                                          r"e.g. .*q_proj.weight \(int4 g16 → Q4_0\).*--allow-lossy-gguf"):
        quantize(src, tmp_path / "a", QuantizeOptions(recipe, gguf=tmp_path / "a.gguf", evaluate=False))
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.gguf").exists()
    report = quantize(src, tmp_path / "b", QuantizeOptions(recipe, gguf=tmp_path / "b.gguf", allow_lossy_gguf=True,
                                                          eval_tokens=300))
    assert not report.gguf.lossless and 0.001 < report.gguf.relative_error < 0.2
    assert report.gguf_quality["kl_mean"] > report.quality["kl_mean"] > 0  # what the merged scales cost, measured

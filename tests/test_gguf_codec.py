"""GGUF blocks ↔ codes + scales: bit-exact import, exact or measured-loss export, GGUF files served packed."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from quant import gguf_codec, gguf_types
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


def reference_pq2_0(raw: np.ndarray) -> np.ndarray:
    """PQ2_0 by the PrismML fork's dequantize_row_pq2_0: 34-byte blocks, fp16 d first, then qs[32]; weight j
    is (((qs[j / 4] >> 2 * (j % 4)) & 3) - 1) * d."""
    out = []
    for block in raw.reshape(-1, 34):
        d = float(block[:2].view(np.float16)[0])
        out += [(((int(block[2 + j // 4]) >> (2 * (j % 4))) & 3) - 1) * d for j in range(128)]
    return np.array(out, dtype=np.float32).reshape(raw.shape[0], -1)


def reference_ptq1_0(raw: np.ndarray) -> np.ndarray:
    """PTQ1_0 by the fork's dequantize_row_ptq1_0: 28-byte blocks, qs[24] read in stages of 16 then 8 bytes
    (five base-3 digits a byte, digit n of every byte of the stage before digit n + 1), then qh[2] (four
    digits a byte), fp16 d last; digit n of byte b is ((uint8)(b * 3^n) * 3) >> 8, the weight (digit - 1) * d."""
    def digit(b: int, n: int) -> int:
        return (((b * 3 ** n) & 0xFF) * 3) >> 8
    out = []
    for block in raw.reshape(-1, 28):
        qs, qh, d = [int(b) for b in block[:24]], [int(b) for b in block[24:26]], float(block[26:28].view(np.float16)[0])
        j = 0
        for stage in (32, 16, 8):
            while j + stage <= 24:
                out += [(digit(qs[j + m], n) - 1) * d for n in range(5) for m in range(stage)]
                j += stage
        out += [(digit(qh[h], n) - 1) * d for n in range(4) for h in range(2)]
    return np.array(out, dtype=np.float32).reshape(raw.shape[0], -1)


def random_blocks(type_id: int, rows: int, k: int) -> np.ndarray:
    block, size = gguf_codec.BLOCKS[type_id]
    raw = RNG.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    d = RNG.uniform(0.001, 0.1, size=(rows, k // block)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    at = size - 2 if type_id == gguf_codec.PTQ1_0_ID else 0  # Q1_0, Q2_0 and PQ2_0 start with d; PTQ1_0 ends with it
    raw[..., at:at + 2] = d
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.TQ2_0, T.TQ1_0])
def test_ternary_import_is_bit_exact_against_gguf(qtype):
    w = (RNG.standard_normal((6, 512)) * RNG.uniform(0.01, 1, (6, 1))).astype(np.float32)
    raw = gguf_quants.quantize(w, qtype)  # [6, bytes]
    codes, scales = gguf_codec.decode(raw, int(qtype), 512)
    assert codes.shape == (6, 512) and scales.shape == (6, 2) and set(codes.unique().tolist()) <= {-1, 0, 1}
    assert np.array_equal(dequantize(codes, scales, 256).numpy(), gguf_quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype,reference", [(T.Q1_0, reference_q1_0), (gguf_codec.Q2_0_ID, reference_q2_0),
                                             (gguf_codec.PQ2_0_ID, reference_pq2_0),
                                             (gguf_codec.PTQ1_0_ID, reference_ptq1_0)])
def test_q1_q2_import_matches_the_byte_layout(qtype, reference):
    raw = random_blocks(int(qtype), 3, 256)
    codes, scales = gguf_codec.decode(raw, int(qtype), 256)
    block = gguf_codec.BLOCKS[int(qtype)][0]
    assert np.array_equal(dequantize(codes, scales, block).numpy(), reference(raw))


EXACT = [(T.TQ2_0, "tri", 256), (T.TQ1_0, "tri-dense", 256), (gguf_codec.Q2_0_ID, "tri", 64),
         (gguf_codec.Q2_0_ID, "tri", 128), (T.Q1_0, "bin", 128), (T.Q1_0, "bin", 256), (T.Q4_0, "int4", 32),
         (T.Q4_0, "int4", 128), (T.Q4_0, "tri", 96), (T.Q4_0, "bin", 32), (T.Q8_0, "int8", 64)]


@pytest.mark.parametrize("qtype,quant_type,group", EXACT, ids=[f"{q}-g{g}" for _, q, g in EXACT])
def test_export_is_exact_when_blocks_split_the_groups(qtype, quant_type, group):
    """A group that is a whole number of blocks: each block repeats its group's scale, nothing is lost."""
    codes, scales = quantize_rtn(QuantSpec(quant_type, group), torch.randn(5, 768))
    raw, err, ref = gguf_codec.encode(codes, scales, group, int(qtype))
    assert raw.shape == (5, 768 // gguf_codec.BLOCKS[int(qtype)][0] * gguf_codec.BLOCKS[int(qtype)][1])
    assert err == 0 and ref > 0
    want = dequantize(codes, scales, group).numpy()
    if int(qtype) in (int(T.Q1_0), gguf_codec.Q2_0_ID):  # no gguf dequantizer: the byte layout, block by block
        got = (reference_q1_0 if int(qtype) == T.Q1_0 else reference_q2_0)(raw)
    else:
        got = gguf_quants.dequantize(raw, qtype)
    assert np.array_equal(got, want)
    assert gguf_codec.export_type(quant_type, 768, group) == (int(qtype), True) or int(qtype) == T.Q4_0


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
    """The fewest-bit type that holds a tensor exactly; else the first whose blocks split the row, not exact."""
    et = gguf_codec.export_type
    assert et("tri", 1536, 256) == (T.TQ2_0, True) and et("tri", 1536, 128) == (gguf_codec.Q2_0_ID, True)
    assert et("tri", 576, 64) == (gguf_codec.Q2_0_ID, True) and et("tri", 576, 96) == (T.Q4_0, True)
    assert et("tri-dense", 512, 256) == (T.TQ1_0, True) and et("tri-dense", 512, 128) == (gguf_codec.Q2_0_ID, True)
    assert et("bin", 384, 128) == (T.Q1_0, True) and et("bin", 576, 64) == (T.Q4_0, True)
    assert et("int8", 64, 64) == (T.Q8_0, True) and et("int4", 576, 192) == (T.Q4_0, True)
    assert et("int4", 64, 16) == (T.Q4_0, False) and et("tri", 512, 48) == (T.TQ2_0, False)  # scales merged
    assert et("int4", 48, 16) == (T.F16, False) and et("bf16", 64, 0) == (T.F16, False)


@pytest.mark.parametrize("qtype,reference", [(gguf_codec.PQ2_0_ID, reference_pq2_0), (gguf_codec.PTQ1_0_ID, reference_ptq1_0)],
                         ids=["PQ2_0", "PTQ1_0"])
def test_prism_blocks_round_trip(qtype, reference):
    """Ternary codes at group 128 → the fork's blocks → the same codes and scales (and the reference values)."""
    codes, scales = quantize_rtn(QuantSpec("tri", 128), torch.randn(4, 512))
    raw, err, _ = gguf_codec.encode(codes, scales, 128, qtype)
    assert err == 0 and raw.shape == (4, 4 * gguf_codec.BLOCKS[qtype][1])
    back, back_scales = gguf_codec.decode(raw, qtype, 512)
    assert torch.equal(back, codes) and torch.equal(back_scales, scales.to(torch.float16).float())
    assert np.array_equal(reference(raw), dequantize(back, back_scales, 128).numpy())


def test_bad_row_lengths_are_refused():
    with pytest.raises(ValueError, match="do not hold"):
        gguf_codec.decode(np.zeros((1, 60), np.uint8), int(T.TQ2_0), 256)
    with pytest.raises(ValueError, match="256-blocks"):
        gguf_codec.encode(torch.zeros(1, 128, dtype=torch.int8), torch.ones(1, 1), 128, int(T.TQ2_0))


# ---- GGUF files: trained-ternary and 1-bit sources served packed; exports read back ----

def write_raw_gguf(path, tokenizer_source, qtype: int):
    """A tiny llama GGUF whose matrices are random raw blocks of qtype (Q1_0, or Q2_0 by patching the header)."""
    from gguf import GGUFWriter

    from tests.gguf_tiny import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, copy_tokenizer
    writer = GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = copy_tokenizer(writer, tokenizer_source)
    hd = HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HEADS * hd, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * hd, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * hd, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    shapes["output.weight"] = (vocab, HIDDEN)
    raws = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
            continue
        raws[name] = random_blocks(qtype, *shape)
        if qtype in gguf_codec.NAMES:  # not in the gguf package's enum: written as bytes (I8), patched below
            writer.add_tensor(name, raws[name].view(np.int8), raw_dtype=T.I8)
        else:
            writer.add_tensor(name, raws[name], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if qtype in gguf_codec.NAMES:
        data = bytearray(path.read_bytes())
        for name in raws:
            cols = shapes[name][1]
            key = len(name).to_bytes(8, "little") + name.encode()
            at = data.index(key) + len(key)  # n_dims u32, dims u64 x2, type u32
            assert int.from_bytes(data[at + 4:at + 12], "little") == raws[name].shape[1]
            data[at + 4:at + 12] = cols.to_bytes(8, "little")
            data[at + 20:at + 24] = qtype.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return raws


@pytest.mark.parametrize("qtype", [int(T.Q1_0), gguf_codec.Q2_0_ID, gguf_codec.PQ2_0_ID, gguf_codec.PTQ1_0_ID],
                         ids=["Q1_0", "Q2_0", "PQ2_0", "PTQ1_0"])
def test_q1_q2_gguf_files_load_and_serve_codes(qtype, tmp_path, smollm2_gguf):
    from engine.sources.gguf_file import GGUFFile
    from engine.weights.loader import load_model
    path = tmp_path / "m.gguf"
    raws = write_raw_gguf(path, smollm2_gguf, qtype)
    source = GGUFFile(path)
    cfg = source.model_config()
    floats = dict(source.iter_canonical_tensors(cfg))
    packed = {name: rest for name, *rest in source.iter_quantized_tensors(cfg)}
    assert len(packed) == 16
    reference = {int(T.Q1_0): reference_q1_0, gguf_codec.Q2_0_ID: reference_q2_0, gguf_codec.PQ2_0_ID: reference_pq2_0,
                 gguf_codec.PTQ1_0_ID: reference_ptq1_0}[qtype]
    quant_type, group, codes, scales = packed["layers.1.down_proj.weight"]
    # random Q2_0 / PQ2_0 bytes use code 2 (int4); every PTQ1_0 byte holds ternary digits
    assert (quant_type, group) == {int(T.Q1_0): ("bin", 128), gguf_codec.Q2_0_ID: ("int4", 64),
                                   gguf_codec.PQ2_0_ID: ("int4", 128), gguf_codec.PTQ1_0_ID: ("tri-dense", 128)}[qtype]
    assert np.array_equal(dequantize(codes, scales, group).numpy(), reference(raws["blk.1.ffn_down.weight"]))
    for name, (_, group, codes, scales) in packed.items():  # q/k rows are unpermuted like the float path
        assert torch.equal(dequantize(codes, scales, group), floats[name]), name
    loaded = load_model(path, weight_dtype=torch.float32)
    assert gguf_types.type_name(qtype) in loaded.summary.types


@pytest.mark.parametrize("qtype", [T.TQ2_0, T.TQ1_0])
def test_trained_ternary_gguf_is_kept_without_requantizing(qtype, tmp_path, smollm2_gguf):
    from engine.sources.checkpoint_file import BonsaiCheckpoint
    from engine.sources.gguf_file import GGUFFile
    from engine.quantization.quantize import QuantizeOptions, quantize
    from quant.recipe import Recipe
    from tests.gguf_tiny import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "t.gguf", smollm2_gguf, qtype)
    source = GGUFFile(path)
    cfg = source.model_config()
    served = {name: rest for name, *rest in source.iter_quantized_tensors(cfg)}
    floats = dict(source.iter_canonical_tensors(cfg))
    assert len(served) == 16 and all(torch.equal(dequantize(c, s, g), floats[n]) for n, (_, g, c, s) in served.items())
    report = quantize(path, tmp_path / "ckpt", QuantizeOptions(Recipe(QuantSpec("tri", 64))))
    assert sum(t.kept for t in report.tensors) == 14  # the block matrices; embedding and head go to bf16
    assert report.error_by_class()["mlp.up_proj"] == 0.0 and "tri g256" in report.by_format()
    ckpt = {name: rest for name, *rest in BonsaiCheckpoint(tmp_path / "ckpt").iter_quantized_tensors(cfg)}
    for name, (quant_type, group, codes, scales) in ckpt.items():
        assert group == 256 and torch.equal(codes, served[name][2]) and torch.equal(scales, served[name][3])


def logits_of(path, ids):
    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    runner = ModelRunner(load_model(path, weight_dtype=torch.float32), max_seq_len=32)
    return runner.forward(runner.slot(), ids, num_logits=None)


def transformers_logits(path, ids):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


IDS = [1, 100, 200, 1000, 5, 77, 409, 12]


@pytest.mark.parametrize("quant_type,group,gguf_type,lossless", [
    ("int4", 32, "Q4_0", True), ("tri", 128, "Q2_0", True), ("tri", 256, "TQ2_0", True), ("tri-dense", 256, "TQ1_0", True),
    ("bin", 128, "Q1_0", True)])
def test_gguf_export_reads_back(quant_type, group, gguf_type, lossless, tmp_path, smollm2_gguf):
    """Exported weights equal the checkpoint's (or differ by exactly the reported error); llama-layout
    q/k rows; transformers reads the file (Q1_0 excepted: it has no decoder for it)."""
    from engine.sources.checkpoint_file import BonsaiCheckpoint
    from engine.sources.gguf_file import GGUFFile
    from engine.quantization.quantize import QuantizeOptions, quantize
    from quant.recipe import Recipe
    from tests.gguf_tiny import write_tiny_gguf
    src = write_tiny_gguf(tmp_path / "src.gguf", smollm2_gguf, T.F32)
    ckpt, gguf = tmp_path / "ckpt", tmp_path / "out.gguf"
    report = quantize(src, ckpt, QuantizeOptions(Recipe(QuantSpec(quant_type, group)), gguf=gguf, evaluate=False))
    exported = report.gguf
    mask = os.umask(0)
    os.umask(mask)
    assert gguf.stat().st_mode & 0o777 == 0o666 & ~mask  # not the temporary file's private mode
    assert {t.gguf_type for t in exported.tensors if t.source_type == quant_type} == {gguf_type}
    assert (exported.relative_error == 0 and exported.lossless) if lossless else (0.01 < exported.relative_error < 0.3)
    out = GGUFFile(gguf)
    cfg = out.model_config()
    theirs = dict(out.iter_canonical_tensors(cfg))
    ours = dict(BonsaiCheckpoint(ckpt).iter_canonical_tensors(cfg))
    assert set(theirs) == set(ours)
    errors = {t.name: t.relative_error for t in exported.tensors}
    for name, w in ours.items():
        from engine.sources.gguf_file import gguf_name
        real = float((theirs[name] - w).norm() / w.norm())
        assert real == pytest.approx(errors[gguf_name(name)], rel=1e-3, abs=1e-7), name
    source_file = GGUFFile(src)
    for key, value in source_file.metadata.items():  # copied with their exact types
        if key not in ("general.file_type", "general.quantization_version", "general.alignment"):
            assert out.metadata[key] == value and out.metadata_types[key] == source_file.metadata_types[key], key
    if lossless:
        torch.testing.assert_close(logits_of(gguf, IDS), logits_of(ckpt, IDS), atol=1e-4, rtol=1e-4)
    if gguf_type not in ("Q1_0", "Q2_0"):  # transformers has no decoder for them
        expected = transformers_logits(gguf, IDS)
        torch.testing.assert_close(logits_of(gguf, IDS), expected, atol=1e-4 * max(1, float(expected.abs().max())), rtol=0)


def test_gguf_export_from_a_hf_source_builds_the_tokenizer(tmp_path, smollm2_gguf):
    from engine.sources.gguf_file import GGUFFile
    from engine.quantization.quantize import QuantizeOptions, quantize
    from engine.sources.tokenizer import Tokenizer
    from quant.recipe import Recipe
    from tests.gguf_tiny import write_tiny_gguf
    from tests.hf_tiny import write_tiny_hf
    hf = write_tiny_hf(tmp_path / "hf", write_tiny_gguf(tmp_path / "t.gguf", smollm2_gguf, T.F32))
    gguf = tmp_path / "ckpt" / "model.gguf"  # inside the checkpoint: written into it before the rename
    quantize(hf, tmp_path / "ckpt", QuantizeOptions(Recipe(QuantSpec("int8", 32)), gguf=gguf, evaluate=False))
    meta = GGUFFile(gguf).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    ours, ref = Tokenizer.from_gguf_metadata(meta), Tokenizer.from_hf_dir(hf)
    for text in ["Hello world 123", "<|im_start|>user\nhi<|im_end|>", "  ü\t\n"]:
        assert ours.encode(text, True) == ref.encode(text, True)
    assert ours.chat_template == ref.chat_template and ours.eos_id == ref.eos_id
    torch.testing.assert_close(logits_of(gguf, IDS), logits_of(tmp_path / "ckpt", IDS), atol=1e-4, rtol=1e-4)
    expected = transformers_logits(gguf, IDS)  # llama.cpp's q/k layout, undone by transformers
    torch.testing.assert_close(logits_of(gguf, IDS), expected, atol=1e-4 * max(1, float(expected.abs().max())), rtol=0)


def test_unknown_types_are_refused_in_one_line(tmp_path, smollm2_gguf):
    """A type id nobody knows is named with what bonsai reads (Prism's rotation: tests/test_prism_hadamard.py)."""
    from engine.errors import BonsaiError
    from engine.sources.gguf_file import GGUFFile
    path = tmp_path / "m.gguf"
    write_raw_gguf(path, smollm2_gguf, gguf_codec.PTQ1_0_ID)
    data = bytearray(path.read_bytes())
    unknown = data.replace((gguf_codec.PTQ1_0_ID).to_bytes(4, "little") + b"\0" * 4, (199).to_bytes(4, "little") + b"\0" * 4, 1)
    (tmp_path / "u.gguf").write_bytes(bytes(unknown))
    with pytest.raises(BonsaiError, match=r"unknown type id 199, which bonsai does not decode \(it reads .*PTQ1_0") as e:
        GGUFFile(tmp_path / "u.gguf").model_config()
    assert "\n" not in str(e.value)

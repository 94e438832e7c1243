"""`bonsai quantize --gguf` of a Qwen3.5 hybrid writes llama.cpp's `qwen35`: a tiny HF hybrid (2 key heads,
4 value heads: the V-head reorder is exercised) quantized to int4, ternary and bf16 gives the names,
shapes, metadata and stored values of llama.cpp's converter (tests/hybrid_gguf.py, run on the same
weights) and the logits of the checkpoint (and, for bf16, of transformers); a reorder that would split
scale groups is lossy and refused unless allowed; a layer mix no interval gives is written as flags;
a source GGUF's MTP blocks are not claimed; a checkpoint's MTP head is written as the converter writes it. (llama-cpp-python is not installed here, so llama.cpp itself
does not load these files in the tests.)"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")

from engine.errors import BonsaiError  # noqa: E402
from engine.quantization import gguf_export_qwen35 as q35  # noqa: E402
from engine.quantization.gguf_export import packed_export_type  # noqa: E402
from engine.quantization.quantize import QuantizeOptions, quantize  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources import gguf_qwen35  # noqa: E402
from engine.sources.checkpoint_file import canonical_name, hf_name  # noqa: E402
from engine.sources.gguf_file import GGUFFile  # noqa: E402
from engine.sources.gguf_reader import read_gguf, tensor_bytes  # noqa: E402
from engine.sources.hybrid_config import FULL, LINEAR  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402
from quant import gguf_types  # noqa: E402
from quant.checkpoint import Checkpoint  # noqa: E402
from quant.formats import QuantSpec  # noqa: E402
from quant.recipe import Recipe  # noqa: E402
from tests.hybrid_gguf import convert_tensor, write_qwen35_gguf  # noqa: E402
from tests.hybrid_tiny import hybrid_config, make_hybrid_model, reference_logits, tokenizer_dir  # noqa: E402

PROMPT = [(i * 37 + 11) % 49152 for i in range(19)]
SPECS = {"int4": QuantSpec("int4", 32), "tri": QuantSpec("tri", 64), "bf16": QuantSpec("bf16")}
GGUF_TYPE = {"int4": "Q4_0", "tri": "Q2_0", "bf16": "BF16"}
# keys our export adds to the converter's: the vocabulary size (bonsai's dense export writes it too)
EXTRA_KEYS = {"qwen35.vocab_size", "general.quantization_version"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory, smollm2_gguf):
    return tokenizer_dir(tmp_path_factory, smollm2_gguf)


@pytest.fixture(scope="module")
def hf(tmp_path_factory, tok):
    """Value heads of 64 (so out_proj's groups of 32 and 64 stay whole), weights bf16-exact (so the bf16
    checkpoint is the HF model itself)."""
    path = tmp_path_factory.mktemp("q35-hf")
    model = make_hybrid_model(path, tok, linear_key_head_dim=64, linear_value_head_dim=64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def mirror(tmp_path_factory, hf, smollm2_gguf):
    """What llama.cpp's converter writes for the HF directory (F32)."""
    return write_qwen35_gguf(hf[0], tmp_path_factory.mktemp("q35-mirror") / "mirror.gguf", smollm2_gguf)


@pytest.fixture(scope="module", params=list(SPECS))
def exported(request, tmp_path_factory, hf):
    d = tmp_path_factory.mktemp(f"q35-{request.param}")
    report = quantize(hf[0], d / "ckpt", QuantizeOptions(Recipe(SPECS[request.param]), evaluate=False,
                                                         gguf=d / "out.gguf"))
    return request.param, d / "ckpt", d / "out.gguf", report


def _stored(path):
    """{GGUF name: (type name, float32 tensor as stored)}."""
    meta, extents, data = read_gguf(path)
    return meta, {t.name: (gguf_types.type_name(t.type_id), gguf_types.dequantize(tensor_bytes(data, t), t.type_id,
                                                                                   t.shape)) for t in extents}


def _logits(path, ids=PROMPT):
    runner = ModelRunner(load_model(path, dtype=torch.float32, weight_dtype=torch.float32), 64, prefill_chunk_size=8)
    return runner.forward(runner.slot(0), ids, num_logits=None)  # [T, V]


def test_names_shapes_and_metadata_are_the_converters(exported, mirror):
    kind, _, path, report = exported
    ours, ref = read_gguf(path)[:2], read_gguf(mirror)[:2]
    assert {t.name: t.shape for t in ours[1]} == {t.name: t.shape for t in ref[1]}
    meta, ref_meta = ours[0], ref[0]
    for key, value in ref_meta.items():
        if not key.startswith(("tokenizer.", "GGUF.")):
            assert meta.get(key) == value, key
    assert {k for k in meta if not k.startswith(("tokenizer.", "GGUF."))} - set(ref_meta) == EXTRA_KEYS
    assert meta["qwen35.full_attention_interval"] == 4 and meta["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]
    assert meta["qwen35.block_count"] == 4 and "qwen35.nextn_predict_layers" not in meta
    assert meta["tokenizer.ggml.tokens"] == ref_meta["tokenizer.ggml.tokens"]
    assert report.gguf.lossless
    types = {t.name: t.gguf_type for t in report.gguf.tensors}
    assert types["blk.0.ssm_conv1d.weight"] == "F32" and types["blk.0.ssm_a"] == "F32"
    assert types["blk.0.ssm_out.weight"] == types["blk.0.attn_qkv.weight"] == types["blk.3.attn_q.weight"] \
        == GGUF_TYPE[kind]


def test_stored_values_are_the_converters(exported, hf):
    """Every tensor as stored equals the converter's transforms (norms + 1, -exp(A_log), squeezed conv,
    tiled value heads) applied to the checkpoint's weights: for codes, rows and whole scale groups moved."""
    _, ckpt, path, _ = exported
    checkpoint, hp = Checkpoint(ckpt), json.loads((hf[0] / "config.json").read_text())
    _, stored = _stored(path)
    for name in checkpoint.entries:
        want = convert_tensor(name, checkpoint.read_dequantized(name), hp)
        got = stored[gguf_qwen35.gguf_name(canonical_name(name))][1]
        assert got.shape == want.shape and torch.equal(got, want), name


def test_logits_equal_the_checkpoints(exported, hf):
    kind, ckpt, path, _ = exported
    got = _logits(path)
    assert (_logits(ckpt) - got).abs().max() <= 1e-5
    if kind == "bf16":  # the float export: the HF model itself (its weights are bf16-exact)
        assert (got - reference_logits(hf[1], PROMPT)).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def odd(tmp_path_factory, tok):
    """Value heads of 16 (int4 g32 groups split across heads) and a layer mix no interval gives."""
    path = tmp_path_factory.mktemp("q35-odd")
    make_hybrid_model(path, tok, vocab_size=64, layer_types=[LINEAR, FULL, LINEAR, LINEAR])
    return path


def test_a_reorder_that_splits_scale_groups_is_lossy(odd, tmp_path):
    opts = QuantizeOptions(Recipe(QuantSpec("int4", 32)), evaluate=False, gguf=tmp_path / "a.gguf")
    with pytest.raises(BonsaiError, match=r"--gguf: 3 tensors .* e\.g\. model\.layers\.0\.linear_attn\.out_proj\.weight "
                                          r"\(int4 g32 → F16: the V-head reorder splits .*linear_value_head_dim"):
        quantize(odd, tmp_path / "a", opts)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.gguf").exists()
    opts = QuantizeOptions(Recipe(QuantSpec("int4", 32)), evaluate=False, gguf=tmp_path / "b.gguf",
                           allow_lossy_gguf=True)
    report = quantize(odd, tmp_path / "b", opts)
    types = {t.name: (t.gguf_type, t.relative_error) for t in report.gguf.tensors}
    assert {n for n, (t, _) in types.items() if t == "F16"} == {f"blk.{i}.ssm_out.weight" for i in (0, 2, 3)}
    assert not report.gguf.lossless and 0 < types["blk.0.ssm_out.weight"][1] < 1e-3
    ids = [(i * 29 + 3) % 64 for i in range(24)]
    ref, got = _logits(tmp_path / "b", ids), _logits(tmp_path / "b.gguf", ids)
    assert (ref - got).abs().max() <= 1e-3 * ref.abs().max()  # float16 rounding of the three out_proj

    meta = read_gguf(tmp_path / "b.gguf")[0]  # the layer mix: one flag per block, no interval
    assert meta["qwen35.attention.recurrent_layers"] == [True, False, True, True]
    assert "qwen35.full_attention_interval" not in meta
    assert GGUFFile(tmp_path / "b.gguf").model_config().hybrid.layer_types == (LINEAR, FULL, LINEAR, LINEAR)


def test_a_source_ggufs_mtp_blocks_are_not_claimed(hf, tmp_path, smollm2_gguf):
    meta = {"qwen35.block_count": (5, V.UINT32), "qwen35.nextn_predict_layers": (1, V.UINT32)}
    src = write_qwen35_gguf(hf[0], tmp_path / "mtp.gguf", smollm2_gguf, meta=meta)
    report = quantize(src, tmp_path / "q", QuantizeOptions(Recipe(QuantSpec("int4", 32)), evaluate=False,
                                                           gguf=tmp_path / "q.gguf"))
    assert report.gguf.lossless
    out_meta, stored = _stored(tmp_path / "q.gguf")
    src_meta, src_stored = _stored(src)
    assert out_meta["qwen35.block_count"] == 4 and "qwen35.nextn_predict_layers" not in out_meta
    assert {k: v for k, v in out_meta.items() if k not in q35.NOT_COPIED | EXTRA_KEYS and not k.startswith("GGUF.")} \
        == {k: v for k, v in src_meta.items() if k not in q35.NOT_COPIED and not k.startswith("GGUF.")}
    assert set(stored) == set(src_stored)
    assert (_logits(tmp_path / "q") - _logits(tmp_path / "q.gguf")).abs().max() <= 1e-5


def test_the_checkpoints_mtp_head_is_written_as_the_converter_writes_it(hf, tmp_path, smollm2_gguf, one_thread):
    """A checkpoint's MTP head (copied by quantize as bfloat16) is exported as llama.cpp's converter writes the
    source's: its names, shapes, metadata (block_count 5, nextn_predict_layers 1) and values (the head made
    bf16-exact), read back as the checkpoint's head; --spec mtp drafts from the GGUF as from the checkpoint."""
    import shutil

    from engine.sources.mtp_source import read_mtp_tensors
    from engine.speculative.config import SpeculativeConfig, build_drafter
    from tests.engine_runs import run_engine
    from tests.hybrid_tiny import add_mtp_head
    src = tmp_path / "hf"
    shutil.copytree(hf[0], src)
    head = add_mtp_head(src, hf[1])
    from safetensors.torch import save_file
    save_file({f"mtp.{k}": v.bfloat16().float().contiguous() for k, v in head.state_dict().items()},
              str(src / "model-mtp.safetensors"))
    mirror = write_qwen35_gguf(src, tmp_path / "mirror.gguf", smollm2_gguf)
    report = quantize(src, tmp_path / "q", QuantizeOptions(Recipe(QuantSpec("tri", 64)), evaluate=False,
                                                           gguf=tmp_path / "q.gguf"))
    assert report.gguf.lossless and len(report.mtp_head) == 15
    (meta, ours), (ref_meta, ref) = _stored(tmp_path / "q.gguf"), _stored(mirror)
    assert meta["qwen35.block_count"] == ref_meta["qwen35.block_count"] == 5
    assert meta["qwen35.nextn_predict_layers"] == ref_meta["qwen35.nextn_predict_layers"] == 1
    mtp_names = {n for n in ref if n.startswith("blk.4.")}
    assert len(mtp_names) == 15 and mtp_names == {n for n in ours if n.startswith("blk.4.")}
    for name in mtp_names:
        assert ours[name][1].shape == ref[name][1].shape and torch.equal(ours[name][1], ref[name][1]), name
    from engine.sources.checkpoint_file import BonsaiCheckpoint
    gguf, ckpt = GGUFFile(tmp_path / "q.gguf"), BonsaiCheckpoint(tmp_path / "q")
    got, want = read_mtp_tensors(gguf, gguf.model_config()), read_mtp_tensors(ckpt, ckpt.model_config())
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
    outputs = []
    for source in (tmp_path / "q", tmp_path / "q.gguf"):
        target = load_model(source, dtype=torch.float32, weight_dtype=torch.float32)
        drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=3, adaptive=False), target, 64)
        outputs.append(run_engine(ModelRunner(target, 64), None, PROMPT, drafter=drafter, k=3, max_tokens=8,
                                  ignore_eos=True, text=False)[1])
        outputs.append(drafter.propose(PROMPT + outputs[-1], 3).tokens)
    assert outputs[0] == outputs[2] and outputs[1] == outputs[3]


def test_to_stored_inverts_from_stored():
    config = ModelConfig.from_hf_config(hybrid_config().to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]})
    g = torch.Generator().manual_seed(0)
    shapes = {f"layers.0.{p}.weight": s for p, s in config.layer_linear_shapes(0).items()}
    hc = config.hybrid
    shapes |= {"layers.0.conv1d.weight": (hc.conv_dim, 1, hc.conv_kernel), "layers.0.A_log.param": (4,),
               "layers.0.dt_bias.param": (4,), "layers.0.input_layernorm.weight": (64,), "norm.weight": (64,),
               "layers.0.linear_norm.weight": (16,)}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        back = gguf_qwen35.from_stored(name, gguf_qwen35.to_stored(name, t, config), config)
        assert back.shape == t.shape and torch.allclose(back, t, atol=1e-6), name
        if name.endswith("weight") and len(shape) == 2 and "conv1d" not in name:
            codes = torch.randint(-1, 2, shape, generator=g, dtype=torch.int8)
            scales = torch.rand(shape[0], shape[1] // 16, generator=g)
            c, s = gguf_qwen35.codes_from_stored(name, *gguf_qwen35.codes_to_stored(name, codes, scales, config), config)
            assert torch.equal(c, codes) and torch.equal(s, scales), name
    codes, scales = torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 2)  # group 32 splits a 16-wide head
    assert gguf_qwen35.codes_to_stored("layers.0.out_proj.weight", codes, scales, config) is None
    assert hf_name("layers.0.A_log.param") == "model.layers.0.linear_attn.A_log"


def test_only_a_split_out_proj_is_written_as_f16():
    config = ModelConfig.from_hf_config(hybrid_config().to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]})
    out_proj, qkv = "model.layers.0.linear_attn.out_proj.weight", "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert packed_export_type(out_proj, "int4", 64, 16, config) == (T.Q4_0, "int4 g16 → Q4_0")  # merged, not split
    for group in (32, 48):  # split across 16-wide value heads, exact type or not
        type_id, how = packed_export_type(out_proj, "tri", 96, group, config)
        assert type_id == T.F16 and "the V-head reorder splits" in how
    assert packed_export_type(qkv, "int4", 64, 32, config)[1] is None
    dense = ModelConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4})
    assert packed_export_type("model.layers.0.self_attn.o_proj.weight", "int4", 64, 32, dense) == (T.Q4_0, None)


@pytest.mark.parametrize("types, preferred, interval", [
    ((LINEAR, LINEAR, LINEAR, FULL), None, 4), ((LINEAR, FULL) * 2, None, 2), ((FULL,) * 3, None, 1),
    ((LINEAR,) * 3, None, 4), ((LINEAR,) * 3, 8, 8), ((LINEAR, LINEAR, LINEAR, FULL), 2, 4),
    ((LINEAR, FULL, LINEAR, LINEAR), None, None)])
def test_the_layer_mix_is_an_interval_where_one_gives_it(types, preferred, interval):
    assert q35.full_attention_interval(types, preferred) == interval

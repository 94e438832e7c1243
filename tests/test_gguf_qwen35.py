"""llama.cpp `qwen35` GGUFs: a tiny HF Qwen3.5 converted the converter's way (tests/hybrid_gguf.py) loads
with the HF directory's config, tensors and logits; names round-trip; stored codes reorder like the floats;
broken files are refused in one line."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import GGUFValueType as V

pytest.importorskip("transformers.models.qwen3_5")

from engine.errors import ModelFileError, UnsupportedModelError  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources import gguf_qwen35  # noqa: E402
from engine.sources.gguf_file import GGUFFile  # noqa: E402
from engine.sources.hf_files import HFModelDir  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from tests.hybrid_gguf import convert_tensor, gguf_tensor_name, write_qwen35_gguf  # noqa: E402
from tests.hybrid_tiny import make_hybrid_model, tokenizer_dir  # noqa: E402
from tests.test_cli_errors import bonsai_in_process  # noqa: E402

PROMPT = [(i * 37 + 11) % 49152 for i in range(19)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("qwen35-hf")
    make_hybrid_model(path, tokenizer_dir(tmp_path_factory, smollm2_gguf))
    return path


@pytest.fixture(scope="module")
def gguf_f32(tmp_path_factory, hf_dir, smollm2_gguf):
    return write_qwen35_gguf(hf_dir, tmp_path_factory.mktemp("q35") / "tiny-f32.gguf", smollm2_gguf)


def _hf_tensors(hf_dir):
    src = HFModelDir(hf_dir)
    return {name: t.float() for name, t in src.iter_canonical_tensors(src.model_config())}


def test_config_and_every_tensor_equal_the_hf_directory(hf_dir, gguf_f32):
    src = GGUFFile(gguf_f32)
    config = src.model_config()
    ref_config = HFModelDir(hf_dir).model_config()
    assert config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps, rel=1e-6)  # a float32 in the GGUF
    assert replace(config, rms_norm_eps=ref_config.rms_norm_eps) == ref_config
    assert config.hybrid.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    ours = dict(src.iter_canonical_tensors(config))
    ref = _hf_tensors(hf_dir)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].shape == t.shape, name
        assert (ours[name] - t).abs().max() <= 1e-6, name  # exact but for (w + 1) - 1 and log(exp(A_log))
    for stored in src.tensor_names:
        assert src.stored_name(src.canonical(stored)) == stored


def test_the_v_head_reorder_is_undone(hf_dir, gguf_f32):
    """The tiny model has 2 key and 4 value heads: stored V rows differ from HF's, read ones do not."""
    src = GGUFFile(gguf_f32)
    raw = src.read_tensor("layers.0.in_proj_z.weight", src.model_config())
    stored = next(torch.from_numpy(t.data.copy()) for t in GGUFReader(gguf_f32).tensors
                  if t.name == "blk.0.attn_gate.weight")  # [Hv * Dv, hidden], tiled value heads
    assert not torch.equal(stored, raw) and torch.equal(raw, _hf_tensors(hf_dir)["layers.0.in_proj_z.weight"])


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_types_load_within_their_rounding(hf_dir, tmp_path, smollm2_gguf, qtype):
    path = write_qwen35_gguf(hf_dir, tmp_path / f"tiny-{qtype.name}.gguf", smollm2_gguf, qtype)
    src = GGUFFile(path)
    config = src.model_config()
    step = 2.0 ** -8 if qtype == T.BF16 else 2.0 ** -11
    ref = _hf_tensors(hf_dir)
    for name, t in src.iter_canonical_tensors(config):
        assert (t - ref[name]).abs().max() <= step * (ref[name].abs().max() + 1), name


def test_logits_equal_the_hf_directory_model(hf_dir, gguf_f32):
    runs = []
    for path in (hf_dir, gguf_f32):
        runner = ModelRunner(load_model(path, dtype=torch.float32, weight_dtype=torch.float32), max_seq_len=64,
                             prefill_chunk_size=8)
        slot = runner.slot(0)
        rows = [runner.forward(slot, PROMPT[:15], num_logits=None)]  # [15, V]
        rows += [runner.forward(slot, [tok]) for tok in PROMPT[15:]]  # 4 decode steps, [1, V] each
        runs.append(torch.cat(rows))
    assert (runs[0] - runs[1]).abs().max() <= 1e-5


def test_stored_codes_reorder_like_the_floats(hf_dir, gguf_f32):
    config = GGUFFile(gguf_f32).model_config()
    g = torch.Generator().manual_seed(0)
    for part, (rows, cols) in config.layer_linear_shapes(0).items():
        name, group = f"layers.0.{part}.weight", 16
        codes = torch.randint(-1, 2, (rows, cols), generator=g, dtype=torch.int8)
        scales = torch.rand(rows, cols // group, generator=g)
        dense = codes.float() * scales.repeat_interleave(group, 1)  # [N, K] as stored
        c, s = gguf_qwen35.codes_from_stored(name, codes, scales, config)
        assert torch.equal(c.float() * s.repeat_interleave(group, 1), gguf_qwen35.from_stored(name, dense, config))
    codes, scales = torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 2)  # group 32 splits a 16-wide head
    assert gguf_qwen35.codes_from_stored("layers.0.out_proj.weight", codes, scales, config) is None
    src = GGUFFile(gguf_f32)  # the loader plans those as floats from the metadata alone
    assert not src.keeps_codes("layers.0.out_proj.weight", 32) and src.keeps_codes("layers.0.out_proj.weight", 16)
    assert src.keeps_codes("layers.0.in_proj_qkv.weight", 256) and src.keeps_codes("layers.3.o_proj.weight", 256)


def test_writer_mirrors_the_converter_on_named_tensors():
    hp = {"linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 1,
          "linear_value_head_dim": 1}
    assert gguf_tensor_name("model.layers.2.linear_attn.dt_bias", 4) == "blk.2.ssm_dt.bias"
    assert gguf_tensor_name("model.layers.2.linear_attn.A_log", 4) == "blk.2.ssm_a"
    assert gguf_tensor_name("model.layers.3.post_attention_layernorm.weight", 4) == "blk.3.post_attention_norm.weight"
    assert torch.equal(convert_tensor("model.layers.0.linear_attn.norm.weight", torch.ones(2), hp), torch.ones(2))
    assert torch.equal(convert_tensor("model.norm.weight", torch.ones(2), hp), torch.full((2,), 2.0))


def test_bonsai_info(capsys, gguf_f32):
    proc = bonsai_in_process(capsys, "info", str(gguf_f32), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"]["hybrid"]["deltanet_layers"] == 3


@pytest.mark.parametrize("meta, skip, error, match", [
    ({}, frozenset({"blk.1.ssm_a"}), ModelFileError, "lacks tensors the architecture needs: blk.1.ssm_a"),
    ({"qwen35.ssm.inner_size": (65, V.UINT32)}, frozenset(), UnsupportedModelError, "inner_size \\(65\\) is not a"),
    ({"qwen35.ssm.state_size": (8, V.UINT32)}, frozenset(), ModelFileError, "blk.0.attn_qkv.weight has shape"),
    ({"qwen35.full_attention_interval": (2, V.UINT32)}, frozenset(), ModelFileError, "lacks tensors"),
    ({"qwen35.rope.dimension_count": (64, V.UINT32)}, frozenset(), UnsupportedModelError, "dimension_count is 64"),
])
def test_broken_files_are_refused_in_one_line(hf_dir, tmp_path, smollm2_gguf, meta, skip, error, match):
    path = write_qwen35_gguf(hf_dir, tmp_path / "bad.gguf", smollm2_gguf, meta=meta, skip=skip)
    with pytest.raises(error, match=match) as e:
        GGUFFile(path).model_config()
    assert "\n" not in str(e.value)


def test_mtp_blocks_counted_in_block_count_are_not_layers(hf_dir, tmp_path, smollm2_gguf):
    meta = {"qwen35.block_count": (5, V.UINT32), "qwen35.nextn_predict_layers": (1, V.UINT32)}
    path = write_qwen35_gguf(hf_dir, tmp_path / "mtp.gguf", smollm2_gguf, meta=meta)
    src = GGUFFile(path)
    assert src.model_config().num_layers == 4 and src.canonical("blk.4.attn_q.weight") is None

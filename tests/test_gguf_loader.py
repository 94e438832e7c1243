"""GGUF loading: every supported tensor type against transformers' GGUF loader; bad files."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.errors import ModelFileError, UnsupportedModelError
from engine.sources.gguf_file import GGUFFile, canonical_name
from engine.weights.loader import load_model
from engine.runtime.runner import ModelRunner
from tests.gguf_tiny import write_tiny_gguf

transformers = pytest.importorskip("transformers")

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
         T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0]


def test_canonical_names():
    assert canonical_name("blk.3.attn_q.weight") == "layers.3.q_proj.weight"
    assert canonical_name("blk.0.attn_q.bias") == "layers.0.q_proj.bias"
    assert canonical_name("blk.11.ffn_down.weight") == "layers.11.down_proj.weight"
    assert canonical_name("blk.1.attn_k_norm.weight") == "layers.1.k_norm.weight"
    assert canonical_name("token_embd.weight") == "embed_tokens.weight"
    assert canonical_name("output.weight") == "lm_head.weight"
    assert canonical_name("output_norm.weight") == "norm.weight"
    assert canonical_name("rope_freqs.weight") == "rope_freqs"
    assert canonical_name("blk.0.something_new.weight") is None


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tensor_type_matches_transformers(qtype, tmp_path, smollm2_gguf):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", smollm2_gguf, qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 100, 200, 1000, 5, 77, 409, 12]])
    with torch.no_grad():
        expected = ref(ids).logits[0]  # [T, V]
    loaded = load_model(path, weight_dtype=torch.float32)  # exact decoding, not float16 storage
    if qtype != T.F32:  # every matrix (embedding, 7 per layer, output) is stored in the type
        assert loaded.summary.types[qtype.name][0] == 2 + 7 * 2
    runner = ModelRunner(loaded, max_seq_len=32)
    ours = runner.forward(runner.slot(), ids[0].tolist(), num_logits=None)
    scale = expected.abs().max().item()
    assert (ours - expected).abs().max().item() <= 1e-4 * max(scale, 1.0), qtype.name


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(bad)


def test_truncated_gguf(tmp_path, smollm2_gguf):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_gguf, T.Q8_0)
    data = path.read_bytes()
    for keep in (len(data) - 1000, len(data) // 2, 100):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ModelFileError, match="corrupt or truncated"):
            GGUFFile(cut)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model(tmp_path / "nope.gguf")


def test_unsupported_architecture(tmp_path, smollm2_gguf):
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", smollm2_gguf, T.F16, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path)

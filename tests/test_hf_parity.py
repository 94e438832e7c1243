"""Tiny random Llama / Qwen2 / Qwen3 models saved by transformers: our logits must match theirs."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.errors import ModelFileError, UnsupportedModelError  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
}


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("tok")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    tok.save_pretrained(out)
    return out


def make_hf_model(arch: str, path, tokenizer_dir, shard: bool = False):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # make biases and norms non-trivial so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="2MB" if shard else "10GB")
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, tmp_path, hf_tokenizer_dir):
    ref = make_hf_model(arch, tmp_path, hf_tokenizer_dir, shard=arch == "qwen3")
    if arch == "qwen3":
        assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]  # [T, V]
    loaded = load_model(tmp_path, weight_dtype=torch.float32)  # exact path; float16 storage is tested elsewhere
    assert loaded.config.architecture == arch
    runner = ModelRunner(loaded, max_seq_len=64)
    ours = runner.forward(runner.slot(), ids[0].tolist(), num_logits=None)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
    # the same positions computed one token at a time through the KV cache
    runner.slot().reset()
    steps = torch.stack([runner.forward(runner.slot(), [t])[-1] for t in ids[0].tolist()])
    torch.testing.assert_close(steps, expected, atol=2e-4, rtol=1e-4)


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        load_model(tmp_path)


def test_unsupported_rope_scaling(tmp_path, hf_tokenizer_dir):
    make_hf_model("llama", tmp_path, hf_tokenizer_dir)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn'"):
        load_model(tmp_path)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelFileError, match="pickle"):
        load_model(tmp_path)

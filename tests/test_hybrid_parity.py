"""Qwen3.5 hybrid (Gated DeltaNet + gated attention) against transformers at fp32 on a tiny random model."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

from engine.errors import UnsupportedModelError  # noqa: E402
from engine.runtime.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from tests.hybrid_tiny import make_hybrid_model, reference_logits  # noqa: E402

TOL = 1e-4
PROMPT = [(i * 37 + 11) % 49152 for i in range(40)]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("tok")
    transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, hf_tokenizer_dir):
    path = tmp_path_factory.mktemp("qwen35")
    model = make_hybrid_model(path, hf_tokenizer_dir)
    return path, model, load_model(path, dtype=torch.float32, weight_dtype=torch.float32)


def test_chunked_equals_recurrent():
    g = torch.Generator().manual_seed(0)
    b, t, hk, hv, dk, dv = 2, 37, 2, 4, 8, 6
    q, k = torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -torch.rand(b, t, hv, generator=g)
    beta = torch.rand(b, t, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g)
    out_r, s_r, kept = recurrent_gated_delta_rule(q, k, v, decay, beta, s0, keep_states=True)
    for chunk in (1, 8, 16, 64):
        out_c, s_c = chunk_gated_delta_rule(q, k, v, decay, beta, s0, chunk)
        assert (out_c - out_r).abs().max() < 1e-4 and (s_c - s_r).abs().max() < 1e-4
    assert kept.shape == (b, t + 1, hv, dk, dv) and torch.equal(kept[:, -1], s_r) and torch.equal(kept[:, 0], s0)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 64])
def test_prefill_chunks_match_transformers(hybrid, chunk):
    _, model, loaded = hybrid
    ref = reference_logits(model, PROMPT)  # [T, V]
    runner = ModelRunner(loaded, max_seq_len=128, prefill_chunk_size=chunk)
    slot = runner.slot(0)
    rows = [runner.forward(slot, PROMPT[i:i + chunk], num_logits=None) for i in range(0, len(PROMPT), chunk)]
    assert (torch.cat(rows) - ref).abs().max() <= TOL


def test_decode_token_by_token_and_two_slots_batched(hybrid):
    _, model, loaded = hybrid
    other = [(i * 53 + 5) % 49152 for i in range(23)]
    runner = ModelRunner(loaded, max_seq_len=128, num_slots=2, prefill_chunk_size=8)
    a, b = runner.slot(0), runner.slot(1)
    runner.prefill(a, PROMPT[:30])
    runner.prefill(b, other[:13])
    for i in range(10):  # both slots, one batched step each
        logits = runner.decode_batch([a, b], [PROMPT[30 + i], other[13 + i]])  # [2, V]
        assert (logits[0] - reference_logits(model, PROMPT[:31 + i])[-1]).abs().max() <= TOL
        assert (logits[1] - reference_logits(model, other[:14 + i])[-1]).abs().max() <= TOL
    c = runner.slot(0)
    c.reset()
    for i, tok in enumerate(PROMPT[:12]):  # one token at a time from an empty slot (a reused slot's old state ignored)
        logits = runner.forward(c, [tok])
        assert (logits[-1] - reference_logits(model, PROMPT[:i + 1])[-1]).abs().max() <= TOL


def test_verify_rollback_restores_the_state(hybrid):
    _, model, loaded = hybrid
    runner = ModelRunner(loaded, max_seq_len=128, prefill_chunk_size=16)
    slot = runner.slot(0)
    runner.prefill(slot, PROMPT[:20])
    runner.verify(slot, PROMPT[20:25] + [7, 8, 9])  # 5 right, 3 wrong drafts
    slot.rewind(3)
    slot.rewind(1)  # two rewinds back into one verify pass (as spec_step does)
    logits = runner.forward(slot, PROMPT[24:30], num_logits=None)
    assert (logits - reference_logits(model, PROMPT[:30])[24:]).abs().max() <= TOL
    runner.forward(slot, [1])  # a later pass drops the rollback points
    with pytest.raises(Exception, match="cannot go back"):
        slot.rewind(3)


def test_config_validation():
    from tests.hybrid_tiny import hybrid_config
    cfg = hybrid_config().to_dict()
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    assert ModelConfig.from_hf_config(cfg).hybrid.counts() == {"linear_attention": 3, "full_attention": 1}
    bad = dict(cfg, layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="layer_types\\[1\\] is 'mamba'"):
        ModelConfig.from_hf_config(bad)
    vlm = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": cfg,
           "tie_word_embeddings": False}
    assert ModelConfig.from_hf_config(json.loads(json.dumps(vlm))).num_layers == 4

"""The hybrid architecture YAMLs (configs/models/qwen3.6-27b.yaml, qwen3.5-0.8b.yaml) for --load-format dummy:
their shapes, `bonsai info` showing the layer mix and the state, and generated weights in the run's format with
DeltaNet's small gate projections kept float."""
from __future__ import annotations

import json

import torch

from bonsai_cli.run_options import dummy_architecture
from engine.weights.formats import LinearFormat, WeightFormat, linear_formats
from tests.test_cli_errors import bonsai_in_process


def test_the_27b_and_0_8b_shapes():
    big, _ = dummy_architecture("qwen3.6-27b")
    hc = big.hybrid
    assert hc.counts() == {"linear_attention": 48, "full_attention": 16} and hc.layer_types[3::4] == ("full_attention",) * 16
    assert (big.num_heads, big.num_kv_heads, big.head_dim, big.rotary_dim, big.vocab_size) == (24, 4, 256, 64, 248320)
    assert (hc.linear_num_key_heads, hc.linear_num_value_heads, hc.conv_dim) == (16, 48, 2 * 2048 + 6144)
    assert hc.state_bytes_per_slot(2) == 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)
    assert 26.5e9 < big.num_parameters() < 27.5e9 and not big.tie_word_embeddings
    small, _ = dummy_architecture("qwen3.5-0.8b")
    assert small.hybrid.counts() == {"linear_attention": 18, "full_attention": 6} and small.tie_word_embeddings
    assert 0.7e9 < small.num_parameters() < 0.9e9


def test_gate_projections_stay_float_in_a_packed_run():
    cfg, _ = dummy_architecture("qwen3.6-27b")
    formats = linear_formats(cfg, WeightFormat("tri", 128, "int4"))
    assert formats["layers.0.attention.in_proj_a"] == formats["layers.0.attention.in_proj_b"] == LinearFormat()
    assert formats["layers.0.attention.in_proj_qkv"] == LinearFormat("tri", 128)
    assert formats["layers.3.attention.wqkv"] == LinearFormat("tri", 128) and formats["lm_head"].kind == "int4"


def test_info_shows_the_layer_mix_and_the_state(capsys):
    proc = bonsai_in_process(capsys, "info", "--load-format", "dummy", "configs/models/qwen3.6-27b.yaml",
                             "--weights", "tri", "--head-weights", "int4")
    assert proc.returncode == 0, proc.stderr
    assert "48 Gated DeltaNet + 16 gated attention" in proc.stdout and "149.62 MiB" in proc.stdout
    assert "linear_attention" not in proc.stdout  # the mix, not the 64-entry layer list
    proc = bonsai_in_process(capsys, "info", "--load-format", "dummy", "qwen3.5-0.8b", "--json")
    mix = json.loads(proc.stdout)["architecture"]["hybrid"]
    assert (mix["deltanet_layers"], mix["attention_layers"]) == (18, 6)


def test_generated_hybrid_weights_are_packed_where_the_format_says():
    from engine.runtime.linear import Linear
    from engine.sources.hybrid_config import HybridConfig
    from engine.sources.model_config import ModelConfig
    from engine.weights.loader import load_dummy
    from engine.weights.packed_linear import PackedLinear
    hc = HybridConfig(("linear_attention", "full_attention"), 2, 4, 32, 32)
    cfg = ModelConfig(architecture="qwen35", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, hybrid=hc)
    model = load_dummy(cfg, "tiny", "cpu", WeightFormat("bin", 128, "int4"), dtype=torch.float32).model
    att = model.layers[0].attention
    assert isinstance(att.in_proj_qkv, PackedLinear) and isinstance(att.out_proj, PackedLinear)
    assert type(att.in_proj_a) is Linear and att.in_proj_a.weight.dtype == torch.float32
    assert isinstance(model.layers[1].attention.wqkv, PackedLinear) and isinstance(model.lm_head, PackedLinear)


def test_generated_weights_leave_no_float_tensor_uninitialized(monkeypatch):
    """Seen on the H200 machine: a packed run's float matrices (a hybrid's in_proj_a/b and conv weights) were
    left as torch.empty memory, NaN there. Fresh allocations are poisoned with NaN here to show any such tensor."""
    from engine.sources.hybrid_config import HybridConfig
    from engine.sources.model_config import ModelConfig
    from engine.weights.loader import load_dummy
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() and t.device.type == "cpu" else t
    monkeypatch.setattr(torch, "empty", poisoned)
    hc = HybridConfig(("linear_attention", "full_attention", "linear_attention"), 2, 4, 32, 32)
    cfg = ModelConfig(architecture="qwen35", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=256, hybrid=hc)
    for fmt in (WeightFormat("tri", 128, "int4"), WeightFormat("bf16")):
        model = load_dummy(cfg, "tiny", "cpu", fmt, dtype=torch.float32).model
        bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not p.is_meta and p.isnan().any()]
        assert bad == [], fmt

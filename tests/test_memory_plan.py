"""The memory plan: hand-computed cases (a tiny config, Qwen3-8B), and the plan's weight and KV lines
against the bytes a real tiny runner allocates (dummy, float and packed-checkpoint loads)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine.memory.budget import dummy_formats, model_formats, run_settings
from engine.memory.plan import RunSettings, decode_step_bytes, make_plan, packed_bytes, pool_segment_bytes
from engine.sources.model_config import ModelConfig
from engine.weights.formats import LinearFormat, WeightFormat, linear_formats
from tests.test_kv_cache import TINY

QWEN3_8B = ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                       max_position_embeddings=40960)
CPU = dict(cuda=False, dtype_bytes=4, weight_dtype_bytes=2, graph_rows=0)


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_tiny_config_by_hand():
    """TINY: vocab 97, hidden 32, ffn 64, 2 layers, 4 heads, 2 KV heads, head 16, q/k norms, untied."""
    plan = make_plan(TINY, linear_formats(TINY), RunSettings(max_seq_len=64, slots=2, **CPU))
    embed = lm_head = 97 * 32 * 4  # compute dtype (float32 on the CPU)
    blocks = 2 * (128 * 32 + 32 * 64 + 128 * 32 + 32 * 64) * 2  # wqkv, wo, w13, w2 in float16
    norms = 32 * 4 + 2 * (2 * 32 + 2 * 16) * 4 + 8 * 4  # final norm, per-layer norms + q/k norms, inv_freq
    assert plan.category("weights") == embed + lm_head + blocks + norms == 74_912
    assert plan.category("kv") == 2 * 2 * 2 * (16 * 4) * 64 * 2  # k+v, layers, kv heads, row, positions, slots
    assert plan.category("decode") == 0  # no fused step on the CPU
    assert plan.category("logits") == 2 * 97 * (4 + 44 + 8)  # float32 copy, sampling, penalty counts
    packed = make_plan(TINY, linear_formats(TINY, WeightFormat("tri", 32)), RunSettings(max_seq_len=64, **CPU))
    # tri: 16 codes per int32 word + a float16 scale per 32 inputs
    tri_blocks = 2 * sum(k // 16 * n * 4 + k // 32 * n * 2 for n, k in ((128, 32), (32, 64), (128, 32), (32, 64)))
    assert packed.category("weights") == embed + lm_head + tri_blocks + norms


def test_qwen3_8b_by_hand():
    s = run_settings(QWEN3_8B, "cuda:0", max_seq_len=4096)
    assert (s.dtype_bytes, s.graph_rows) == (2, 1)
    plan = make_plan(QWEN3_8B, linear_formats(QWEN3_8B, WeightFormat("tri", 128)), s)
    per_layer = (4096 // 16 * 6144 * 4 + 32 * 6144 * 2  # wqkv [6144, 4096]
                 + 4096 // 16 * 4096 * 4 + 32 * 4096 * 2  # wo
                 + 4096 // 16 * 24576 * 4 + 32 * 24576 * 2  # w13 [2 x 12288, 4096]
                 + 12288 // 16 * 4096 * 4 + 96 * 4096 * 2  # w2 [4096, 12288]
                 + (2 * 4096 + 2 * 128) * 2)  # norms
    assert per_layer == 51_266_048
    weights = 36 * per_layer + 2 * 151936 * 4096 * 2 + 4096 * 2 + 64 * 4  # + embed, bf16 lm_head, norm, inv_freq
    assert plan.category("weights") == weights == 4_334_905_600
    assert plan.category("kv") == 36 * 8 * 2 * 128 * 2 * 4096 == 603_979_776
    static, live = decode_step_bytes(QWEN3_8B, plan_formats := linear_formats(QWEN3_8B, WeightFormat("tri", 128)), 1, s)
    assert static == 8 + 12 + 6144 * 4 + 24576 * 4 + 4096 * 4  # inputs, qkv, gate_up, the last hidden state
    assert plan.category("decode") == static + pool_segment_bytes(live)
    assert 151936 * 4 in live  # the graph's float32 logits
    # prefill: the 512-row chunk unpacks w13 for cuBLAS in bf16 slices of 64 MiB (8192 of its 24576 columns)
    assert plan.category("prefill") > 4096 * 8192 * 2
    assert packed_bytes(plan_formats["layers.0.feed_forward.w13"], 24576, 4096) == 26_738_688


def test_offload_leaves_a_two_layer_ring_on_the_device():
    s = run_settings(QWEN3_8B, "cuda:0", max_seq_len=32768)
    formats = linear_formats(QWEN3_8B, WeightFormat("tri", 128))
    resident = make_plan(QWEN3_8B, formats, s)
    offloaded = make_plan(QWEN3_8B, formats, RunSettings(**{**vars(s), "kv_offload": True}))
    kv = resident.category("kv")
    assert offloaded.category("kv") == 2 * kv // 36
    assert sum(line.bytes for line in offloaded.host_lines) == kv
    both = make_plan(QWEN3_8B, formats, RunSettings(**{**vars(s), "kv_offload": True, "weight_offload": True}))
    layer = 51_266_048
    assert both.category("weights") == 2 * layer + 151936 * 4096 * 2 + 4096 * 2 + 64 * 4  # ring, lm_head, norm


def test_pool_segments_model_the_caching_allocator():
    assert pool_segment_bytes([100]) == 2 << 20
    assert pool_segment_bytes([3 << 20, 100]) == (2 << 20) + (20 << 20)
    assert pool_segment_bytes([11 << 20]) == 12 << 20


def test_dummy_load_allocates_what_the_plan_says(one_thread):
    from engine.weights.loader import load_dummy
    from engine.runtime.runner import ModelRunner
    tied = ModelConfig(**{**vars(TINY), "extra": {}, "tie_word_embeddings": True})
    for config, fmt in ((TINY, WeightFormat("tri", 32)), (TINY, WeightFormat("bin", 32, head_type="int8")),
                        (tied, WeightFormat("int4", 32, head_type="int8")), (TINY, WeightFormat())):
        loaded = load_dummy(config, "tiny", weight_format=fmt)
        runner = ModelRunner(loaded, max_seq_len=48, num_slots=3)
        weights = dummy_formats(config, fmt)
        plan = make_plan(config, weights.formats, run_settings(config, "cpu", 48, slots=3, dummy=True))
        assert plan.category("weights") == model_bytes(loaded.model), fmt
        assert plan.category("kv") == runner.cache.nbytes


def _tiny_tokenizer(path) -> None:
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1}, "unk_token": "<unk>"}}
    (path / "tokenizer.json").write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A bonsai checkpoint of TINY's shapes: q/k/v tri, o_proj int4, gate tri + up bin (mixed: the
    fused gate/up stays float), down int8; embedding, norms and lm_head float."""
    from engine.sources.checkpoint_file import hf_config, hf_name
    from quant.checkpoint import CheckpointWriter
    from quant.formats import QuantSpec, quantize_rtn
    out = tmp_path_factory.mktemp("plan") / "tiny-ckpt"
    torch.manual_seed(0)
    kinds = {"q_proj": "tri", "k_proj": "tri", "v_proj": "tri", "o_proj": "int4", "gate_proj": "tri",
             "up_proj": "bin", "down_proj": "int8"}
    shapes = {"q_proj": (64, 32), "k_proj": (32, 32), "v_proj": (32, 32), "o_proj": (32, 64), "gate_proj": (64, 32),
              "up_proj": (64, 32), "down_proj": (32, 64)}
    with CheckpointWriter(out) as w:
        w.add_file("config.json", json.dumps(hf_config(TINY)).encode())
        for i in range(TINY.num_layers):
            for part, kind in kinds.items():
                spec = QuantSpec(kind, 32)
                codes, scales = quantize_rtn(spec, torch.randn(*shapes[part]))
                w.write_quantized(hf_name(f"layers.{i}.{part}.weight"), spec, codes, scales)
            for part, size in (("input_layernorm", 32), ("post_attention_layernorm", 32), ("q_norm", 16),
                               ("k_norm", 16)):
                w.write_float(hf_name(f"layers.{i}.{part}.weight"), torch.ones(size), "f32")
        w.write_float("model.embed_tokens.weight", torch.randn(97, 32), "bf16")
        w.write_float("lm_head.weight", torch.randn(97, 32), "bf16")
        w.write_float("model.norm.weight", torch.ones(32), "f32")
        w.commit()
    _tiny_tokenizer(out)
    return out


def test_checkpoint_load_allocates_what_the_plan_says(tiny_checkpoint, one_thread):
    from engine.weights.loader import load_model, open_model_source
    from engine.runtime.runner import ModelRunner
    source = open_model_source(tiny_checkpoint)
    for keep_codes, fmt in ((True, WeightFormat()), (True, WeightFormat("int8", 32)), (False, WeightFormat())):
        loaded = load_model(tiny_checkpoint, "cpu", keep_codes=keep_codes, weight_format=fmt)
        weights = model_formats(source, TINY, fmt, keep_codes=keep_codes)
        if keep_codes:
            assert weights.formats["layers.0.attention.wqkv"] == LinearFormat("tri", 32)
            assert weights.formats["layers.1.feed_forward.w2"] == LinearFormat("int8", 32)
            assert weights.formats["layers.0.feed_forward.w13"].kind == fmt.quant_type.replace("bf16", "float")
        runner = ModelRunner(loaded, max_seq_len=40, num_slots=2)
        plan = make_plan(TINY, weights.formats, run_settings(TINY, "cpu", 40, slots=2))
        assert plan.category("weights") == model_bytes(loaded.model), (keep_codes, fmt)
        assert plan.category("kv") == runner.cache.nbytes


def test_stored_codes_are_never_read_as_floats(tiny_checkpoint, monkeypatch, one_thread):
    """Layers packed from stored codes skip the float load (no float copy of a packed model)."""
    from engine.weights.loader import load_model
    from quant.checkpoint import Checkpoint
    read = []
    real = Checkpoint.read_dequantized
    monkeypatch.setattr(Checkpoint, "read_dequantized", lambda self, name: read.append(name) or real(self, name))
    load_model(tiny_checkpoint, "cpu", keep_codes=True)
    quantized_read = {n.split(".")[-2] for n in read if "proj" in n}
    assert quantized_read == {"gate_proj", "up_proj"}  # mixed tri + bin: the fused gate/up stays float
    read.clear()
    load_model(tiny_checkpoint, "cpu", keep_codes=False)
    assert {n.split(".")[-2] for n in read if "proj" in n} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"}


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_decode_static_buffers_match_the_step_runner(hybrid, one_thread):
    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.hybrid_state import attach_states
    from engine.runtime.kv_cache import KVCache
    from engine.sources.hybrid_config import HybridConfig
    from engine.weights.loader import load_dummy
    cfg = TINY if not hybrid else replace(TINY, architecture="qwen35", qk_norm=True, hybrid=HybridConfig(
        ("linear_attention", "full_attention"), 2, 4, 16, 16))
    loaded = load_dummy(cfg, "tiny", weight_format=WeightFormat("tri", 32))
    cache = KVCache(cfg, 32, 1)
    if hybrid:
        attach_states(cache, cfg)
    step = DecodeStepRunner(loaded.model, cache, rows=3, num_splits=1, use_graph=False, kernels=False)
    fields = (*vars(step.inputs).values(), *vars(step.workspace).values())
    tensors = [t for t in fields if isinstance(t, torch.Tensor)]  # the buffers (not the workspace's flags)
    s = RunSettings(max_seq_len=32, **CPU)
    static, live = decode_step_bytes(cfg, linear_formats(cfg, WeightFormat("tri", 32)), 3, s)
    assert static == sum(t.numel() * t.element_size() for t in tensors)
    if hybrid:  # three rows of one slot (a verify): their rollback points (the plan's DeltaNet verify states)
        cache.states.allocate_rows(3)
    logits = step.run([1, 2, 3], [0, 1, 2] if hybrid else [0, 0, 0], [0, 0, 0])
    assert logits.numel() * logits.element_size() in live


def test_prefill_unpacks_in_column_slices(monkeypatch, one_thread):
    """A packed product of many rows unpacks W in column slices: same result as unpacking it whole."""
    from engine.weights import packed_linear
    from quant.packed_layout import random_packed
    pw = random_packed("int4", 384, 256, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(9, 256)
    calls = []
    real = packed_linear.column_slice
    monkeypatch.setattr(packed_linear, "column_slice", lambda *a: calls.append(a[1:]) or real(*a))
    whole = packed_linear.packed_matmul(x, pw)  # [9, 384]
    assert calls == [] and packed_linear.unpack_columns(384, 256, 4) == 384  # slice_bytes 0: whole
    slice_bytes = 256 * 4 * 128  # 128 columns at a time
    assert packed_linear.unpack_columns(384, 256, 4, slice_bytes) == 128
    torch.testing.assert_close(packed_linear.packed_matmul(x, pw, slice_bytes), whole, rtol=1e-6, atol=1e-6)
    assert calls == [(0, 128), (128, 256), (256, 384)]

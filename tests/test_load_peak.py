"""Loading's peak: each packed matrix is made in its final buffer a slice at a time (dummy generation,
floats rounded at load), so the peak is the final footprint plus one slice's temporaries, which the
memory plan counts. Measured on the CPU by counting the bytes of live tensor storages
(tests/live_bytes.py), the stand-in for torch.cuda.max_memory_allocated."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.weights import packed_linear
from engine.weights.loader import load_dummy, load_model
from engine.memory.budget import dummy_formats, model_formats, run_settings
from engine.memory.plan import load_transient_bytes
from engine.sources.model_config import ModelConfig
from engine.weights.formats import WeightFormat
from engine.weights.packed_linear import pack_linears
from quant import packed_layout
from tests.live_bytes import LiveBytes

CFG = ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=64)
SHAPES = {"q_proj": (128, 128), "k_proj": (64, 128), "v_proj": (64, 128), "o_proj": (128, 128),
          "gate_proj": (384, 128), "up_proj": (384, 128), "down_proj": (128, 384)}


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("fmt", [WeightFormat("tri", 32, head_type="tri"), WeightFormat("bin", 32, head_type="tri")])
def test_dummy_generation_peaks_one_slice_above_the_weights(one_thread, monkeypatch, fmt):
    """The ternary output layer is made last: its temporaries come on top of all the weights."""
    monkeypatch.setattr(packed_layout, "GENERATE_SLICE_WORDS", 1024)  # several slices per matrix
    with LiveBytes() as live:
        loaded = load_dummy(CFG, "tiny", weight_format=fmt)
    final = model_bytes(loaded.model)
    assert live.current == final  # nothing else stays
    s = run_settings(CFG, "cpu", 32, dummy=True)
    planned = load_transient_bytes(CFG, dummy_formats(CFG, fmt).formats, s)
    assert planned == 4 * 4 * 1024  # a ternary fix-up slice: two masks, their product, its complement
    assert live.peak - final <= planned + 4096  # + the rotary frequencies' float64 temporaries
    monkeypatch.setattr(packed_layout, "GENERATE_SLICE_WORDS", 1 << 22)  # whole matrices: over the plan above
    with LiveBytes() as whole:
        load_dummy(CFG, "tiny", weight_format=fmt)
    assert whole.peak - final > planned + 4096


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    """A bonsai checkpoint of CFG's shapes with every tensor float (bf16 matrices)."""
    from engine.sources.checkpoint_file import hf_config, hf_name
    from quant.checkpoint import CheckpointWriter
    from tests.test_memory_plan import _tiny_tokenizer
    out = tmp_path_factory.mktemp("peak") / "float-ckpt"
    g = torch.Generator().manual_seed(0)
    with CheckpointWriter(out) as w:
        w.add_file("config.json", json.dumps(hf_config(CFG)).encode())
        for i in range(CFG.num_layers):
            for part, shape in SHAPES.items():
                w.write_float(hf_name(f"layers.{i}.{part}.weight"), torch.randn(*shape, generator=g) * 0.05, "bf16")
            for part, size in (("input_layernorm", 128), ("post_attention_layernorm", 128), ("q_norm", 32),
                               ("k_norm", 32)):
                w.write_float(hf_name(f"layers.{i}.{part}.weight"), torch.ones(size), "f32")
        w.write_float("model.embed_tokens.weight", torch.randn(512, 128, generator=g), "bf16")
        w.write_float("lm_head.weight", torch.randn(512, 128, generator=g), "bf16")
        w.write_float("model.norm.weight", torch.ones(128), "f32")
        w.commit()
    _tiny_tokenizer(out)
    return out


@pytest.mark.parametrize("fmt", [WeightFormat("tri", 32, head_type="int8"), WeightFormat("bin", 64),
                                 WeightFormat("int4", 32, head_type="int4")])
def test_packing_at_load_matches_packing_after_and_never_holds_the_float_model(float_checkpoint, one_thread,
                                                                             monkeypatch, fmt):
    monkeypatch.setattr(packed_linear, "QUANTIZE_SLICE_ELEMENTS", 4096)  # several slices per matrix
    with LiveBytes() as live:
        loaded = load_model(float_checkpoint, "cpu", weight_format=fmt)
    final = model_bytes(loaded.model)
    reference = load_model(float_checkpoint, "cpu")  # floats, packed afterwards (the whole float model first)
    pack_linears(reference.model, fmt)
    got = dict(loaded.model.named_buffers())
    for name, want in reference.model.named_buffers():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    # the peak: the weights, two float source tensors read from the file (host memory on a GPU), and
    # one slice's rounding temporaries, which the plan counts on the device
    from engine.weights.loader import open_model_source
    weights = model_formats(open_model_source(float_checkpoint), CFG, fmt)
    planned = load_transient_bytes(CFG, weights.formats, run_settings(CFG, "cpu", 32))
    source = 512 * 128 * 4  # the largest tensor, as float32
    assert live.peak - final <= 2 * source + planned
    blocks_in_float = CFG.num_layers * sum(n * k for n, k in SHAPES.values()) * 2  # float16 on the CPU
    assert live.peak - final < blocks_in_float  # what packing after the load held on top of the weights


def test_plan_counts_the_27b_items_by_hand():
    """The 27B-class model (configs/models/dense-27b.yaml), 1-bit blocks, int4 output layer, 4K context."""
    from bonsai_cli.run_options import dummy_architecture
    from engine.memory.plan import make_plan
    config, _ = dummy_architecture("dense-27b")
    formats = dummy_formats(config, WeightFormat("bin", 128, "int4")).formats
    s = run_settings(config, "cuda:0", 4096, kv_type="int8", dummy=True)
    on_gpu = make_plan(config, formats, s)
    hosted = make_plan(config, formats, run_settings(config, "cuda:0", 4096, kv_type="int8", dummy=True,
                                                     embedding_on_host=True))
    table = 151936 * 5120 * 2
    assert on_gpu.category("weights") - hosted.category("weights") == table == 1_555_824_640
    assert [line.bytes for line in hosted.host_lines] == [table]
    assert hosted.category("decode") - on_gpu.category("decode") == 5120 * 2  # the step's static rows
    assert hosted.category("kv") == 64 * 8 * 2 * (128 + 2) * 4096 == 545_259_520  # int8 rows + f16 scales
    assert load_transient_bytes(config, formats, s) == 0  # 1-bit and int4 words are drawn in place
    tri = dummy_formats(config, WeightFormat("tri", 128, "int4")).formats
    assert load_transient_bytes(config, tri, s) == 4 * 4 * 320 * 13107 == 67_107_840  # [K/16, 4 Mi/320 cols] slices
    floats = run_settings(config, "cuda:0", 4096)
    rows = (1 << 21) // 5120  # 409 rows of a [.., 5120] matrix per slice, from bf16, tri temporaries
    assert load_transient_bytes(config, tri, floats) == max(rows * 5120 * (2 + 46), (1 << 21) // 21504 * 21504 * 48)
    assert hosted.total <= 5_500_000_000  # under 6 GB with half a GB to spare


GPU_SHAPE = ModelConfig(architecture="qwen3", vocab_size=8192, hidden_size=1024, intermediate_size=4096,
                        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True,
                        max_position_embeddings=4096)


@pytest.mark.gpu
def test_dummy_load_peak_on_a_gpu():
    """torch.cuda.max_memory_allocated over a dummy load: the weights plus at most the planned slice."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    config = GPU_SHAPE
    fmt = WeightFormat("tri", 128, head_type="tri")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load_dummy(config, "tiny", device="cuda", weight_format=fmt, embedding_on_host=True)
    torch.cuda.synchronize()
    final = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    tensors = len(list(loaded.model.parameters())) + len(list(loaded.model.buffers()))
    assert abs(final - model_bytes(loaded.model)) <= 512 * tensors  # the allocator rounds each block to 512 B
    s = run_settings(config, "cuda", 4096, dummy=True, embedding_on_host=True)
    planned = load_transient_bytes(config, dummy_formats(config, WeightFormat("tri", 128, "tri")).formats, s)
    assert peak - final <= planned + (1 << 20)


@pytest.mark.gpu
def test_streamed_blocks_never_reach_the_gpu_while_loading():
    """A dummy load with half the blocks in host memory (weight offload): the GPU's peak over the load
    is the resident blocks and the rest of the model plus at most the planned slice; the streamed
    blocks' bytes are never allocated there."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    config = dataclasses.replace(GPU_SHAPE, num_layers=4)
    fmt = WeightFormat("tri", 128, head_type="int4")
    host = frozenset({1, 3})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load_dummy(config, "tiny", device="cuda", weight_format=fmt, embedding_on_host=True, host_layers=host)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    on_gpu = sum(t.numel() * t.element_size() for t in [*loaded.model.parameters(), *loaded.model.buffers()]
                 if t.is_cuda)
    streamed = sum(t.numel() * t.element_size() for i in host
                   for t in [*loaded.model.layers[i].parameters(), *loaded.model.layers[i].buffers()])
    assert streamed > 0 and all(not t.is_cuda for i in host for t in loaded.model.layers[i].parameters())
    s = run_settings(config, "cuda", 4096, dummy=True, embedding_on_host=True)
    planned = load_transient_bytes(config, dummy_formats(config, fmt).formats, s)
    assert peak <= on_gpu + planned + (1 << 20), (peak, on_gpu, planned, streamed)

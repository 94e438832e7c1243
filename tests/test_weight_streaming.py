"""Partial weight offload: the memory plan's choice of streamed blocks (pure), the loader making those
blocks in host memory (never on the device), a partial offload's logits equal to the resident run's,
and `bonsai info --plan` naming the streamed layers with the predicted speed."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.errors import BonsaiError
from engine.memory.budget import SERVE_KEYS, check_budget, dummy_formats, fit_to_budget, plan_run, run_settings
from engine.memory.stream_fit import layer_weight_bytes, stream_plan
from engine.memory.streaming import StreamPlan, choose_streamed, layer_ranges, ring_bytes, spread
from engine.weights.formats import WeightFormat
from tests.test_kv_cache import TINY
from tests.test_memory_plan import QWEN3_8B
from tests.hybrid_tiny import engine_hybrid_config
from tests.test_offload import scenario


def test_spread_over_the_depth():
    assert spread(0, 8) == () and spread(8, 8) == tuple(range(8))
    assert spread(2, 8) == (2, 6) and spread(4, 8) == (1, 3, 5, 7)
    many = spread(19, 64)
    assert len(set(many)) == 19 and list(many) == sorted(many) and 0 <= many[0] and many[-1] < 64
    with pytest.raises(ValueError):
        spread(9, 8)
    assert layer_ranges((0, 1, 2, 5, 7, 8)) == "0-2, 5, 7-8"


def test_choose_streamed_fits_all_some_or_none():
    blocks = [100] * 8
    assert choose_streamed(blocks, 800) == ()  # all resident
    # k streamed cost (8 - k) * 100 resident + min(2, k) * 100 of ring: 4 is the fewest under 650
    assert choose_streamed(blocks, 650) == (1, 3, 5, 7)
    assert choose_streamed(blocks, 200) == tuple(range(8))  # every block through the ring of 2
    assert choose_streamed(blocks, 199) is None  # not even the ring
    # with the allocator's rounding (10 a resident block), 4 streamed need 640: 5 are streamed under 630
    assert choose_streamed(blocks, 640, [10] * 8) == (1, 3, 5, 7) and choose_streamed(blocks, 630, [10] * 8) == spread(5, 8)
    assert ring_bytes(blocks, (3,)) == 100 and ring_bytes([10, 50, 20], (0, 2)) == 40  # one buffer; the largest


def test_stream_plan_predicts_the_pcie_bound():
    sp = StreamPlan(4, (1, 3), streamed_bytes=1_000_000_000, resident_bytes=4_000_000_000,
                    pcie_bytes_per_s=50e9, hbm_bytes_per_s=4e12)
    assert sp.resident == (0, 2) and sp.pass_seconds == pytest.approx(0.021)
    assert sp.tokens_per_second() == pytest.approx(1 / 0.021) and sp.tokens_per_second(3) == pytest.approx(3 / 0.021)
    text = "\n".join(sp.lines())
    assert "2 of 4 resident" in text and "layers 1, 3" in text and "47.6 tok/s" in text and "prediction" not in text
    assert "a bound, not a measurement" in text


def _tri_8b():
    return dummy_formats(QWEN3_8B, WeightFormat("tri", 128, "int4")), run_settings(QWEN3_8B, "cuda:0", 4096, kv_type="int4")


def test_the_plan_streams_only_the_blocks_the_budget_cannot_hold():
    weights, s = _tri_8b()
    same, choices = fit_to_budget(weights, s, plan_run(weights, s).total + 1, True, False, stream_auto=True)
    assert same == s and choices == []  # fits: nothing streams
    resident = plan_run(weights, dataclasses.replace(s, embedding_on_host=True)).total
    limit = resident - 500_000_000  # the embedding in host memory is not enough: blocks stream
    got, choices = fit_to_budget(weights, s, limit, True, False, stream_auto=True)
    streamed = tuple(i for i in range(QWEN3_8B.num_layers) if i not in got.resident_layers)
    assert got.weight_offload and got.embedding_on_host and 0 < len(streamed) < QWEN3_8B.num_layers
    assert streamed == spread(len(streamed), QWEN3_8B.num_layers)
    assert plan_run(weights, got).total <= limit
    fewer = spread(len(streamed) - 1, QWEN3_8B.num_layers)
    one_less = dataclasses.replace(got, resident_layers=tuple(i for i in range(QWEN3_8B.num_layers) if i not in fewer))
    assert plan_run(weights, one_less).total > limit  # the fewest that fit
    assert [c.key for c in choices] == ["embedding_on_host", "weight_offload"]
    assert f"{len(streamed)} of 36 blocks streamed" in choices[1].line
    plan = plan_run(weights, got)
    host = sum(line.bytes for line in plan.host_lines if "streamed" in line.note)
    per_layer = layer_weight_bytes(QWEN3_8B, weights.formats, got)
    assert host == sum(per_layer[i] for i in streamed)  # the plan's host lines are the streamed blocks' bytes
    assert stream_plan(QWEN3_8B, weights.formats, got).streamed == streamed
    from engine.memory.plan import block_slack
    rounding = [line.bytes for line in plan.lines if line.name == "allocator rounding of the resident blocks"]
    slack = block_slack(QWEN3_8B, weights.formats, got)
    assert rounding == [sum(slack[i] for i in got.resident_layers)] and rounding[0] > 0


def test_a_budget_below_the_staging_ring_is_refused_with_the_smallest_that_works():
    weights, s = _tri_8b()
    every = dataclasses.replace(s, weight_offload=True, embedding_on_host=True)
    smallest = plan_run(weights, every).total
    got, choices = fit_to_budget(weights, s, smallest - 1, False, False, stream_auto=True)
    assert got.weight_offload and got.resident_layers == () and choices == []
    with pytest.raises(BonsaiError) as e:
        check_budget(plan_run(weights, got), smallest - 1, weights, got, SERVE_KEYS)
    from engine.memory.budget import format_bytes
    assert f"{format_bytes(smallest)} is the smallest max_gpu_memory" in str(e.value) and "\n" not in str(e.value)
    exact, _ = fit_to_budget(weights, s, smallest, False, False, stream_auto=True)
    assert exact.weight_offload and plan_run(weights, exact).total <= smallest


def test_without_auto_the_refusal_names_auto_with_its_prediction():
    weights, s = _tri_8b()
    limit = plan_run(weights, s).total - 500_000_000
    got, _ = fit_to_budget(weights, s, limit, False, False, stream_auto=False)
    assert not got.weight_offload
    with pytest.raises(BonsaiError, match=r"memory.weight_offload: auto \(streams \d+ of 36 blocks: ~[\d.]+ tok/s"):
        check_budget(plan_run(weights, got), limit, weights, got, SERVE_KEYS)


CFG = dataclasses.replace(TINY, num_layers=4)
FMT = WeightFormat("tri", 32, "int4")


def test_the_loader_makes_streamed_blocks_in_host_memory_only(monkeypatch):
    """The device is the meta device (no memory: every tensor left there is one the device would hold),
    so on the CPU it shows which tensors a GPU would get: none of the streamed blocks'."""
    from engine.weights import loader, packed_linear
    real = packed_linear.tensor_generator
    fake = lambda device, seed, name: None if torch.device(device).type == "meta" else real(device, seed, name)  # noqa: E731
    monkeypatch.setattr(packed_linear, "tensor_generator", fake)
    monkeypatch.setattr(loader, "tensor_generator", fake)
    monkeypatch.setattr(loader, "resolve_device", torch.device)
    loaded = loader.load_dummy(CFG, "tiny", device="meta", weight_format=FMT, host_layers=frozenset({1, 3}))
    seen = set()
    for name, t in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]:
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        assert t.device.type == ("cpu" if layer in (1, 3) else "meta"), name
        seen.add(layer)
    assert {0, 1, 2, 3} <= seen


def _runner(loaded, offload):
    from engine.runtime.runner import ModelRunner
    return ModelRunner(loaded, max_seq_len=40, num_slots=2, prefill_chunk_size=4, fast_decode=False,
                       offload_layers=offload)


@pytest.mark.parametrize("layers", [{1}, {0, 3}])
def test_partial_offload_from_the_loader_matches_resident(one_thread, layers):
    from engine.weights.loader import load_dummy
    want_tokens, want = scenario(_runner(load_dummy(CFG, "tiny", weight_format=FMT), None), True)
    loaded = load_dummy(CFG, "tiny", weight_format=FMT, host_layers=frozenset(layers))
    got_tokens, got = scenario(_runner(loaded, layers), True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # the same weights, streamed: bit-identical


ARCH = """architectures: [Qwen3ForCausalLM]
vocab_size: 256
hidden_size: 64
intermediate_size: 128
num_hidden_layers: 4
num_attention_heads: 4
num_key_value_heads: 2
head_dim: 16
tie_word_embeddings: false
"""


def _config(tmp_path, limit: str, offload: str = "auto"):
    arch = tmp_path / "tiny4.yaml"
    arch.write_text(ARCH)
    path = tmp_path / f"serve-{limit}.yaml"
    path.write_text(f"model:\n  path: {arch}\n  load_format: dummy\n  quant_type: tri\n  group_size: 32\n"
                    f"runtime:\n  device: cpu\n  max_seq_len: 64\n  prefill_chunk_size: 16\n"
                    f"memory:\n  weight_offload: {offload}\n  embedding_on_host: true\n  max_gpu_memory: {limit}\n")
    return path


def _read(path):
    from bonsai_cli.run_options import run_config
    return run_config(None, {}, path)


def _resident_total(tmp_path) -> tuple[int, int]:
    from bonsai_cli.run_options import architecture_of
    from engine.run.plan import plan_run as plan_config
    cfg = _read(_config(tmp_path, "1GB"))
    planned = plan_config(cfg, architecture_of(cfg))
    assert not planned.settings.weight_offload
    per_layer = layer_weight_bytes(planned.weights.config, planned.weights.formats, planned.settings)
    return planned.plan.total, per_layer[0]


def test_info_plan_lists_the_streamed_layers_and_the_prediction(tmp_path, capsys, monkeypatch):
    from bonsai_cli.main import main
    monkeypatch.setenv("COLUMNS", "250")
    total, block = _resident_total(tmp_path)
    path = _config(tmp_path, f"{total - block // 2}B")  # half a block short
    main(["info", "--plan", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    ws = out["weight_streaming"]
    assert out["fits"] and ws is not None and ws["predicted_tokens_per_second"] > 0
    assert sorted(ws["streamed_layers"] + ws["resident_layers"]) == [0, 1, 2, 3]
    main(["info", "--plan", str(path)])
    text = capsys.readouterr().out
    # a streamed block saves its bytes only past the ring's two: half a block short streams three of four
    assert len(ws["streamed_layers"]) == 3
    assert f"streamed from pinned host memory each pass: layers {layer_ranges(tuple(ws['streamed_layers']))}" in text
    assert "predicted decode (a bound, not a measurement)" in text and "with the streamed blocks' copies" in text


def test_a_run_with_auto_loads_and_streams_the_planned_blocks(tmp_path, one_thread):
    from bonsai_cli.run_options import architecture_of
    from engine.run.builder import open_run
    total, block = _resident_total(tmp_path)
    cfg = _read(_config(tmp_path, f"{total - block // 2}B"))
    run = open_run(cfg, architecture_of(cfg))
    stream = run.runner.weight_stream
    assert stream is not None and tuple(stream.order) == run.plan.stream.streamed
    assert 0 < len(stream.order) < 4
    logits = run.runner.prefill(run.runner.slot(0), [1, 2, 3, 4, 5])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("weights", ["bf16", "tri"])
def test_a_model_file_loaded_with_streamed_blocks_in_host_memory_matches_resident(tmp_path, smollm2_gguf, one_thread,
                                                                                 weights):
    """Read from a file (floats, or rounded and packed at load), the streamed blocks are made in host
    memory and streamed: the same logits as the resident model."""
    from tests.gguf_tiny import LAYERS, write_tiny_gguf
    from engine.weights.loader import load_model
    path = write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_gguf)
    fmt = WeightFormat(weights, 32)
    host = frozenset(range(1, LAYERS, 2))
    want_tokens, want = scenario(_runner(load_model(path, weight_format=fmt), None), True)
    got_tokens, got = scenario(_runner(load_model(path, weight_format=fmt, host_layers=host), host), True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert torch.equal(g, w)



@pytest.mark.parametrize("layers", [{1}, {0, 3}])
@pytest.mark.parametrize("fast", [False, True], ids=["model", "fused-step"])
def test_a_hybrid_streams_its_blocks_and_matches_resident(one_thread, layers, fast):
    """Qwen3.5-style blocks (DeltaNet and gated attention) streamed from host memory: the same tokens and logits,
    bit for bit, as resident, through the model's path and through the fused step (whose DeltaNet gate projections
    stay apart for a streamed block: a joined copy would be made of the staging buffer's other block)."""
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_dummy
    cfg, fmt = engine_hybrid_config(), WeightFormat("tri", 32, "int4")

    def run(offload):
        loaded = load_dummy(cfg, "tiny", weight_format=fmt, host_layers=frozenset(offload or ()))
        runner = ModelRunner(loaded, max_seq_len=40, num_slots=2, prefill_chunk_size=4, fast_decode=fast,
                             offload_layers=offload)
        return scenario(runner, True)
    want_tokens, want = run(None)
    got_tokens, got = run(layers)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_plan_weighs_a_hybrids_blocks_as_loaded():
    """What streaming a DeltaNet or gated attention block moves (the plan's per-block bytes) is what the block
    holds on a GPU (bf16 activations and float matrices)."""
    from engine.memory.weight_offload import bytes_per_layer
    from engine.weights.loader import load_dummy
    cfg, fmt = engine_hybrid_config(), WeightFormat("tri", 32, "int4")
    loaded = load_dummy(cfg, "tiny", weight_format=fmt, dtype=torch.bfloat16)
    planned = layer_weight_bytes(cfg, dummy_formats(cfg, fmt).formats, run_settings(cfg, "cuda:0", 40))
    assert planned == bytes_per_layer(loaded.model) and planned[0] != planned[3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_hybrids_graphed_streamed_decode_on_cuda_tracks_resident():
    """On a GPU the streamed hybrid's fused step is captured with its copies: the resident run's greedy tokens,
    logits within rounding (a streamed DeltaNet block projects its gates apart, a resident one in one kernel)."""
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_dummy
    cfg, fmt = engine_hybrid_config(), WeightFormat("tri", 32, "int4")

    def run(streamed: bool):
        # the same generated weights both times: blocks 0 and 2 made in host memory (a generator of their own),
        # then streamed, or moved to the GPU for the resident run
        loaded = load_dummy(cfg, "tiny", device="cuda", weight_format=fmt, host_layers=frozenset({0, 2}))
        if not streamed:
            for i in (0, 2):
                loaded.model.layers[i].to("cuda")
        runner = ModelRunner(loaded, max_seq_len=40, num_slots=2, prefill_chunk_size=4,
                             offload_layers={0, 2} if streamed else None, prefill_graphs=False)
        assert runner.decoder is not None and runner.decoder.graph is not None
        return scenario(runner, True)
    want_tokens, want = run(False)
    got_tokens, got = run(True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max() <= 2e-2 * w.float().abs().max()


@pytest.mark.parametrize("fast, kernels", [(False, False), (True, False), (True, True)],
                         ids=["model", "fused-step", "fused-step-kernels"])
def test_a_hybrids_kv_offload_matches_resident(one_thread, monkeypatch, fast, kernels):
    """A hybrid's KV pool (its attention layers only: 1 of 4 blocks here) in host memory, streamed layer by layer:
    the resident run's tokens and logits bit for bit (with the Triton kernels too, interpreted on a CPU: the gated
    attention's K/V write and the decode attention read the position-major buffers through their strides); the
    plan's staging ring is the runner's two layer buffers."""
    if kernels:
        monkeypatch.setenv("BONSAI_KERNELS_ON_CPU", "1")
    from engine.memory.plan import make_plan
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_dummy
    cfg, fmt = engine_hybrid_config(), WeightFormat("tri", 32, "int4")
    runs = {}
    for offload in (False, True):
        runner = ModelRunner(load_dummy(cfg, "tiny", weight_format=fmt), max_seq_len=40, num_slots=2,
                             prefill_chunk_size=4, fast_decode=fast, kv_offload=offload)
        assert runner.decoder is None or runner.decoder.ops.fast == kernels
        runs[offload] = scenario(runner, not kernels)  # interpreted kernels: one slot (time)
    assert runs[True][0] == runs[False][0]
    for g, w in zip(runs[True][1], runs[False][1]):
        assert torch.equal(g, w)
    assert runner.cache.num_layers == cfg.num_kv_layers == 1
    plan = make_plan(cfg, dummy_formats(cfg, fmt).formats,
                     dataclasses.replace(run_settings(cfg, "cpu", 40, slots=2), kv_offload=True))
    [ring] = [line for line in plan.lines if line.name.startswith("KV staging ring")]
    assert ring.bytes == runner.cache.working_nbytes
    assert any(line.name.startswith("DeltaNet states") for line in plan.lines)

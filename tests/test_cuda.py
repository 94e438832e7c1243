"""The same engine code on CUDA: runs on a GPU machine only (marker `gpu`)."""
from __future__ import annotations

import pytest
import torch

from engine.bench.model_bench import measure_copy_bandwidth, plan_tests, run_model_bench
from engine.runtime.kv_cache import KVCache
from engine.runtime.model import rotary_inverse_frequencies
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams, make_generator, sample
from tests.test_kv_cache import TINY, run, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_on_cuda_matches_cpu(dtype):
    cpu_model = tiny_model()
    gpu_model = tiny_model().to("cuda", dtype)
    gpu_model.inv_freq = rotary_inverse_frequencies(TINY).cuda()  # rotary frequencies stay float32
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    cpu_cache = KVCache(TINY, 32)
    expected = run(cpu_model, cpu_cache, cpu_cache.slots[0], tokens)
    gpu_cache = KVCache(TINY, 32, dtype=dtype, device="cuda")
    got = run(gpu_model, gpu_cache, gpu_cache.slots[0], tokens[:6]).cpu()
    got = torch.cat([got] + [run(gpu_model, gpu_cache, gpu_cache.slots[0], [t]).cpu() for t in tokens[6:]])
    tol = 1e-3 if dtype == torch.float32 else 0.15
    assert (got - expected).abs().max() < tol * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_seeded_sampling_on_cuda_is_reproducible():
    logits = torch.randn(1000, device="cuda")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    a = [sample(logits, params, g) for g in [make_generator(params, torch.device("cuda"))] for _ in range(20)]
    b = [sample(logits, params, g) for g in [make_generator(params, torch.device("cuda"))] for _ in range(20)]
    assert a == b


def test_runner_and_model_bench_on_cuda():
    from pathlib import Path

    from engine.weights.loader import LoadedModel, TensorSummary
    model = tiny_model().to("cuda", torch.bfloat16)
    model.inv_freq = rotary_inverse_frequencies(TINY).cuda()
    loaded = LoadedModel(model=model, tokenizer=None, config=TINY, path=Path("tiny"),
                         summary=TensorSummary("test", 0, 0, 0), device=torch.device("cuda"),
                         dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    runner = ModelRunner(loaded, max_seq_len=64)
    from engine.decoding.engine import Engine
    results = run_model_bench(Engine(runner, None), plan_tests([8], [4], [0, 16], combined=True), 2, frozenset())
    assert all(len(m.samples_seconds) == 2 for m in results)
    assert measure_copy_bandwidth(torch.device("cuda"), megabytes=256) > 1e12


def test_graphed_prefill_chunks_match_eager_prefill():
    """Full chunks replay from CUDA graphs (one per slot and start); logits and the cache they write
    equal the eager path's, on a first use (capture), a replay with other tokens, and a later chunk."""
    from pathlib import Path

    from engine.weights.loader import LoadedModel, TensorSummary
    model = tiny_model().to("cuda", torch.float32)
    model.inv_freq = rotary_inverse_frequencies(TINY).cuda()
    loaded = LoadedModel(model=model, tokenizer=None, config=TINY, path=Path("tiny"),
                         summary=TensorSummary("test", 0, 0, 0), device=torch.device("cuda"),
                         dtype=torch.float32, weight_dtype=torch.float32)
    graphed = ModelRunner(loaded, max_seq_len=64, num_slots=2, prefill_chunk_size=8, prefill_graphs=True)
    eager = ModelRunner(loaded, max_seq_len=64, num_slots=2, prefill_chunk_size=8, prefill_graphs=False)
    assert graphed.prefill_graphs is not None and eager.prefill_graphs is None
    graphed.short_prefill_rows = 0  # chunks up to SHORT_PREFILL_TOKENS would take the graphed decode step instead
    assert ModelRunner(loaded, max_seq_len=64).prefill_graphs is not None  # on by default where decode is graphed
    gen = torch.Generator().manual_seed(0)
    for prompt_len in (21, 16, 21):  # a capture, then replays with other tokens (and a partial last chunk)
        for slot in (0, 1):
            tokens = torch.randint(0, TINY.vocab_size, (prompt_len,), generator=gen).tolist()
            for runner in (graphed, eager):
                runner.slot(slot).reset()
            a, b = graphed.prefill(graphed.slot(slot), tokens), eager.prefill(eager.slot(slot), tokens)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
            assert torch.allclose(graphed.cache.k[:, slot, :, :prompt_len], eager.cache.k[:, slot, :, :prompt_len])
    assert set(graphed.prefill_graphs.graphs) == {(0, 0), (0, 8), (1, 0), (1, 8)}


def test_a_prefill_chunk_that_cannot_be_captured_runs_eagerly(monkeypatch):
    """A step that syncs the host cannot be captured: the chunk's logits are still right, its K/V are
    written, and every later chunk runs eagerly."""
    from pathlib import Path

    from engine.weights.loader import LoadedModel, TensorSummary
    model = tiny_model().to("cuda", torch.float32)
    model.inv_freq = rotary_inverse_frequencies(TINY).cuda()
    loaded = LoadedModel(model=model, tokenizer=None, config=TINY, path=Path("tiny"),
                         summary=TensorSummary("test", 0, 0, 0), device=torch.device("cuda"),
                         dtype=torch.float32, weight_dtype=torch.float32)
    eager = ModelRunner(loaded, max_seq_len=64, prefill_chunk_size=8, prefill_graphs=False)
    tokens = list(range(3, 19))
    want = eager.prefill(eager.slot(0), tokens)
    graphed = ModelRunner(loaded, max_seq_len=64, prefill_chunk_size=8, prefill_graphs=True)
    graphed.short_prefill_rows = 0  # the prefill graphs, not the graphed decode step short chunks take
    norm_forward = type(model.norm).forward

    def syncing(self, x):
        torch.cuda.synchronize() if not torch.cuda.is_current_stream_capturing() else x.sum().item()
        return norm_forward(self, x)
    monkeypatch.setattr(type(model.norm), "forward", syncing)
    got = graphed.prefill(graphed.slot(0), tokens)
    assert graphed.prefill_graphs.failed and not graphed.prefill_graphs.graphs
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(graphed.cache.k[:, 0, :, :16], eager.cache.k[:, 0, :, :16])
    # the failed capture left the device's random generator as it was: sampling still draws
    torch.manual_seed(0)
    assert torch.multinomial(torch.ones(1, 8, device="cuda"), 1).shape == (1, 1)

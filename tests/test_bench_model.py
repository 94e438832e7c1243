"""Model benchmark maths and runs on a tiny random model; the report statistics."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.bench.model_bench import (BenchTest, decode_bytes_per_token, fresh_tokens, measure_copy_bandwidth,
                                      plan_tests, run_model_bench)
from engine.bench.records import Measurement, mean_std, percentile
from engine.decoding.engine import Engine
from engine.errors import BonsaiError
from engine.weights.loader import LoadedModel, TensorSummary
from engine.runtime.runner import ModelRunner
from tests.test_kv_cache import TINY, tiny_model


def tiny_runner(max_seq_len: int = 64) -> ModelRunner:
    loaded = LoadedModel(model=tiny_model(), tokenizer=None, config=TINY, path=Path("tiny"),
                         summary=TensorSummary("test", 0, 0, 0), device=torch.device("cpu"),
                         dtype=torch.float32, weight_dtype=torch.float32)
    return ModelRunner(loaded, max_seq_len=max_seq_len)


def test_statistics_on_synthetic_samples():
    assert mean_std([2.0, 4.0, 6.0]) == (4.0, 2.0)
    assert mean_std([5.0]) == (5.0, 0.0)
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([10, 20], 90) == pytest.approx(19.0)
    m = Measurement("pp4+tg4", 4, 4, 0, samples_seconds=[1.0, 2.0])
    assert m.samples_tps == [8.0, 4.0]
    s = m.summary()
    assert s["tokens_per_second"] == 6.0 and s["stddev"] == pytest.approx(2.8284, rel=1e-3)


def test_plan_names_like_llama_bench():
    names = [t.name for t in plan_tests([512], [128], [0, 4096], combined=True)]
    assert names == ["pp512", "tg128", "pp512+tg128", "pp512 @ d4096", "tg128 @ d4096", "pp512+tg128 @ d4096"]
    with pytest.raises(BonsaiError):
        plan_tests([0], [0], [0], combined=True)
    with pytest.raises(BonsaiError):
        plan_tests([-1], [1], [0], combined=False)


def test_fresh_tokens_differ_per_repetition_and_skip_specials():
    a, b = fresh_tokens(97, frozenset({0, 1, 2}), 50, 1), fresh_tokens(97, frozenset({0, 1, 2}), 50, 2)
    assert a != b and not ({0, 1, 2} & set(a + b)) and len(a) == 50


def test_runs_collect_one_sample_per_repetition():
    runner = tiny_runner()
    seen = []
    results = run_model_bench(Engine(runner, None), plan_tests([8], [4], [0, 16], combined=True), 3, frozenset(),
                              on_sample=lambda t, r, s: seen.append((t.name, r)))
    assert [m.name for m in results] == ["pp8", "tg4", "pp8+tg4", "pp8 @ d16", "tg4 @ d16", "pp8+tg4 @ d16"]
    assert all(len(m.samples_seconds) == 3 and min(m.samples_seconds) > 0 for m in results)
    assert len(seen) == 18


def test_a_test_larger_than_the_context_is_refused():
    runner = tiny_runner(max_seq_len=16)
    with pytest.raises(BonsaiError, match="context holds 16"):
        run_model_bench(Engine(runner, None), [BenchTest(12, 8, 0)], 1, frozenset())


def test_decode_bytes_per_token_by_hand():
    runner = tiny_runner(max_seq_len=64)
    c = TINY
    linear = c.num_layers * sum(o * i for o, i in c.linear_shapes().values())
    output = c.vocab_size * c.hidden_size  # untied tiny model has its own lm_head (a Linear, counted above)
    weights = (linear + (0 if c.tie_word_embeddings else output) + c.hidden_size) * 4
    kv = 10 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert decode_bytes_per_token(runner, 10) == weights + kv


def test_copy_bandwidth_is_positive():
    assert measure_copy_bandwidth(torch.device("cpu"), megabytes=8, repeats=2) > 1e8

"""The embedding table in host memory (memory.embedding_on_host / --embedding-on-host): the same
tokens as the table on the device, through the plain path and the fused decode step (whose graph
reads the rows from a static input buffer); a tied float output layer refuses it."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.errors import BonsaiError
from engine.memory.host_embedding import HostEmbedding
from engine.weights.loader import load_dummy
from engine.weights.formats import WeightFormat
from engine.runtime.runner import ModelRunner
from tests.test_kv_cache import TINY

TIED = dataclasses.replace(TINY, tie_word_embeddings=True)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]


def greedy(runner: ModelRunner, steps: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    slot = runner.slot(0)
    logits = runner.prefill(slot, list(PROMPT))
    tokens, rows = [], [logits]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.forward(slot, [tokens[-1]])[-1]
        rows.append(logits)
    return tokens, rows


@pytest.mark.parametrize("config,fmt", [(TINY, WeightFormat("bin", 32, head_type="int8")), (TINY, WeightFormat()),
                                        (TIED, WeightFormat("tri", 32, head_type="int8"))])
@pytest.mark.parametrize("fast_decode", [False, True])
def test_host_table_gives_the_same_tokens(one_thread, config, fmt, fast_decode):
    plain = load_dummy(config, "tiny", weight_format=fmt)
    hosted = load_dummy(config, "tiny", weight_format=fmt, embedding_on_host=True)
    assert isinstance(hosted.model.embed, HostEmbedding)
    torch.testing.assert_close(hosted.model.embed.weight, plain.model.embed.weight, rtol=0, atol=0)
    table = config.vocab_size * config.hidden_size * 4
    device_bytes = [sum(t.numel() * t.element_size() for t in [*m.model.parameters(), *m.model.buffers()])
                    for m in (plain, hosted)]
    assert device_bytes[0] - device_bytes[1] == table  # the table left the model's device tensors
    want = greedy(ModelRunner(plain, max_seq_len=32, prefill_chunk_size=4, fast_decode=fast_decode))
    runner = ModelRunner(hosted, max_seq_len=32, prefill_chunk_size=4, fast_decode=fast_decode)
    if fast_decode:
        assert runner.decoder.inputs.embedded is not None
    got = greedy(runner)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_decode_step_reads_the_static_rows_not_the_table(one_thread):
    """The graph must never touch the host table: the step reads the rows `run` copied in."""
    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.kv_cache import KVCache
    loaded = load_dummy(TINY, "tiny", weight_format=WeightFormat("bin", 32), embedding_on_host=True)
    step = DecodeStepRunner(loaded.model, KVCache(TINY, 16, 1), rows=2, num_splits=1, use_graph=False, kernels=False)
    calls = []
    real = HostEmbedding.forward
    HostEmbedding.forward = lambda self, tokens: calls.append(1) or real(self, tokens)
    try:
        step.run([5, 7], [0, 1], [0, 0])
    finally:
        HostEmbedding.forward = real
    assert calls == []
    table = loaded.model.embed.weight
    torch.testing.assert_close(step.inputs.embedded, table[[5, 7]], rtol=0, atol=0)


def test_a_tied_float_output_layer_refuses_a_host_table():
    with pytest.raises(BonsaiError) as e:
        load_dummy(TIED, "tiny", weight_format=WeightFormat("bin", 32), embedding_on_host=True)
    message = str(e.value)
    assert "\n" not in message and "tied" in message and "--head-weights int4" in message
    from engine.memory.budget import dummy_formats, run_settings
    from engine.memory.plan import make_plan
    weights = dummy_formats(TIED, WeightFormat("bin", 32))
    with pytest.raises(BonsaiError, match="tied"):
        make_plan(TIED, weights.formats, run_settings(TIED, "cpu", 32, embedding_on_host=True))


def test_bench_places_the_table_on_the_host(tmp_path, one_thread):
    from bonsai_cli.main import main
    from tests.test_memory_budget import TINY_ARCH
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY_ARCH.replace("tie_word_embeddings: true", "tie_word_embeddings: false"))
    out = tmp_path / "r.json"
    main(["bench", str(arch), "--load-format", "dummy", "--weights", "bin", "--group-size", "32", "-p", "8",
          "-n", "2", "-r", "1", "--no-pg", "--embedding-on-host", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["model"]["embedding_on_host"] is True and report["memory"]["embedding_on_host"] is True
    tied = tmp_path / "tied.yaml"
    tied.write_text(TINY_ARCH)
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tied), "--load-format", "dummy", "--weights", "bin", "--group-size", "32", "-p", "8",
              "-n", "2", "-r", "1", "--no-pg", "--embedding-on-host"])
    assert e.value.code == 1


@pytest.mark.gpu
def test_graphed_step_with_a_host_table_matches_the_device_table():
    """On a GPU: the CUDA-graphed decode step with the rows copied in before each replay gives the
    tokens of the table on the device (pinned staging buffers taking turns)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    config = dataclasses.replace(TINY, vocab_size=256, hidden_size=128, intermediate_size=256, num_heads=4,
                                 num_kv_heads=2, head_dim=64)
    fmt = WeightFormat("bin", 64, head_type="int8")
    hosted = load_dummy(config, "tiny", device="cuda", weight_format=fmt, embedding_on_host=True)
    plain = load_dummy(config, "tiny", device="cuda", weight_format=fmt)
    with torch.no_grad():  # the host table is drawn by the CPU's generator: give the device model the same one
        plain.model.embed.weight.copy_(hosted.model.embed.weight)
    runs = []
    for loaded in (plain, hosted):
        runner = ModelRunner(loaded, max_seq_len=48, prefill_chunk_size=4)
        assert runner.decoder is not None and runner.decoder.graph is not None
        runs.append(greedy(runner, steps=20)[0])
    assert runs[0] == runs[1]

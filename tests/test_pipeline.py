"""Pipeline parallelism (engine/pipeline): the layer split, the device checks, and 2 gloo processes
giving what one process gives — bit for bit on a tiny generated model (fused step, micro-batches,
quantized KV), token for token on SmolLM2 (plain, n-gram speculation, two slots through the server's
engine loop)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.errors import BonsaiError
from engine.pipeline.devices import check_devices, check_pipeline_request
from engine.pipeline.protocol import PLAIN, ROWS, Command, micro_batches, split_rows
from engine.pipeline.split import plan_stages, split_layers

# ---- the split (pure) ----


def test_split_balances_bytes_with_embedding_first_and_head_last():
    assert split_layers([10] * 4, 0, 0, 2) == [(0, 2), (2, 4)]
    # the embedding's 15 bytes on stage 0: 25 | 30 beats 35 | 20
    assert split_layers([10] * 4, 15, 0, 2) == [(0, 1), (1, 4)]
    # a tie (3|2 or 2|3): the later stage takes more (rank 0 also runs the driver)
    assert split_layers([10] * 5, 0, 0, 2) == [(0, 2), (2, 5)]
    # largest stage 20 at best; the last stage takes 2 layers (10 + 10), the middle one 3, stage 0 one
    assert split_layers([5] * 6, 10, 10, 3) == [(0, 1), (1, 4), (4, 6)]
    assert split_layers([1, 1, 100, 1], 0, 0, 2) == [(0, 2), (2, 4)]
    with pytest.raises(BonsaiError, match="at most 2 devices"):
        split_layers([1, 1], 0, 0, 3)


def test_plan_stages_count_every_weight_once_and_the_tied_head_on_the_last():
    from engine.memory.budget import dummy_formats, run_settings
    from engine.memory.plan import weight_tensors
    from engine.sources.model_config import ModelConfig
    cfg = ModelConfig("llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    formats = dummy_formats(cfg).formats
    settings = run_settings(cfg, "cpu", 32, dummy=True)
    stages = plan_stages(cfg, formats, settings, ["cpu", "cpu"])
    assert [(s.first, s.end) for s in stages] == [(0, 3), (3, 6)]  # embedding on both ends: symmetric
    assert stages[0].takes_tokens and not stages[0].gives_logits and stages[1].gives_logits
    embed = 1000 * 64 * 4
    total = sum(size for _, _, size in weight_tensors(cfg, formats, settings))
    inv_freq = 16 // 2 * 4
    assert sum(s.weight_bytes for s in stages) == total + embed + inv_freq  # the tied head: a copy on the last
    assert stages[0].kv_bytes == stages[1].kv_bytes == 3 * 2 * 2 * 16 * 4 * 32  # layers × K,V × heads × D × f32 × S


# ---- bad input, before anything loads ----


@pytest.mark.parametrize("devices, cuda, nccl, fragment", [
    (["cuda:0", "cuda:2"], 2, True, r"cuda:2 does not exist: this machine has 2 CUDA GPU\(s\)"),
    (["cuda:0", "cuda:1", "cuda:2"], 2, True, "does not exist"),
    (["cuda:0", "cuda:1"], 0, True, "no CUDA GPU is available"),
    (["cuda:0", "cuda:1"], 2, False, "needs NCCL"),
    (["cuda:1", "cuda:1"], 2, True, "cuda:1 is listed twice"),
    (["cpu", "cuda:0"], 1, True, "mixes CPU and CUDA"),
    (["cuda", "cuda"], 2, True, "give each GPU of a pipeline its index"),
    (["tpu:0", "tpu:1"], 0, True, "unsupported device 'tpu:0'"),
    (["cuda:0"], 1, True, "at least two devices"),
])
def test_bad_device_lists_are_one_line(devices, cuda, nccl, fragment):
    with pytest.raises(BonsaiError, match=fragment) as e:
        check_devices(devices, cuda, nccl)
    assert "\n" not in str(e.value)


def test_good_device_lists_pick_the_backend():
    assert check_devices(["cuda:1", "cuda:0"], 2, True) == "nccl"
    assert check_devices(["cpu", "cpu"], 0, False) == "gloo"
    assert check_pipeline_request("cuda:0", False) is None
    with pytest.raises(BonsaiError, match="set memory.pipeline_parallel: true"):
        check_pipeline_request("cuda:0,cuda:1", False)


def test_pipeline_refuses_what_it_cannot_run():
    from engine.server.config import ServeConfig
    base = {"model": {"path": "m"}, "runtime": {"device": "cpu,cpu"}, "memory": {"pipeline_parallel": True}}
    with pytest.raises(BonsaiError, match="memory.weight_offload"):
        ServeConfig.from_dict({**base, "memory": {"pipeline_parallel": True, "weight_offload": True}})
    with pytest.raises(BonsaiError, match="mtp reads the target's hidden states"):
        ServeConfig.from_dict({**base, "runtime": {"device": "cpu,cpu", "decode_algorithm": "speculative"},
                               "speculative": {"method": "mtp:x.safetensors"}})


def test_cli_device_list_errors_come_before_loading(capsys):
    from tests.test_cli_errors import assert_one_line_error, bonsai_in_process
    proc = bonsai_in_process(capsys, "generate", "no-such-model", "-p", "hi", "--device", "cpu,cpu")
    assert_one_line_error(proc, "--device lists 2 devices (cpu,cpu): set --pipeline-parallel")
    proc = bonsai_in_process(capsys, "bench", "no-such-model", "--device", "cuda:0,cuda:0", "--pipeline-parallel")
    assert_one_line_error(proc, "cuda:0 is listed twice")


def test_command_round_trip_and_micro_batches():
    cmd = Command(PLAIN, (3, 1), (17, 4), num_tokens=5, num_logits=-1)
    back = Command.decode(cmd.encode())
    assert back == cmd and back.kv_len == 22 and back.output_shape(50) == (2, 5, 50)
    assert back.hidden_shape(8) == (2, 5, 8)
    rows = Command(ROWS, (0, 0, 0), (7, 8, 9))
    assert Command.decode(rows.encode()) == rows and rows.output_shape(50) == (3, 50) and rows.hidden_shape(8) == (3, 8)
    assert not Command(PLAIN, (0,), (0,), 4, 0).wants_output
    assert split_rows(5, 2) == [(0, 3), (3, 5)] and split_rows(1, 2) == [(0, 1)] and split_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a GPU's fused step (flat cost up to 16 rows) keeps 8 rows whole, cuts 40 into 3 of <= 16, in flight together
    assert micro_batches(8, 2, 16, True) == [(0, 8)] and micro_batches(40, 2, 16, True) == [(0, 14), (14, 27), (27, 40)]
    # a CPU (cost grows with the rows): one micro-batch per stage
    assert micro_batches(8, 2, 16, False) == [(0, 4), (4, 8)] and micro_batches(3, 4, 0, False) == [(0, 1), (1, 2), (2, 3)]


# ---- two gloo processes against one ----


def _pipeline(source, cfg, devices=("cpu", "cpu"), **kw):
    from engine.memory.budget import dummy_formats, run_settings
    from engine.pipeline.setup import open_pipeline, plan_pipeline
    settings = run_settings(cfg, "cpu", kw.get("max_seq_len", 64), dummy=True)
    pp = plan_pipeline(cfg, dummy_formats(cfg).formats, settings, list(devices))
    return open_pipeline(source, pp, **kw)


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny generated model (ternary blocks, int4 head), one process vs a 2-stage gloo pipeline, both
    with the fused decode step (its CPU references), an int8 KV cache and 2 slots."""
    from engine.weights.loader import load_dummy
    from engine.weights.formats import WeightFormat
    from engine.pipeline.launch import ModelSource
    from engine.runtime.runner import ModelRunner
    from tests.test_decode_step import CFG
    cfg = dataclasses.replace(CFG, num_layers=3)
    fmt = WeightFormat("tri", 64, "int4")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    single = ModelRunner(load_dummy(cfg, "tiny", weight_format=fmt), 64, num_slots=2, prefill_chunk_size=4,
                         fast_decode=True, kv_type="int8")
    pipe = _pipeline(ModelSource(architecture=cfg, name="tiny", weight_format=fmt), cfg, max_seq_len=64,
                     num_slots=2, prefill_chunk_size=4, kv_type="int8", fast_decode=True)
    yield single, pipe
    pipe.close()
    torch.set_num_threads(threads)


def test_tiny_pipeline_equals_one_process_bit_for_bit(tiny_pair):
    single, pipe = tiny_pair
    first, last = pipe.stages
    assert first.first == 0 and first.end == last.first and last.end == 3 and len(pipe.model.layers) == first.end
    for runner in tiny_pair:
        runner.slot(0).reset()
        runner.slot(1).reset()
    for slot, prompt in ((0, [3, 4, 5, 6, 7, 8, 9]), (1, [11, 12, 13])):  # chunks of 4 in flight together
        assert torch.equal(pipe.prefill(pipe.slot(slot), prompt), single.prefill(single.slot(slot), prompt))
    # two slots: two micro-batches of one row each, in flight together
    got = pipe.decode_batch([pipe.slot(1), pipe.slot(0)], [20, 21])
    assert torch.equal(got, single.decode_batch([single.slot(1), single.slot(0)], [20, 21]))
    # verify three rows (micro-batches of 2 and 1 rows), rewind two, decode on: the rejected rows are overwritten
    got, _ = pipe.verify(pipe.slot(0), [30, 31, 32])
    want, _ = single.verify(single.slot(0), [30, 31, 32])
    assert torch.equal(got, want)
    pipe.slot(0).rewind(2)
    single.slot(0).rewind(2)
    assert torch.equal(pipe.forward(pipe.slot(0), [40]), single.forward(single.slot(0), [40]))
    # a plain multi-token pass with every row's logits
    assert torch.equal(pipe.forward(pipe.slot(1), [1, 2], None), single.forward(single.slot(1), [1, 2], None))
    assert pipe.slot(0).tokens == single.slot(0).tokens


def test_a_worker_that_dies_stops_the_driver_with_one_line(tiny_pair):
    """Last in this file: it ends the module's pipeline."""
    _, pipe = tiny_pair
    pipe.links.procs[0].kill()
    pipe.links.procs[0].wait(10)
    with pytest.raises(BonsaiError, match="the pipeline stopped"):
        for _ in range(3):
            pipe.forward(pipe.slot(0), [5])
    pipe.close()


def test_cli_generate_pipelined_matches_one_process(tmp_path, smollm2_gguf, capsys):
    """In this process (the driver), before the SmolLM2 pipeline below starts: one pipeline at a time."""
    from tests.gguf_tiny import write_tiny_gguf
    from tests.test_cli_errors import bonsai_in_process
    path = write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_gguf)
    args = ["generate", str(path), "-p", "Hello there", "-n", "8", "--json", "--max-seq-len", "256"]
    want = bonsai_in_process(capsys, *args)
    got = bonsai_in_process(capsys, *args, "--device", "cpu,cpu", "--pipeline-parallel")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]


@pytest.fixture(scope="module")
def smollm2_pipe(smollm2_gguf):
    from engine.sources.gguf_file import GGUFFile
    from engine.pipeline.launch import ModelSource
    cfg = GGUFFile(smollm2_gguf).model_config()
    pipe = _pipeline(ModelSource(path=str(smollm2_gguf)), cfg, max_seq_len=160, num_slots=2, prefill_chunk_size=16)
    yield pipe
    pipe.close()


PROMPT = "The three primary colors are red, yellow and blue. The three primary colors are"


@pytest.mark.slow
def test_smollm2_two_processes_generate_what_one_does(smollm2_loaded, smollm2_pipe, smollm2_tok, one_thread):
    from engine.decoding.engine import Engine
    from engine.runtime.runner import ModelRunner
    from engine.speculative.ngram import NgramDrafter
    from tests.engine_runs import Threaded, run_engine
    from tests.test_serve_engine import collect, submit
    single = ModelRunner(smollm2_loaded, max_seq_len=160, prefill_chunk_size=16)
    ids = smollm2_tok.encode(PROMPT, add_special_tokens=True)
    request = dict(max_tokens=32)
    text, want, _, _ = run_engine(single, smollm2_tok, ids, **request)
    _, got, _, _ = run_engine(smollm2_pipe, smollm2_tok, ids, **request)
    assert got == want
    # n-gram speculation: verify passes through the pipeline, rewinds on rank 0 only
    _, spec, _, stats = run_engine(smollm2_pipe, smollm2_tok, ids, **request, drafter=NgramDrafter(1, 3), k=4)
    assert spec == want and stats.speculative.accepted > 0
    # two slots through the server's engine loop: batched decode steps as micro-batches
    other = smollm2_tok.encode("def add(a, b):", add_special_tokens=True)
    text_other, _, _, _ = run_engine(single, smollm2_tok, other, max_tokens=16)
    engine = Threaded(Engine(smollm2_pipe, smollm2_tok, 160, max_queue=4))
    try:
        jobs = [submit(engine, ids, max_tokens=32, id="a"),
                submit(engine, other, max_tokens=16, id="b")]
        (text_a, _, _), (text_b, _, _) = (collect(q, timeout=300) for _, q in jobs)
        assert engine.metrics.decode_rows > engine.metrics.decode_steps  # the slots shared steps
    finally:
        engine.stop()
    assert text_a == text and text_b == text_other


# ---- the command line, and the workers' end ----


def _generate_cmd(path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bonsai_cli", "generate", str(path), "-p", "Hello there", "--device", "cpu,cpu",
            "--pipeline-parallel", "--max-seq-len", "256", *extra]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_workers_exit_when_the_driver_is_killed(tmp_path, smollm2_gguf):
    from tests.gguf_tiny import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_gguf)
    proc = subprocess.Popen(_generate_cmd(path, "-n", "200"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.read(1)  # generating: the worker is up
        workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert workers
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, "a pipeline worker outlived its driver"
        time.sleep(0.1)

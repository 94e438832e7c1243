"""Pipeline stages of a hybrid (Qwen3.5 / 3.6: DeltaNet + gated attention) model: two gloo processes give what one
process gives, bit for bit, on a tiny generated hybrid — prefill chunks, batched slots, verify rows through the fused
step and through the plain path with their rewinds (each stage restores its own DeltaNet layers' states), prefix
points saved and restored on every stage, n-gram speculation through the engine — and the split counts each
layer's cache (KV rows of an attention layer, states of a DeltaNet layer)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.pipeline.split import layer_cache_bytes, plan_stages, stage_config
from tests.hybrid_tiny import engine_hybrid_config

TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention")


def _cfg():
    return engine_hybrid_config(TYPES, 128)


def test_the_split_counts_kv_rows_for_attention_layers_and_states_for_deltanet_layers():
    from engine.memory.budget import dummy_formats, run_settings
    from engine.memory.plan import make_plan
    cfg = _cfg()
    settings = run_settings(cfg, "cpu", 64, slots=2, dummy=True)
    cache = layer_cache_bytes(cfg, settings)
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 64 * 2  # K and V × heads × D × float32 × positions × slots
    state = cfg.hybrid.state_bytes_per_slot(4) // 3 * 2
    assert cache == [state, kv, state, state, kv]
    plan = make_plan(cfg, dummy_formats(cfg).formats, settings)
    assert sum(cache) == plan.category("kv")  # the KV cache and the DeltaNet states, as the plan counts them
    stages = plan_stages(cfg, dummy_formats(cfg).formats, settings, ["cpu", "cpu"])
    assert sum(s.kv_bytes for s in stages) == sum(cache)
    first = stage_config(cfg, stages[1].first, stages[1].end)
    assert first.num_layers == stages[1].num_layers and first.hybrid.layer_types == TYPES[stages[1].first:]


def test_cli_generate_of_a_hybrid_pipelined_matches_one_process(tmp_path_factory, smollm2_gguf, capsys):
    """A tiny Qwen3_5ForCausalLM directory (transformers writes it) through `bonsai generate` with n-gram
    speculation: two CPU processes give one's tokens (before this file's pipeline starts: one at a time in a process)."""
    pytest.importorskip("transformers.models.qwen3_5")
    from tests.hybrid_tiny import make_hybrid_model, tokenizer_dir
    from tests.test_cli_errors import bonsai_in_process
    path = tmp_path_factory.mktemp("q35-cli")
    make_hybrid_model(path, tokenizer_dir(tmp_path_factory, smollm2_gguf))
    args = ["generate", str(path), "-p", "Hello there, hello there, hello", "-n", "12", "--json", "--max-seq-len",
            "128", "--spec", "ngram"]
    want = bonsai_in_process(capsys, *args)
    got = bonsai_in_process(capsys, *args, "--device", "cpu,cpu", "--pipeline-parallel")
    assert want.returncode == 0 and got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]


@pytest.fixture(scope="module")
def pair():
    """One process and a 2-stage gloo pipeline over the same generated hybrid (ternary blocks, int4 head, the fused
    step's CPU references, int8 KV for the attention layers, 2 slots, prefill chunks of 4)."""
    from engine.memory.budget import dummy_formats, run_settings
    from engine.pipeline.launch import ModelSource
    from engine.pipeline.setup import open_pipeline, plan_pipeline
    from engine.runtime.runner import ModelRunner
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    cfg, fmt = _cfg(), WeightFormat("tri", 32, "int4")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    single = ModelRunner(load_dummy(cfg, "tiny", weight_format=fmt), 64, num_slots=2, prefill_chunk_size=4,
                         fast_decode=True, kv_type="int8")
    settings = run_settings(cfg, "cpu", 64, dummy=True)
    pp = plan_pipeline(cfg, dummy_formats(cfg).formats, settings, ["cpu", "cpu"])
    pipe = open_pipeline(ModelSource(architecture=cfg, name="tiny", weight_format=fmt), pp, max_seq_len=64,
                         num_slots=2, prefill_chunk_size=4, kv_type="int8", fast_decode=True)
    yield single, pipe
    pipe.close()
    torch.set_num_threads(threads)


def _reset(*runners):
    for runner in runners:
        for slot in runner.cache.slots:
            slot.reset()


def test_two_stages_give_what_one_process_gives(pair):
    single, pipe = pair
    _reset(single, pipe)
    first, last = pipe.stages
    assert first.end == last.first and last.end == len(TYPES) and pipe.rewinds_for_free is False
    assert {TYPES[i] for i in range(first.end)} == {TYPES[i] for i in range(last.first, last.end)}  # both kinds each
    for slot, prompt in ((0, [3, 4, 5, 6, 7, 8, 9]), (1, [11, 12, 13])):  # chunks of 4 in flight together
        assert torch.equal(pipe.prefill(pipe.slot(slot), prompt), single.prefill(single.slot(slot), prompt))
    got = pipe.decode_batch([pipe.slot(1), pipe.slot(0)], [20, 21])
    assert torch.equal(got, single.decode_batch([single.slot(1), single.slot(0)], [20, 21]))
    for tokens, back in (([30, 31, 32], 2), ([33, 34, 35, 36, 37, 38, 39, 40], 3)):  # verify rows (one pass), rewind
        got, _ = pipe.verify(pipe.slot(0), tokens)
        want, _ = single.verify(single.slot(0), tokens)
        assert torch.equal(got, want)
        pipe.slot(0).rewind(back)
        single.slot(0).rewind(back)
        assert torch.equal(pipe.forward(pipe.slot(0), [41]), single.forward(single.slot(0), [41]))
    assert torch.equal(pipe.forward(pipe.slot(1), [1, 2], None), single.forward(single.slot(1), [1, 2], None))
    assert torch.equal(pipe.decode_batch([pipe.slot(0), pipe.slot(1)], [5, 6]),
                       single.decode_batch([single.slot(0), single.slot(1)], [5, 6]))
    assert pipe.slot(0).tokens == single.slot(0).tokens


def test_a_verify_longer_than_a_fused_step_rewinds_on_every_stage(pair):
    """17 rows: the plain path's recorded pass (RECORD), each stage keeping every position's state. (The prompt
    leaves no 1-token chunk: one process steps that through the fused step, a pipeline through its plain pass,
    1e-10 apart in the state.)"""
    single, pipe = pair
    _reset(single, pipe)
    prompt, draft = [7, 8, 9, 10, 11, 12], list(range(40, 57))
    assert torch.equal(pipe.prefill(pipe.slot(0), prompt), single.prefill(single.slot(0), prompt))
    got, _ = pipe.verify(pipe.slot(0), draft)
    want, _ = single.verify(single.slot(0), draft)
    assert torch.equal(got, want)
    pipe.slot(0).rewind(12)
    single.slot(0).rewind(12)
    assert torch.equal(pipe.forward(pipe.slot(0), [3]), single.forward(single.slot(0), [3]))


def test_a_prefix_point_restores_on_every_stage(pair):
    """A prompt of three chunks, then the slot cut back to its second chunk's end (a request sharing that prefix):
    stage 0 restores its point and the other stage the same entry."""
    single, pipe = pair
    _reset(single, pipe)
    prompt = list(range(60, 71))  # chunks 4 + 4 + 3: points after 4, 8 and 11 tokens; the newest two kept
    assert torch.equal(pipe.prefill(pipe.slot(1), prompt), single.prefill(single.slot(1), prompt))
    assert pipe.slot(1).keepable(9) == single.slot(1).keepable(9) == 8
    pipe.slot(1).rewind(3)
    single.slot(1).rewind(3)
    tail = [90, 91, 92]
    assert torch.equal(pipe.prefill(pipe.slot(1), tail), single.prefill(single.slot(1), tail))
    assert pipe.slot(1).tokens == single.slot(1).tokens == prompt[:8] + tail


def test_ngram_speculation_through_the_pipeline_equals_plain_decoding(pair, one_thread):
    from engine.speculative.ngram import NgramDrafter
    from tests.engine_runs import run_engine
    single, pipe = pair
    prompt = [3, 17, 42, 9] * 4 + [5]
    request = dict(max_tokens=16, ignore_eos=True, text=False)
    _reset(single, pipe)
    plain = run_engine(single, None, prompt, **request)[1]
    _reset(single, pipe)
    spec = run_engine(pipe, None, prompt, drafter=NgramDrafter(), k=4, **request)
    assert spec[1] == plain and spec[3].speculative.drafted > 0, spec[3].speculative


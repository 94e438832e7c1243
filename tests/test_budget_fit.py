"""What the plan chooses under max_gpu_memory (the embedding table in host memory, a smaller prefill
chunk), the 27B-class model under 6 GB through `bonsai info --plan`, and the refusals."""
from __future__ import annotations

import dataclasses
import json

import pytest

from bonsai_cli.run_options import dummy_architecture
from engine.errors import BonsaiError
from engine.memory.budget import SERVE_KEYS, check_budget, dummy_formats, fit_to_budget, run_settings
from engine.memory.plan import make_plan
from engine.weights.formats import WeightFormat
from engine.weights.packed_linear import FIT_UNPACK_SLICE_BYTES

SERVE_27B = """model:
  path: dense-27b
  load_format: dummy
  tokenizer: smollm2-135m
  quant_type: bin
  head_type: int4
  max_context: 4096
  kv_type: {kv}
runtime:
  device: cuda:0
  max_seq_len: 4096
memory:
  max_gpu_memory: 6GB
"""


def plan_json(tmp_path, capsys, text: str) -> dict:
    from bonsai_cli.main import main
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    main(["info", "configs/models/dense-27b.yaml", "--plan", str(path), "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_27b_one_bit_at_4k_fits_6gb(tmp_path, capsys, kv):
    out = plan_json(tmp_path, capsys, SERVE_27B.format(kv=kv))
    assert out["fits"] and out["refusal"] is None
    assert out["total_bytes"] <= 5_500_000_000  # half a GB of margin at least
    assert out["settings"]["embedding_on_host"] is True and out["settings"]["prefill_chunk_size"] == 512
    assert [c["key"] for c in out["chosen_to_fit"]] == ["embedding_on_host"]
    assert out["host_bytes"] == 151936 * 5120 * 2
    refused = plan_json(tmp_path, capsys, SERVE_27B.format(kv=kv) + "  embedding_on_host: false\n")
    assert not refused["fits"] and "would fit: " in refused["refusal"]
    assert "memory.embedding_on_host: true" in refused["refusal"] and "\n" not in refused["refusal"]


def test_a_smaller_prefill_chunk_is_chosen_only_when_left_open():
    config, _ = dummy_architecture("dense-27b")
    weights = dummy_formats(config, WeightFormat("bin", 128, "int4"))
    s = run_settings(config, "cuda:0", 4096, dummy=True, limited=True)
    limit = make_plan(config, weights.formats, dataclasses.replace(s, embedding_on_host=True,
                                                                   prefill_chunk_size=256)).total
    chosen, choices = fit_to_budget(weights, s, limit, embedding_auto=True, chunk_auto=True)
    assert (chosen.embedding_on_host, chosen.prefill_chunk_size) == (True, 256)
    assert [c.key for c in choices] == ["embedding_on_host", "prefill_chunk_size"]
    assert "prefill chunk 256 tokens instead of 512" in choices[1].line
    fixed, choices = fit_to_budget(weights, s, limit, embedding_auto=True, chunk_auto=False)
    assert fixed.prefill_chunk_size == 512 and [c.key for c in choices] == ["embedding_on_host"]
    plan = make_plan(config, weights.formats, fixed)
    with pytest.raises(BonsaiError, match=r"runtime.prefill_chunk_size <= 256"):
        check_budget(plan, limit, weights, fixed, SERVE_KEYS)
    same, none = fit_to_budget(weights, s, None, embedding_auto=True, chunk_auto=True)
    assert same == s and none == []  # no limit: nothing changes


def test_prefill_unpacks_whole_unless_a_memory_limit_is_set(tmp_path, capsys):
    """Packed matrices are unpacked whole for prefill (fastest), but under max_gpu_memory in 64 MB slices (a whole
    27B gate/up Wᵀ is 440 MB, and a segment that size cannot be had in a nearly full budget); the plan counts
    whichever the run does."""
    config, _ = dummy_architecture("dense-27b")
    weights = dummy_formats(config, WeightFormat("bin", 128, "int4"))
    whole = run_settings(config, "cuda:0", 4096, dummy=True)
    sliced = run_settings(config, "cuda:0", 4096, dummy=True, limited=True)
    assert (whole.unpack_slice_bytes, sliced.unpack_slice_bytes) == (0, FIT_UNPACK_SLICE_BYTES)
    gate_up = 2 * config.intermediate_size * config.hidden_size * 2  # its whole bf16 Wᵀ
    assert make_plan(config, weights.formats, whole).category("prefill") >= gate_up > \
        make_plan(config, weights.formats, sliced).category("prefill")
    out = plan_json(tmp_path, capsys, SERVE_27B.format(kv="int8"))
    assert out["settings"]["unpack_slice_bytes"] == FIT_UNPACK_SLICE_BYTES


def test_a_tied_float_head_keeps_its_table(tmp_path, capsys):
    from tests.test_memory_budget import TINY_ARCH
    arch = tmp_path / "tied.yaml"
    arch.write_text(TINY_ARCH)
    config, _ = dummy_architecture(str(arch))
    weights = dummy_formats(config, WeightFormat("bin", 32))
    s = run_settings(config, "cuda:0", 256, dummy=True)
    tight = make_plan(config, weights.formats, s).total - 1
    chosen, choices = fit_to_budget(weights, s, tight, embedding_auto=True, chunk_auto=False)
    assert not chosen.embedding_on_host and choices == []  # never chosen: the output layer reads the table
    with pytest.raises(BonsaiError) as e:
        check_budget(make_plan(config, weights.formats, chosen), tight, weights, chosen, SERVE_KEYS)
    assert "embedding_on_host" not in str(e.value)


def test_the_hybrid_27b_in_6gb_config_plans_to_fit_streaming_some_blocks(capsys):
    """configs/serve-qwen3.6-27b-6gb.yaml: the plan fits 6 GB with the base-3 layout, the embedding in host memory
    and part of the 64 blocks streamed (H200: 5.48 GB allocated at peak, docs/perf.md session 20)."""
    from bonsai_cli.main import main
    main(["info", "configs/models/qwen3.6-27b.yaml", "--plan", "configs/serve-qwen3.6-27b-6gb.yaml", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["total_bytes"] <= 6_000_000_000
    chosen = {c["key"]: c["value"] for c in out["chosen_to_fit"]}
    assert chosen["ternary_layout"] == "base3" and chosen["embedding_on_host"] is True
    assert 0 < len(chosen["weight_offload"]) < 64
    assert out["settings"]["unpack_slice_bytes"] == FIT_UNPACK_SLICE_BYTES

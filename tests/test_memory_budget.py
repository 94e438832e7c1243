"""max_gpu_memory: refusals before loading say what would fit; the seed config; the commands
(`bonsai info --plan`, `generate/bench --max-gpu-memory`) and the serve loader on the CPU."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from engine.errors import BonsaiError
from engine.memory.budget import SERVE_KEYS, check_budget, dummy_formats, run_settings
from engine.memory.plan import make_plan
from engine.weights.formats import WeightFormat
from tests.test_memory_plan import QWEN3_8B
from tests.test_serve_config import SEED, error, load

TINY_ARCH = """architectures: [Qwen3ForCausalLM]
vocab_size: 49152
hidden_size: 64
intermediate_size: 128
num_hidden_layers: 2
num_attention_heads: 4
num_key_value_heads: 2
head_dim: 32
tie_word_embeddings: true
"""


def refusal(limit: int, s, weights) -> str:
    plan = make_plan(weights.config, weights.formats, s)
    with pytest.raises(BonsaiError) as e:
        check_budget(plan, limit, weights, s, SERVE_KEYS)
    return str(e.value)


def total(weights, s, **changes) -> int:
    return make_plan(weights.config, weights.formats, dataclasses.replace(s, **changes)).total


def test_refusal_says_which_context_kv_type_slots_or_offload_would_fit():
    weights = dummy_formats(QWEN3_8B, WeightFormat("tri", 128, "int4"))
    s = run_settings(QWEN3_8B, "cuda:0", 4096, slots=4)
    plan = make_plan(QWEN3_8B, weights.formats, s)
    check_budget(plan, plan.total, weights, s, SERVE_KEYS)  # exactly at the limit: accepted
    check_budget(plan, None, weights, s, SERVE_KEYS)
    limit = total(weights, s, kv_type="int8") + 1000
    message = refusal(limit, s, weights)
    assert "\n" not in message and "memory.max_gpu_memory" in message and "would fit: " in message
    assert "KV cache type int8" in message and "runtime.max_batch_size <= 2" in message
    assert "memory.kv_offload: true" in message
    # each suggestion really fits, and one step further does not
    assert total(weights, s, slots=2, graph_rows=2) <= limit < total(weights, s, slots=3, graph_rows=3)
    n = int(re.search(r"runtime.max_seq_len <= (\d+)", message).group(1))
    assert n % 256 == 0
    at = {m: dict(max_seq_len=m, num_splits=run_settings(QWEN3_8B, "cuda", m).num_splits) for m in (n, n + 256)}
    assert total(weights, s, **at[n]) <= limit < total(weights, s, **at[n + 256])
    assert total(weights, s, kv_offload=True) <= limit
    tight = total(weights, s, kv_type="int4") + 1
    assert "int4" in refusal(tight, s, weights) and "int8" not in refusal(tight, s, weights)


def test_weights_over_the_limit_suggest_weight_offload_or_nothing():
    weights = dummy_formats(QWEN3_8B, WeightFormat("bf16"))  # 16 GB of float weights
    s = run_settings(QWEN3_8B, "cuda:0", 1024)
    message = refusal(6_000_000_000, s, weights)
    assert "memory.weight_offload: auto (streams 27 of 36 blocks" in message and "max_seq_len" not in message
    assert "no single change" in refusal(500_000_000, s, weights)


def test_seed_config_loads_as_written(tmp_path):
    """With its path changed, the users' seed config loads: max_gpu_memory is a hard limit,
    activation_checkpoint: false is accepted, true is refused as a training option."""
    cfg = load(SEED, tmp_path)
    assert cfg.memory.max_gpu_memory_bytes == 6_000_000_000 and cfg.memory.activation_checkpoint is False
    assert cfg.model.kv_type_name == "int4" and cfg.spec_config is not None
    assert load(SEED.replace("6GB", "5.5GiB"), tmp_path).memory.max_gpu_memory_bytes == int(5.5 * 2**30)
    message = error(SEED.replace("activation_checkpoint: false", "activation_checkpoint: true"), tmp_path)
    assert "memory.activation_checkpoint" in message and "training option" in message
    assert "memory.max_gpu_memory" in error(SEED.replace("6GB", "six gigabytes"), tmp_path)


def _write_dummy_config(tmp_path, smollm2_gguf, limit: str, slots: int = 2) -> object:
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY_ARCH)
    path = tmp_path / "serve.yaml"
    path.write_text(f"model:\n  path: {arch}\n  load_format: dummy\n  tokenizer: {smollm2_gguf}\n  quant_type: tri\n"
                    f"  group_size: 32\nruntime:\n  device: cpu\n  max_batch_size: {slots}\n  max_seq_len: 256\n"
                    f"memory:\n  max_gpu_memory: {limit}\n")
    return path


def test_info_plan_json_and_table(tmp_path, smollm2_gguf, capsys, monkeypatch):
    from bonsai_cli.main import main
    monkeypatch.setenv("COLUMNS", "250")
    from engine.run.plan import plan_run
    path = _write_dummy_config(tmp_path, smollm2_gguf, "1GB")
    main(["info", "--plan", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    from bonsai_cli.cmd_serve import read_serve_config
    from bonsai_cli.run_options import architecture_of
    cfg = read_serve_config(path)
    planned = plan_run(cfg, architecture_of(cfg))
    assert out["total_bytes"] == planned.plan.total and out["fits"] and out["refusal"] is None
    assert out["by_category"]["kv"] == 2 * 2 * 2 * 32 * 4 * 256 * 2  # layers, kv heads, k+v, f32 rows, 256 x 2 slots
    assert out["settings"]["slots"] == 2 and out["max_gpu_memory"] == 1_000_000_000
    small = _write_dummy_config(tmp_path, smollm2_gguf, "18MB")
    main(["info", "--plan", str(small)])
    text = capsys.readouterr().out
    assert "total on the device" in text and "over max_gpu_memory" in text and "would fit" in text


def test_serve_refuses_before_loading_and_loads_within_the_limit(tmp_path, smollm2_gguf, monkeypatch, one_thread):
    from bonsai_cli.cmd_serve import read_serve_config
    from bonsai_cli.run_options import architecture_of
    from engine.run import builder
    from engine.server.engine_thread import start_serving
    cfg = read_serve_config(_write_dummy_config(tmp_path, smollm2_gguf, "18MB"))
    loads = []
    real = builder.load_run_model
    monkeypatch.setattr(builder, "load_run_model", lambda *a: loads.append(1) or real(*a))
    with pytest.raises(BonsaiError, match=r"memory.max_gpu_memory 18.00 MB: the memory plan needs .* would fit: "):
        start_serving(cfg, architecture=architecture_of(cfg))
    assert loads == []  # refused before anything was loaded
    cfg = read_serve_config(_write_dummy_config(tmp_path, smollm2_gguf, "50MB"))
    served = start_serving(cfg, architecture=architecture_of(cfg))
    try:
        assert loads == [1] and served.engine.runner.cache.nbytes == 2 * 2 * 2 * 32 * 4 * 256 * 2
    finally:
        served.stop()


def test_generate_refuses_before_loading(smollm2_gguf, capsys):
    from bonsai_cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["generate", str(smollm2_gguf), "-p", "hi", "--max-gpu-memory", "100MB", "--max-seq-len", "2048"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --max-gpu-memory 100.00 MB: the memory plan needs") and "\n" not in err
    assert "--max-seq-len" not in err  # the float weights alone are over: no context fits


def test_bench_reports_plan_and_limit(tmp_path, one_thread):
    from bonsai_cli.main import main
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY_ARCH)
    out = tmp_path / "r.json"
    main(["bench", str(arch), "--load-format", "dummy", "--weights", "bin", "--group-size", "32", "-p", "8",
          "-n", "2", "-r", "1", "--no-pg", "--max-gpu-memory", "20MB", "--json", str(out)])
    memory = json.loads(out.read_text())["memory"]
    assert memory["max_gpu_memory"] == 20_000_000 and 0 < memory["planned_bytes"] < 20_000_000
    assert memory["peak_allocated_bytes"] is None  # the CPU has no allocator statistics


def test_info_describes_a_dummy_model(tmp_path, capsys):
    from bonsai_cli.main import main
    from engine.memory.plan import weight_tensors
    from engine.sources.model_config import ModelConfig
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY_ARCH)
    main(["info", str(arch), "--load-format", "dummy", "--weights", "bin", "--group-size", "32", "--json"])
    out = json.loads(capsys.readouterr().out)
    config = ModelConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
                                         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True})
    formats = dummy_formats(config, WeightFormat("bin", 32)).formats
    assert out["format"] == "dummy" and out["parameters"] == config.num_parameters()
    assert out["bytes"] == sum(b for _, _, b in weight_tensors(config, formats, run_settings(config, "cuda", 2)))
    assert out["bytes"] - 49152 * 64 * 2 < 64 * 64 * 8  # past the bf16 embedding: 1-bit blocks, small

"""The serve config: the users' layout parses, unknown keys name the nearest one, unavailable
features are refused with one line naming the key, the YAML reader and CLI overrides."""
from __future__ import annotations

import textwrap

import pytest

from engine.errors import BonsaiError
from engine.run.config import parse_bytes
from engine.server.config import ServeConfig

SEED = """
model:
  path: ./bonsai-27b-trit
  quant_type: tri
  max_context: 1536
  kv_cache_quant: true
  kv_cache_bits: 4
runtime:
  device: cuda:0
  max_batch_size: 1
  max_seq_len: 1536
  prefill_chunk_size: 512
  decode_algorithm: speculative
  draft_model: none
memory:
  weight_offload: false
  activation_checkpoint: false
  max_gpu_memory: 6GB
"""


def load(text: str, tmp_path, **overrides) -> ServeConfig:
    from bonsai_cli.cmd_serve import read_serve_config
    path = tmp_path / "serve.yaml"
    path.write_text(textwrap.dedent(text))
    return read_serve_config(path, overrides)


def error(text: str, tmp_path, **overrides) -> str:
    with pytest.raises(BonsaiError) as e:
        load(text, tmp_path, **overrides)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_seed_config_is_read_and_each_unavailable_key_is_named(tmp_path):
    # The layout parses (no unknown key); what is not built yet is refused one key at a time.
    cfg = load(SEED, tmp_path)  # accepted as written
    # decode_algorithm: speculative with draft_model: none → n-gram drafting; kv_cache_bits 4 → int4
    assert cfg.spec_config.method == "ngram" and cfg.spec_config.num_draft_tokens == 4
    assert load(SEED.replace("decode_algorithm: speculative", "decode_algorithm: standard")
                .replace("  draft_model: none\n", ""), tmp_path).spec_config is None
    assert cfg.model.quant_type == "tri" and cfg.runtime.device == "cuda:0" and cfg.model.kv_type_name == "int4"
    assert cfg.slot_context == 1536 and cfg.seq_len == 1536 and cfg.runtime.prefill_chunk_size == 512
    assert cfg.server.host == "127.0.0.1" and cfg.context.compress_at == 0.9
    assert cfg.memory.max_gpu_memory_bytes == 6_000_000_000


def test_users_variants_are_refused_by_name(tmp_path):
    base = "model:\n  path: m\n"
    assert "model.kv_cache_async_dequant" in error(base + "  kv_cache_async_dequant: true\n", tmp_path)
    assert "in registers" in error(base + "  kv_cache_async_dequant: true\n", tmp_path)
    two = base + "runtime:\n  device: cuda:0,cuda:1\nmemory:\n  pipeline_parallel: true\n"
    assert load(two, tmp_path).runtime.devices == ["cuda:0", "cuda:1"]  # the pipeline (engine/pipeline)
    unset = error(base + "runtime:\n  device: cuda:0,cuda:1\n", tmp_path)
    assert "2 devices" in unset and "set memory.pipeline_parallel: true" in unset
    assert "two or more devices" in error(base + "memory:\n  pipeline_parallel: true\n", tmp_path)
    assert "kv_cache_bits" in error(base + "  kv_cache_bits: 4\n", tmp_path)


def test_kv_cache_keys(tmp_path):
    """The seed keys (kv_cache_quant + kv_cache_bits) and model.kv_type pick the KV type; contradictions
    are one line naming the keys."""
    base = "model:\n  path: m\n"
    assert load(base, tmp_path).model.kv_type_name == "bf16"
    assert load(base + "  kv_cache_quant: true\n  kv_cache_bits: 8\n", tmp_path).model.kv_type_name == "int8"
    assert load(base + "  kv_cache_quant: true\n  kv_cache_bits: 4\n", tmp_path).model.kv_type_name == "int4"
    assert load(base + "  kv_cache_quant: false\n", tmp_path).model.kv_type_name == "bf16"
    for kv_type in ("bf16", "int8", "int4", "k8v4"):
        assert load(base + f"  kv_type: {kv_type}\n", tmp_path).model.kv_type_name == kv_type
    assert load(base + "  kv_type: k8v4\n  kv_cache_quant: true\n", tmp_path).model.kv_type_name == "k8v4"
    assert load(base + "  kv_type: int4\n  kv_cache_quant: true\n  kv_cache_bits: 4\n", tmp_path
                ).model.kv_type_name == "int4"
    message = error(base + "  kv_type: int8\n  kv_cache_quant: true\n  kv_cache_bits: 4\n", tmp_path)
    assert "model.kv_cache_bits" in message and "model.kv_type" in message and "contradicts" in message
    message = error(base + "  kv_type: int8\n  kv_cache_quant: false\n", tmp_path)
    assert "model.kv_cache_quant" in message and "model.kv_type" in message
    assert "model.kv_cache_quant" in error(base + "  kv_type: bf16\n  kv_cache_quant: true\n", tmp_path)
    assert "model.kv_cache_bits" in error(base + "  kv_type: k8v4\n  kv_cache_quant: true\n  kv_cache_bits: 8\n",
                                          tmp_path)
    assert "model.kv_cache_bits" in error(base + "  kv_cache_quant: true\n", tmp_path)  # which bits?
    assert "8 or 4" in error(base + "  kv_cache_quant: true\n  kv_cache_bits: 2\n", tmp_path)
    message = error(base + "  kv_type: fp8\n", tmp_path)
    assert "model.kv_type" in message and "k8v4" in message
    assert "'kv_type'" in error(base + "  kv_typ: int8\n", tmp_path)  # the nearest key


def test_unknown_keys_name_the_nearest_valid_key(tmp_path):
    message = error("model:\n  path: m\nruntime:\n  max_batch_sise: 2\n", tmp_path)
    assert "runtime.max_batch_sise" in message and "max_batch_size" in message
    assert "'server'" in error("model:\n  path: m\nservr:\n  port: 1\n", tmp_path)
    assert "model.path" in error("runtime:\n  device: cpu\n", tmp_path)


def test_wrong_types_and_values_give_the_key_path(tmp_path):
    assert "runtime.max_batch_size" in error("model:\n  path: m\nruntime:\n  max_batch_size: two\n", tmp_path)
    assert "runtime.max_batch_size" in error("model:\n  path: m\nruntime:\n  max_batch_size: 0\n", tmp_path)
    assert "server.port" in error("model:\n  path: m\nserver:\n  port: 70000\n", tmp_path)
    assert "thinking.budget" in error("model:\n  path: m\nthinking:\n  budget: -1\n", tmp_path)
    assert "context.compress_at" in error("model:\n  path: m\ncontext:\n  compress_at: 1.5\n", tmp_path)
    assert "model.max_context" in error("model:\n  path: m\n  max_context: 4096\nruntime:\n  max_seq_len: 1024\n",
                                        tmp_path)
    assert "speculative" in error("model:\n  path: m\nspeculative:\n  method: ngram\n", tmp_path)
    spec = "model:\n  path: m\nruntime:\n  decode_algorithm: speculative\n  draft_model: {}\nspeculative:\n  method: {}\n"
    assert "speculative.method" in error(spec.format("none", "mix:ngram,draft:./small"), tmp_path)
    assert "runtime.draft_model" in error(spec.format("./small", "ngram"), tmp_path)
    cfg = load(spec.format("none", "ngram") + "  num_draft_tokens: 6\n  adaptive: false\n", tmp_path)
    assert cfg.spec_config.num_draft_tokens == 6 and not cfg.spec_config.adaptive
    cfg = load("model:\n  path: m\nruntime:\n  decode_algorithm: speculative\n  draft_model: ./small\n", tmp_path)
    assert cfg.spec_config.method == "draft" and cfg.spec_config.drafters[0].path == "./small"
    assert "speculative.drafter" in error("model:\n  path: m\nspeculative:\n  drafter: ngram\n", tmp_path)
    from engine.run.config import SpeculativeSection
    assert SpeculativeSection("mix:ngram,mtp", num_draft_tokens=6).as_spec_config().num_draft_tokens == 6
    with pytest.raises(BonsaiError, match="config speculative: unknown drafter 'ngarm'"):
        SpeculativeSection("ngarm")
    assert "runtime.weight_dtype" in error("model:\n  path: m\nruntime:\n  weight_dtype: fp8\n", tmp_path)
    assert "memory.activation_checkpoint" in error("model:\n  path: m\nmemory:\n  activation_checkpoint: true\n",
                                                   tmp_path)
    assert "mapping" in error("- just\n- a list\n", tmp_path)
    budget = "model:\n  path: m\nserver:\n  max_prefill_tokens_per_step: {}\n"
    assert "server.max_prefill_tokens_per_step" in error(budget.format(0), tmp_path)
    assert "server.max_prefill_tokens_per_step" in error(budget.format("lots"), tmp_path)
    assert load(budget.format(128), tmp_path).server.max_prefill_tokens_per_step == 128
    assert "max_prefill_tokens_per_step" in error(budget.format(1).replace("tokens_per", "token_per"), tmp_path)


def test_command_line_overrides_and_defaults(tmp_path):
    cfg = load("model:\n  path: m\n", tmp_path, **{"server.port": 9001, "server.host": None,
                                                   "runtime.max_batch_size": 4})
    assert cfg.server.port == 9001 and cfg.server.host == "127.0.0.1" and cfg.runtime.max_batch_size == 4
    assert cfg.slot_context == 4096 and cfg.speculative is None and cfg.thinking.budget is None
    assert "server.api_key" in error("model:\n  path: m\n", tmp_path, **{"server.api_key": "short"})


def test_sizes_parse():
    assert parse_bytes("6GB", "x") == 6_000_000_000 and parse_bytes("512MiB", "x") == 512 << 20
    with pytest.raises(BonsaiError, match="x"):
        parse_bytes("lots", "x")


def test_every_example_config_loads_or_is_refused_by_name(tmp_path):
    from pathlib import Path

    from bonsai_cli.cmd_serve import read_serve_config
    examples = sorted((Path(__file__).resolve().parents[1] / "configs").glob("serve-*.yaml"))
    assert len(examples) >= 4
    for path in examples:
        cfg = read_serve_config(path)
        assert cfg.model.path
        if "speculative" in path.name:
            assert cfg.spec_config is not None and cfg.runtime.max_batch_size > 1


def test_served_dummy_models_need_a_tokenizer(tmp_path):
    assert "model.tokenizer" in error("model:\n  path: qwen3-8b\n  load_format: dummy\n", tmp_path)
    assert "model.tokenizer" in error("model:\n  path: m\n  tokenizer: smollm2-135m\n", tmp_path)
    cfg = load("model:\n  path: qwen3-8b\n  load_format: dummy\n  tokenizer: smollm2-135m\n  quant_type: tri\n",
               tmp_path)
    from bonsai_cli.run_options import architecture_of
    assert architecture_of(cfg).hidden_size == 4096


def test_offload_keys(tmp_path):
    base = "model:\n  path: m\nmemory:\n"
    cfg = load(base + "  kv_offload: true\n  host_kv_mib: 8192\n  weight_offload: true\n", tmp_path)
    assert cfg.memory.kv_offload and cfg.memory.host_kv_mib == 8192 and cfg.memory.weight_offload
    assert "memory.host_kv_mib" in error(base + "  host_kv_mib: 512\n", tmp_path)  # without kv_offload
    assert "memory.host_kv_mib" in error(base + "  kv_offload: true\n  host_kv_mib: 0\n", tmp_path)
    assert "host_kv_mib" in error(base + "  host_kv_mb: 512\n", tmp_path)  # the nearest key
    assert "true (stream every block)" in error(base + "  weight_offload: yes please\n", tmp_path)
    assert "set memory.max_gpu_memory" in error(base + "  weight_offload: auto\n", tmp_path)
    assert load(base + "  weight_offload: auto\n  max_gpu_memory: 6GB\n", tmp_path).memory.weight_offload == "auto"
    from engine.memory.plan import RunSettings
    from engine.run.builder import offloaded_layers
    assert offloaded_layers(RunSettings(8, weight_offload=True), 3) == {0, 1, 2}
    assert offloaded_layers(RunSettings(8, weight_offload=True, resident_layers=(0, 2)), 3) == {1}
    assert offloaded_layers(RunSettings(8), 3) is None


def test_flags_build_the_run_config_a_file_builds(tmp_path):
    """MODEL and the flags make the RunConfig the same keys of a file make; flags override a file's
    keys; a refusal names the flag that set the key; the `server:` section is the server's alone."""
    from bonsai_cli.run_options import run_config
    path = tmp_path / "serve.yaml"
    path.write_text("model:\n  path: m\n  kv_type: int8\nruntime:\n  max_seq_len: 512\nserver:\n  port: 9\n")
    assert run_config(None, {}, path) == run_config("m", {"--kv-type": "int8", "--max-seq-len": 512})
    over = run_config(None, {"--kv-type": "int4", "--spec": "ngram", "--draft-tokens": 3, "--kv-offload": False}, path)
    assert over.model.kv_type == "int4" and over.runtime.max_seq_len == 512 and not over.memory.kv_offload
    assert over.spec_config.num_draft_tokens == 3 and run_config(None, {"--spec": "none"}, path).spec_config is None
    with pytest.raises(BonsaiError, match="^--host-kv-mib: only applies with --kv-offload; remove it$"):
        run_config("m", {"--host-kv-mib": 64})
    with pytest.raises(BonsaiError, match="^--device lists 2 devices .* set --pipeline-parallel"):
        run_config("m", {"--device": "cpu,cpu"})
    path.write_text("model:\n  path: m\nmemory:\n  host_kv_mib: 64\n")
    with pytest.raises(BonsaiError, match="^config memory.host_kv_mib: only applies with memory.kv_offload"):
        run_config(None, {"--device": "cpu"}, path)  # the file set it: its key's name

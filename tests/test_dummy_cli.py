"""`--load-format dummy` and `--weights` on the command line: generated models bench on the CPU,
bad values are one-line errors."""
from __future__ import annotations

import json

from tests.test_cli_errors import assert_one_line_error, bonsai_in_process

TINY = """architectures: [Qwen3ForCausalLM]
vocab_size: 1024
hidden_size: 256
intermediate_size: 512
num_hidden_layers: 2
num_attention_heads: 4
num_key_value_heads: 2
head_dim: 64
"""


def test_dummy_ternary_model_benches_on_cpu(tmp_path, capsys):
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY)
    out = tmp_path / "r.json"
    proc = bonsai_in_process(capsys, "bench", str(arch), "--load-format", "dummy", "--weights", "tri", "--head-weights",
                             "int4", "--group-size", "64", "-p", "16", "-n", "4", "-r", "1", "--no-pg", "--json", str(out),
                             "--kv-type", "k8v4")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["model"]["load_format"] == "dummy" and report["model"]["weights"] == "tri"
    # k8v4: (64 + 2) + (32 + 2 * 2 * 2) bytes per key + value row, 2 layers x 2 kv heads per position
    m = report["model"]
    assert m["kv_type"] == "k8v4" and m["kv_bytes"] == (66 + 40) * 2 * 2 * m["max_seq_len"]
    assert report["model"]["head_weights"] == "int4" and report["complete"]
    tg = next(t for t in report["tests"] if t["name"] == "tg4")
    # ternary codes + int4 head + the float32 embedding row read per token: far fewer bytes than float
    assert 0 < tg["decode_bandwidth"]["bytes_per_token"] < 1_000_000


def test_builtin_architecture_names_resolve(tmp_path, capsys):
    proc = bonsai_in_process(capsys, "bench", "no-such-arch", "--load-format", "dummy", "-p", "8", "-n", "2", "-r", "1")
    assert_one_line_error(proc, "qwen3-8b")  # the message lists the known architecture files


def test_bad_weight_type_and_group_size(tmp_path, capsys):
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY)
    assert_one_line_error(bonsai_in_process(capsys, "bench", str(arch), "--load-format", "dummy", "--weights", "tri3"),
                          "--weights: 'tri3' is not one of")
    assert_one_line_error(bonsai_in_process(capsys, "bench", str(arch), "--load-format", "dummy", "--weights", "tri",
                                            "--group-size", "48"), "--group-size: 48 is not one of 32, 64")
    assert_one_line_error(bonsai_in_process(capsys, "bench", str(arch), "--load-format", "magic"),
                          "--load-format: 'magic' is not auto or dummy")
    assert_one_line_error(bonsai_in_process(capsys, "bench", str(arch), "--load-format", "dummy", "--kv-type", "fp8"),
                          "--kv-type: 'fp8' is not one of")
    assert_one_line_error(bonsai_in_process(capsys, "generate", str(arch), "--prompt", "hi", "--kv-type", "int3"),
                          "--kv-type: 'int3' is not one of")


def test_dummy_model_refuses_text(tmp_path, capsys):
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY)
    assert_one_line_error(bonsai_in_process(capsys, "bench", str(arch), "--load-format", "dummy", "--suite", "short"),
                          "no tokenizer")


def test_group_size_not_dividing_is_one_line(smollm2_gguf, capsys):
    # SmolLM2's hidden size 576 is not a multiple of 128
    proc = bonsai_in_process(capsys, "bench", str(smollm2_gguf), "--weights", "int8", "-p", "8", "-n", "2", "-r", "1")
    assert_one_line_error(proc, "choose another --group-size")


def test_a_generated_model_with_a_borrowed_tokenizer_takes_text(tmp_path, capsys, smollm2_gguf):
    """model.tokenizer gives generated weights a tokenizer: bench's suites and generate take text."""
    arch = tmp_path / "tiny.yaml"
    arch.write_text(TINY.replace("vocab_size: 1024", "vocab_size: 49152").replace("hidden_size: 256", "hidden_size: 64")
                    .replace("intermediate_size: 512", "intermediate_size: 128").replace("head_dim: 64", "head_dim: 16"))
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {arch}\n  load_format: dummy\n  tokenizer: {smollm2_gguf}\n  quant_type: tri\n"
                      "  group_size: 32\nruntime:\n  device: cpu\n  max_seq_len: 256\n")
    out = tmp_path / "suite.json"
    proc = bonsai_in_process(capsys, "bench", "--config", str(config), "--suite", "short", "--categories", "code",
                             "--limit", "1", "-r", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["suite"]
    proc = bonsai_in_process(capsys, "generate", "--config", str(config), "--prompt", "hi", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr

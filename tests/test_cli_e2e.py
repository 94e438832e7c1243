"""The commands end to end on the real SmolLM2 (CPU)."""
from __future__ import annotations

import json

import pytest

from tests.test_cli_errors import bonsai

pytestmark = pytest.mark.slow


def test_generate_json_is_one_object_and_greedy_is_deterministic(smollm2_gguf):
    args = ("generate", str(smollm2_gguf), "--prompt", "The capital of France is", "--max-tokens", "12", "--json")
    first, second = bonsai(*args), bonsai(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)  # exactly one JSON document on stdout
    assert set(out) >= {"text", "token_ids", "finish_reason", "timings", "prompt_tokens"}
    assert "Paris" in out["text"]
    assert 1 <= len(out["token_ids"]) <= 12 and out["timings"]["generated_tokens"] == len(out["token_ids"])
    assert json.loads(second.stdout)["token_ids"] == out["token_ids"]


def test_seeded_sampling_reproducible(smollm2_gguf):
    args = ("generate", str(smollm2_gguf), "--prompt", "Write a word:", "-n", "10", "--temperature", "1.0",
            "--seed", "42", "--json")
    a, b = json.loads(bonsai(*args).stdout), json.loads(bonsai(*args).stdout)
    assert a["token_ids"] == b["token_ids"]


def test_chat_answers_and_stop_string(smollm2_gguf):
    out = json.loads(bonsai("generate", str(smollm2_gguf), "--chat", "--prompt", "What is the capital of France?",
                            "-n", "40", "--json").stdout)
    assert "Paris" in out["text"] and out["finish_reason"] in ("stop", "length")
    stopped = json.loads(bonsai("generate", str(smollm2_gguf), "--chat", "--prompt", "What is the capital of France?",
                                "-n", "40", "--stop", "Paris", "--json").stdout)
    assert stopped["finish_reason"] == "stop" and "Paris" not in stopped["text"]
    assert out["text"].startswith(stopped["text"])


def test_chat_session_over_stdin(smollm2_gguf, tmp_path):
    import subprocess
    import sys
    script = "My name is Ada.\n/stats\nWhat is my name?\n/reset\n/exit\n"
    proc = subprocess.run([sys.executable, "-m", "bonsai_cli", "chat", str(smollm2_gguf), "--temperature", "0",
                           "-n", "30", "--plain"], input=script, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bonsai> ") == 2
    assert "Ada" in proc.stdout.split("What is my name?")[1]
    assert "(0 reused from cache)" in proc.stdout  # /stats after the first answer
    assert "conversation cleared" in proc.stdout


def test_info_json(smollm2_gguf):
    out = json.loads(bonsai("info", str(smollm2_gguf), "--json").stdout)
    assert out["architecture"]["architecture"] == "llama" and out["architecture"]["num_layers"] == 30
    assert 130e6 < out["parameters"] < 140e6
    assert set(out["tensor_types"]) == {"Q4_1", "Q8_0", "F32"}
    assert 4.5 < out["bits_per_weight"] < 6.5

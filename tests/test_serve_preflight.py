"""Issue 24, classes 7 and 8: everything `bonsai serve` can check without the weights is checked
before it binds its port, so a bad config is exactly one line on stderr and exit 1 (before: uvicorn
started, logged its start-up, then the loading thread failed); a port in use is the same one line
(before: uvicorn's exit 3); a group size the model cannot be packed in names model.group_size; and
serving with a model.quant_type the file does not store says so at load with a measured cost."""
from __future__ import annotations

import json
import logging
import shutil
import socket

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from tests.gguf_tiny import write_tiny_gguf
from tests.hf_tiny import write_tiny_hf
from tests.serve_process import free_port
from tests.test_cli_errors import bonsai_in_process


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return write_tiny_gguf(tmp_path_factory.mktemp("preflight") / "tiny.gguf", smollm2_gguf, T.F16)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny):
    return write_tiny_hf(tmp_path_factory.mktemp("preflight-hf") / "hf", tiny)


def serve_config(tmp_path, model, extra: str = "", port: int | None = None):
    path = tmp_path / "serve.yaml"
    path.write_text(f"model:\n  path: {model}\n  max_context: 128\n{extra}"
                    f"runtime:\n  device: cpu\n  max_batch_size: 1\nserver:\n  port: {port or free_port()}\n")
    return path


def only_line(capsys, config, fragment: str) -> str:
    proc = bonsai_in_process(capsys, "serve", "--config", str(config), "--log-level", "info")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


def test_a_missing_model_file(tmp_path, capsys):
    only_line(capsys, serve_config(tmp_path, tmp_path / "nope.gguf"), "model file not found")


def test_a_text_file_named_gguf(tmp_path, capsys):
    (tmp_path / "text.gguf").write_text("I am not a model")
    only_line(capsys, serve_config(tmp_path, tmp_path / "text.gguf"), "is not a GGUF file")


def test_a_directory_given_as_the_model(tmp_path, capsys):
    (tmp_path / "empty.gguf").mkdir()
    only_line(capsys, serve_config(tmp_path, tmp_path / "empty.gguf"), "has no config.json")


def test_an_unreadable_model_file(tmp_path, capsys, tiny, monkeypatch):
    import builtins
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file) == str(tiny):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    only_line(capsys, serve_config(tmp_path, tiny), "Permission denied")


def test_a_corrupt_model_file(tmp_path, capsys, smollm2_gguf):
    bad = write_tiny_gguf(tmp_path / "bad.gguf", smollm2_gguf, T.F16, meta={"llama.block_count": (500, V.UINT32)})
    only_line(capsys, serve_config(tmp_path, bad), "llama.block_count is 500 but the file holds tensors of 2")


def test_a_missing_draft_model(tmp_path, capsys, tiny):
    config = serve_config(tmp_path, tiny).read_text().replace(
        "  max_batch_size: 1\n", f"  max_batch_size: 1\n  decode_algorithm: speculative\n  draft_model: {tmp_path / 'd.gguf'}\n")
    (tmp_path / "spec.yaml").write_text(config)
    only_line(capsys, tmp_path / "spec.yaml", "draft model: model file not found")


def test_a_missing_drafter_file(tmp_path, capsys, tiny):
    config = serve_config(tmp_path, tiny).read_text().replace(
        "  max_batch_size: 1\n", "  max_batch_size: 1\n  decode_algorithm: speculative\n")
    config += f"speculative:\n  method: mtp:{tmp_path / 'mtp'}\n"
    (tmp_path / "spec.yaml").write_text(config)
    only_line(capsys, tmp_path / "spec.yaml", "mtp drafter file not found")


def test_a_device_this_machine_lacks(tmp_path, capsys, tiny):
    import torch
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    config = serve_config(tmp_path, tiny).read_text().replace("device: cpu", "device: cuda:7")
    (tmp_path / "dev.yaml").write_text(config)
    only_line(capsys, tmp_path / "dev.yaml", "cuda:7")


def test_a_context_longer_than_the_model_knows(tmp_path, capsys, tiny):
    config = serve_config(tmp_path, tiny).read_text().replace("max_batch_size: 1\n", "max_batch_size: 1\n  max_seq_len: 100000\n")
    (tmp_path / "long.yaml").write_text(config)
    only_line(capsys, tmp_path / "long.yaml", "exceeds the model's 512 positions")


def test_a_missing_chat_template(tmp_path, capsys, tiny):
    only_line(capsys, serve_config(tmp_path, tiny, f"  chat_template: {tmp_path / 'nope.jinja'}\n"),
              "config model.chat_template")


def test_a_group_size_the_model_cannot_take_names_the_config_key(tmp_path, capsys, tiny_hf):
    line = only_line(capsys, serve_config(tmp_path, tiny_hf, "  quant_type: tri\n  group_size: 128\n"),
                     "choose another config model.group_size")
    assert "--group-size" not in line


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path, capsys, tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        only_line(capsys, serve_config(tmp_path, tiny, port=port), f"port {port} on 127.0.0.1 is in use")


# -- class 7: model.quant_type that differs from what the file stores -------------------------------------
def test_rounding_at_load_is_found_from_metadata(tiny):
    from engine.weights.format_cost import rounding_at_load
    from engine.weights.loader import open_model_source
    source = open_model_source(tiny)
    config = source.model_config()
    r = rounding_at_load(source, config, "tri", 128, keep_codes=False)
    assert r.stored == "F16" and len(r.modules) == 4 * config.num_layers
    assert rounding_at_load(source, config, "bf16", 128, keep_codes=False) is None


def test_serving_with_another_quant_type_says_what_it_costs(tmp_path, tiny, caplog):
    from engine.server.config import ServeConfig
    from engine.server.engine_thread import start_serving
    config = ServeConfig.from_dict({"model": {"path": str(tiny), "quant_type": "tri", "max_context": 64},
                                    "runtime": {"device": "cpu", "max_batch_size": 1}})
    with caplog.at_level(logging.WARNING):
        served = start_serving(config)
    served.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "quant_type" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    line = warnings[0]
    for fragment in ("model.quant_type tri", str(tiny), "stores its block matrices as F16", "rounded to nearest ternary",
                     "measured on 255 tokens", "mean KL", "same top token", "bonsai quantize", "--method gptq", "gsq"):
        assert fragment in line, line
    kl = float(line.split("mean KL ")[1].split(",")[0])
    assert kl > 0.01  # random weights rounded to three values: far from free


def test_a_checkpoint_stored_in_the_served_format_loads_without_a_warning(tmp_path, tiny_hf, capsys, caplog):
    from engine.weights.format_cost import rounding_at_load
    from engine.weights.loader import open_model_source
    out = tmp_path / "tri"
    proc = bonsai_in_process(capsys, "quantize", str(tiny_hf), str(out), "--quant-type", "tri", "--group-size", "64")
    assert proc.returncode == 0, proc.stderr
    source = open_model_source(out)
    config = source.model_config()
    assert rounding_at_load(source, config, "tri", 64, keep_codes=False) is None
    assert rounding_at_load(source, config, "tri", 64, keep_codes=True) is None
    other = rounding_at_load(source, config, "tri", 32, keep_codes=False)  # re-rounded into smaller groups
    assert other is not None and other.stored == "tri g64"
    assert rounding_at_load(source, config, "tri", 32, keep_codes=True) is None  # kept packed as stored

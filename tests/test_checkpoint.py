"""The bonsai checkpoint: written tensor by tensor, self-describing, atomic; read back exactly."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from quant.checkpoint import Checkpoint, CheckpointError, CheckpointWriter, is_checkpoint
from quant.formats import QuantSpec, quantize_rtn

SPECS = [QuantSpec("tri", 16), QuantSpec("tri-dense", 16), QuantSpec("bin", 16), QuantSpec("int4", 32),
         QuantSpec("int8", 32)]


def write_sample(out, force=False, shard_bytes=1 << 30):
    torch.manual_seed(0)
    expected = {}
    with CheckpointWriter(out, force=force, shard_bytes=shard_bytes) as w:
        w.add_file("config.json", json.dumps({"architectures": ["LlamaForCausalLM"]}).encode())
        for i, spec in enumerate(SPECS):
            name = f"model.layers.{i}.mlp.down_proj.weight"
            codes, scales = quantize_rtn(spec, torch.randn(24, 64))
            w.write_quantized(name, spec, codes, scales)
            expected[name] = (spec, codes, scales)
        norm = torch.randn(64)
        w.write_float("model.norm.weight", norm, "f32")
        embed = torch.randn(10, 64)
        w.write_float("model.embed_tokens.weight", embed, "bf16")
        expected["model.norm.weight"] = norm
        expected["model.embed_tokens.weight"] = embed.bfloat16()
        w.commit()
    return expected


def check_round_trip(out, expected):
    ckpt = Checkpoint(out)
    assert set(ckpt.entries) == set(expected)
    for name, want in expected.items():
        if isinstance(want, tuple):
            spec, codes, scales = ckpt.read_quantized(name)
            assert spec == want[0] and torch.equal(codes, want[1]) and torch.equal(scales, want[2])
            assert ckpt.entries[name].shape == (24, 64)
        else:
            got = ckpt.read_float(name)
            assert got.dtype == want.dtype and torch.equal(got, want)
    return ckpt


def test_round_trip_every_type(tmp_path):
    out = tmp_path / "ckpt"
    expected = write_sample(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    ckpt = check_round_trip(out, expected)
    assert ckpt.config == {"architectures": ["LlamaForCausalLM"]}
    assert is_checkpoint(out)


def test_metadata_is_standard_safetensors(tmp_path):
    out = tmp_path / "ckpt"
    write_sample(out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # the reference reader accepts it
        meta = f.metadata()
        assert meta["format"] == "bonsai" and meta["format_version"] == "1"
        table = json.loads(meta["bonsai.tensors"])
        assert table["model.layers.0.mlp.down_proj.weight"] == {"quant_type": "tri", "group_size": 16, "shape": [24, 64]}
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight.codes").shape == (24, 16)
        assert f.get_tensor("model.layers.1.mlp.down_proj.weight.codes").shape == (24, 13)  # 5 trits a byte
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight.scales").dtype == torch.float16


def test_shards_with_index(tmp_path):
    out = tmp_path / "ckpt"
    expected = write_sample(out, shard_bytes=3000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["format"] == "bonsai"
    check_round_trip(out, expected)


def test_types_come_from_metadata_not_names(tmp_path):
    out = tmp_path / "int8-model"
    expected = write_sample(out)
    os.rename(out, tmp_path / "tri-g128")
    ckpt = check_round_trip(tmp_path / "tri-g128", expected)
    assert ckpt.entries["model.layers.3.mlp.down_proj.weight"].quant_type == "int4"


def test_a_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with CheckpointWriter(out) as w:
            w.write_float("a", torch.ones(4), "f32")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(FileExistsError):
        CheckpointWriter(out)
    expected = write_sample(out, force=True)
    assert not (out / "keep").exists()
    check_round_trip(out, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no leftovers


def test_corrupt_files_are_refused(tmp_path):
    out = tmp_path / "ckpt"
    write_sample(out)
    path = out / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # truncated
    with pytest.raises(CheckpointError, match="does not fit the file"):
        Checkpoint(out)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(CheckpointError, match="corrupt header"):
        Checkpoint(out)
    assert not is_checkpoint(out)


def test_plain_safetensors_is_not_a_checkpoint(tmp_path):
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert not is_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a bonsai checkpoint"):
        Checkpoint(tmp_path)


def test_output_directory_is_not_private(tmp_path):
    out = tmp_path / "ckpt"
    write_sample(out)
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask

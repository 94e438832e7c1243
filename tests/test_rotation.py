"""`--rotate`: the Hadamard maths alone, the folded model against the original, the fused decode step,
and `bonsai quantize --rotate` end to end (checkpoint, loader, GGUF export, bad input)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.sources.checkpoint_file import BonsaiCheckpoint
from engine.runtime.cuda_graphs import DecodeStepRunner
from engine.weights.loader import LoadedModel, load_dummy, load_model
from engine.sources.model_config import ModelConfig
from engine.weights.formats import WeightFormat
from engine.quantization.rotation import load_rotated
from engine.runtime.runner import ModelRunner
from quant.checkpoint import Checkpoint, CheckpointError, SafetensorsFile
from quant.rotation import (block_hadamard, block_hadamard_factors, block_hadamard_matrix, fold_norm, hadamard_matrix,
                            has_hadamard, power_of_two_block, random_hadamard, rotate_input, rotate_output)
from tests.gguf_tiny import write_tiny_gguf
from tests.hf_tiny import write_tiny_hf
from tests.test_quantize_cli import assert_nothing_written, cli

IDS = [5, 17, 300, 42, 9, 1000, 77, 3, 64, 128, 256, 511, 12, 800, 33, 2]


# ---- the maths ----

@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 20, 24, 48, 64, 72, 96, 576, 1536])
def test_hadamard_matrices_are_orthogonal_with_equal_magnitudes(n):
    h = hadamard_matrix(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(h.abs(), torch.full_like(h, n ** -0.5))
    q = random_hadamard(n, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    if n > 2:
        assert not torch.equal(q, h)  # random signs


def test_orders_without_a_construction_are_refused():
    assert has_hadamard(576) and has_hadamard(4096) and has_hadamard(5120)
    assert not has_hadamard(36) and not has_hadamard(100) and not has_hadamard(6)
    with pytest.raises(ValueError, match="no Hadamard matrix of order 100"):
        hadamard_matrix(100)


def test_block_hadamard_is_the_block_diagonal_sylvester_product(one_thread):
    assert power_of_two_block(1536) == 512 and power_of_two_block(12288) == 4096 and power_of_two_block(96) == 32
    for n, block in [(1536, 512), (96, 32), (64, 64), (8, 2), (12, 1)]:
        x = torch.randn(3, 5, n, dtype=torch.float64)
        dense = block_hadamard_matrix(n, block)
        torch.testing.assert_close(block_hadamard(x, *block_hadamard_factors(block, torch.float64)), x @ dense)
        torch.testing.assert_close(dense, dense.T)  # Sylvester blocks are symmetric: H = Hᵀ = H⁻¹
    x = torch.randn(4, 1536)
    y = block_hadamard(x.bfloat16(), *block_hadamard_factors(512))  # float32 inside, the input's dtype out
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x @ block_hadamard_matrix(1536, 512).float(), atol=0.05, rtol=0.02)


def test_folding_keeps_a_normed_linear_and_a_residual_write(one_thread):
    k, n = 48, 20
    x, g = torch.randn(7, k, dtype=torch.float64), torch.rand(k, dtype=torch.float64) + 0.5
    w_in, w_out = torch.randn(n, k, dtype=torch.float64), torch.randn(k, n, dtype=torch.float64)
    q = random_hadamard(k, seed=1)
    rms = lambda v, weight=None: torch.nn.functional.rms_norm(v, (k,), weight, 1e-6)  # noqa: E731
    want = rms(x, g) @ w_in.T
    torch.testing.assert_close(rms(x @ q) @ rotate_input(fold_norm(w_in, g), q).T, want)  # the stream rotated
    z = torch.randn(7, n, dtype=torch.float64)
    torch.testing.assert_close(z @ rotate_output(w_out, q).T, (z @ w_out.T) @ q)  # a write lands rotated


# ---- the folded model ----

def _rotated(source_path: Path, online: bool, seed: int = 0) -> tuple[LoadedModel, LoadedModel]:
    """(the source loaded in float32, the rotated float32 model built from its tensors)."""
    return load_model(source_path, weight_dtype=torch.float32), load_rotated(source_path, online, seed)


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    return runner.forward(runner.slot(), ids, None)  # [T, V]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("rotate")
    gguf = write_tiny_gguf(d / "tiny.gguf", smollm2_gguf, T.F32)
    return SimpleNamespace(gguf=gguf, hf=write_tiny_hf(d / "hf", gguf),
                           tied=write_tiny_hf(d / "tied", gguf, hidden=48, ffn=96, heads=4, kv_heads=2, tied=True),
                           odd=write_tiny_hf(d / "odd", gguf, hidden=36, ffn=64, heads=2, kv_heads=2))


@pytest.mark.parametrize("which,online", [("hf", True), ("hf", False), ("tied", True)])
def test_the_folded_model_computes_the_original_function(tiny, which, online, one_thread):
    ref, rot = _rotated(getattr(tiny, which), online)
    assert rot.model.lm_head is not None and all(float(b.attention_norm.weight.detach().min()) == 1.0 for b in rot.model.layers)
    assert rot.model.layers[0].feed_forward.down_hadamard == ((128 if which == "hf" else 32) if online else 0)
    want, got = _logits(ref, IDS), _logits(rot, IDS)
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-4)
    # the weights did change: a rotated q_proj is not the source's
    assert not torch.allclose(rot.model.layers[0].attention.wqkv.weight, ref.model.layers[0].attention.wqkv.weight)


def test_a_missing_online_hadamard_breaks_the_function(tiny, one_thread):
    """The planted bug: weights folded with H, the run time not applying it."""
    ref, rot = _rotated(tiny.hf, online=True)
    for block in rot.model.layers:
        block.feed_forward.w2_rotation = None
    want, got = _logits(ref, IDS), _logits(rot, IDS)
    assert (got - want).abs().max() > 1e-2 * want.abs().max()


@pytest.mark.slow
def test_smollm2_folded_in_float32_matches(smollm2_gguf):
    ref, rot = _rotated(smollm2_gguf, online=True)
    ids = ref.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    want, got = _logits(ref, ids), _logits(rot, ids)
    torch.testing.assert_close(got, want, atol=1e-3 * want.abs().max().item(), rtol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- the fused decode step ----

def test_fused_step_applies_the_online_hadamard():
    """The kernels' references (the Triton kernels are the same before and after the Hadamard, which
    runs in torch; interpreted on a CPU they take a minute here)."""
    cfg = ModelConfig("qwen3", vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, qk_norm=True)
    loaded = load_dummy(cfg, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    for block in loaded.model.layers:
        block.feed_forward.set_down_hadamard(128, "cpu")  # 384 = 3 · 128
    tokens = list(range(3, 15))
    plain = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    plain.prefill(plain.slot(), tokens[:8])
    want = [plain.forward(plain.slot(), [t])[0] for t in tokens[8:]]
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    runner.prefill(runner.slot(), tokens[:8])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=False)
    for i, (token, ref) in enumerate(zip(tokens[8:], want)):
        got = step.run([token], [8 + i], [0])[0]
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    assert float(step.workspace.gate_up.abs().max()) == 0.0  # left zeroed for the next step's split-K sums


# ---- the command ----

def test_quantize_rotate_end_to_end(tiny, tmp_path, capsys, one_thread):
    out = tmp_path / "rot"
    code, stdout, err = cli(capsys, "quantize", "--method", "rtn", str(tiny.tied), str(out), "--rotate", "--quant-type", "int8",
                            "--group-size", "16", "--head-bits", "8", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["rotation"] == {"residual": "randomized-hadamard", "seed": 0, "down_proj_hadamard": 32}
    assert report["formats"]["int8 g16"]["tensors"] == 2 * 7 + 1  # the untied output layer is int8 too
    meta = BonsaiCheckpoint(out).checkpoint
    assert meta.rotation["down_proj_hadamard"] == 32 and "lm_head.weight" in meta.entries
    assert SafetensorsFile(out / "model.safetensors").metadata["format_version"] == "2"  # v1 readers refuse it
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    code, stdout, _ = cli(capsys, "info", str(out), "--json")
    assert code == 0 and json.loads(stdout)["rotation"]["down_proj_hadamard"] == 32
    loaded = load_model(out, weight_dtype=torch.float32)
    assert loaded.model.layers[1].feed_forward.down_hadamard == 32
    ref = load_model(tiny.tied, weight_dtype=torch.float32)
    want, got = _logits(ref, IDS).log_softmax(-1), _logits(loaded, IDS).log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1)  # int8 weights (bf16 embedding): close, not equal
    assert 0 < float(kl.max()) < 2e-3
    # requantizing the rotated checkpoint keeps its rotation (its down projections hold W·H)
    again = tmp_path / "again"
    code, stdout, err = cli(capsys, "quantize", "--method", "rtn", str(out), str(again), "--quant-type", "int8", "--group-size", "16",
                            "--json")
    assert code == 0 and json.loads(stdout)["rotation"]["down_proj_hadamard"] == 32, err
    kl2 = (want.exp() * (want - _logits(load_model(again, weight_dtype=torch.float32), IDS).log_softmax(-1))).sum(-1)
    assert float(kl2.max()) < 4e-3


def test_rotated_gptq_calibrates_the_rotated_model(tiny, tmp_path, monkeypatch, one_thread):
    from engine.quantization.quantize import QuantizeOptions, quantize
    from quant.formats import QuantSpec
    from quant.recipe import Recipe
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 30)
    opts = dict(method="gptq", calib=calib, calib_samples=4, calib_seq_len=32)
    ref = load_model(tiny.hf, weight_dtype=torch.float32)
    want = _logits(ref, IDS).log_softmax(-1)
    import engine.quantization.layerwise as layerwise
    seen, real = [], layerwise.quantize_block

    def spy(block, hidden, targets, keep, method, options, model, say, floats=None):
        seen.append((model.lm_head is not None, block.feed_forward.down_hadamard,
                     float(block.ffn_norm.weight.detach().min())))
        return (yield from real(block, hidden, targets, keep, method, options, model, say, floats))
    monkeypatch.setattr(layerwise, "quantize_block", spy)
    kls = {}
    for rotate in (False, True):
        out = tmp_path / f"r{rotate}"
        quantize(tiny.hf, out, QuantizeOptions(Recipe(QuantSpec("int8", 32)), rotate=rotate, evaluate=False, **opts))
        got = _logits(load_model(out, weight_dtype=torch.float32), IDS).log_softmax(-1)
        kls[rotate] = float((want.exp() * (want - got)).sum(-1).mean())
    layers = len(seen) // 2
    assert seen[0][1] == 0 and seen[layers] == (True, 128, 1.0)  # GPTQ saw the rotated, norm-folded model
    assert kls[True] < 2e-3 and kls[False] < 2e-3, kls


def test_gguf_export_of_a_rotated_model(tiny, tmp_path, capsys, one_thread):
    before = {p.name for p in tmp_path.iterdir()}
    code, stdout, err = cli(capsys, "quantize", "--method", "rtn", str(tiny.hf), str(tmp_path / "o"), "--rotate",
                            "--online-hadamard", "--quant-type", "int8", "--group-size", "32", "--gguf", str(tmp_path / "o.gguf"))
    assert code == 1 and len(err.splitlines()) == 1 and "cannot apply the online Hadamard" in err, err
    assert_nothing_written(tmp_path, before)
    code, stdout, err = cli(capsys, "quantize", "--method", "rtn", str(tiny.hf), str(tmp_path / "o"), "--rotate",
                            "--quant-type", "int8", "--group-size", "32", "--gguf", str(tmp_path / "o.gguf"), "--json")
    # (with --gguf the online Hadamard is off by default: llama.cpp cannot apply it)
    assert code == 0, err
    assert json.loads(stdout)["rotation"]["down_proj_hadamard"] == 0
    assert SafetensorsFile(tmp_path / "o" / "model.safetensors").metadata["format_version"] == "1"  # a plain model
    ref = load_model(tiny.hf, weight_dtype=torch.float32)
    exported = load_model(tmp_path / "o.gguf", weight_dtype=torch.float32)  # a plain llama GGUF
    want, got = _logits(ref, IDS).log_softmax(-1), _logits(exported, IDS).log_softmax(-1)
    assert float((want.exp() * (want - got)).sum(-1).max()) < 2e-3


def test_rotate_bad_input(tiny, tmp_path, capsys):
    def error(*args):
        code, stdout, err = cli(capsys, "quantize", *args)
        assert code == 1 and stdout == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
        return err
    rotated = tmp_path / "rotated"
    assert cli(capsys, "quantize", "--method", "rtn", str(tiny.hf), str(rotated), "--rotate", "--quant-type", "int8",
               "--group-size", "32")[0] == 0
    before = {p.name for p in tmp_path.iterdir()}
    assert "Hadamard matrix of the hidden size 36" in error(str(tiny.odd), str(tmp_path / "o"), "--rotate",
                                                             "--group-size", "4")
    assert "is already rotated" in error(str(rotated), str(tmp_path / "o"), "--rotate", "--group-size", "32")
    assert "cannot apply the online Hadamard" in error(str(rotated), str(tmp_path / "o"), "--quant-type", "int8",
                                                        "--group-size", "32", "--gguf", str(tmp_path / "o.gguf"))
    assert_nothing_written(tmp_path, before)


def test_corrupt_rotation_metadata_is_refused(tmp_path):
    from quant.checkpoint import CheckpointWriter
    from quant.formats import QuantSpec
    for rotation, ok in [({"residual": "randomized-hadamard", "seed": 0, "down_proj_hadamard": 64}, True),
                         ({"residual": "randomized-hadamard", "down_proj_hadamard": 48}, False),
                         ({"down_proj_hadamard": 64}, False)]:
        out = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        with CheckpointWriter(out, rotation=rotation) as writer:
            writer.add_file("config.json", b"{}")
            writer.write_quantized("w", QuantSpec("int8", 32), torch.ones(4, 64, dtype=torch.int8), torch.ones(4, 2))
            writer.commit()
        if ok:
            assert Checkpoint(out).rotation == rotation
        else:
            with pytest.raises(CheckpointError, match="bonsai.rotation metadata is corrupt"):
                Checkpoint(out)

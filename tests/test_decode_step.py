"""The fused decode step (the body of the CUDA graph) against the plain model path, on the CPU.

Both the kernels' references and the Triton kernels themselves (interpreted on a CPU) are run,
for float, ternary + int4 head, and int8 weights, on a tiny random Qwen3-style model.
"""
from __future__ import annotations

import pytest
import torch

from engine.runtime.cuda_graphs import DecodeStepRunner
from engine.weights.loader import load_dummy
from engine.sources.model_config import ModelConfig
from engine.weights.formats import WeightFormat
from engine.runtime.runner import ModelRunner

CFG = ModelConfig("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64, qk_norm=True)
TOKENS = list(range(3, 19))


def _plain_logits(loaded, prompt: int) -> list[torch.Tensor]:
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    slot = runner.slot(0)
    runner.prefill(slot, TOKENS[:prompt])
    return [runner.forward(slot, [t])[0] for t in TOKENS[prompt:]]


@pytest.mark.parametrize("weights,head", [("bf16", "bf16"), ("tri", "int4"), ("int8", "int8"), ("bin", "bf16")])
@pytest.mark.parametrize("kernels", [False, True])
def test_fused_step_matches_the_model(weights, head, kernels):
    device = "cuda" if kernels and torch.cuda.is_available() else "cpu"  # compiled kernels on a GPU
    loaded = load_dummy(CFG, "tiny", device=device, weight_format=WeightFormat(weights, 64, head),
                        dtype=torch.float32)
    want = _plain_logits(loaded, 10)
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    slot = runner.slot(0)
    runner.prefill(slot, TOKENS[:10])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=kernels)
    # Triton interpreted on a CPU is slow: two steps run every kernel, the second reading the K/V the
    # first wrote (the later positions fall in the same split and add nothing)
    steps = 2 if kernels and device == "cpu" else len(want)
    for i, (token, ref) in enumerate(zip(TOKENS[10:10 + steps], want)):
        got = step.run([token], [10 + i], [0])[0]
        # int8 activations: a last-bit difference of the float32 residual can move one activation to
        # the next int8 step, so the tolerance is a step's effect (~1e-3 of the logits' scale)
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
        assert got.argmax() == ref.argmax()


@pytest.mark.parametrize("weights", ["tri", "bin"])
def test_the_one_launch_ffn_in_the_step_matches_the_model(weights):
    """The persistent FFN kernel (quant.kernels.persistent_ffn) in place of the four FFN launches: phased in the
    interpreter on a CPU, one launch with grid barriers on a GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_dummy(CFG, "tiny", device=device, weight_format=WeightFormat(weights, 64, "int4"),
                        dtype=torch.float32)
    want = _plain_logits(loaded, 10)
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    runner.prefill(runner.slot(0), TOKENS[:10])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=True, persistent_ffn=True)
    assert step.workspace.ffn is not None
    for i, (token, ref) in enumerate(zip(TOKENS[10:12], want)):
        got = step.run([token], [10 + i], [0])[0]
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
        assert got.argmax() == ref.argmax()
    assert int(step.workspace.ffn.stuck) == 0 and not step.workspace.gate_up.any()


def test_runner_uses_the_fused_step_when_asked():
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    want = _plain_logits(loaded, 12)
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=True)
    assert runner.decoder is not None and runner.decoder.graph is None  # no CUDA here: eager
    slot = runner.slot(0)
    runner.prefill(slot, TOKENS[:12])
    got = [runner.forward(slot, [t])[0] for t in TOKENS[12:]]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3 * b.abs().max().item())
    assert slot.tokens == TOKENS


def test_fused_step_catches_a_wrong_position():
    """A planted bug (rows told the wrong position) must break the comparison."""
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("int8", 64, "bf16"))
    want = _plain_logits(loaded, 10)
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    runner.prefill(runner.slot(0), TOKENS[:10])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=False)
    got = step.run([TOKENS[10]], [11], [0])[0]
    assert not torch.allclose(got, want[0], rtol=1e-3, atol=2e-3 * want[0].abs().max().item())


def test_verify_rows_through_the_fused_step_equal_token_by_token():
    """Speculative verification of 4 tokens in one fused step (rows = consecutive positions of one
    slot, each attending to keys up to its own position) equals feeding them one at a time; a
    rejected tail rewinds and the next step continues from the accepted prefix."""
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    want = _plain_logits(loaded, 8)
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=True)
    slot = runner.slot(0)
    runner.prefill(slot, TOKENS[:8])
    logits, hidden = runner.verify(slot, TOKENS[8:12])
    assert logits.shape == (4, CFG.vocab_size) and hidden == {} and 4 in runner._row_steps
    for got, ref in zip(logits, want[:4]):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    slot.rewind(2)  # keep TOKENS[8:10]
    logits, _ = runner.verify(slot, TOKENS[10:13])
    for got, ref in zip(logits, want[2:5]):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    assert slot.tokens == TOKENS[:13]

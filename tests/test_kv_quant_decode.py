"""The fused decode step on a quantized KV cache equals the plain model path on the same cache type:
one row (decode), several rows of one slot (speculative verify, then a rewind) and rows of several
slots (batched decode). The kernels run under Triton's interpreter on a CPU; tiny model, few tokens."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from engine.runtime.cuda_graphs import DecodeStepRunner  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402

CFG = ModelConfig("qwen3", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64, qk_norm=True)
TOKENS = list(range(3, 15))


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 3e-3) -> None:
    # int8 activations of the fused step: a last-bit difference can move one activation a step (on
    # these generated weights that moves a logit by up to 2.6e-3 of the largest)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=atol * want.abs().max().item())


@pytest.fixture(scope="module")
def loaded():
    # on a GPU machine the kernels run compiled, so the model must be there (CPU tensors: interpreter only)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_dummy(CFG, "tiny", device, weight_format=WeightFormat("tri", 64, "int4"), dtype=torch.float32)


def plain_logits(loaded, kv_type: str, prompt: int) -> list[torch.Tensor]:
    runner = ModelRunner(loaded, max_seq_len=32, fast_decode=False, kv_type=kv_type)
    runner.prefill(runner.slot(0), TOKENS[:prompt])
    return [runner.forward(runner.slot(0), [t])[0] for t in TOKENS[prompt:]]


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_step_on_a_k8v4_cache(loaded, kernels):
    want = plain_logits(loaded, "k8v4", 9)
    runner = ModelRunner(loaded, max_seq_len=32, fast_decode=False, kv_type="k8v4")
    runner.prefill(runner.slot(0), TOKENS[:9])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=kernels)
    for i, (token, ref) in enumerate(zip(TOKENS[9:], want)):
        close(step.run([token], [9 + i], [0])[0], ref)
    bf16 = plain_logits(loaded, "bf16", 9)
    assert not torch.allclose(want[-1], bf16[-1], rtol=1e-3, atol=2e-3 * bf16[-1].abs().max().item())


def test_verify_rewind_and_batched_rows_on_an_int8_cache(loaded):
    """The runner's paths (references on a CPU): verify rows, rewind, batched decode of two slots."""
    want = plain_logits(loaded, "int8", 6)
    runner = ModelRunner(loaded, max_seq_len=32, num_slots=2, fast_decode=True, kv_type="int8")
    slot, other = runner.slot(0), runner.slot(1)
    runner.prefill(slot, TOKENS[:6])
    logits, _ = runner.verify(slot, TOKENS[6:9])  # three rows of one slot in one fused step
    for got, ref in zip(logits, want):
        close(got, ref)
    slot.rewind(1)  # keep TOKENS[6:8]
    runner.prefill(other, TOKENS[:7])
    both = runner.decode_batch([slot, other], [TOKENS[8], TOKENS[7]])  # [2, V]: two slots, two positions
    close(both[0], want[2])
    close(both[1], want[1])


def test_kernels_on_verify_rows_and_another_slot_of_an_int4_cache(loaded):
    want = plain_logits(loaded, "int4", 6)
    runner = ModelRunner(loaded, max_seq_len=32, num_slots=2, fast_decode=False, kv_type="int4")
    runner.prefill(runner.slot(0), TOKENS[:6])
    runner.prefill(runner.slot(1), TOKENS[:7])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=3, num_splits=1, kernels=True)
    got = step.run([TOKENS[6], TOKENS[7], TOKENS[7]], [6, 7, 7], [0, 0, 1])  # [3, V]
    close(got[0], want[0])
    close(got[1], want[1])
    # slot 1 was prefilled in one pass, slot 0 token by token: a last-bit difference of a key can move
    # one of its (rotated) int4 codes a step
    close(got[2], want[1], atol=4e-3)

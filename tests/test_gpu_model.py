"""Whole-model logits on the GPU (packed kernels, fused CUDA-graph decode) vs the CPU reference path,
on the real SmolLM2: top-1 agreement ≥ 99% at every decoded position. GPU only."""
from __future__ import annotations

import pytest
import torch

from engine.weights.loader import load_model
from engine.weights.formats import WeightFormat
from engine.runtime.runner import ModelRunner

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden press. Books became cheaper, literacy "
        "spread, and scholars could compare identical copies of the same text across Europe. ")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_smollm2_gpu_decode_agrees_with_cpu_reference(smollm2_gguf, weights, dtype):
    fmt = WeightFormat(weights, 64, "bf16")
    cpu = load_model(smollm2_gguf, "cpu", weight_dtype=torch.float32, weight_format=fmt)
    ids = cpu.tokenizer.encode(TEXT * 2)[:160]
    # the reference decodes token by token too, so packed layers see int8 activations on both sides
    ref_runner = ModelRunner(cpu, max_seq_len=256, fast_decode=False)
    ref_slot = ref_runner.slot(0)
    ref_runner.prefill(ref_slot, ids[:32])
    ref = {i: ref_runner.forward(ref_slot, [ids[i]])[0] for i in range(32, len(ids) - 1)}  # position → [V]
    gpu = load_model(smollm2_gguf, "cuda", dtype=dtype, weight_dtype=dtype if weights == "bf16" else None,
                     weight_format=fmt)
    runner = ModelRunner(gpu, max_seq_len=256)
    assert runner.decoder is not None and runner.decoder.graph is not None
    slot = runner.slot(0)
    runner.prefill(slot, ids[:32])
    agree = total = 0
    for i in range(32, len(ids) - 1):
        logits = runner.forward(slot, [ids[i]])[0].cpu()
        agree += int(logits.argmax() == ref[i].argmax())
        total += 1
    # Measured on an H200 (docs/perf.md): bf16 weights 66/66 in float32, 65-66/66 in bfloat16 (bfloat16
    # activations against the float32 reference: one near-tie); packed formats 62-65/66 in bfloat16 and
    # 64-66/66 in float32 — int8 activations are rounded from a differently-summed float (fused
    # RMSNorm→int8 vs F.rms_norm then quantize), and a value near a rounding boundary moves a near-tie.
    # A broken kernel gives far less (a wrong split, position or scale: < 50%).
    if weights == "bf16":
        floor = 0.99 if dtype == torch.float32 else 0.97
    else:
        floor = 0.95 if dtype == torch.float32 else 0.93
    assert agree / total >= floor, f"{weights}: top-1 agreement {agree}/{total}"

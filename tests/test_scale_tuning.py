"""End-to-end scale tuning (engine.quantization.scale_tuning) on a tiny model quantized by GPTQ: it lowers the KL to the
float model on held-out sequences, touches only scales, and returns the start scales when it cannot help."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.quantization.calibration import CalibrationOptions, calibration_sequences, quantize_with_calibration
from engine.errors import BonsaiError
from engine.weights.loader import load_model
from engine.quantization.scale_tuning import ScaleTuningOptions, tune_scales
from quant.grids import dequantize
from tests.gguf_tiny import write_tiny_gguf
from tests.test_calibration import TEXT

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Spec:
    quant_type: str
    group_size: int


def ternary_mlp(name: str):
    return Spec("tri" if ".mlp." in name else "int4", 32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return write_tiny_gguf(tmp_path_factory.mktemp("tune") / "tiny.gguf", smollm2_gguf, T.F32)


@pytest.fixture
def quantized_tiny(tiny):
    path = tiny
    teacher = load_model(path, weight_dtype=torch.float32)
    ids = teacher.tokenizer.encode(TEXT)
    sequences = calibration_sequences(ids, 16, 32)
    student = load_model(path, weight_dtype=torch.float32)
    options = CalibrationOptions(samples=16, seq_len=32)
    quantized = {name: (codes, scales, spec) for name, codes, scales, spec in
                 quantize_with_calibration(student, sequences, ternary_mlp, "gptq", options)}
    return teacher, student, sequences, quantized


def test_tuning_lowers_held_out_kl_and_the_model_holds_the_new_scales(quantized_tiny):
    teacher, student, sequences, quantized = quantized_tiny
    model = student.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scales, report = tune_scales(model, teacher.model, sequences, quantized,
                                 ScaleTuningOptions(steps=40, lr=1e-2, batch_sequences=4), torch.device("cpu"))
    assert report.kept and report.kl_after < 0.9 * report.kl_before, report
    assert report.held_out_sequences == 2 and report.train_sequences == 14
    assert set(scales) == set(quantized)
    changed = [n for n in scales if not torch.equal(scales[n], quantized[n][1].float())]
    assert len(changed) == len(scales)  # every tensor's scales moved
    # the model now holds codes x new scales; everything that is not a quantized weight is untouched
    q = model.layers[0].attention.wqkv.weight
    want = dequantize(quantized["model.layers.0.self_attn.q_proj.weight"][0],
                      scales["model.layers.0.self_attn.q_proj.weight"], 32)
    torch.testing.assert_close(q[:want.shape[0]], want)
    w2 = model.layers[1].feed_forward.w2.weight
    torch.testing.assert_close(w2, dequantize(quantized["model.layers.1.mlp.down_proj.weight"][0],
                                              scales["model.layers.1.mlp.down_proj.weight"], 32))
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, before[name]), name
    # the codes are untouched: the new weights divided by their scales are the codes again
    codes = torch.round(w2.reshape(w2.shape[0], -1, 32) / scales["model.layers.1.mlp.down_proj.weight"][..., None])
    assert torch.equal(codes.reshape(w2.shape).to(torch.int8), quantized["model.layers.1.mlp.down_proj.weight"][0])


def test_start_scales_are_kept_when_tuning_does_not_help(quantized_tiny):
    teacher, student, sequences, quantized = quantized_tiny
    model = student.model
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    scales, report = tune_scales(model, teacher.model, sequences, quantized,
                                 ScaleTuningOptions(steps=3, lr=5.0), torch.device("cpu"))  # steps of e^±5
    assert not report.kept and report.kl_after >= report.kl_before
    for name, (codes, s, spec) in quantized.items():
        assert torch.equal(scales[name], s.float()), name
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, start[name], rtol=0, atol=0)


def test_bad_options_and_too_few_sequences(quantized_tiny):
    teacher, student, sequences, quantized = quantized_tiny
    with pytest.raises(BonsaiError, match="steps must be >= 0"):
        ScaleTuningOptions(steps=-1)
    with pytest.raises(BonsaiError, match="held_out"):
        ScaleTuningOptions(held_out=1.0)
    with pytest.raises(BonsaiError, match="at least 2 calibration sequences"):
        tune_scales(student.model, teacher.model, sequences[:1], quantized, ScaleTuningOptions(steps=1),
                    torch.device("cpu"))

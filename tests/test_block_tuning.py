"""Block-wise scale tuning (engine.quantization.block_tuning) on a tiny random model: on held-out sequences the
tuned block's outputs are nearer the float model's than GPTQ's, only scales change, a step that cannot help
leaves the start scales, and `bonsai quantize` runs it layer by layer and validates its options."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.errors import BonsaiError
from engine.quantization.block_tuning import BlockTuningOptions, Quantized, relative_error, tune_block
from engine.quantization.calibration import (CalibrationOptions, block_forward, block_targets, calibration_sequences,
                                             group_sums, quantize_block, quantize_with_calibration, rotary_tables,
                                             weight_error)
from engine.quantization.quantize import QuantizeOptions, quantize
from engine.weights.loader import load_model
from quant.checkpoint import Checkpoint
from quant.formats import QuantSpec, quantize_rtn
from quant.formats import relative_error as weight_relative_error
from quant.grids import dequantize
from quant.recipe import Recipe, Rule
from tests.gguf_tiny import write_tiny_gguf
from tests.test_calibration import TEXT

pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = QuantSpec("tri", 32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return write_tiny_gguf(tmp_path_factory.mktemp("block_tune") / "tiny.gguf", smollm2_gguf, T.F32)


def quantized_block(tiny):
    """Layer 1 of the tiny model quantized by GPTQ (ternary g32) on the float layer-0 states of 64 sequences,
    with the float block's outputs as the targets."""
    loaded = load_model(tiny, weight_dtype=torch.float32)
    model, cfg = loaded.model, loaded.config
    ids = torch.tensor(calibration_sequences(loaded.tokenizer.encode(TEXT * 4), 64, 32))  # [64, 32]
    with torch.no_grad():
        x = block_forward(model.layers[0], model.embed(ids), *rotary_tables(model, 32, ids.device))  # [64, 32, H]
        block = model.layers[1]
        target = list(block_forward(block, x, *rotary_tables(model, 32, ids.device)).split(8))  # [8, 32, H] each
        inputs = list(x.split(8))  # [8, 32, H] each
        targets = block_targets(block, 1, cfg, lambda name: SPEC)
        by_name = {t.name: t for group in targets.values() for t in group}
        stages = quantize_block(block, inputs, targets, None, "gptq", CalibrationOptions(scale_refits=1), model,
                                lambda m: None)
        tensors = []
        while True:
            try:
                name, codes, scales, _ = next(stages)
            except StopIteration as end:
                outputs = end.value
                break
            tensors.append(Quantized(by_name[name], codes, scales))
    return model, block, inputs, target, outputs, tensors


def held_out_error(report: dict) -> tuple[float, float]:
    return report["held_out_before"], report["held_out_after"]


def test_tuned_block_is_nearer_the_float_outputs_on_held_out_sequences(tiny):
    model, block, inputs, targets, outputs, tensors = quantized_block(tiny)
    start = {q.target.name: q.scales.clone() for q in tensors}
    with torch.no_grad():
        new, report = tune_block(block, model, inputs, targets, outputs, tensors,
                                 BlockTuningOptions(steps=40, lr=1e-2, batch_sequences=2, bf16=False))
    before, after = held_out_error(report)
    assert report["kept"] and after < 0.95 * before, report
    assert relative_error(torch.cat(new), torch.cat(targets)) < relative_error(torch.cat(outputs), torch.cat(targets))
    assert all(not torch.equal(q.scales, start[q.target.name]) for q in tensors)  # every tensor's scales moved
    for q in tensors:  # stored as fp16, and the block holds codes × the new scales
        assert torch.equal(q.scales, q.scales.half().float())
        t = q.target
        want = dequantize(q.codes, q.scales, SPEC.group_size)  # [N, K]
        assert torch.equal(t.param[t.start:t.start + t.rows], want), t.name
    with torch.no_grad():  # the outputs returned are the block's own with those weights
        torch.testing.assert_close(new[0], block_forward(block, inputs[0], *rotary_tables(model, 32, inputs[0].device)))


def test_bf16_steps_help_too(tiny):
    model, block, inputs, targets, outputs, tensors = quantized_block(tiny)
    with torch.no_grad():
        _, report = tune_block(block, model, inputs, targets, outputs, tensors,
                               BlockTuningOptions(steps=40, lr=1e-2, batch_sequences=2, bf16=True))
    before, after = held_out_error(report)
    assert report["kept"] and after < 0.95 * before, report


def test_start_scales_are_kept_when_tuning_does_not_help(tiny):
    model, block, inputs, targets, outputs, tensors = quantized_block(tiny)
    start = {q.target.name: q.scales.clone() for q in tensors}
    weights = {n: p.detach().clone() for n, p in block.named_parameters()}
    with torch.no_grad():
        new, report = tune_block(block, model, inputs, targets, outputs, tensors,
                                 BlockTuningOptions(steps=3, lr=5.0, bf16=False))  # steps of e^±5
    assert not report["kept"] and report["held_out_after"] >= report["held_out_before"]
    assert new is outputs
    assert all(torch.equal(q.scales, start[q.target.name]) for q in tensors)
    for name, p in block.named_parameters():
        assert torch.equal(p, weights[name]), name


def _quantize_tiny(tiny, tmp_path, name: str, **options):
    """The tiny model by the layer loop: ternary g32, q/o int4, gptq on 16 x 32 tokens of TEXT (also the held-out
    text). Returns the report and the checkpoint."""
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    recipe = Recipe(QuantSpec("tri", 32), rules=(Rule("q_proj|o_proj", QuantSpec("int4", 32)),))
    opts = QuantizeOptions(recipe, method="gptq", calib=calib, calib_samples=16, calib_seq_len=32, eval_text=calib,
                           **options)
    return quantize(tiny, tmp_path / name, opts), Checkpoint(tmp_path / name)


def test_quantize_with_block_tuning_writes_tuned_scales(tiny, tmp_path):
    """Layer by layer with --block-tune-steps: same codes as without, other scales, a nearer model."""
    written = {}
    for steps in (0, 30):
        report, ckpt = _quantize_tiny(tiny, tmp_path, f"ckpt{steps}", block_tune_steps=steps, block_tune_lr=1e-2,
                                      eval_tokens=256)
        assert report.settings["block_tune_steps"] == steps
        written[steps] = (ckpt, report.quality["kl_mean"])
    (plain, kl_plain), (tuned, kl_tuned) = written[0], written[30]
    names = [n for n, e in plain.entries.items() if not e.is_float]
    moved = 0
    for name in names:
        _, codes, scales = plain.read_quantized(name)
        _, tuned_codes, tuned_scales = tuned.read_quantized(name)
        if ".layers.0." in name:  # layer 0 sees the same inputs: tuning keeps GPTQ's codes
            assert torch.equal(codes, tuned_codes), name
        moved += not torch.equal(scales, tuned_scales)
    assert moved == len(names)
    assert kl_tuned < kl_plain


def test_weight_error_of_new_scales_from_group_sums():
    """The weight error a tuned tensor reports, from per-group sums kept at quantization, equals the direct one."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)  # [N, K]
    codes, scales = quantize_rtn(SPEC, w)  # [N, K], [N, K/G]
    other = scales * (1 + 0.2 * torch.rand(scales.shape, generator=gen))  # [N, K/G]
    err, ref = weight_error(group_sums(w, codes, 32), other)
    want_err, want_ref = weight_relative_error(w, codes, other, 32)
    assert err == pytest.approx(want_err, rel=1e-5) and ref == pytest.approx(want_ref, rel=1e-6)
    assert weight_error(group_sums(w, codes, 32), other * 2)[0] > err  # not a constant


def test_bad_block_tuning_options(tiny, tmp_path):
    recipe = Recipe(QuantSpec("tri", 32))
    with pytest.raises(BonsaiError, match="--block-tune-steps must be >= 0"):
        QuantizeOptions(recipe, method="gptq", block_tune_steps=-1)
    with pytest.raises(BonsaiError, match="--block-tune-lr > 0"):
        QuantizeOptions(recipe, method="gptq", block_tune_steps=5, block_tune_lr=0.0)
    with pytest.raises(BonsaiError, match="use it with --method gptq or gsq"):
        QuantizeOptions(recipe, method="rtn", block_tune_steps=5)
    with pytest.raises(BonsaiError, match="--block-tune-lr must be > 0"):
        BlockTuningOptions(lr=float("nan"))
    with pytest.raises(BonsaiError, match="held_out"):
        BlockTuningOptions(held_out=0.0)
    with pytest.raises(BonsaiError, match="--asymmetric must be between 0 and 1"):
        QuantizeOptions(recipe, method="gptq", asymmetric=1.5)
    with pytest.raises(BonsaiError, match="--asymmetric must be between 0 and 1"):
        CalibrationOptions(asymmetric=-0.1)
    with pytest.raises(BonsaiError, match="--asymmetric fits layers on calibration text"):
        QuantizeOptions(recipe, method="rtn", asymmetric=0.5)
    loaded = load_model(tiny, weight_dtype=torch.float32)
    with pytest.raises(BonsaiError, match="asymmetric calibration needs the float model"):
        next(quantize_with_calibration(loaded, [[1, 2, 3]], lambda name: SPEC, "gptq", CalibrationOptions(asymmetric=1)))


def _run(stages):
    """Drain quantize_block's generator: the tensors it yields and the next hidden states it returns."""
    out = []
    while True:
        try:
            out.append(next(stages))
        except StopIteration as end:
            return out, end.value


def test_asymmetric_calibration_fits_a_block_to_the_float_model(tiny):
    """Layer 0 ternary puts the quantized stream off the float one; layer 1 quantized (int8) on the quantized
    stream with the float model's pass given (asymmetric 1) gives outputs nearer the float model's than plain
    GPTQ, on its calibration sequences and on held-out ones; float_stream's outputs are the float block's."""
    import copy
    from engine.quantization.block_pass import float_stream
    from engine.quantization.calibration import LayerInputs, Target
    loaded = load_model(tiny, weight_dtype=torch.float32)
    model, cfg = loaded.model, loaded.config
    ids = torch.tensor(calibration_sequences(loaded.tokenizer.encode(TEXT * 4), 72, 32))  # [72, 32]
    rope = rotary_tables(model, 32, ids.device)
    say = lambda m: None  # noqa: E731
    with torch.no_grad():
        x0 = model.embed(ids)  # [72, 32, H]
        x_f = block_forward(model.layers[0], x0, *rope)  # the float model's layer-1 inputs
        y_f = block_forward(model.layers[1], x_f, *rope)  # and its layer-1 outputs
        layer0 = block_targets(model.layers[0], 0, cfg, lambda name: SPEC)
        _, x_q = _run(quantize_block(model.layers[0], list(x0[:64].split(8)), layer0, None, "gptq",
                                     CalibrationOptions(), model, say))
        held_q = block_forward(model.layers[0], x0[64:], *rope)  # [8, 32, H] held out
        errors = {}
        for share in (0.0, 1.0):
            block = copy.deepcopy(model.layers[1])
            targets = block_targets(block, 1, cfg, lambda name: QuantSpec("int8", 32))
            floats = float_stream(block, list(x_f[:64].split(8)), model) if share else None
            if floats is not None:
                torch.testing.assert_close(torch.cat(floats.outputs), y_f[:64])
            options = CalibrationOptions(asymmetric=share)
            _, out = _run(quantize_block(block, x_q, targets, None, "gptq", options, model, say, floats))
            held = block_forward(block, held_q, *rope)
            errors[share] = (relative_error(torch.cat(out), y_f[:64]), relative_error(held, y_f[64:]))
            if floats is not None:  # every stage's float parts dropped once used
                assert floats.inputs is floats.attention is floats.hidden is floats.w13 is None
    (plain_fit, plain_held), (asym_fit, asym_held) = errors[0.0], errors[1.0]
    assert asym_fit < 0.8 * plain_fit, errors
    assert asym_held < plain_held, errors
    # the cross term kept as W D [N, K] (one weight, N < K) or as D [K, K] gives the same rows
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=gen)  # [N, K]
    x, xf = torch.randn(3, 10, 40, generator=gen), torch.randn(3, 10, 40, generator=gen)
    wide, square = LayerInputs(40, x.device, None, w), LayerInputs(40, x.device, None)
    for inputs in (wide, square):
        inputs.add(x, xf)
    target = Target("t", w, 2, 3, SPEC)
    exact = w[2:5].double() @ ((xf - x).reshape(-1, 40).double().T @ x.reshape(-1, 40).double())  # [3, K]
    for inputs in (wide, square):  # products in CROSS_DTYPE: within float32's rounding
        assert float((inputs.cross_of(target).double() - exact).norm() / exact.norm()) < 2e-2
    assert LayerInputs(40, x.device, None).cross_of(target) is None


def test_quantize_with_asymmetric_calibration(tiny, tmp_path):
    """Layer by layer with `asymmetric` 1: layer 0's q/k/v see the same inputs in both streams (tied embedding,
    float rows) and keep plain GPTQ's codes; every tensor after them is fitted to the float model and moves;
    the settings say so."""
    written = {}
    for share in (0.0, 1.0):
        report, written[share] = _quantize_tiny(tiny, tmp_path, f"ckpt{share}", asymmetric=share, evaluate=False)
        assert report.settings["asymmetric"] == share
    plain, asym = written[0.0], written[1.0]
    names = [n for n, e in plain.entries.items() if not e.is_float and ".layers." in n]
    for name in names:
        same = torch.equal(plain.read_quantized(name)[1], asym.read_quantized(name)[1])
        first = ".layers.0.self_attn." in name and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
        assert same == first, name


@pytest.mark.gpu
def test_the_layer_loop_on_the_gpu_with_tuning_and_asymmetric_calibration(tiny, tmp_path):
    """`bonsai quantize --device cuda` with the defaults' block tuning and asymmetric calibration: the scales
    tuned on the GPU (it once crashed: start scales on the CPU, the block on the GPU) give a model as near
    the source as the CPU's."""
    kl = {}
    for device in ("cpu", "cuda"):
        report, ckpt = _quantize_tiny(tiny, tmp_path, f"ckpt-{device}", block_tune_steps=20, block_tune_lr=1e-2,
                                      asymmetric=0.25, eval_tokens=256, device=device)
        assert report.settings["block_tune_steps"] == 20 and report.settings["asymmetric"] == 0.25
        kl[device] = report.quality["kl_mean"]
    assert kl["cuda"] < 1.2 * kl["cpu"] + 1e-3, kl

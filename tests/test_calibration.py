"""Sequential GPTQ / GSQ over a tiny random model: plumbing against hooks on the real model, and quality."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.quantization.calibration import (CalibrationOptions, block_forward, calibration_sequences, quantize_with_calibration,
                                rotary_tables)
from engine.errors import BonsaiError
from engine.quantization.evaluate import evaluate
from engine.weights.loader import load_model
from engine.runtime.runner import ModelRunner
from quant.grids import dequantize
from quant.gptq import gptq_quantize, rtn
from quant.gsq import GSQOptions
from tests.gguf_tiny import write_tiny_gguf


pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 3 +
        "A list is a mutable sequence; a tuple is an immutable one. Functions return values to the caller. ") * 12


@dataclass(frozen=True)
class Spec:
    quant_type: str
    group_size: int


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return write_tiny_gguf(tmp_path_factory.mktemp("calib") / "tiny.gguf", smollm2_gguf, T.F32)


@pytest.fixture(scope="module")
def token_stream(tiny):
    return load_model(tiny, weight_dtype=torch.float32).tokenizer.encode(TEXT)


def only(names: dict[str, Spec]):
    return lambda name: names.get(name)


def everything(mlp_type: str, other_type: str | None = None):
    """mlp_type for gate/up/down, other_type (default the same) for attention, embedding and output."""
    return lambda name: Spec(mlp_type if ".mlp." in name else other_type or mlp_type, 64)


def test_block_forward_matches_the_model(tiny, token_stream):
    loaded = load_model(tiny, weight_dtype=torch.float32)
    model = loaded.model
    ids = token_stream[:48]
    expected = ModelRunner(loaded, max_seq_len=64).forward(ModelRunner(loaded, 64).slot(), ids, num_logits=None)
    with torch.no_grad():
        x = model.embed(torch.tensor([ids]))  # [1, T, H]
        cos, sin = rotary_tables(model, len(ids), x.device)
        for block in model.layers:
            x = block_forward(block, x, cos, sin)
        logits = model.norm(x) @ model.lm_head.weight.T  # [1, T, V]
    assert torch.allclose(logits[0], expected, atol=1e-4, rtol=1e-4)


def hooked_hessians(loaded, sequences) -> dict[str, torch.Tensor]:
    """Σ xᵀx of every linear's input, taken with forward hooks while the real model (KV cache path) runs."""
    model, hessians = loaded.model, {}

    def hook(key):
        def grab(module, args, output=None):
            x = (output if output is not None else args[0]).reshape(-1, (output if output is not None else args[0]).shape[-1])
            hessians[key] = hessians.get(key, 0) + x.double().T @ x.double()
        return grab

    handles = [model.norm.register_forward_hook(hook("head"))]
    for i, block in enumerate(model.layers):
        for key, module in (("qkv", block.attention.wqkv), ("o", block.attention.wo), ("gate_up", block.feed_forward.w13),
                            ("down", block.feed_forward.w2)):
            handles.append(module.register_forward_pre_hook(hook(f"{i}.{key}")))
    runner = ModelRunner(loaded, max_seq_len=64)
    for s in sequences:
        runner.slot().reset()
        runner.forward(runner.slot(), s, num_logits=None)
    for h in handles:
        h.remove()
    return hessians


@pytest.mark.parametrize("name,key,rows", [
    ("model.layers.1.self_attn.k_proj.weight", "1.qkv", (256, 384)),
    ("model.layers.1.self_attn.o_proj.weight", "1.o", (0, 256)),
    ("model.layers.0.mlp.up_proj.weight", "0.gate_up", (512, 1024)),
    ("model.layers.1.mlp.down_proj.weight", "1.down", (0, 256)),
    ("lm_head.weight", "head", None),
])
def test_each_layer_sees_the_inputs_the_model_gives_it(tiny, token_stream, name, key, rows):
    sequences = calibration_sequences(token_stream, 6, 40)
    reference = load_model(tiny, weight_dtype=torch.float32)
    hessian = hooked_hessians(reference, sequences)[key]
    m = reference.model
    params = {"1.qkv": m.layers[1].attention.wqkv, "1.o": m.layers[1].attention.wo, "0.gate_up": m.layers[0].feed_forward.w13,
              "1.down": m.layers[1].feed_forward.w2, "head": m.lm_head}
    weight = params[key].weight if rows is None else params[key].weight[rows[0]:rows[1]]
    expected, expected_scales = gptq_quantize(weight.float(), hessian, "int4", 64)

    loaded = load_model(tiny, weight_dtype=torch.float32)
    out = list(quantize_with_calibration(loaded, sequences, only({name: Spec("int4", 64)}), "gptq",
                                         CalibrationOptions(seq_len=40)))
    assert [o[0] for o in out] == [name]
    _, codes, scales, spec = out[0]
    assert spec == Spec("int4", 64) and codes.shape == weight.shape and scales.shape == (weight.shape[0], weight.shape[1] // 64)
    # two float32 code paths compute the activations: a rare near-tie flips a code, and GPTQ carries the
    # change along that row; every other row is identical
    same = (codes == expected).all(1)  # [N]
    assert same.float().mean() > 0.99
    assert torch.allclose(scales[same], expected_scales[same].half().float(), rtol=1e-3)  # stored as float16
    assert torch.equal(scales, scales.half().float())
    written = loaded.model.lm_head.weight if rows is None else {
        "1.qkv": loaded.model.layers[1].attention.wqkv, "1.o": loaded.model.layers[1].attention.wo,
        "0.gate_up": loaded.model.layers[0].feed_forward.w13, "1.down": loaded.model.layers[1].feed_forward.w2,
    }[key].weight[rows[0]:rows[1]]
    assert torch.equal(written, dequantize(codes, scales, 64))  # written back for the layers after it


def test_a_tied_embedding_is_quantized_last_as_the_output_layer(tmp_path, smollm2_gguf, token_stream):
    """Tied: the embedding is the output layer too; GPTQ on the final-norm outputs of the float model
    (were it rounded first, the blocks' inputs, hence that Hessian, would differ)."""
    path = write_tiny_gguf(tmp_path / "tied.gguf", smollm2_gguf, T.F32, tied=True)
    sequences = calibration_sequences(token_stream, 6, 40)
    reference = load_model(path, weight_dtype=torch.float32)
    assert reference.model.lm_head is None
    expected, _ = gptq_quantize(reference.model.embed.weight.float(), hooked_hessians(reference, sequences)["head"], "int4", 64)
    loaded = load_model(path, weight_dtype=torch.float32)
    out = list(quantize_with_calibration(loaded, sequences, only({"model.embed_tokens.weight": Spec("int4", 64)}), "gptq",
                                         CalibrationOptions(seq_len=40)))
    assert [o[0] for o in out] == ["model.embed_tokens.weight"]
    assert (out[0][1] == expected).all(1).float().mean() > 0.99
    assert torch.equal(loaded.model.embed.weight, dequantize(out[0][1], out[0][2], 64))


def model_kl(tiny, token_stream, quantize) -> float:
    loaded = load_model(tiny, weight_dtype=torch.float32)
    quantize(loaded)
    held_out = token_stream[-200:]
    reference = ModelRunner(load_model(tiny, weight_dtype=torch.float32), max_seq_len=64)
    return evaluate(ModelRunner(loaded, max_seq_len=64), reference, held_out, 64).kl_mean


def quantize_rtn(loaded, mlp_type: str, other_type: str) -> None:
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():  # engine names: feed_forward = HF mlp
            if param.ndim == 2:
                codes, scales = rtn(param.float(), mlp_type if "feed_forward" in name else other_type, 64)
                param.copy_(dequantize(codes, scales, 64))


def test_calibrated_models_are_closer_to_the_float_model_than_rtn(tiny, token_stream):
    plan = everything("tri", "int4")  # ternary MLP; int4 attention, embedding and output
    calib = calibration_sequences(token_stream[:-200], 16, 48)
    seen = []

    def run(method, options=CalibrationOptions(seq_len=48, batch_sequences=5)):
        def apply(loaded):
            for name, codes, scales, spec in quantize_with_calibration(loaded, calib, plan, method, options, seen.append):
                assert codes.dtype == torch.int8 and scales.dtype == torch.float32
                lo = -7 if spec.quant_type == "int4" else -1
                assert codes.min() >= lo and codes.max() <= -lo
        return apply

    rtn_kl = model_kl(tiny, token_stream, lambda loaded: quantize_rtn(loaded, "tri", "int4"))
    gptq_kl = model_kl(tiny, token_stream, run("gptq"))
    gsq = CalibrationOptions(seq_len=48, gsq=GSQOptions(steps=60, eval_every=10), gsq_tokens=512)
    gsq_kl = model_kl(tiny, token_stream, run("gsq", gsq))
    print(f"KL vs float: rtn {rtn_kl:.4f}, gptq {gptq_kl:.4f}, gsq {gsq_kl:.4f}")
    assert gptq_kl < 0.9 * rtn_kl, (gptq_kl, rtn_kl)
    assert gsq_kl < 0.9 * rtn_kl, (gsq_kl, rtn_kl)
    assert len(seen) == 2 * 16 and "model.embed_tokens.weight" in seen[0]  # a progress line per tensor


def test_bad_plans_and_inputs_are_one_line_errors(tiny, token_stream):
    loaded = load_model(tiny, weight_dtype=torch.float32)
    seqs = calibration_sequences(token_stream, 2, 16)
    cases = [(everything("tri3"), "gptq", seqs, "unknown quant type 'tri3'"),
             (lambda n: Spec("tri", 96), "gptq", seqs, "group size 96 does not divide"),
             (everything("tri"), "awq", seqs, "unknown calibration method"),
             (everything("tri"), "gptq", [], "needs at least one sequence")]
    for plan, method, sequences, message in cases:
        with pytest.raises(BonsaiError, match=message):
            next(quantize_with_calibration(loaded, sequences, plan, method, CalibrationOptions()))
    with pytest.raises(BonsaiError, match="fewer than one sequence"):
        calibration_sequences(token_stream[:10], 4, 16)
    with pytest.raises(BonsaiError, match="damp"):
        CalibrationOptions(damp=0)


@pytest.mark.gpu
def test_blocks_run_on_the_gpu_and_the_model_stays_home(tiny, token_stream):
    plan = everything("tri", "int4")
    calib = calibration_sequences(token_stream[:-200], 16, 48)
    results = {}
    for device in ("cpu", "cuda"):
        options = CalibrationOptions(seq_len=48, device=device, gsq=GSQOptions(steps=30, eval_every=10), gsq_tokens=256)

        def apply(loaded):
            out = list(quantize_with_calibration(loaded, calib, plan, "gsq", options))
            assert all(codes.device.type == "cpu" and scales.device.type == "cpu" for _, codes, scales, _ in out)
            assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
        results[device] = model_kl(tiny, token_stream, apply)
    assert results["cuda"] < 1.2 * results["cpu"], results

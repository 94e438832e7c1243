"""Quantized checkpoints load into the packed layouts without requantizing: the packed layers hold
exactly the stored codes and scales, and the model gives the logits of the dequantized weights."""
from __future__ import annotations

import pytest
import torch

from engine.weights.loader import load_model
from engine.weights.packed_linear import PackedLinear
from engine.runtime.runner import ModelRunner
from quant.packed_layout import dequantize


@pytest.fixture(scope="module")
def ternary_checkpoint(smollm2_gguf, tmp_path_factory):
    from bonsai_cli.main import main
    out = tmp_path_factory.mktemp("ckpt") / "smol-tri"
    main(["quantize", str(smollm2_gguf), str(out), "--method", "rtn", "--no-eval", "--quant-type", "tri",
          "--group-size", "64", "--sensitive-layers", "q_proj,k_proj,v_proj,o_proj", "--sensitive-bits", "4"])
    assert (out / "config.json").exists()
    return out


@pytest.fixture(scope="module")
def packed_and_float(ternary_checkpoint):
    """The checkpoint loaded packed as stored, and as floats (float32 matrices), once for the module."""
    return (load_model(ternary_checkpoint, "cpu", weight_dtype=torch.float32, keep_codes=True),
            load_model(ternary_checkpoint, "cpu", weight_dtype=torch.float32))


def test_checkpoint_codes_are_packed_as_stored(ternary_checkpoint, packed_and_float):
    from engine.sources.checkpoint_file import BonsaiCheckpoint
    from engine.weights.loader import open_model_source
    source = open_model_source(ternary_checkpoint)
    assert isinstance(source, BonsaiCheckpoint)
    config = source.model_config()
    stored = {n: (qt, g, c, s) for n, qt, g, c, s in source.iter_quantized_tensors(config)}
    packed, float_model = packed_and_float[0].model, packed_and_float[1].model
    layer = packed.layers[3]
    assert isinstance(layer.feed_forward.w13, PackedLinear) and layer.feed_forward.w13.kind == "tri"
    assert isinstance(layer.attention.wqkv, PackedLinear) and layer.attention.wqkv.kind == "int4"
    # the packed matrix is exactly the stored codes x scales (the float load's matrix)
    dense = dequantize(layer.feed_forward.w13.packed)
    assert torch.equal(dense, float_model.layers[3].feed_forward.w13.weight.float())
    qt, g, codes, scales = stored["layers.3.gate_proj.weight"]
    assert qt == "tri" and g == 64 and codes.shape == (1536, 576)


def test_packed_checkpoint_decodes_like_its_float_load(packed_and_float):
    packed, plain = packed_and_float
    ids = packed.tokenizer.encode("The capital of France is")
    logits = []
    for loaded in (packed, plain):
        runner = ModelRunner(loaded, max_seq_len=64)
        logits.append(runner.prefill(runner.slot(0), ids))  # M > 4: dense product of the same values
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", ["TQ2_0", "TQ1_0"])
def test_trained_ternary_gguf_runs_packed_without_requantizing(qtype, smollm2_gguf, tmp_path):
    from gguf import GGMLQuantizationType as T

    from tests.gguf_tiny import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", smollm2_gguf, getattr(T, qtype))
    packed = load_model(path, "cpu", weight_dtype=torch.float32, keep_codes=True)
    plain = load_model(path, "cpu", weight_dtype=torch.float32)
    kinds = {m.kind for m in packed.model.modules() if isinstance(m, PackedLinear)}
    assert kinds == {"tri"}
    for p, f in zip(packed.model.layers, plain.model.layers):  # same values as the gguf package decodes
        assert torch.equal(dequantize(p.feed_forward.w2.packed), f.feed_forward.w2.weight.float())

"""`bonsai quantize` (rtn) on a tiny hybrid model: the checkpoint loads and runs close to the float model;
what has no hybrid path yet (--rotate, gptq / gsq) is refused in one line."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")

from engine.errors import BonsaiError  # noqa: E402
from engine.quantization.quantize import QuantizeOptions, quantize  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from quant.formats import QuantSpec  # noqa: E402
from quant.recipe import Recipe  # noqa: E402
from tests.hybrid_tiny import make_hybrid_model  # noqa: E402

IDS = [(i * 29 + 3) % 64 for i in range(24)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, smollm2_gguf):
    import transformers
    tok = tmp_path_factory.mktemp("tok")
    transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(tok)
    path = tmp_path_factory.mktemp("qwen35")
    make_hybrid_model(path, tok, vocab_size=64)
    return path


def _logits(path) -> torch.Tensor:
    runner = ModelRunner(load_model(path, dtype=torch.float32, weight_dtype=torch.float32), 64, prefill_chunk_size=8)
    return runner.forward(runner.slot(0), IDS, num_logits=None)  # [T, V]


def test_int8_rtn_checkpoint_runs_close_to_the_float_model(source, tmp_path):
    out = tmp_path / "q"
    quantize(source, out, QuantizeOptions(Recipe(QuantSpec("int8", 32)), evaluate=False))
    ref, got = _logits(source), _logits(out)
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)  # [T]
    assert kl.max() < 1e-3 and not torch.equal(ref, got)  # quantized, and close


TEXT = ("def merge(left, right):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n"
        "    while left and right:\n        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
        "    return out + left + right\n\nclass Stack:\n    \"\"\"A last-in first-out stack of items.\"\"\"\n"
        "    def push(self, item):\n        self.items.append(item)\n") * 6


@pytest.fixture(scope="module")
def full_vocab(tmp_path_factory, smollm2_gguf):
    """The tiny hybrid with the tokenizer's whole vocabulary: calibration text tokenizes into it."""
    import transformers
    tok = tmp_path_factory.mktemp("tok-full")
    transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(tok)
    path = tmp_path_factory.mktemp("qwen35-full")
    make_hybrid_model(path, tok, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return path


def _in_sample_kl(path, ref_path, ids) -> float:
    def logits(p):
        runner = ModelRunner(load_model(p, dtype=torch.float32, weight_dtype=torch.float32), 128, prefill_chunk_size=16)
        return runner.forward(runner.slot(0), ids, num_logits=None)  # [T, V]
    p, q = logits(ref_path).log_softmax(-1), logits(path).log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("method, extra", [("gptq", {}), ("gsq", {"gsq_steps": 60}), ("gptq", {"tune_steps": 2}),
                                           ("gptq", {"block_tune_steps": 10}),
                                           ("gptq", {"block_tune_steps": 10, "asymmetric": 0.25})])
def test_calibrated_quantization_of_a_hybrid_beats_rtn_on_its_calibration_text(full_vocab, tmp_path, method, extra):
    """gptq / gsq (and end-to-end or block-wise scale tuning, asymmetric calibration) through the DeltaNet layers (q/k/v and z from the block's norm,
    out_proj from the rule's gated-normed output) and the gated attention: the checkpoint loads, and on the text
    it was calibrated on its logits are closer to the float model's than round-to-nearest's."""
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    recipe = Recipe(QuantSpec("int4", 32))
    kw = dict(calib=calib, calib_samples=4, calib_seq_len=48, evaluate=False)
    quantize(full_vocab, tmp_path / "rtn", QuantizeOptions(recipe, **kw))
    quantize(full_vocab, tmp_path / method, QuantizeOptions(recipe, method=method, **kw, **extra))
    ids = load_model(full_vocab, dtype=torch.float32).tokenizer.encode(TEXT)[:96]
    rtn, calibrated = (_in_sample_kl(tmp_path / name, full_vocab, ids) for name in ("rtn", method))
    assert 0 < calibrated < rtn, (calibrated, rtn)


@pytest.mark.parametrize("change, message", [(dict(rotate=True), "--rotate")])
def test_what_has_no_hybrid_path_is_refused(source, tmp_path, change, message):
    opts = replace(QuantizeOptions(Recipe(QuantSpec("tri", 32)), evaluate=False), **change)
    with pytest.raises(BonsaiError, match=message):
        quantize(source, tmp_path / "q", opts)

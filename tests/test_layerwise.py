"""Layer-by-layer quantization (engine.quantization.layerwise) against the whole-model calibration, and the quality report
(engine.quantization.quality) against `bonsai eval`'s scores."""
from __future__ import annotations

import math

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.quantization.calibration import CalibrationOptions, quantize_with_calibration
from engine.sources.checkpoint_file import BonsaiCheckpoint
from engine.quantization.evaluate import Tally, evaluate, windows_of
from engine.weights.loader import load_model
from engine.quantization.quality import VocabScores
from engine.quantization.quantize import QuantizeOptions, quantize, spread_windows
from engine.runtime.runner import ModelRunner
from quant.formats import QuantSpec
from quant.recipe import Recipe, Rule, calibration_plan, plan
from tests.gguf_tiny import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 3 +
        "A list is a mutable sequence; a tuple is an immutable one. Functions return values to the caller. ") * 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return write_tiny_gguf(tmp_path_factory.mktemp("layerwise") / "tiny.gguf", smollm2_gguf, T.F32)


def test_vocab_scores_equal_the_whole_vocabulary_tally():
    """Online log-sum-exp, KL, argmax and target scores over vocabulary slices = the whole-row computation."""
    gen = torch.Generator().manual_seed(0)
    ref, logits = torch.randn(40, 300, generator=gen) * 3, torch.randn(40, 300, generator=gen) * 3
    targets = torch.randint(0, 300, (40,), generator=gen)
    tally = Tally()
    tally.add(torch.log_softmax(logits, -1), torch.log_softmax(ref, -1), targets)
    want = tally.result()
    scores = VocabScores(targets)
    for start in range(0, 300, 70):  # uneven slices, the last one short
        scores.add(ref[:, start:start + 70], logits[:, start:start + 70], start)
    got = scores.result()
    assert got.tokens == want.tokens and got.same_top == want.same_top
    for field in ("perplexity", "reference_perplexity", "kl_mean", "kl_p99", "kl_max"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-5), field


def test_layer_by_layer_gptq_equals_the_whole_model_calibration(tiny, tmp_path):
    """The checkpoint written layer by layer holds the codes sequential GPTQ gives on the whole loaded model."""
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    recipe = Recipe(QuantSpec("tri", 32), rules=(Rule("q_proj|o_proj", QuantSpec("int4", 32)),),
                    embed=QuantSpec("int4", 32))
    opts = QuantizeOptions(recipe, method="gptq", calib=calib, calib_samples=6, calib_seq_len=48, scale_refits=1,
                           evaluate=False)
    quantize(tiny, tmp_path / "ckpt", opts)
    loaded = load_model(tiny, weight_dtype=torch.float32)
    shapes = {n: tuple(p.shape) for n, p in [("model.embed_tokens.weight", loaded.model.embed.weight)]}
    for i in range(loaded.config.num_layers):
        for part, (o, k) in loaded.config.linear_shapes().items():
            section = "self_attn" if part.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            shapes[f"model.layers.{i}.{section}.{part}.weight"] = (o, k)
    sequences = spread_windows(TEXT, loaded.tokenizer, 6, 48)
    want = {name: (codes, scales) for name, codes, scales, _ in quantize_with_calibration(
        loaded, sequences, calibration_plan(plan(recipe, shapes, loaded.config.num_layers)), "gptq",
        CalibrationOptions(samples=6, seq_len=48, scale_refits=1))}
    checkpoint = BonsaiCheckpoint(tmp_path / "ckpt").checkpoint
    assert set(want) == {n for n, e in checkpoint.entries.items() if not e.is_float}
    for name, (codes, scales) in want.items():
        _, got_codes, got_scales = checkpoint.read_quantized(name)
        assert torch.equal(got_codes, codes), name
        assert torch.equal(got_scales, scales), name


def test_the_quality_report_is_bonsai_eval_of_the_checkpoint(tiny, tmp_path):
    """The scores printed at the end of quantize equal engine.quantization.evaluate's on the written checkpoint (float32)."""
    out = tmp_path / "ckpt"
    text = tmp_path / "heldout.txt"
    text.write_text(TEXT * 3)
    report = quantize(tiny, out, QuantizeOptions(Recipe(QuantSpec("int4", 32)), eval_text=text, eval_tokens=700))
    q = report.quality
    ours, ref = (ModelRunner(load_model(p, weight_dtype=torch.float32), max_seq_len=512) for p in (out, tiny))
    ids = ref.loaded.tokenizer.encode(TEXT * 3)[:700]
    assert len(windows_of(ids, 512)) == 2
    want = evaluate(ours, ref, ids, 512)
    assert q["tokens"] == want.tokens == 698
    assert q["perplexity"] == pytest.approx(want.perplexity, rel=1e-4)
    assert q["reference_perplexity"] == pytest.approx(want.reference_perplexity, rel=1e-4)
    assert q["kl_mean"] == pytest.approx(want.kl_mean, rel=1e-3, abs=1e-6) and q["same_top"] == pytest.approx(
        want.same_top, abs=2 / 698)
    assert 0 < q["kl_mean"] and math.isfinite(q["kl_p99"])
    assert (out / "quality.json").is_file()

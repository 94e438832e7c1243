"""`bonsai eval`: perplexity, KL and same-top of a model against a reference."""
from __future__ import annotations

import json
import math

import pytest
from gguf import GGMLQuantizationType as T

from engine.quantization.evaluate import default_eval_text
from tests.gguf_tiny import write_tiny_gguf
from tests.test_cli_errors import assert_one_line_error, bonsai_in_process


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("eval")
    a = write_tiny_gguf(d / "a.gguf", smollm2_gguf, T.F32, seed=0)
    b = write_tiny_gguf(d / "b.gguf", smollm2_gguf, T.Q4_0, seed=0)  # the same weights, rounded to 4 bits
    c = write_tiny_gguf(d / "c.gguf", smollm2_gguf, T.F32, seed=1)  # other weights
    return a, b, c


def run_eval(capsys, model, ref, *extra):
    proc = bonsai_in_process(capsys, "eval", str(model), "--ref", str(ref), "--max-tokens", "64", "--context", "32",
                             "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_model_against_itself_is_perfect(tiny_pair, capsys):
    a, _, _ = tiny_pair
    out = run_eval(capsys, a, a)
    assert out["tokens"] == 62  # two windows of 32 tokens, the first of each unscored
    assert out["kl_mean"] == pytest.approx(0, abs=1e-6) and out["same_top"] == 1.0
    assert out["perplexity"] == pytest.approx(out["reference_perplexity"])


def test_rounded_weights_are_closer_than_other_weights(tiny_pair, capsys):
    a, b, c = tiny_pair
    near, far = run_eval(capsys, b, a), run_eval(capsys, c, a)
    assert 0 < near["kl_mean"] < far["kl_mean"]
    assert near["same_top"] > far["same_top"]
    assert near["kl_p99"] >= near["kl_mean"] and math.isfinite(near["perplexity"])
    assert near["bits_per_weight"] < near["reference_bits_per_weight"]


def test_errors_are_one_line(tiny_pair, smollm2_gguf, tmp_path, capsys):
    a, _, _ = tiny_pair
    run = bonsai_in_process
    assert_one_line_error(run(capsys, "eval", str(a), "--ref", str(smollm2_gguf), "--max-tokens", "64"),
                          "do not share a tokenizer")
    assert_one_line_error(run(capsys, "eval", str(a), "--ref", str(a), "--text", str(tmp_path / "none.txt")),
                          "evaluation text not found")


def test_default_text_is_english_prose():
    text = default_eval_text()
    assert len(text) > 100_000 and "the" in text

"""`bonsai eval`: perplexity, KL and same-top of a model against a reference."""
from __future__ import annotations

import json
import math

import pytest
from gguf import GGMLQuantizationType as T

from engine.evaluate import default_eval_text
from tests.gguf_tiny import write_tiny_gguf
from tests.test_cli_errors import assert_one_line_error, bonsai


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("eval")
    a = write_tiny_gguf(d / "a.gguf", smollm2_gguf, T.F32, seed=0)
    b = write_tiny_gguf(d / "b.gguf", smollm2_gguf, T.Q4_0, seed=0)  # the same weights, rounded to 4 bits
    c = write_tiny_gguf(d / "c.gguf", smollm2_gguf, T.F32, seed=1)  # other weights
    return a, b, c


def run_eval(model, ref, *extra):
    proc = bonsai("eval", str(model), "--ref", str(ref), "--max-tokens", "64", "--context", "32", "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_model_against_itself_is_perfect(tiny_pair):
    a, _, _ = tiny_pair
    out = run_eval(a, a)
    assert out["tokens"] == 62  # two windows of 32 tokens, the first of each unscored
    assert out["kl_mean"] == pytest.approx(0, abs=1e-6) and out["same_top"] == 1.0
    assert out["perplexity"] == pytest.approx(out["reference_perplexity"])


def test_rounded_weights_are_closer_than_other_weights(tiny_pair):
    a, b, c = tiny_pair
    near, far = run_eval(b, a), run_eval(c, a)
    assert 0 < near["kl_mean"] < far["kl_mean"]
    assert near["same_top"] > far["same_top"]
    assert near["kl_p99"] >= near["kl_mean"] and math.isfinite(near["perplexity"])
    assert near["bits_per_weight"] < near["reference_bits_per_weight"]


def test_errors_are_one_line(tiny_pair, smollm2_gguf, tmp_path):
    a, _, _ = tiny_pair
    assert_one_line_error(bonsai("eval", str(a), "--ref", str(smollm2_gguf), "--max-tokens", "64"),
                          "do not share a tokenizer")
    assert_one_line_error(bonsai("eval", str(a), "--ref", str(a), "--text", str(tmp_path / "none.txt")),
                          "evaluation text not found")


def test_default_text_is_english_prose():
    text = default_eval_text()
    assert len(text) > 100_000 and "the" in text

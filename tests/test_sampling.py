"""Sampling maths without a model."""
from __future__ import annotations

import pytest
import torch

from engine.errors import BonsaiError
from engine.decoding.sampling import SamplingParams, apply_penalties, make_generator, probabilities, sample, sample_rows


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, SamplingParams(), None) == 1


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert (p > 0).tolist() == [True, True, False, False]
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert (p > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, min_p=0.1))
    assert (p > 0).tolist() == [True, True, True, False]


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 2.0])
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    cold = probabilities(logits, SamplingParams(temperature=0.5))
    assert cold[1] > hot[1] > 0.5


def test_repetition_penalty_hf_rule():
    logits = torch.tensor([2.0, -2.0, 1.0])
    seen = torch.tensor([1.0, 1.0, 0.0])
    out = apply_penalties(logits, seen, torch.zeros(3), SamplingParams(repetition_penalty=2.0))
    torch.testing.assert_close(out, torch.tensor([1.0, -4.0, 1.0]))


def test_presence_and_frequency_penalties():
    logits = torch.zeros(3)
    counts = torch.tensor([0.0, 1.0, 3.0])
    out = apply_penalties(logits, counts, counts, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    torch.testing.assert_close(out, torch.tensor([0.0, -0.75, -1.25]))


def test_same_seed_same_samples_and_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, params, g) for g in [make_generator(params, torch.device("cpu"))] for _ in range(50)]
    b = [sample(logits, params, g) for g in [make_generator(params, torch.device("cpu"))] for _ in range(50)]
    assert a == b
    gen = make_generator(params, torch.device("cpu"))
    counts = torch.bincount(torch.tensor([sample(logits, params, gen) for _ in range(4000)]), minlength=4)
    expected = torch.softmax(logits, -1) * 4000
    assert ((counts - expected).abs() < 5 * expected.sqrt() + 5).all(), (counts, expected)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1.0),
                                    dict(top_k=-1), dict(repetition_penalty=0), dict(presence_penalty=3)])
def test_invalid_parameters_are_user_errors(kwargs):
    with pytest.raises(BonsaiError):
        SamplingParams(**kwargs)


def test_sample_rows_gives_what_sample_gives_row_by_row(one_thread):
    torch.manual_seed(0)
    logits = torch.randn(7, 300) * 3  # [B, V]
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2), SamplingParams(temperature=1.3, top_k=20, seed=3),
              SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=4),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5)]
    gens_rows = [None if p.greedy else make_generator(p, logits.device) for p in params]
    gens_one = [None if p.greedy else make_generator(p, logits.device) for p in params]
    for draw in range(20):  # each row's generator advances alike in both
        rows = sample_rows(logits, params, gens_rows)
        alone = [sample(logits[i], p, g) for i, (p, g) in enumerate(zip(params, gens_one))]
        assert rows == alone, draw
    assert rows[0] == int(logits[0].argmax()) and rows[4] == int(logits[4].argmax())
    assert sample_rows(logits[:2], [SamplingParams()] * 2, [None, None]) == logits[:2].argmax(-1).tolist()


def test_logit_bias_adds_to_every_row_at_its_ids():
    from engine.decoding.sampling import apply_logit_bias, bias_tensors
    bias = bias_tensors({1: -100.0, 3: 2.5}, "cpu")
    logits = torch.zeros(2, 5, dtype=torch.bfloat16)  # [T, V]
    out = apply_logit_bias(logits, bias)
    assert out.dtype == torch.bfloat16 and logits.abs().sum() == 0  # a copy
    assert out[0].tolist() == [0, -100, 0, 2.5, 0] and out[1].tolist() == out[0].tolist()
    assert apply_logit_bias(torch.ones(5), bias).tolist() == [1, -99, 1, 3.5, 1]  # [V]

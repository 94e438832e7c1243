"""Verification maths without a model: greedy acceptance, lossless sampling, row-wise penalties."""
from __future__ import annotations

import math

import pytest
import torch

from engine.decoding.sampling import SamplingParams, apply_penalties, probabilities
from engine.speculative.verify import penalized_rows, verify_draft, verify_greedy, verify_sampling


def chi_square_ok(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001); cells expecting fewer than 5 are pooled into one."""
    n = counts.sum().item()
    expected = expected_probs.to(torch.float64) * n
    counts = counts.to(torch.float64)
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    expected = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if expected[-1] < 5:  # the pooled cell is still small: fold it into the smallest kept cell
        assert observed[-1] <= 10, "samples where the target has (almost) no mass"
        observed, expected = observed[:-1], expected[:-1]
    stat = (((observed - expected) ** 2) / expected).sum().item()
    df = len(observed) - 1
    z = 3.09  # one-sided 0.001; Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 0]):
        logits[row, best] = 3.0
    assert verify_greedy(logits, [2, 5, 1]).tokens == [2, 5, 1, 0]  # all accepted + bonus
    v = verify_greedy(logits, [2, 4, 1])
    assert (v.accepted, v.tokens) == (1, [2, 5])  # the target's token at the first mismatch
    v = verify_greedy(logits[:1], [])
    assert (v.accepted, v.tokens) == (0, [2])


def test_penalties_apply_row_by_row_with_the_drafts_counted():
    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    seen = torch.zeros(8)
    seen[[1, 2]] = 1
    out = torch.zeros(8)
    out[2] = 1
    drafts = [4, 4]
    got = penalized_rows(logits, drafts, seen, out, params)
    s, o = seen.clone(), out.clone()
    for i in range(3):
        torch.testing.assert_close(got[i], apply_penalties(logits[i], s, o, params))
        if i < 2:
            s[drafts[i]] += 1
            o[drafts[i]] += 1
    assert seen[4] == 0 and out[4] == 0  # the caller's counts are left alone
    penalty = logits[:, 4] - got[:, 4]
    assert penalty[0] == 0 < penalty[1] < penalty[2]  # token 4 is penalized more with each drafted copy
    # greedy verification sees the penalties: the repeated token loses to the next best
    logits = torch.tensor([[0.0, 5.0, 4.9], [0.0, 5.0, 4.9]])
    v = verify_draft(logits, [1], None, SamplingParams(frequency_penalty=1.0), None,
                     torch.zeros(3), torch.zeros(3))
    assert v.tokens == [1, 2]


def _drafts_from(q: torch.Tensor, gen: torch.Generator) -> list[int]:
    return [int(torch.multinomial(row, 1, generator=gen)) for row in q]


@pytest.mark.parametrize("with_q, params", [
    (True, SamplingParams(temperature=1.0)),
    (True, SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)),
    (False, SamplingParams(temperature=0.8, top_k=5))])
def test_sampling_keeps_the_target_distribution(one_thread, with_q, params):
    """First output token ~ p0; the second, given the first equals draft 1, ~ p1 (its row)."""
    torch.manual_seed(1)
    vocab, n = 6, 4000
    logits = torch.randn(3, vocab) * 1.5  # [k + 1, V]
    q = torch.softmax(torch.randn(2, vocab), dim=-1)  # [k, V] the drafter's distribution
    fixed = [int(q[0].argmax()), int(q[1].argmax())]  # a deterministic drafter: one-hot q
    p = probabilities(logits, params)
    gen = torch.Generator().manual_seed(2)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        drafts = _drafts_from(q, gen) if with_q else fixed
        v = verify_sampling(logits, drafts, q if with_q else None, params, gen)
        first[v.tokens[0]] += 1
        if v.accepted >= 1:  # token 1 was draft 1: token 2 came from row 1
            second[v.tokens[1]] += 1
    stat, critical = chi_square_ok(first, p[0])
    assert stat < critical, (stat, critical)
    stat, critical = chi_square_ok(second, p[1])
    assert stat < critical, (stat, critical)


def test_sampling_plants_a_bias_and_the_test_sees_it(one_thread):
    """The chi-square check above would catch a verifier that forgets the residual (resamples from p)."""
    torch.manual_seed(1)
    vocab, n = 6, 4000
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=1.0)
    p = probabilities(logits, params)
    drafted = int(p[0].argmin())
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(vocab)
    for _ in range(n):
        accept = torch.rand(1, generator=gen).item() < p[0, drafted].item()
        token = drafted if accept else int(torch.multinomial(p[0], 1, generator=gen))  # wrong: not the residual
        counts[token] += 1
    stat, critical = chi_square_ok(counts, p[0])
    assert stat > critical


def test_sampling_with_equal_p_and_q_accepts_everything():
    logits = torch.randn(3, 5)
    params = SamplingParams(temperature=1.0)
    q = probabilities(logits[:2], params)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        drafts = _drafts_from(q, gen)
        assert verify_sampling(logits, drafts, q, params, gen).accepted == 2


def test_sampling_rejects_a_token_the_target_cannot_produce():
    logits = torch.tensor([[0.0, 0.0, -float("inf")], [0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        v = verify_sampling(logits, [2], None, SamplingParams(temperature=1.0), gen)
        assert v.accepted == 0 and v.tokens[0] in (0, 1)

"""Short prompts through the fused decode step (engine.runtime.runner.ModelRunner._short_prefill): on a GPU
the graphed 16-row step replaces the eager prefill of a chunk up to SHORT_PREFILL_TOKENS long. Here on the
CPU (the fused step asked for, its plain-torch references) with 4 rows a pass: the same logits and cache
as the eager prefill, the same greedy continuation, and longer chunks still go the eager way."""
from __future__ import annotations

import torch

from engine.runtime.runner import SHORT_PREFILL_TOKENS, ModelRunner
from engine.weights.formats import WeightFormat
from engine.weights.loader import load_dummy
from tests.engine_runs import run_engine
from tests.test_decode_step import CFG
from tests.test_spec_generate import TinyTokenizer

PROMPT = [3, 17, 5, 99, 41, 8, 8, 23, 61, 2, 77]  # 11 tokens: passes of 4, 4, 3


def _runners():
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    eager = ModelRunner(loaded, 96, fast_decode=True)
    short = ModelRunner(loaded, 96, fast_decode=True)
    assert eager.short_prefill_rows == 0 and short.short_prefill_rows == 0  # off where the step is not graphed
    short.short_prefill_rows = 4
    short.prepare_rows(4)
    assert set(short._row_steps) == {2, 3, 4}
    return eager, short


def test_short_prefill_matches_the_eager_prefill(one_thread):
    eager, short = _runners()
    want = eager.forward(eager.slot(0), PROMPT)  # [1, V]
    got = short.forward(short.slot(0), PROMPT)
    assert got.shape == want.shape == (1, CFG.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    assert short.slot(0).tokens == eager.slot(0).tokens == PROMPT
    n = len(PROMPT)
    for name in ("k", "v"):  # the same rows, up to the two paths' roundings (int8 activations, attention order)
        a, b = getattr(short.cache, name)[:, 0, :, :n], getattr(eager.cache, name)[:, 0, :, :n]
        assert (a - b).abs().max() < 0.05 * b.abs().max()
        assert getattr(short.cache, name)[:, 0, :, n:].abs().max() == 0  # nothing written past the prompt
    # after a prompt already in the slot, the next chunk starts at its length
    more = [4, 4, 9]
    torch.testing.assert_close(short.forward(short.slot(0), more), eager.forward(eager.slot(0), more),
                               rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_short_prefill_gives_the_same_greedy_continuation(one_thread):
    eager, short = _runners()
    tok = TinyTokenizer()
    _, want, _, _ = run_engine(eager, tok, PROMPT, max_tokens=16, ignore_eos=True)
    _, got, _, _ = run_engine(short, tok, PROMPT, max_tokens=16, ignore_eos=True)
    assert got == want


def test_long_chunks_and_several_logits_take_the_eager_path(one_thread, monkeypatch):
    eager, short = _runners()
    assert SHORT_PREFILL_TOKENS >= 64
    short.short_prefill_tokens = 8
    calls = []
    real = short._short_prefill
    monkeypatch.setattr(short, "_short_prefill", lambda slot, tokens: calls.append(len(tokens)) or real(slot, tokens))
    short.forward(short.slot(0), PROMPT[:8])
    assert calls == [8]
    short.forward(short.slot(0), PROMPT[:9])  # longer than short_prefill_tokens: the eager prefill
    short.forward(short.slot(0), [5, 6, 7], num_logits=2)  # several logits: the model's path
    short.forward(short.slot(0), [5])  # one token: the one-row decode step
    assert calls == [8] and short.slot(0).length == 8 + 9 + 3 + 1


def test_the_engine_cuts_a_short_prompt_in_the_runners_passes(one_thread, monkeypatch):
    """Through the engine a prompt that fits the short prefill is fed in chunks of its passes (so two passes,
    the default budget, can run between decode steps of other slots), a longer one in eager chunks; the
    greedy continuation is the eager prefill's."""
    from tests.engine_runs import engine_over
    eager, short = _runners()
    sizes = []
    forward = ModelRunner.forward

    def record(self, slot, tokens, num_logits=1):
        if len(tokens) > 1:
            sizes.append(len(tokens))
        return forward(self, slot, tokens, num_logits)
    monkeypatch.setattr(ModelRunner, "forward", record)
    engine = engine_over(short, TinyTokenizer(), None, 4)
    assert (engine.short_cut, engine.prefill_budget) == (4, 8)
    tok = TinyTokenizer()
    _, want, _, _ = run_engine(eager, tok, PROMPT, max_tokens=12, ignore_eos=True)
    assert sizes == [len(PROMPT)]
    sizes.clear()
    _, got, _, _ = run_engine(short, tok, PROMPT, max_tokens=12, ignore_eos=True)
    assert sizes == [4, 4, 3] and got == want
    sizes.clear()
    _, short = _runners()  # (a fresh cache: the slot would reuse the prompt it holds)
    short.short_prefill_tokens = 8  # now the prompt is longer than a short prefill: one eager chunk
    _, got, _, _ = run_engine(short, tok, PROMPT, max_tokens=12, ignore_eos=True)
    assert sizes == [len(PROMPT)] and got == want

"""Short prompts through the fused decode step (engine.runtime.runner.ModelRunner._short_prefill): on a GPU
the graphed 16-row step replaces the eager prefill of a chunk up to SHORT_PREFILL_TOKENS long. Here on the
CPU (the fused step asked for, its plain-torch references) with 4 rows a pass: the same logits and cache
as the eager prefill, the same greedy continuation, and longer chunks still go the eager way."""
from __future__ import annotations

import pytest
import torch

from engine.runtime.runner import SHORT_PREFILL_TOKENS, ModelRunner
from engine.weights.formats import WeightFormat
from engine.weights.loader import load_dummy
from tests.engine_runs import engine_over, run_engine
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


def _watch_passes(monkeypatch) -> tuple[list, list]:
    """The slots of every fused pass (step_rows) and (slot, tokens) of every runner forward, as they run."""
    passes, forwards = [], []
    step_rows, forward = ModelRunner.step_rows, ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "step_rows",
                        lambda self, t, p, s: passes.append(list(s)) or step_rows(self, t, p, s))
    monkeypatch.setattr(ModelRunner, "forward",
                        lambda self, slot, t, num_logits=1: forwards.append((slot.index, len(t))) or
                        forward(self, slot, t, num_logits))
    return passes, forwards


def _two_prompts(short_tokens: int | None = None):
    """(tokenizer, two prompts, each one's greedy tokens alone, a two-slot runner whose fused step takes 8 rows)."""
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    tok = TinyTokenizer()
    prompts = (PROMPT, PROMPT[::-1] + [9])
    alone = [run_engine(ModelRunner(loaded, 96, fast_decode=True), tok, p, max_tokens=10, ignore_eos=True)[1]
             for p in prompts]
    runner = ModelRunner(loaded, 96, num_slots=2, fast_decode=True)
    runner.short_prefill_rows = 8
    if short_tokens is not None:
        runner.short_prefill_tokens = short_tokens
    runner.prepare_rows(8)
    return tok, prompts, alone, runner


def _run_out(engine, steps: int = 40) -> None:
    for _ in range(steps):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work


def _second_once_the_first_decodes(engine, prompts, outs: dict, max_tokens: int = 10) -> None:
    """Submit prompts[0], step until it decodes, then submit prompts[1] (outs[i]: request i's tokens)."""
    from engine.decoding.sequence import Request

    def request(i: int) -> Request:
        return Request(list(prompts[i]), max_tokens=max_tokens, ignore_eos=True,
                       emit=lambda e: outs[i].extend(getattr(e, "token_ids", ())))
    engine.submit(request(0))
    for _ in range(8):
        engine.step()
        if any(len(s.pending) == 1 for s in engine.active.values()):
            break
    engine.submit(request(1))


def test_short_prompts_ride_in_the_decode_pass_of_other_slots(one_thread, monkeypatch):
    """While a slot decodes, a second request's short prompt goes in the free rows of the decode step's
    pass (a mixed pass: rows of both slots in one step_rows call), no prefill pass of its own runs, and
    both requests' greedy outputs are those each gets alone."""
    tok, prompts, alone, runner = _two_prompts()
    passes, forwards = _watch_passes(monkeypatch)
    engine = engine_over(runner, tok)
    assert (engine.mix_rows, engine.min_riders) == (8, 2)
    outs = {0: [], 1: []}
    _second_once_the_first_decodes(engine, prompts, outs)
    assert outs[0], "the first request should decode by now"
    forwards.clear()
    _run_out(engine)
    mixed = [p for p in passes if set(p) == {0, 1} and len(p) > 2]
    assert mixed and mixed[0][0] == 0 and mixed[0][1:] == [1] * 7  # the decode row, then 7 prompt rows
    assert all(index == 0 or n == 1 for index, n in forwards)  # slot 1's prompt ran in no pass of its own
    assert [outs[0], outs[1]] == alone


def test_a_longer_prompt_rides_while_a_slot_decodes_and_runs_eager_when_none_does(one_thread, monkeypatch):
    """A prompt longer than the short prefill (here 8 tokens) but within a chunk: with nobody decoding it runs as
    one eager chunk (its first token sooner); while another slot decodes it rides in the decode passes instead of
    stalling that slot with an eager chunk; both greedy outputs are those each request gets alone."""
    tok, prompts, alone, runner = _two_prompts(short_tokens=8)
    passes, forwards = _watch_passes(monkeypatch)
    engine = engine_over(runner, tok)
    assert engine.short_tokens == 8 and engine.ride_tokens >= len(prompts[1])
    outs = {0: [], 1: []}
    _second_once_the_first_decodes(engine, prompts, outs)
    assert (0, len(PROMPT)) in forwards  # nobody decoding: the whole prompt as one eager chunk
    forwards.clear()
    _run_out(engine)
    assert all(index == 0 or n == 1 for index, n in forwards)  # slot 1's 12 tokens ran in no forward of their own
    assert any(set(p) == {0, 1} and len(p) > 2 for p in passes)  # they rode in slot 0's decode passes
    assert [outs[0], outs[1]] == alone


def test_a_wave_of_short_prompts_shares_passes_before_anyone_decodes(one_thread, monkeypatch):
    """Three requests arriving together, nobody decoding: their prompts share the step's passes (oldest first, a
    pass holding two prompts' rows where one ends), none runs a pass of its own, the first ones decode while the
    others still feed, and every greedy output is the one its request gets alone."""
    from engine.decoding.sequence import Request
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    tok = TinyTokenizer()
    prompts = (PROMPT, PROMPT[::-1] + [9], PROMPT[3:] + [5, 6])
    alone = [run_engine(ModelRunner(loaded, 96, fast_decode=True), tok, p, max_tokens=8, ignore_eos=True)[1]
             for p in prompts]
    runner = ModelRunner(loaded, 96, num_slots=3, fast_decode=True)
    runner.short_prefill_rows = 8
    runner.prepare_rows(8)
    passes, forwards = _watch_passes(monkeypatch)
    engine = engine_over(runner, tok)
    outs = {i: [] for i in range(3)}
    for i, prompt in enumerate(prompts):
        engine.submit(Request(list(prompt), max_tokens=8, ignore_eos=True,
                              emit=lambda e, i=i: outs[i].extend(getattr(e, "token_ids", ()))))
    for _ in range(40):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work
    assert passes[0] == [0] * 8 and passes[1] == [0] * 3 + [1] * 5  # oldest first (its last token too), then the next
    assert not any(n > 1 for _, n in forwards)  # no prompt ran a pass of its own
    assert any(len(set(p)) == 3 for p in passes)  # a decode row of the first next to the others' prompt rows
    assert [outs[0], outs[1], outs[2]] == alone


def _watch_decode_steps(monkeypatch, asked: list, spec_steps: list) -> list:
    """(riders?, gate questions, speculative steps) of every decode step as it runs."""
    from engine.decoding.engine import Engine
    calls, decode_all = [], Engine._decode_all

    def watched(self, riders=()):
        n, k = len(asked), len(spec_steps)
        decode_all(self, riders)
        calls.append((bool(riders), len(asked) - n, len(spec_steps) - k))
    monkeypatch.setattr(Engine, "_decode_all", watched)
    return calls


@pytest.mark.parametrize("gate_speculates", [False, True])
def test_with_drafters_and_the_gate_prompts_ride_in_plain_steps(one_thread, monkeypatch, gate_speculates):
    """Drafters attached, the gate on: a short prompt rides in a decode pass whichever way the gate would go (a step
    with riders is plain, the gate not asked: a prompt's own passes stall the drafting slots for longer), and no
    pass of its own runs for it; either way both requests' greedy outputs are those each gets alone."""
    from engine.decoding.spec_gate import SpecGate
    from engine.speculative.ngram import NgramDrafter
    tok, prompts, alone, runner = _two_prompts()
    asked, spec_steps = [], []
    monkeypatch.setattr(SpecGate, "speculate", lambda self, batch, *cost: asked.append(batch) or gate_speculates)
    monkeypatch.setattr(SpecGate, "peek", lambda self, batch: gate_speculates)
    engine = engine_over(runner, tok, NgramDrafter(1, 3), 4, spec_gate=True)
    assert engine.gate is not None and engine.mix_rows == 8
    monkeypatch.setattr(engine.spec, "step", lambda *a, step=engine.spec.step: spec_steps.append(1) or step(*a))
    outs = {0: [], 1: []}
    _second_once_the_first_decodes(engine, prompts, outs)
    passes, forwards = _watch_passes(monkeypatch)
    calls = _watch_decode_steps(monkeypatch, asked, spec_steps)
    _run_out(engine, 60)
    assert any(r for r, _, _ in calls) and all(index == 0 or n == 1 for index, n in forwards)  # slot 1's prompt rode
    assert all(a == 0 and k == 0 for r, a, k in calls if r)  # a step with riders: plain, the gate not asked
    assert any(k for r, _, k in calls if not r) == gate_speculates
    assert [outs[0], outs[1]] == alone


def test_without_the_gate_drafters_keep_prompts_out_of_their_steps(one_thread, monkeypatch):
    """Drafters that see every step (no gate): no prompt rides (a step with riders is a plain one); the second
    prompt runs passes of its own and both greedy outputs are those each request gets alone."""
    from engine.speculative.ngram import NgramDrafter
    tok, prompts, alone, runner = _two_prompts()
    engine = engine_over(runner, tok, NgramDrafter(1, 3), 4, spec_gate=False)
    assert engine.gate is None and engine.mix_rows == 8
    outs = {0: [], 1: []}
    _second_once_the_first_decodes(engine, prompts, outs)
    passes, forwards = _watch_passes(monkeypatch)
    calls = _watch_decode_steps(monkeypatch, [], [])
    _run_out(engine, 60)
    assert not any(r for r, _, _ in calls) and any(index == 1 and n > 1 for index, n in forwards)
    assert [outs[0], outs[1]] == alone


def test_riders_planned_before_a_prompt_finished_prefill_are_cut_to_the_pass(one_thread):
    """Riders are planned before this iteration's prompt chunks; a prompt that finishes then decodes in the
    same pass, one row more: the riders are re-planned to fit (a pass over its rows failed every request)."""
    from engine.decoding.scheduler import PrefillChunk
    from engine.decoding.sequence import Request
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    runner = ModelRunner(loaded, 96, num_slots=3, fast_decode=True)
    runner.short_prefill_rows = 8
    runner.prepare_rows(8)
    engine = engine_over(runner, TinyTokenizer())
    failed = []
    for prompt in (PROMPT, PROMPT[::-1]):
        engine.submit(Request(list(prompt), max_tokens=30, ignore_eos=True,
                              emit=lambda e: failed.append(e) if type(e).__name__ == "Failed" else None))
    for _ in range(20):
        engine.step()
        if len([s for s in engine.active.values() if len(s.pending) == 1]) == 2:
            break
    third = Request(list(PROMPT) + [4, 4], max_tokens=30, ignore_eos=True)
    engine.submit(third)
    with engine.lock:
        engine._admit()
    slot = next(i for i, s in engine.active.items() if len(s.pending) > 1)
    left = len(engine.active[slot].pending)
    engine._decode_all([PrefillChunk(slot, 7)])  # planned for one decode row: two decode now
    assert len(engine.active[slot].pending) == left - 6 and not failed
    assert all(not s.done for s in engine.active.values())

"""Speculative decoding inside the server's engine loop, on a tiny random model (real SmolLM2
tokenizer): greedy output equal to plain decoding with several slots decoding together, through the
fused multi-slot step and through the plain per-slot path; prefix reuse after speculative steps
(the slot's tokens are exactly what its KV holds); stop strings and max_tokens landing inside an
accepted draft; the thinking budget; draft counters in timings, /metrics and /slots."""
from __future__ import annotations

import time

import pytest
import torch

from engine.decoding.engine import Engine
from engine.decoding.spec_step import split_draft_budget
from engine.runtime.runner import ModelRunner
from engine.speculative.config import SpeculativeConfig
from engine.speculative.drafter import Draft
from engine.speculative.planner import TargetCost
from tests.engine_runs import Threaded, run_engine, spec_engine
from tests.test_serve_engine import collect, submit, tiny_loaded

# repetitive prompts: the n-gram drafter finds continuations in them
PROMPTS = [[1, 504, 3259, 28, 504, 3259, 28, 504], [1, 77, 88, 99, 77, 88, 99, 77], [1, 1203, 284, 253, 1542],
           [1, 5, 6, 5, 6, 5]]
NGRAM = SpeculativeConfig.from_spec("ngram", num_draft_tokens=4, adaptive=False)


@pytest.fixture(scope="module")
def loaded(smollm2_tok):
    return tiny_loaded(smollm2_tok.vocab_size)


class FreeRows(TargetCost):
    """A pass costs the same whatever its rows (as on a GPU at small widths): the joint planner
    keeps every draft, so tests of the batched step see drafts (on the CPU each row costs a pass,
    and the planner would rightly drop them)."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def estimate(self, rows: int) -> float:
        return 1.0


def make_engine(loaded, tok, slots=4, context=96, fused=False, spec=NGRAM, rules=None) -> Threaded:
    runner = ModelRunner(loaded, max_seq_len=context, num_slots=slots, prefill_chunk_size=8, fast_decode=fused)
    engine = (spec_engine(runner, tok, spec, slot_context=context, max_queue=8, rules=rules) if spec is not None
              else Engine(runner, tok, context, max_queue=8, rules=rules))
    if engine.spec is not None:
        engine.spec.pass_cost = FreeRows()
    return Threaded(engine)


def plain(loaded, tok, prompt, max_tokens=24, context=96, **kw) -> tuple[str, list[int], list[int]]:
    """Plain decoding: text, token ids, and the tokens its slot holds at the end."""
    runner = ModelRunner(loaded, max_seq_len=context)
    text, ids, _, _ = run_engine(runner, tok, list(prompt), max_tokens=max_tokens, **kw)
    return text, ids, runner.slot(0).tokens


class Oracle:
    """Drafts the known greedy continuation (every draft is accepted): a stop string or max_tokens
    then lands wherever the test puts it inside a draft."""
    name = "oracle"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, *runs: tuple[list[int], list[int]]):
        self.sequences = [prompt + output for prompt, output in runs]  # (prompt, greedy output) pairs

    def begin(self, prompt):
        pass

    def propose(self, context, k):
        n = len(context)
        [sequence] = [s for s in self.sequences if s[:n] == context]
        return Draft(sequence[n:n + k], source=self.name)

    def observe(self, feedback):
        pass


def idle(engine) -> None:
    """Wait until the engine thread released every slot (it emits Finished before tidying the slot)."""
    deadline = time.time() + 30
    while engine.active and time.time() < deadline:
        time.sleep(0.005)
    assert not engine.active


class Recorder:
    """Wraps a drafter and records what it was begun on and asked to continue; every observe must
    follow a propose (a mix judges its members by the spans of its last proposal)."""

    def __init__(self, drafter):
        self.drafter, self.name, self.hidden_layers = drafter, drafter.name, drafter.hidden_layers
        self.begun: list[list[int]] = []
        self.contexts: list[list[int]] = []
        self.proposed = False

    def begin(self, prompt):
        self.begun.append(list(prompt))
        self.contexts.clear()
        self.drafter.begin(prompt)

    def propose(self, context, k):
        self.contexts.append(list(context))
        self.proposed = True
        return self.drafter.propose(context, k)

    def observe(self, feedback):
        assert self.proposed, "observe without a propose"
        self.proposed = False
        self.drafter.observe(feedback)


def kv_matches_tokens(engine, index: int) -> None:
    """The slot's cached token list is exactly what its KV holds: a fresh prefill of those tokens
    writes the same keys and values."""
    idle(engine)
    slot = engine.runner.slot(index)
    fresh = ModelRunner(engine.runner.loaded, max_seq_len=engine.runner.max_seq_len)
    fresh.prefill(fresh.slot(0), list(slot.tokens))
    n = slot.length
    torch.testing.assert_close(engine.runner.cache.k[:, index, :, :n], fresh.cache.k[:, 0, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.runner.cache.v[:, index, :, :n], fresh.cache.v[:, 0, :, :n], atol=1e-4, rtol=1e-4)


def test_draft_budget_is_split_fairly():
    assert split_draft_budget([4, 4, 4, 4], 12) == [3, 3, 3, 3]
    assert split_draft_budget([4, 0, 4, 1], 7) == [3, 0, 3, 1]  # what one does not want goes to the others
    assert split_draft_budget([4, 4, 4], 7) == [3, 2, 2] and split_draft_budget([4, 4, 4], 7, first=1) == [2, 3, 2]
    assert split_draft_budget([2, 2], 16) == [2, 2] and split_draft_budget([3, 3], 0) == [0, 0]
    assert sum(split_draft_budget([4] * 16, 0)) == 0 and sum(split_draft_budget([4] * 10, 6)) == 6


@pytest.mark.parametrize("fused", [False, True], ids=["per-slot-verify", "fused-step-rows"])
def test_concurrent_greedy_streams_equal_plain_decoding(loaded, smollm2_tok, one_thread, fused):
    engine = make_engine(loaded, smollm2_tok, fused=fused)
    try:
        jobs = [submit(engine, p, max_tokens=24, id=f"r{i}") for i, p in enumerate(PROMPTS)]
        results = [collect(q) for _, q in jobs]
        for p, (text, _, fin) in zip(PROMPTS, results):
            assert text == plain(loaded, smollm2_tok, p)[0]
            assert fin.usage["completion_tokens"] == fin.timings["predicted_n"]
            assert 0 <= fin.timings["draft_n_accepted"] <= fin.timings["draft_n"]
        drafted = sum(fin.timings["draft_n"] for _, _, fin in results)
        accepted = sum(fin.timings["draft_n_accepted"] for _, _, fin in results)
        m = engine.metrics
        assert accepted > 0 and (m.spec_drafted, m.spec_accepted) == (drafted, accepted)
        assert sum(m.spec_drafted_per_position.values()) == drafted
        assert sum(m.spec_accepted_per_position.values()) == accepted
        assert m.decode_rows > m.decode_steps  # slots shared steps
        if fused:
            assert max(engine.runner._row_steps) > 4  # rows of several slots with drafts in one step
            assert max(engine.runner._row_steps) <= 16
        idle(engine)
        info = engine.slots()
        assert sum(s["drafter"]["drafted"] for s in info) == drafted and info[0]["drafter"]["method"] == "ngram"
        for i in range(4):
            kv_matches_tokens(engine, i)
    finally:
        engine.stop()


def test_four_slots_share_fused_steps_of_at_most_16_rows(loaded, smollm2_tok, one_thread, monkeypatch):
    wants = [(p, plain(loaded, smollm2_tok, p, 20)) for p in PROMPTS]
    engine = make_engine(loaded, smollm2_tok, fused=True)
    widths: list[int] = []
    step_rows = engine.runner.step_rows
    monkeypatch.setattr(engine.runner, "step_rows", lambda t, p, s: widths.append(len(t)) or step_rows(t, p, s))
    # rows cost nothing here (FreeRows), so the joint planner keeps every draft the row limit allows
    try:
        for s in engine.spec.slots:
            s.drafter = Oracle(*[(p, ids) for p, (_, ids, _) in wants])
        jobs = [submit(engine, p, max_tokens=20, id=f"r{i}") for i, p in enumerate(PROMPTS)]
        for (_, q), (_, (text, _, _)) in zip(jobs, wants):
            got, _, fin = collect(q)
            assert got == text and fin.timings["draft_n"] == fin.timings["draft_n_accepted"] > 0
        # 4 slots each wanting 1 + 4 rows: 16 rows, the drafts split 3 each
        assert max(widths) == 16 and 20 not in widths
    finally:
        engine.stop()


def test_batched_drafts_are_cut_when_rows_cost_a_whole_pass(loaded, smollm2_tok, one_thread, monkeypatch):
    """The joint planner weighs the shared pass: when every row costs as much as a one-row pass,
    no draft pays, the slots decode one row each, and the output is plain decoding's."""
    wants = [(p, plain(loaded, smollm2_tok, p, 12)) for p in PROMPTS[:3]]
    engine = make_engine(loaded, smollm2_tok, fused=True)
    shapes: list[tuple[int, int]] = []  # (rows, slots) of each fused step
    step_rows = engine.runner.step_rows
    monkeypatch.setattr(engine.runner, "step_rows", lambda t, p, s: shapes.append((len(t), len(set(s)))) or step_rows(t, p, s))
    monkeypatch.setattr(engine.spec, "pass_cost", TargetCost({1: 1.0, 2: 2.0}))
    monkeypatch.setattr(engine.spec.pass_cost, "observe", lambda rows, seconds: None)
    try:
        for s in engine.spec.slots:
            s.drafter = Oracle(*[(p, ids) for p, (_, ids, _) in wants])
        jobs = [submit(engine, p, max_tokens=12, id=f"r{i}") for i, p in enumerate(PROMPTS[:3])]
        for (_, q), (_, (text, _, _)) in zip(jobs, wants):
            got, _, fin = collect(q)
            assert got == text
        shared = [(rows, slots) for rows, slots in shapes if slots > 1]
        assert shared and all(rows == slots for rows, slots in shared)  # one row per slot, no drafts
    finally:
        engine.stop()


def test_more_slots_than_one_fused_step_takes_decode_without_drafts(loaded, smollm2_tok, one_thread):
    engine = make_engine(loaded, smollm2_tok, slots=17, context=32, fused=True)
    try:
        prompts = [[1, 5 + i, 6, 5 + i] for i in range(17)]
        jobs = [submit(engine, p, max_tokens=20, id=f"r{i}") for i, p in enumerate(prompts)]
        for p, (_, q) in zip(prompts, jobs):
            assert collect(q)[0] == plain(loaded, smollm2_tok, p, 20)[0]
    finally:
        engine.stop()


def test_second_turn_reuses_the_prefix_with_speculation_and_two_slots(loaded, smollm2_tok, one_thread):
    engine = make_engine(loaded, smollm2_tok, slots=2, fused=True)
    for s in engine.spec.slots:
        s.drafter = Recorder(s.drafter)
    try:
        jobs = [submit(engine, p, max_tokens=16, id=f"a{i}") for i, p in enumerate(PROMPTS[:2])]
        first = [collect(q) for _, q in jobs]
        assert all(fin.timings["draft_n"] > 0 for _, _, fin in first)
        idle(engine)
        index = next(s.index for s in engine.runner.cache.slots if s.tokens[:len(PROMPTS[1])] == PROMPTS[1])
        # the next turn of conversation 1: its prompt, the answer, and more user tokens
        _, out, _ = plain(loaded, smollm2_tok, PROMPTS[1], 16)
        again = PROMPTS[1] + out + [42, 43]
        text, _, fin = collect(submit(engine, again, max_tokens=16, id="b")[1])
        # plain decoding's slot holds everything but the last token sampled: all of that is reused
        assert fin.timings["cache_n"] == len(PROMPTS[1]) + len(out) - 1
        assert text == plain(loaded, smollm2_tok, again, 16)[0]
        assert engine.scheduler.info(index).cache_hits == 1 and engine.scheduler.info(1 - index).cache_hits == 0
        # the slot's drafter was begun on the whole new prompt and drafts from it, reused prefix included
        recorder = engine.spec.slots[index].drafter
        assert recorder.begun[-1] == again and recorder.contexts[0][:len(again)] == again
        for i in range(2):
            kv_matches_tokens(engine, i)
    finally:
        engine.stop()


@pytest.mark.parametrize("fused", [False, True], ids=["per-slot-verify", "fused-step-rows"])
def test_stop_string_inside_an_accepted_draft_and_max_tokens(loaded, smollm2_tok, one_thread, fused):
    prompt = PROMPTS[2]
    full_text, full, _ = plain(loaded, smollm2_tok, prompt, 30)
    # the first step verifies full[1:5] (all accepted) and the bonus full[5]: a stop string made of
    # full[3]'s text ends the output inside the accepted draft
    stop = smollm2_tok.decode(full[3:4]).strip() or smollm2_tok.decode(full[3:5])
    want_text, _, want_slot = plain(loaded, smollm2_tok, prompt, 30, stop=(stop,))
    assert len(want_text) < len(full_text)
    engine = make_engine(loaded, smollm2_tok, slots=2, fused=fused)
    try:
        for s in engine.spec.slots:
            s.drafter = Oracle((prompt, full))
        text, _, fin = collect(submit(engine, prompt, max_tokens=30, stop=(stop,))[1])
        assert (text, fin.reason) == (want_text, "stop") and fin.timings["draft_n_accepted"] > 0
        idle(engine)
        assert engine.runner.slot(0).tokens == want_slot  # not the accepted drafts after the stop
        kv_matches_tokens(engine, 0)
        # drafts never pass max_tokens: exactly max_tokens tokens, and plain decoding's slot content
        text, _, fin = collect(submit(engine, prompt, max_tokens=7)[1])
        assert (text, fin.reason, fin.usage["completion_tokens"]) == (plain(loaded, smollm2_tok, prompt, 7)[0], "length", 7)
        idle(engine)
        assert engine.runner.slot(0).tokens == prompt + full[:6]
        kv_matches_tokens(engine, 0)
    finally:
        engine.stop()


def test_a_full_context_ends_the_answer_where_plain_decoding_does(loaded, smollm2_tok, one_thread):
    prompt = [1, 2, 3]
    _, full, _ = plain(loaded, smollm2_tok, prompt, 40, context=32)
    engine = make_engine(loaded, smollm2_tok, slots=2, context=32, fused=True)
    try:
        for s in engine.spec.slots:
            s.drafter = Oracle((prompt, full))
        text, _, fin = collect(submit(engine, prompt, max_tokens=40)[1])
        # every position holds a token; the last sampled one needs none
        assert text == plain(loaded, smollm2_tok, prompt, 40, context=32)[0] and fin.reason == "length"
        assert fin.usage["prompt_tokens"] + fin.usage["completion_tokens"] == 33 and fin.timings["draft_n"] > 0
        idle(engine)
        assert engine.runner.slot(0).length == 32
    finally:
        engine.stop()


def test_a_pass_is_timed_without_the_device_work_queued_before_it(loaded, smollm2_tok, one_thread, monkeypatch):
    """A fused verify pass is timed from a settled device: work launched before it (asynchronously on a GPU: this
    iteration's prompt chunks, a dropped step launched ahead) is not billed to it; billed, one pass measured several
    times its cost and the joint planner cut the drafts that needed its row count. Here a clock that moves only
    when the device is waited for, a prompt chunk queueing 10 s of device work and a pass 1 ms a row."""
    import types

    from engine.decoding import spec_step
    clock = {"now": 0.0, "queued": 0.0}

    def sync(device):
        clock["now"] += clock["queued"]
        clock["queued"] = 0.0
    monkeypatch.setattr(spec_step, "_sync", sync)
    monkeypatch.setattr(spec_step, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    want = plain(loaded, smollm2_tok, PROMPTS[0], 12)[1]
    runner = ModelRunner(loaded, max_seq_len=96, num_slots=1, prefill_chunk_size=8, fast_decode=True)
    forward, step_rows = runner.forward, runner.step_rows

    def queued(seconds, run, *args, **kw):
        clock["queued"] += seconds
        return run(*args, **kw)
    monkeypatch.setattr(runner, "forward", lambda *a, **kw: queued(10.0, forward, *a, **kw))
    monkeypatch.setattr(runner, "step_rows", lambda t, p, s: queued(1e-3 * len(t), step_rows, t, p, s))
    engine = spec_engine(runner, smollm2_tok, NGRAM, slot_context=96)
    assert engine.spec is not None and engine.gate is None and runner.decoder is not None
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    _, got, _, _ = generate_text(engine, Request(list(PROMPTS[0]), max_tokens=12))
    assert got == want
    costs = engine.spec.pass_cost.seconds
    assert costs and all(seconds == pytest.approx(1e-3 * rows) for rows, seconds in costs.items())


def test_a_request_caps_or_turns_off_its_own_drafts(loaded, smollm2_tok, one_thread, monkeypatch):
    """Request.draft_tokens (the API's speculative.n_max): 0 decodes that request plainly — no drafts, and a step
    whose every row asks so is the plain step — while another request of the same engine drafts; a cap of 1
    drafts at most one token a step. Outputs stay plain decoding's (the oracle would draft 4 for every slot)."""
    wants = [(p, plain(loaded, smollm2_tok, p, 16)) for p in PROMPTS[:3]]
    engine = make_engine(loaded, smollm2_tok, slots=3, fused=True)
    per_step: list[list[int]] = []  # rows of each slot in each fused speculative step, most first
    step_rows = engine.runner.step_rows
    monkeypatch.setattr(engine.runner, "step_rows", lambda t, p, s: per_step.append(
        sorted((list(s).count(i) for i in set(s)), reverse=True)) or step_rows(t, p, s))
    try:
        for slot in engine.spec.slots:
            slot.drafter = Oracle(*[(p, ids) for p, (_, ids, _) in wants])
        _, q = submit(engine, PROMPTS[0], max_tokens=16, id="alone-off", draft_tokens=0)
        text, _, fin = collect(q)
        assert text == wants[0][1][0] and fin.timings["draft_n"] == 0 and not per_step  # plain steps only
        jobs = [submit(engine, p, max_tokens=16, id=f"r{i}", draft_tokens=cap)
                for i, (p, cap) in enumerate(zip(PROMPTS[:3], (0, None, 1)))]
        results = [collect(q) for _, q in jobs]
        assert [r[0] for r in results] == [text for _, (text, _, _) in wants]
        drafted = [r[2].timings["draft_n"] for r in results]
        assert drafted[0] == 0 and drafted[1] > 0 and drafted[2] > 0
        three = [rows for rows in per_step if len(rows) == 3]  # steps of all three slots: 1 + 4, 1 + 1 and 1 row
        assert three and all(rows[1] <= 2 and rows[2] == 1 for rows in three) and max(r[0] for r in three) == 5
    finally:
        engine.stop()


def test_a_negative_draft_cap_is_refused():
    from engine.decoding.sequence import Request
    from engine.errors import BonsaiError
    with pytest.raises(BonsaiError, match="draft_tokens"):
        Request([1, 2], draft_tokens=-1)

"""The choice between a speculative and a plain decode step (engine.decoding.spec_gate): pure bookkeeping
tested with made-up clocks, and through the engine: switching between the two every step (or at random)
leaves greedy output equal to plain decoding."""
from __future__ import annotations

import random

import pytest

from engine.decoding.spec_gate import SpecGate
from engine.runtime.runner import ModelRunner
from engine.speculative.ngram import NgramDrafter
from tests.engine_runs import run_engine
from tests.test_spec_generate import TinyTokenizer, tiny_loaded


def _feed(gate: SpecGate, rates: dict[bool, float], batch: int, steps: int) -> list[bool]:
    """Run `steps` steps with a clock in which a step generates `batch` tokens at rates[speculated] tok/s."""
    generated, now, chosen = 0, 0.0, []
    for _ in range(steps):
        spec = gate.speculate(batch)
        gate.begin(spec, batch, generated, 0, now)
        chosen.append(spec)
        generated += batch
        now += batch / rates[spec]
    return chosen


def test_the_faster_way_wins_and_the_other_is_retried_ever_less_often():
    gate = SpecGate(every=10, max_every=40)
    chosen = _feed(gate, {True: 100.0, False: 300.0}, batch=8, steps=200)
    # each way measured first (a step is scored when the next begins), speculation first
    assert chosen[:4] == [True, True, False, False]
    # then retried after 10 steps, and after twice as many each time it is still slower (at most 40)
    assert [i + 1 for i, s in enumerate(chosen) if s and i >= 3] == [10, 31, 72, 113, 154, 195]
    assert gate.rates[(False, 8)] == pytest.approx(300.0) and gate.rates[(True, 8)] == pytest.approx(100.0)
    # at another batch size the measurements are separate: here speculation is faster
    chosen = _feed(gate, {True: 500.0, False: 200.0}, batch=1, steps=30)
    assert chosen[:3] == [True, True, False]
    assert [201 + i for i, s in enumerate(chosen) if not s] == [203, 204, 210]  # the next try: 231


def test_a_try_that_finds_the_other_way_faster_switches_and_resets_the_wait():
    gate = SpecGate(every=10)
    _feed(gate, {True: 100.0, False: 300.0}, batch=4, steps=40)
    assert gate.period[4] == 40  # two tries found speculation slower
    chosen = _feed(gate, {True: 900.0, False: 300.0}, batch=4, steps=60)  # the workload changed
    first = chosen.index(True)  # its try (scored when the next step has already been chosen, plainly)
    assert chosen[first + 1:first + 12] == [False] + [True] * 9 + [False]  # kept; plain tried after 10 steps
    assert all(chosen[first + 12:first + 32]) and gate.period[4] == 20  # that try found plain slower: twice as long


def _noisy(gate: SpecGate, rates: dict[bool, float], steps: int, noise: float, seed: int) -> list[bool]:
    """One slot; each step's time off its way's rate by a uniform factor in [1 - noise, 1 + noise] (made-up)."""
    rng = random.Random(seed)
    generated, now, chosen = 0, 0.0, []
    for _ in range(steps):
        spec = gate.speculate(1)
        gate.begin(spec, 1, generated, 0, now)
        chosen.append(spec)
        generated += 1
        now += (1 + rng.uniform(-noise, noise)) / rates[spec]
    return chosen


def test_on_a_cpu_noise_does_not_keep_a_slower_speculation_on():
    """A loaded 2-core machine: steps ±30%, speculation 10% slower. One-step tries (the GPU's settings) let noise
    pick speculation for long stretches; four-step measurements and a 5% margin keep it to the tries."""
    rates = {True: 18.0, False: 20.0}
    gpu = [sum(_noisy(SpecGate(), rates, 2000, 0.3, seed)) for seed in range(5)]
    cpu = [sum(_noisy(SpecGate.for_device("cpu"), rates, 2000, 0.3, seed)) for seed in range(5)]
    assert max(cpu) < 0.05 * 2000 and sum(cpu) < sum(gpu) / 2, (cpu, gpu)
    # and where speculation is 30% faster it is kept (the plain tries aside)
    chosen = _noisy(SpecGate.for_device("cpu"), {True: 26.0, False: 20.0}, 2000, 0.3, 1)
    assert sum(chosen) > 0.93 * 2000


def test_within_the_margin_a_cpu_stays_plain():
    gate = SpecGate.for_device("cpu")
    assert (gate.try_steps, gate.margin) == (4, 0.05)
    assert (SpecGate.for_device("cuda").try_steps, SpecGate.for_device("cuda").margin) == (1, 0.0)
    chosen = _feed(gate, {True: 103.0, False: 100.0}, batch=1, steps=400)
    assert chosen[:5] == [True] * 5 and not any(chosen[10:31])  # each way measured over 4 steps, then plain
    tries = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    assert all(chosen[i:i + 4] == [True] * 4 and not chosen[i + 4] for i in tries[1:])  # each try: 4 steps
    assert sum(chosen) < 0.15 * 400


def test_peek_says_what_the_next_step_will_choose_without_counting_it():
    gate = SpecGate(every=10)
    _feed(gate, {True: 100.0, False: 300.0}, batch=8, steps=8)
    for _ in range(5):
        steps, expected = gate.steps, gate.peek(8)
        assert gate.steps == steps and gate.speculate(8) == expected


def test_steps_with_prompt_chunks_are_not_scored():
    gate = SpecGate()
    gate.begin(True, 4, 0, 0, 0.0)
    gate.begin(True, 4, 8, 1, 10.0)  # a prompt chunk ran in between: not scored
    assert (True, 4) not in gate.rates
    # nor the step whose own iteration ran that chunk just before it began: launched asynchronously, the chunk's
    # device time lands in the step's window (speculative steps, after which prompts ran their own chunks, were
    # scored several times slower than they ran)
    gate.begin(False, 4, 12, 1, 30.0)
    assert (True, 4) not in gate.rates
    gate.begin(False, 4, 16, 1, 31.0)  # a step with no chunk in its iteration or its window
    gate.begin(True, 4, 24, 1, 33.0)
    assert gate.rates == {(False, 4): pytest.approx(4.0)}
    gate.begin(True, 4, 36, 1, 34.0)
    assert gate.rates[(True, 4)] == pytest.approx(12.0)


@pytest.mark.parametrize("lookahead", [False, True])  # on: as on a GPU (a plain step launches the next one)
@pytest.mark.parametrize("policy", ["alternate", "random"])
def test_switching_leaves_greedy_output_unchanged(one_thread, monkeypatch, policy, lookahead):
    loaded = tiny_loaded(scale=0.6)
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    tok = TinyTokenizer()
    _, want, _, _ = run_engine(ModelRunner(loaded, 96), tok, prompt, max_tokens=40, ignore_eos=True)
    rng = random.Random(3)
    calls = []

    def speculate(self, batch, backlog=0, left=0):
        calls.append(batch)
        return len(calls) % 2 == 1 if policy == "alternate" else rng.random() < 0.5
    monkeypatch.setattr(SpecGate, "speculate", speculate)
    from tests.engine_runs import engine_over
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    runner = ModelRunner(loaded, 96)
    engine = engine_over(runner, tok, NgramDrafter(1, 3), 4, spec_gate=True, lookahead=lookahead)
    assert engine.gate is not None and (engine.ahead is not None) == lookahead
    _, got, _, stats = generate_text(engine, Request(list(prompt), max_tokens=40, ignore_eos=True))
    assert got == want and len(calls) > 10 and stats.speculative.drafted > 0
    assert runner.slot(0).tokens == prompt + want[:-1]  # the slot holds what plain decoding leaves


def test_batch_sizes_of_one_class_share_their_measurements():
    """At 8 slots the batch size moves between 5 and 8 as requests end and begin: one class (5-8), so plain
    decoding, measured faster once, is kept (per exact size each size was tried both ways again)."""
    from engine.decoding.spec_gate import size_class
    assert [size_class(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    gate = SpecGate(every=1000)
    generated, now, chosen = 0, 0.0, []
    rates = {True: 100.0, False: 300.0}
    for i in range(40):
        batch = (8, 7, 6, 5)[i % 4]
        spec = gate.speculate(batch)
        gate.begin(spec, batch, generated, 0, now)
        chosen.append(spec)
        generated += batch
        now += batch / rates[spec]
    assert chosen[:4] == [True, True, False, False]  # each way measured once for the class, then plain
    assert not any(chosen[4:])
    assert set(gate.rates) == {(True, 8), (False, 8)}


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_run_gates_adaptive_speculation_on_the_cpu_too(one_thread, smollm2_gguf, tmp_path, adaptive):
    """With adaptive speculation a run's engine has the gate on any device (on a CPU whose plain steps run the
    int4 kernels, the 0.5B drafter costs more than it saves: docs/perf.md session 17); fixed-length does not."""
    from gguf import GGMLQuantizationType as T

    from engine.run.builder import open_run
    from engine.run.config import RunConfig
    from tests.gguf_tiny import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_gguf, T.Q4_0)
    config = RunConfig.from_dict({"model": {"path": str(path)}, "runtime": {"decode_algorithm": "speculative"},
                                  "speculative": {"method": "ngram", "adaptive": adaptive}})
    run = open_run(config)
    try:
        engine = run.engine()
        assert (engine.gate is not None) == adaptive and engine.spec is not None
        assert engine.gate is None or engine.gate.try_steps == 4  # the CPU's settings (SpecGate.for_device)
        assert run.loaded.int4_layers > 0  # the CPU default: the Q4_0 matrices as stored
    finally:
        run.close()


def test_time_a_drafter_spent_catching_up_is_left_out_of_the_step():
    gate = SpecGate()
    gate.begin(True, 1, 0, 0, 0.0)
    gate.exclude(3.0)  # the drafter fed the prompt: 3 of the step's 4 seconds
    gate.begin(True, 1, 4, 0, 4.0)
    assert gate.rates[(True, 1)] == pytest.approx(4.0)  # 4 tokens in the step's own second
    gate.exclude(0.0)
    gate.begin(False, 1, 5, 0, 5.0)
    assert gate.rates[(True, 1)] == pytest.approx(0.7 * 4.0 + 0.3 * 1.0)


def test_a_speculative_step_reports_its_drafters_catch_up(one_thread):
    """The engine's speculative step returns the seconds its drafters spent feeding tokens they had not seen:
    the whole prompt at the first step, nothing once they draft every step."""
    from engine.decoding.engine import Engine
    from engine.decoding.sequence import Request
    from engine.speculative.draft_model import DraftModelDrafter
    from engine.speculative.mix import MixDrafter
    from tests.test_spec_generate import PROMPT, perturbed
    loaded = tiny_loaded()
    drafter = MixDrafter([DraftModelDrafter(perturbed(loaded, 0.02), loaded.config.vocab_size, 96)], adaptive=False)
    engine = Engine(ModelRunner(loaded, 96), TinyTokenizer(), drafters=[drafter], num_draft_tokens=3)
    excluded: list[float] = []

    backlogs: list[int] = []

    class Always(SpecGate):  # every step speculates; what it is told to leave out is recorded
        def speculate(self, batch: int, backlog: int = 0, left: int = 0) -> bool:
            backlogs.append(backlog)
            return True

        def peek(self, batch: int) -> bool:
            return True

        def exclude(self, seconds: float, tokens: int = 0) -> None:
            excluded.append((seconds, tokens))

    engine.gate = Always()
    engine.submit(Request(list(PROMPT), max_tokens=12, ignore_eos=True))
    while engine.has_work:
        engine.step()
    assert excluded[0][0] > 0 and drafter.catch_up_seconds == 0.0
    assert excluded[0][1] == backlogs[0] >= len(PROMPT)  # the prompt: told beforehand, then fed
    assert all(x == (0.0, 0) for x in excluded[2:]) and not any(backlogs[2:])  # then a step's own two tokens at most


def _measured(rates: dict[bool, float]) -> SpecGate:
    """A CPU's gate with both ways measured at `rates` (one slot) and a feed of 10 ms a token."""
    gate = SpecGate.for_device("cpu")
    _feed(gate, rates, batch=1, steps=12)
    gate.exclude(1.0, 100)
    assert gate.feed == pytest.approx(0.01) and gate._measured(True, 1) and gate._measured(False, 1)
    return gate


def test_speculation_that_cannot_win_back_its_drafters_catch_up_stays_plain():
    """Speculation measured 10% faster: feeding a 200-token prompt (2 s) first is worth it for 10,000 tokens left
    (~9 s saved), not for 50 (~0.05 s); a backlog a drafter feeds within a step costs nothing."""
    gate = _measured({True: 110.0, False: 100.0})
    assert gate.speculate(1) and gate.speculate(1, backlog=200, left=10_000)
    assert not gate.speculate(1, backlog=200, left=50)
    assert gate.speculate(1, backlog=0, left=50)


def test_a_try_of_the_slower_speculation_spends_little_on_catching_up():
    """Speculation measured slower: its try is declined while the catch-up would cost more than TRY_SHARE of the
    tokens left at plain speed, and runs once they are many (a workload may have changed)."""
    gate = _measured({True: 90.0, False: 100.0})
    due = gate.retry_at[1]
    while gate.steps + 1 < due:
        assert not gate.speculate(1, backlog=200, left=10_000)
    assert not gate.speculate(1, backlog=200, left=100)  # 2 s against 5% of 1 s
    assert gate.speculate(1, backlog=200, left=10_000)  # 2 s against 5% of 100 s: the try begins
    assert gate.speculate(1, backlog=200, left=10)  # and runs its steps (4 on a CPU)


def test_a_mix_held_back_drafts_without_catching_its_model_member_up():
    """Where the gate finds a catch-up not worth it, a mix of n-gram lookup and a draft model that lags drafts by
    lookup alone: its model member feeds nothing (told in O(1) by its backlog) and proposes nothing."""
    from engine.speculative.draft_model import DraftModelDrafter
    from engine.speculative.mix import MixDrafter
    from tests.test_spec_generate import PROMPT, perturbed
    loaded = tiny_loaded()
    model = DraftModelDrafter(perturbed(loaded, 0.02), loaded.config.vocab_size, 96)
    mix = MixDrafter([NgramDrafter(1, 3), model], adaptive=False)
    mix.begin(list(PROMPT))
    context = list(PROMPT) + [5, 17]  # "5 17" seen before: lookup drafts
    assert mix.backlog(len(context)) == len(context) and mix.least_backlog(len(context)) == 0
    mix.hold_back = True
    draft = mix.propose(context, 3)
    assert draft.tokens and draft.source != model.name
    assert mix.catch_up_tokens == 0 and model.runner.slot(0).length == 0
    mix.hold_back = False
    mix.propose(context, 3)
    assert mix.catch_up_tokens == len(context) and model.backlog(len(context) + 2) == 0  # fed: caught up

"""Multi-turn chat on the real SmolLM2: history, prefix reuse through the KV slot, reset, the
context policy (the oldest turns leave the history once the prompt outgrows the context)."""
from __future__ import annotations

import pytest

from engine.decoding.chat import ChatSession
from engine.decoding.engine import Engine
from engine.decoding.sampling import SamplingParams
from engine.runtime.runner import ModelRunner
from tests.engine_runs import run_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded(smollm2_loaded):
    return smollm2_loaded


def answer(session: ChatSession, text: str) -> str:
    return "".join(e.text for e in session.send(text, 24, SamplingParams()))


def test_second_turn_reuses_the_first_turns_cache(loaded):
    runner = ModelRunner(loaded, max_seq_len=1024)
    session = ChatSession(Engine(runner, loaded.tokenizer), system="You are terse.")
    first = answer(session, "My name is Ada. Say hello.")
    first_prompt = session.last_stats.prompt_tokens
    assert session.last_stats.cached_tokens == 0 and first
    answer(session, "What is my name?")
    stats = session.last_stats
    assert stats.cached_tokens >= first_prompt  # the whole first turn came from the cache
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_reused_prefix_gives_the_same_tokens_as_a_fresh_cache(loaded):
    request = dict(max_tokens=16)
    prompt_a = loaded.tokenizer.encode("The first law of thermodynamics states that")
    prompt_b = prompt_a + loaded.tokenizer.encode(" energy")
    warm = ModelRunner(loaded, max_seq_len=256)
    run_engine(warm, loaded.tokenizer, prompt_a, **request)
    _, reused, _, stats = run_engine(warm, loaded.tokenizer, prompt_b, **request)
    assert stats.cached_tokens == len(prompt_a)
    _, fresh, _, _ = run_engine(ModelRunner(loaded, max_seq_len=256), loaded.tokenizer, prompt_b, **request)
    assert reused == fresh


def test_reset_forgets_history_and_cache(loaded):
    runner = ModelRunner(loaded, max_seq_len=512)
    session = ChatSession(Engine(runner, loaded.tokenizer))
    answer(session, "Hello!")
    session.reset()
    assert session.messages == [] and runner.slot().length == 0


def test_the_oldest_turns_leave_a_history_that_outgrows_the_context(loaded):
    session = ChatSession(Engine(ModelRunner(loaded, max_seq_len=160), loaded.tokenizer), compress_at=0.5)
    for i in range(4):
        answer(session, f"Tell me fact number {i} about the sea.")
    assert len(session.messages) < 8 and session.messages[-2]["content"] == "Tell me fact number 3 about the sea."
    assert session.last_stats.prompt_tokens <= 80


def test_prompt_longer_than_the_context_is_a_clear_error(loaded):
    from engine.errors import BonsaiError
    runner = ModelRunner(loaded, max_seq_len=16)
    ids = loaded.tokenizer.encode("word " * 40)
    with pytest.raises(BonsaiError, match="the context holds 16"):
        run_engine(runner, loaded.tokenizer, ids, max_tokens=4)


def test_generation_stops_with_length_at_the_end_of_the_context(loaded):
    runner = ModelRunner(loaded, max_seq_len=24)
    ids = loaded.tokenizer.encode("Count: 1, 2, 3, 4,")
    _, out, finish, _ = run_engine(runner, loaded.tokenizer, ids, max_tokens=100, ignore_eos=True)
    assert finish == "length" and len(ids) + len(out) == 24 + 1  # the last token is sampled, never fed

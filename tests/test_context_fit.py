"""Issue 24, class 2: fitting a conversation to the context is bounded work. The old policy dropped
one turn at a time and re-rendered the whole history after each drop (1,000 one-word messages: 11 s,
10,000: ~20 minutes). Now: the same answer as that policy (checked against it on random
conversations), found with a few renders near the answer; the request edge caps messages and
characters (400) before any template or tokenizer work."""
from __future__ import annotations

import random

import pytest

from engine.errors import BonsaiError
from engine.decoding.context_policy import fit_conversation


def reference_fit(messages, count, context, compress_at=0.9):
    """The old policy, turn by turn (the specification the fast one must match)."""
    threshold = int(compress_at * context)
    n = count(messages)
    if n <= threshold:
        return messages, n, 0
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    system, history = messages[:head], messages[head:]
    dropped = 0
    while len(history) > 1 and n > threshold:
        cut = 1
        while cut < len(history) - 1 and history[cut]["role"] != "user":
            cut += 1
        history = history[cut:]
        dropped += cut
        n = count(system + history)
    if n > threshold and n >= context:
        return None
    return system + history, n, dropped


class Counter:
    """A template that costs 3 tokens per message, 5 for the frame, and one per word; it records the
    messages it was asked to render (the work)."""

    def __init__(self):
        self.rendered = 0
        self.calls = 0

    def __call__(self, msgs) -> int:
        self.calls += 1
        self.rendered += len(msgs)
        return 5 + sum(3 + len(m["content"].split()) for m in msgs)


def words(m) -> int:
    return len(m["content"].split()) + 3


def random_conversation(rng: random.Random, n: int) -> list[dict]:
    out = [{"role": "system", "content": "be brief " * rng.randint(0, 5)}] if rng.random() < 0.5 else []
    roles = ["user", "assistant", "tool"]
    for i in range(n):
        role = "user" if i == n - 1 or i % 2 == 0 else rng.choice(roles[1:])
        out.append({"role": role, "content": "w " * rng.randint(0, 40)})
    return out


@pytest.mark.parametrize("estimate", [None, words, lambda m: words(m) // 3, lambda m: 3 * words(m), lambda m: 1])
def test_the_fast_fit_gives_the_turn_by_turn_answer(estimate):
    rng = random.Random(5)
    for trial in range(300):
        msgs = random_conversation(rng, rng.randint(1, 60))
        context = rng.randint(8, 900)
        compress_at = rng.choice([0.5, 0.9, 1.0])
        want = reference_fit(msgs, Counter(), context, compress_at)
        if want is None:
            with pytest.raises(BonsaiError, match="context holds"):
                fit_conversation(msgs, Counter(), context, compress_at, estimate=estimate)
            continue
        got = fit_conversation(msgs, Counter(), context, compress_at, estimate=estimate)
        assert (got.messages, got.prompt_tokens, got.dropped) == want, (trial, len(msgs), context)


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_ten_thousand_messages_cost_a_few_renders_near_the_answer(n):
    """The issue's case: n one-word messages into a 256-token context."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word"} for i in range(n + 1)]
    count = Counter()
    fitted = fit_conversation(msgs, count, 256, 0.9, estimate=words)
    assert fitted.prompt_tokens <= 230 and fitted.dropped > n - 100
    kept = len(fitted.messages)
    assert count.calls <= 6 and count.rendered <= 6 * kept, (count.calls, count.rendered, kept)


def test_without_an_estimate_the_work_is_n_log_n():
    n = 10_000
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word"} for i in range(n + 1)]
    count = Counter()
    fit_conversation(msgs, count, 256, 0.9)
    assert count.calls <= 2 * n.bit_length() + 2 and count.rendered <= 2 * n * n.bit_length(), count.rendered


def test_a_conversation_that_fits_is_rendered_once():
    msgs = random_conversation(random.Random(1), 20)
    count = Counter()
    fitted = fit_conversation(msgs, count, 10_000, estimate=words)
    assert fitted.messages is msgs and fitted.dropped == 0 and count.calls == 1


def test_chat_prompt_renders_only_near_the_answer(smollm2_tok, monkeypatch):
    """Through the real template and tokenizer: 10,000 one-word messages into a 256-token context."""
    from engine.decoding.prompts import chat_prompt
    rendered = []
    render = smollm2_tok.apply_chat_template
    monkeypatch.setattr(smollm2_tok, "apply_chat_template", lambda msgs, **kw: rendered.append(len(msgs)) or
                        render(msgs, **kw))
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word"} for i in range(10_001)]
    prompt = chat_prompt(smollm2_tok, msgs, 256, 0.9, "<think>")
    assert 150 < len(prompt.ids) <= 230 and prompt.dropped_messages > 9_900
    kept = len(msgs) - prompt.dropped_messages
    assert len(rendered) <= 8 and max(rendered) <= 2 * kept, rendered  # few renders, none of the whole history


@pytest.fixture(scope="module")
def capped(tiny_engine_model, smollm2_tok):
    from tests.serve_inproc import tiny_server
    app, engine = tiny_server(tiny_engine_model, smollm2_tok, max_messages=50,
                              max_prompt_chars=2_000)
    yield app
    engine.stop()


@pytest.mark.parametrize("path, body, key", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 51}, "server.max_messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 2_001}]}, "server.max_prompt_chars"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 700}] * 3}, "server.max_prompt_chars"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 1_001}] * 2}]},
     "server.max_prompt_chars"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "a", "reasoning_content": "b" * 2_000}]},
     "server.max_prompt_chars"),
    ("/v1/completions", {"prompt": "a" * 2_001}, "server.max_prompt_chars"),
    ("/v1/completions", {"prompt": ["a" * 2_001]}, "server.max_prompt_chars"),
])
def test_the_edge_caps_messages_and_characters(capped, path, body, key):
    from tests.serve_inproc import call
    r = call(capped, [("POST", path, body)])[0]
    assert r.status_code == 400 and key in r.json()["error"]["message"], r.text


def test_under_the_caps_a_long_conversation_is_fitted_and_served(capped, one_thread):
    from tests.serve_inproc import call
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "one two three"} for i in range(49)]
    r = call(capped, [("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})])[0]
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= 96 * 0.9

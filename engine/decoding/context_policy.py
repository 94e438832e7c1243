"""What to do when a conversation outgrows its slot's context: pure, tested without a model.

Nothing happens below `compress_at` of the context (users report engines that compress at 20-30%
of the window and then loop). Above it, the oldest turns go, whole turns at a time, until the
prompt is back under the threshold; the system messages and the current turn always stay. When
even that does not fit, the request is refused (the caller answers 400).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from engine.errors import BonsaiError

log = logging.getLogger(__name__)


@dataclass
class Fitted:
    messages: list[dict[str, Any]]
    prompt_tokens: int
    dropped: int  # messages removed from the front of the history


def fit_conversation(messages: list[dict[str, Any]], count_tokens: Callable[[list[dict[str, Any]]], int],
                     context: int, compress_at: float = 0.9) -> Fitted:
    """Drop the oldest turns while the prompt is longer than compress_at * context.

    The system messages at the start and the last message (the current turn) are kept; a turn is a
    user message with the assistant (and tool) messages after it, so roles keep alternating.
    """
    threshold = int(compress_at * context)
    n = count_tokens(messages)
    if n <= threshold:
        return Fitted(messages, n, 0)
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    system, history = messages[:head], messages[head:]
    before = n
    dropped = 0
    while len(history) > 1 and n > threshold:
        cut = 1
        while cut < len(history) - 1 and history[cut].get("role") != "user":
            cut += 1  # the rest of the oldest turn
        history = history[cut:]
        dropped += cut
        n = count_tokens(system + history)
    if n > threshold and n >= context:
        raise BonsaiError(f"the prompt has {n} tokens (system messages and the last message alone) but a slot's "
                          f"context holds {context}: shorten it or raise model.max_context")
    if dropped:
        log.info("context policy: the prompt had %d tokens, over %.0f%% of the %d-token context; dropped the %d "
                 "oldest messages (kept the system prompt and the current turn), now %d tokens",
                 before, 100 * compress_at, context, dropped, n)
    return Fitted(system + history, n, dropped)

"""What to do when a conversation outgrows its slot's context: pure, tested without a model.

Nothing happens below `compress_at` of the context (users report engines that compress at 20-30%
of the window and then loop). Above it, the oldest turns go, whole turns at a time, until the
prompt is back under the threshold; the system messages and the current turn always stay. When
even that does not fit, the request is refused (the caller answers 400).

The answer is the fewest whole turns whose dropping brings the prompt under the threshold (what
dropping them one by one and counting again after each would give, when dropping more never makes
the prompt longer). It is found without rendering the whole history after each drop: an estimate
of each message's tokens, summed from the newest back, guesses where to cut; renders of the
conversation from a cut on then check it (the estimates rescaled once to the first render's
count), galloping from the guess and halving: a few renders of about the threshold's size when
the guess is close, O(log n) when it is not, never one per dropped turn.
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
                     context: int, compress_at: float = 0.9,
                     estimate: Callable[[dict[str, Any]], int] | None = None) -> Fitted:
    """Drop the oldest turns while the prompt is longer than compress_at * context.

    The system messages at the start and the last message (the current turn) are kept; a turn is a
    user message with the assistant (and tool) messages after it, so roles keep alternating.
    count_tokens: the prompt tokens of some messages (rendered by the template); estimate: a guess
    of one message's share of them (None: no guess, start from the whole conversation).
    """
    threshold = int(compress_at * context)
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    system, history = messages[:head], messages[head:]
    # where the kept history may start: 0 (drop nothing), each later user message, the last message
    starts = [0] + [i for i in range(1, len(history) - 1) if history[i].get("role") == "user"]
    if len(history) > 1:
        starts.append(len(history) - 1)
    counts: dict[int, int] = {}

    def fits(k: int) -> bool:
        if k not in counts:
            counts[k] = count_tokens(messages if k == 0 else system + history[starts[k]:])
        return counts[k] <= threshold

    guess = 0
    if estimate is not None:
        cache: dict[int, int] = {}  # history index → its estimate

        def share(i: int) -> int:
            if i not in cache:
                cache[i] = estimate(history[i])
            return cache[i]

        base = sum(estimate(m) for m in system)
        guess = _guess(base, share, len(history), starts, threshold, 1.0)
        fits(guess)  # measured once: the estimates scaled to it point close to the answer
        estimated = base + sum(share(i) for i in range(starts[guess], len(history)))
        guess = _guess(base, share, len(history), starts, threshold, counts[guess] / max(estimated, 1))
    k = _first_fitting(fits, guess, len(starts) - 1)
    n = counts[k]
    if n > threshold and n >= context:
        raise BonsaiError(f"the prompt has {n} tokens (system messages and the last message alone) but a slot's "
                          f"context holds {context}: shorten it or raise model.max_context")
    if k == 0:
        return Fitted(messages, n, 0)
    dropped = starts[k]
    log.info("context policy: the prompt had more than %d tokens, over %.0f%% of the %d-token context; dropped the "
             "%d oldest messages (kept the system prompt and the current turn), now %d tokens",
             threshold, 100 * compress_at, context, dropped, n)
    return Fitted(system + history[dropped:], n, dropped)


def _guess(base: int, share: Callable[[int], int], n: int, starts: list[int], threshold: int, scale: float) -> int:
    """The index into `starts` of the longest kept history whose estimate (system messages `base`,
    history message i `share(i)`, all times `scale`) fits the threshold. Only the newest messages are
    estimated (until the sum passes the threshold)."""
    total = base * scale
    first = n  # the oldest history message still inside the estimated budget
    while first > 0 and total + share(first - 1) * scale <= threshold:
        first -= 1
        total += share(first) * scale
    return next((k for k, s in enumerate(starts) if s >= first), len(starts) - 1)


def _first_fitting(fits: Callable[[int], bool], guess: int, last: int) -> int:
    """The smallest k in 0..last with fits(k) (fits is monotone: once true, true for every larger
    k), or `last` when none fits; fits(k) has been called for the k returned. Gallops from the
    guess, then halves the gap."""
    if fits(guess):
        ok, step = guess, 1
        bad = -1  # below every k: "does not fit"
        while ok - step >= 0:
            if not fits(ok - step):
                bad = ok - step
                break
            ok, step = ok - step, step * 2
    else:
        bad, step = guess, 1
        while bad < last:
            probe = min(bad + step, last)
            if fits(probe):
                break
            bad, step = probe, step * 2
        else:
            return last
        ok = probe
    while ok - bad > 1:
        mid = (bad + ok) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok

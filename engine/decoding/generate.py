"""Offline generation: one request through the engine, as a stream of events (submit, then step).

`bonsai generate`, `bonsai chat`, the bench's suites and -p/-n runs, and the drafter trainer's data
and acceptance all take this path: the same end rules, penalties, speculation and vocabulary cut
as the server, which drives the same engine with many requests from its thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.decoding.engine import Engine
from engine.decoding.sequence import Delta, Failed, Request
from engine.decoding.stats import GenerationStats
from engine.errors import BonsaiError


@dataclass
class GenerationEvent:
    """What one engine step gave the request: its new token(s), the text they completed (the answer,
    and the thought when the request splits reasoning), and, last, why it ended."""
    token_ids: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
    reasoning: str = ""
    logprobs: list[dict] = field(default_factory=list)


def generate(engine: Engine, request: Request) -> Iterator[GenerationEvent]:
    """Submit `request` and step the engine until it ends, yielding an event per step that gave it
    tokens or text. A failure of the request is raised (BonsaiError, one line). Leaving the loop
    early cancels the request (its slot keeps what it has cached)."""
    events: list = []
    request.emit = events.append
    engine.submit(request)
    finished, stats = False, None
    try:
        while not finished:
            engine.step()
            if not events:
                assert engine.has_work, f"request {request.id!r} left the engine without an end event"
                continue
            end = events[-1] if not isinstance(events[-1], Delta) else None
            deltas = events[:-1] if end is not None else events
            events = []
            request.emit = events.append
            if isinstance(end, Failed):
                raise BonsaiError(end.message)
            finished = end is not None
            stats = end.stats if finished else stats or _stats_of(engine, request)
            yield GenerationEvent([t for d in deltas for t in d.token_ids], "".join(d.content for d in deltas), stats,
                                  end.reason if finished else None, "".join(d.reasoning for d in deltas),
                                  [x for d in deltas for x in d.logprobs])
    finally:
        if not finished:
            engine.cancel(request)
            engine.step()  # the slot is released now


def generate_text(engine: Engine, request: Request) -> tuple[str, list[int], str, GenerationStats]:
    """Run the stream to its end: (text, token ids, finish reason, stats)."""
    pieces: list[str] = []
    ids: list[int] = []
    finish, stats = "length", GenerationStats()
    for event in generate(engine, request):
        pieces.append(event.text)
        ids.extend(event.token_ids)
        stats = event.stats
        finish = event.finish_reason or finish
    return "".join(pieces), ids, finish, stats


def _stats_of(engine: Engine, request: Request) -> GenerationStats:
    """The live counters of the request (kept by its Sequence while it runs)."""
    return next(seq.stats for seq in engine.active.values() if seq.request is request)

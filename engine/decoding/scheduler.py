"""Slots and the waiting queue: plain bookkeeping (no torch), tested without a model.

A slot is one row of the KV cache with the token ids it holds. A slot that finished a request keeps
its tokens cached; the next request goes to the free slot whose cached tokens share the longest
prefix with its prompt (ties: the slot idle the longest, so recently used caches survive), and that
prefix is not computed again. Requests beyond the free slots wait in a bounded FIFO queue; beyond
the queue they are refused (the server answers 503 with Retry-After).

`plan_prefill` decides the prompt work of one engine iteration: whole chunks, oldest request first,
within a token budget, so the decoding slots step again after at most that many prefill tokens.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class CachedSlot(Protocol):
    """What the scheduler needs of a KV slot (engine.runtime.kv_cache.KVSlot has it)."""
    index: int
    capacity: int
    tokens: list[int]

    def rewind(self, n: int) -> None:
        """Forget the last n tokens (a hybrid slot also puts back its DeltaNet state from a saved point)."""


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: all slots are working and {waiting} requests are waiting; "
                         f"retry in {retry_after} s")
        self.retry_after = retry_after


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _kept(slot: CachedSlot, prompt: list[int]) -> int:
    """Prompt tokens a slot can keep: the common prefix, one token short of the prompt at most, cut to a
    length the slot can go back to (a hybrid model's DeltaNet state: all of it, a saved prefix point, or nothing:
    HybridSlot.keepable)."""
    n = max(min(common_prefix(slot.tokens, prompt), len(prompt) - 1), 0)
    keepable = getattr(slot, "keepable", None)
    return keepable(n) if keepable is not None else n


R = TypeVar("R")


@dataclass
class SlotInfo(Generic[R]):
    slot: CachedSlot
    request: R | None = None
    last_used: int = 0  # tick of the last release (LRU among equally good slots)
    requests_served: int = 0
    cache_hits: int = 0  # requests that reused part of this slot's cache


@dataclass
class Assignment(Generic[R]):
    request: R
    slot: CachedSlot
    reused: int  # prompt tokens whose cached KV stays (the slot was rewound to this length)


@dataclass
class Scheduler(Generic[R]):
    slots: list[CachedSlot]
    max_queue: int = 16
    retry_after: int = 1
    _info: list[SlotInfo] = field(init=False)
    _queue: deque = field(init=False, default_factory=deque)
    _ticks: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        assert self.slots, "at least one slot"
        self._info = [SlotInfo(s) for s in self.slots]

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> int:
        return sum(i.request is not None for i in self._info)

    def info(self, index: int) -> SlotInfo:
        return self._info[index]

    def submit(self, request: R, prompt: list[int]) -> None:
        """Queue a request (its prompt ids decide its slot). Raises QueueFull when no room is left."""
        free = len(self._info) - self.busy
        if len(self._queue) >= self.max_queue + free:  # requests for free slots only pass through
            raise QueueFull(len(self._queue), self.retry_after)
        self._queue.append((request, prompt))

    def drop_waiting(self, predicate) -> list[R]:
        """Remove the waiting requests for which predicate(request) is true (clients gone)."""
        gone = [r for r, _ in self._queue if predicate(r)]
        if gone:
            self._queue = deque(item for item in self._queue if not predicate(item[0]))
        return gone

    def assign(self) -> list[Assignment[R]]:
        """Give waiting requests (first come, first served) the free slot with the longest cached
        prefix of their prompt, and rewind that slot to the part of the prefix kept: at least one
        prompt token is always left to compute (its logits start the answer)."""
        out: list[Assignment[R]] = []
        while self._queue:
            free = [i for i in self._info if i.request is None]
            if not free:
                break
            request, prompt = self._queue.popleft()
            best = max(free, key=lambda i: (_kept(i.slot, prompt), -i.last_used))
            reused = _kept(best.slot, prompt)
            best.slot.rewind(len(best.slot.tokens) - reused)  # not a bare cut: a hybrid restores its state there
            best.request = request
            best.requests_served += 1
            best.cache_hits += reused > 0
            out.append(Assignment(request, best.slot, reused))
        return out

    def release(self, slot: CachedSlot) -> None:
        """The slot's request ended; its tokens stay cached for the next request."""
        info = self._info[slot.index]
        assert info.request is not None, f"slot {slot.index} is not busy"
        info.request = None
        info.last_used = next(self._ticks)

    def drain(self) -> list[R]:
        """Empty the queue (shutdown): the requests that were waiting."""
        items = [r for r, _ in self._queue]
        self._queue.clear()
        return items


@dataclass(frozen=True)
class PrefillChunk:
    slot: int
    size: int  # prompt tokens fed in one forward


def plan_prefill(waiting: list[tuple[int, int, int]], budget: int | None) -> list[PrefillChunk]:
    """The prefill forwards of one engine iteration, run before its decode step.

    waiting: (slot, tokens it still has to feed, its chunk) of the requests still prefilling, oldest
    first; a request with one token left decodes instead (that token's logits start its answer, in the
    batched step). Each prompt is cut in chunks of its `chunk` tokens (its last one shorter; the engine
    picks a chunk from the prompt alone): the same cuts whatever else runs, so a request's output does not
    depend on the load. Whole chunks go out first come, first served while their sum fits `budget`, and
    at least one chunk runs, so prefill always moves; the decoding slots then wait for at most
    max(budget, chunk) prefill tokens. budget None (no slot is decoding, so nobody waits): one chunk for
    every waiting request."""
    assert budget is None or budget >= 1
    out: list[PrefillChunk] = []
    spent = 0
    for slot, left, chunk in waiting:
        assert chunk >= 1
        while left > 1:
            size = min(chunk, left)
            if budget is None:
                out.append(PrefillChunk(slot, size))
                break
            if out and spent + size > budget:
                return out
            out.append(PrefillChunk(slot, size))
            spent += size
            left -= size
    return out


def plan_riders(decoding: int, waiting: list[tuple[int, int]], rows: int, min_free: int) -> list[PrefillChunk]:
    """The prompt pieces that ride in the rows a decode step's pass leaves free (a mixed pass).

    decoding: slots decoding this step (one row each); waiting: (slot, tokens it still has to feed) of the
    short prompts still prefilling, oldest first; rows: the rows a pass holds. The free rows go to the
    oldest prompts, each piece its next tokens (consecutive positions of its slot). With no slot decoding,
    two or more prompts share passes (a wave arriving together: no pass ends half empty at each prompt's
    end, and the first prompts decode, in the same passes, while the others still feed); a lone prompt then
    runs its own passes (the same rows). Nothing rides when fewer than `min_free` rows are free (a prompt
    would crawl: its own passes serve it better)."""
    free = rows - decoding
    if (decoding < 1 and len(waiting) < 2) or free < max(min_free, 1):
        return []
    out: list[PrefillChunk] = []
    for slot, left in waiting:
        if free == 0:
            break
        size = min(left, free)
        out.append(PrefillChunk(slot, size))
        free -= size
    return out


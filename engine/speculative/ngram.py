"""Prompt lookup: propose what followed the last n tokens where they occurred before.

The context (prompt + accepted output) only grows within a request, so every n-gram is indexed
once, as it appears: {n-gram → position of the token that followed its latest occurrence}. A
proposal looks up the last n tokens for n from max down to min and copies what followed; a match
near the end continues periodically (the copied tokens are themselves part of the sequence).
An optional pool shared across requests (bounded, least recently used out) remembers n-grams of
earlier requests and is consulted when the request's own text has no match.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.errors import BonsaiError
from engine.speculative.drafter import Draft, Feedback


class NgramPool:
    """n-gram → next token, shared by the requests of one process; at most `max_entries` kept."""

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise BonsaiError(f"the n-gram pool needs room for at least 1 entry, got {max_entries}")
        self.max_entries = max_entries
        self._next: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, gram: tuple[int, ...], next_token: int) -> None:
        self._next[gram] = next_token
        self._next.move_to_end(gram)
        if len(self._next) > self.max_entries:
            self._next.popitem(last=False)

    def get(self, gram: tuple[int, ...]) -> int | None:
        token = self._next.get(gram)
        if token is not None:
            self._next.move_to_end(gram)
        return token


class NgramDrafter:
    name = "ngram"
    hidden_layers: tuple[int, ...] = ()
    draftless = True  # proposing costs no model pass

    def __init__(self, min_n: int = 1, max_n: int = 4, pool: NgramPool | None = None):
        if not 1 <= min_n <= max_n:
            raise BonsaiError(f"n-gram sizes must satisfy 1 <= min <= max, got min {min_n}, max {max_n}")
        self.min_n, self.max_n, self.pool = min_n, max_n, pool
        self._context: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def begin(self, prompt: list[int]) -> None:
        self._context = []
        self._index = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def _extend(self, context: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        old = len(self._context)
        if context[:old] != self._context:  # not a continuation (a caller reused the drafter): start over
            self.begin(context)
            old = 0
        self._context = list(context)
        for i in range(max(old, 1), len(context)):  # context[i] follows the n-grams ending at i - 1
            for n, index in self._index.items():
                if i >= n:
                    gram = tuple(context[i - n:i])
                    index[gram] = i
                    if self.pool is not None:
                        self.pool.add(gram, context[i])

    def propose(self, context: list[int], k: int) -> Draft:
        return self.propose_after(context, [], k)

    def propose_after(self, context: list[int], extra: list[int], k: int) -> Draft:
        """A continuation of context + extra (extra: tokens not accepted yet, e.g. another
        drafter's proposal to extend); only `context` is indexed."""
        if k <= 0 or not context:
            return Draft([], source=self.name)
        self._extend(context)
        seq = context + extra if extra else context
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self._index[n].get(tuple(seq[-n:]))
            if start is not None:
                out: list[int] = []
                while len(out) < k:
                    j = start + len(out)
                    out.append(seq[j] if j < len(seq) else out[j - len(seq)])
                return Draft(out, source=self.name)
        return Draft(self._from_pool(seq, k), source=self.name)

    def _from_pool(self, context: list[int], k: int) -> list[int]:
        if self.pool is None:
            return []
        seq = list(context)
        out: list[int] = []
        while len(out) < k:
            token = next((t for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1)
                          if (t := self.pool.get(tuple(seq[-n:]))) is not None), None)
            if token is None:
                break
            out.append(token)
            seq.append(token)
        return out

    def observe(self, feedback: Feedback) -> None:
        """Nothing to rewind: the index only holds accepted text (it grows in `propose`)."""

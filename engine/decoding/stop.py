"""Stop strings over a stream of text pieces: pure bookkeeping, no model."""
from __future__ import annotations


class StopStringMatcher:
    """Feeds text pieces; releases text that cannot be the start of a stop string.

    `push` returns (text safe to emit, stopped). Once stopped, the stop string and everything after
    it are dropped, as OpenAI-compatible servers do.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that stopped the text

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        text = self._held + piece
        cut, self.matched = min(((i, s) for s in self.stops if (i := text.find(s)) >= 0), default=(-1, None))
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

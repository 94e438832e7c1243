"""Whether a decode step speculates: speculation that never loses to plain decoding (issue 20).

The drafters' planners size each draft from the measured cost of a verify pass (engine.speculative.
planner), but a speculative step also costs what the pass does not show: drafting on the host, the sync
the planners time by, accepting row by row, and no step launched ahead (engine.decoding.lookahead). At
high concurrency that made speculation slower than plain decoding (0.72-0.94x at 8 slots on an H200). So
the engine measures both: the tokens per second of the iterations that speculated and of those that did
not, per class of batch size (iterations that also ran prompt chunks are not scored), and takes the faster; the
slower one is tried again every `every` steps, so a change of workload is seen. A class is the batch sizes up to
a power of two (1, 2, 3-4, 5-8, 9-16, …): with many slots the batch size changes every few steps as requests end
and begin, and per exact size each new size was tried both ways again (at 8 slots that kept speculation on
though it lost: 0.93x plain on the H200). Plain bookkeeping, no
tensors: the choice changes speed only, never the output (greedy output is the same either way).
"""
from __future__ import annotations

EMA = 0.3  # weight of a new measurement


def size_class(batch: int) -> int:
    """The batch sizes measured together: the smallest power of two ≥ batch."""
    return 1 << max(0, batch - 1).bit_length()


class SpecGate:
    def __init__(self, every: int = 32):
        self.every = every
        self.rates: dict[tuple[bool, int], float] = {}  # (speculated, size_class(batch)) → tokens per second
        self.steps = 0
        self._open: tuple[bool, int, int, int, float] | None = None  # the step being timed

    def speculate(self, batch: int) -> bool:
        """Whether the step of `batch` slots speculates: each way measured once first (speculating
        first), then the faster, and every `every` steps the other."""
        self.steps += 1
        c = size_class(batch)
        spec, plain = self.rates.get((True, c)), self.rates.get((False, c))
        if spec is None or plain is None:
            return spec is None
        better = spec >= plain
        return (not better) if self.steps % self.every == 0 else better

    def begin(self, speculated: bool, batch: int, generated: int, prefills: int, now: float) -> None:
        """A decode step begins (after this iteration's prompt chunks): the previous step is scored by the
        tokens generated since it began over the time since, unless prompt chunks ran in between
        (`prefills`: the engine's count of prompt chunks run)."""
        if self._open is not None:
            was, b, g0, p0, t0 = self._open
            if prefills == p0 and generated > g0 and now > t0:
                rate = (generated - g0) / (now - t0)
                old = self.rates.get((was, b))
                self.rates[(was, b)] = rate if old is None else (1 - EMA) * old + EMA * rate
        self._open = (speculated, size_class(batch), generated, prefills, now)

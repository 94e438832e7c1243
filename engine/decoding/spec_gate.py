"""Whether a decode step speculates: speculation that never loses to plain decoding (issue 20).

The drafters' planners size each draft from the measured cost of a verify pass (engine.speculative.
planner), but a speculative step also costs what the pass does not show: drafting on the host, the sync
the planners time by, accepting row by row, and no step launched ahead (engine.decoding.lookahead). At
high concurrency that made speculation slower than plain decoding (0.72-0.94x at 8 slots on an H200). So
the engine measures both: the tokens per second of the iterations that speculated and of those that did
not, per class of batch size, and takes the faster; the slower one is tried again after `every` steps, so a
change of workload is seen, and after twice as many each time a try finds it still slower (up to MAX_EVERY: at
8 slots on an H200 the tries alone cost 11% of plain decoding's speed, 2026-12-04). A step is not scored when
prompt chunks ran in its window or in its own iteration before it began: launched asynchronously, a chunk's
device time lands in the step's window (those chunks ran before speculative steps, prompts riding in plain ones:
speculation was scored slower than it ran, and kept off where it paid, 2026-12-06). A plain step does not launch
the next one ahead when that one will speculate. A class is the batch sizes up to a power of two (1, 2, 3-4, 5-8,
9-16, …): with many slots the batch size changes every few steps as requests end and begin, and per exact size
each new size was tried both ways again (at 8 slots that kept speculation on though it lost: 0.93x plain on the
H200). Plain bookkeeping, no tensors: the choice changes speed only, never the output (greedy output is the same
either way).
"""
from __future__ import annotations

EMA = 0.3  # weight of a new measurement
MAX_EVERY = 1024  # the longest wait between two tries of the slower way


def size_class(batch: int) -> int:
    """The batch sizes measured together: the smallest power of two ≥ batch."""
    return 1 << max(0, batch - 1).bit_length()


class SpecGate:
    def __init__(self, every: int = 32, max_every: int = MAX_EVERY):
        self.every, self.max_every = every, max_every
        self.rates: dict[tuple[bool, int], float] = {}  # (speculated, size_class(batch)) → tokens per second
        self.steps = 0
        # per class: steps between two tries of the slower way (doubled each time a try confirms it slower, so
        # a way that keeps losing costs ever less; back to `every` when a try finds it faster) and the next try
        self.period: dict[int, int] = {}
        self.retry_at: dict[int, int] = {}
        self._open: tuple[bool, int, int, int, float, bool, bool] | None = None  # the step being timed
        self._prefills = 0  # the engine's count of prompt chunks run when the last step began
        self._trial = False  # the step just chosen is a try of the slower way

    def _choice(self, c: int, step: int) -> tuple[bool, bool]:
        """(speculate, a try of the slower way) for a step of class c at step number `step`."""
        spec, plain = self.rates.get((True, c)), self.rates.get((False, c))
        if spec is None or plain is None:
            return spec is None, False
        better = spec >= plain
        due = self.retry_at.get(c, self._first_retry(step))
        return (not better, True) if step >= due else (better, False)

    def _first_retry(self, step: int) -> int:
        """The first try of the slower way once both are measured: the next multiple of `every`."""
        return step - step % self.every + self.every

    def speculate(self, batch: int) -> bool:
        """Whether the step of `batch` slots speculates: each way measured once first (speculating
        first), then the faster, and now and then the other (`period`)."""
        self.steps += 1
        c = size_class(batch)
        choice, trial = self._choice(c, self.steps)
        if trial:
            self.retry_at[c] = self.steps + self.period.get(c, self.every)
        elif (True, c) in self.rates and (False, c) in self.rates:
            self.retry_at.setdefault(c, self._first_retry(self.steps))
        self._trial = trial
        return choice

    def peek(self, batch: int) -> bool:
        """What `speculate(batch)` will answer at the next step (no bookkeeping): a plain step does not
        launch the next one ahead when that one speculates (it would be dropped: engine.decoding.lookahead)."""
        return self._choice(size_class(batch), self.steps + 1)[0]

    def begin(self, speculated: bool, batch: int, generated: int, prefills: int, now: float) -> None:
        """A decode step begins (after this iteration's prompt chunks): the previous step is scored by the
        tokens generated since it began over the time since, unless prompt chunks ran in between or in its own
        iteration before it began (`prefills`: the engine's count of prompt chunks run; the device may still
        be running them when the step begins)."""
        if self._open is not None:
            was, b, g0, p0, t0, trial, clean = self._open
            if clean and prefills == p0 and generated > g0 and now > t0:
                rate = (generated - g0) / (now - t0)
                old = self.rates.get((was, b))
                self.rates[(was, b)] = rate if old is None else (1 - EMA) * old + EMA * rate
                if trial:
                    self._after_try(was, b)
        clean = prefills == self._prefills  # no prompt chunk since the last step began
        self._open = (speculated, size_class(batch), generated, prefills, now, self._trial, clean)
        self._prefills, self._trial = prefills, False

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of the step being timed out of its rate: one-time work, such as a drafter feeding the
        prompt or the tokens of plain steps it did not see (a speculative step's rate is its steady state's)."""
        if self._open is not None and seconds > 0:
            was, b, g0, p0, t0, trial, clean = self._open
            self._open = (was, b, g0, p0, t0 + seconds, trial, clean)

    def _after_try(self, tried: bool, c: int) -> None:
        """A try of the slower way was scored: still slower, wait twice as long before the next; faster now,
        the other way is the slower one and is tried after `every` steps."""
        still_slower = tried != (self.rates[(True, c)] >= self.rates[(False, c)])  # the tie rule of _choice
        self.period[c] = min(2 * self.period.get(c, self.every), self.max_every) if still_slower else self.every
        self.retry_at[c] = self.steps + self.period[c]

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

On a CPU (`for_device`) single steps vary by ±30% on a loaded machine while the two ways differ by ~10% (a 1.5B
target, its 0.5B drafter: docs/perf.md session 32; the bench lost 7-13% to one-step tries that noise made look
faster): there a measurement is `try_steps` steps of a way (their tokens over their seconds), a try runs that many
steps, tries come rarer (CPU_EVERY) and speculation must be `margin` faster to be chosen. On a GPU a measurement is
one step, no margin.

A speculative step's rate leaves out its drafters' catch-up (a draft model feeding the prompt, or the tokens of
the plain steps it did not see: ~10 ms a token for the 0.5B on two cores), a one-time cost that decides short
requests: on the coder suite's 24-68-token answers after 100-400-token prompts it made speculation 0.79x plain while
the steady rates were even (docs/perf.md session 37). So `speculate` is told the tokens the drafters would feed first
and the tokens the rows may still generate: at the measured feed rate (`exclude`) the catch-up must cost less than
speculating gains over those tokens, and a try of speculation while it is the slower way may spend at most TRY_SHARE
of their time at plain decoding's rate.
"""
from __future__ import annotations

EMA = 0.3  # weight of a new measurement
MAX_EVERY = 1024  # the longest wait between two tries of the slower way
# a CPU's first wait: a try there also feeds a draft model the request's prompt (~0.5 s for the 0.5B drafter on two
# cores), a cost the steady-state rate leaves out
CPU_EVERY = 256
TRY_SHARE = 0.05  # a try of the slower speculation may spend this share of the tokens left's plain time catching up


def size_class(batch: int) -> int:
    """The batch sizes measured together: the smallest power of two ≥ batch."""
    return 1 << max(0, batch - 1).bit_length()


class SpecGate:
    def __init__(self, every: int = 32, max_every: int = MAX_EVERY, try_steps: int = 1, margin: float = 0.0):
        self.every, self.max_every = every, max_every
        self.try_steps, self.margin = try_steps, margin
        self.rates: dict[tuple[bool, int], float] = {}  # (speculated, size_class(batch)) → tokens per second
        self._pending: dict[tuple[bool, int], tuple[int, float, int]] = {}  # a measurement's (tokens, seconds, steps)
        self._scored: dict[tuple[bool, int], int] = {}  # steps scored of each way and class
        self.steps = 0
        # per class: steps between two tries of the slower way (doubled each time a try confirms it slower, so
        # a way that keeps losing costs ever less; back to `every` when a try finds it faster) and the next try
        self.period: dict[int, int] = {}
        self.retry_at: dict[int, int] = {}
        self._trying: dict[int, tuple[bool, int]] = {}  # class → (the way tried, its steps still to run)
        self._open: tuple[bool, int, int, int, float, bool, bool] | None = None  # the step being timed
        self._prefills = 0  # the engine's count of prompt chunks run when the last step began
        self._trial = False  # the step just chosen ends a try of the slower way
        self.feed: float | None = None  # seconds a drafter takes to feed a token it had not seen (measured)

    @staticmethod
    def for_device(device_type: str) -> SpecGate:
        """The gate's settings for a device: as measured on GPUs (one-step tries, no margin), or a CPU's."""
        return SpecGate() if device_type == "cuda" else SpecGate(every=CPU_EVERY, try_steps=4, margin=0.05)

    def _measured(self, way: bool, c: int) -> bool:
        return self._scored.get((way, c), 0) >= self.try_steps

    def _spec_faster(self, c: int) -> bool:
        return self.rates[(True, c)] >= self.rates[(False, c)] * (1 + self.margin)

    def _choice(self, c: int, step: int) -> tuple[bool, bool]:
        """(speculate, a try of the slower way) for a step of class c at step number `step`."""
        for way in (True, False):  # each way measured first, speculation first
            if not self._measured(way, c):
                return way, False
        if c in self._trying:
            return self._trying[c][0], True
        better = self._spec_faster(c)
        due = self.retry_at.get(c, self._first_retry(step))
        return (not better, True) if step >= due else (better, False)

    def _first_retry(self, step: int) -> int:
        """The first try of the slower way once both are measured: the next multiple of `every`."""
        return step - step % self.every + self.every

    def _worth(self, c: int, trial: bool, backlog: int, left: int) -> bool:
        """Whether speculating now pays for its drafters' catch-up: `backlog` tokens to feed at the measured rate
        against the time speculation saves over the `left` tokens the rows may still generate (a try: at most
        TRY_SHARE of their plain time). Before both ways are measured, or a feed is: yes."""
        if backlog <= 0 or self.feed is None or not (self._measured(True, c) and self._measured(False, c)):
            return True
        cost, plain = backlog * self.feed, left / self.rates[(False, c)]
        return cost <= TRY_SHARE * plain if trial else plain - left / self.rates[(True, c)] > cost

    def worth(self, batch: int, backlog: int, left: int) -> bool:
        """Whether a step of `batch` slots that speculates pays for feeding `backlog` tokens first (as `_worth`
        judges a try while speculation is measured slower)."""
        c = size_class(batch)
        slower = self._measured(True, c) and self._measured(False, c) and not self._spec_faster(c)
        return self._worth(c, slower, backlog, left)

    def speculate(self, batch: int, backlog: int = 0, left: int = 0) -> bool:
        """Whether the step of `batch` slots speculates: each way measured first (speculating first), then
        the faster, and now and then the other for `try_steps` steps (`period`) — unless the drafters' catch-up
        (`backlog` tokens) costs more than speculating can gain over the `left` tokens (`_worth`; a try begun
        runs its steps)."""
        self.steps += 1
        c = size_class(batch)
        choice, trial = self._choice(c, self.steps)
        self._trial = False
        if choice and c not in self._trying and not self._worth(c, trial, backlog, left):
            return False
        if trial:
            way, left = self._trying.get(c, (choice, self.try_steps))
            if left == self.try_steps:  # a try begins: its steps are one measurement
                self.retry_at[c] = self.steps + self.period.get(c, self.every)
                self._pending.pop((way, c), None)
            if left > 1:
                self._trying[c] = (way, left - 1)
            else:
                self._trying.pop(c, None)
                self._trial = True  # its last step: judged once scored
        elif self._measured(True, c) and self._measured(False, c):
            self.retry_at.setdefault(c, self._first_retry(self.steps))
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
                tokens, seconds, steps = self._pending.pop((was, b), (0, 0.0, 0))
                tokens, seconds, steps = tokens + generated - g0, seconds + now - t0, steps + 1
                if steps < self.try_steps:
                    self._pending[(was, b)] = (tokens, seconds, steps)
                else:  # a measurement: its steps' tokens over their seconds
                    old = self.rates.get((was, b))
                    rate = tokens / seconds
                    self.rates[(was, b)] = rate if old is None else (1 - EMA) * old + EMA * rate
                self._scored[(was, b)] = self._scored.get((was, b), 0) + 1
                if trial and (True, b) in self.rates and (False, b) in self.rates:
                    self._after_try(was, b)
        clean = prefills == self._prefills  # no prompt chunk since the last step began
        self._open = (speculated, size_class(batch), generated, prefills, now, self._trial, clean)
        self._prefills, self._trial = prefills, False

    def exclude(self, seconds: float, tokens: int = 0) -> None:
        """Leave `seconds` of the step being timed out of its rate: one-time work, such as a drafter feeding the
        prompt or the tokens of plain steps it did not see (a speculative step's rate is its steady state's);
        `tokens` fed in them give the feed rate `_worth` charges for the next catch-up."""
        if tokens > 0 and seconds > 0:
            rate = seconds / tokens
            self.feed = rate if self.feed is None else (1 - EMA) * self.feed + EMA * rate
        if self._open is not None and seconds > 0:
            was, b, g0, p0, t0, trial, clean = self._open
            self._open = (was, b, g0, p0, t0 + seconds, trial, clean)

    def _after_try(self, tried: bool, c: int) -> None:
        """A try of the slower way was scored: still slower, wait twice as long before the next; faster now,
        the other way is the slower one and is tried after `every` steps."""
        still_slower = tried != self._spec_faster(c)  # the rule of _choice
        self.period[c] = min(2 * self.period.get(c, self.every), self.max_every) if still_slower else self.every
        self.retry_at[c] = self.steps + self.period[c]

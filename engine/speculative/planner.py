"""How many tokens to draft: plain bookkeeping of acceptance and measured costs, no tensors.

Each drafter's acceptance is modelled as geometric: a draft token is accepted with probability a
given that the ones before it were. a is estimated from decayed counts (accepted tokens S,
rejections F: a = S / (S + F)), so it follows what is being accepted now. The target's cost of a
pass over T rows and each drafter's cost per drafted token are measured as the run goes. The
draft length k maximizes expected tokens per second:

    tokens(k) = 1 + a + a^2 + ... + a^k        seconds(k) = target(k + 1) + draft_cost * k

k = 0 (no speculation this step) when drafting does not pay: on a CPU, where each verified row
costs a good part of a pass, low acceptance means plain decoding is faster, and the plan says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.9  # weight of the past per observation: acceptance follows roughly the last ten drafts
TIME_EMA = 0.2


@dataclass
class Acceptance:
    """Decayed accepted / rejected counts of one drafter; prior a = 0.5 worth two observations."""
    accepted: float = 1.0
    rejected: float = 1.0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, accepted: int, rejected: bool) -> None:
        """A draft of which `accepted` leading tokens were kept, then one rejected (or none: the
        whole draft was kept, which says nothing of the token after it)."""
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (1 if rejected else 0)


@dataclass
class TargetCost:
    """Seconds of one target pass by number of rows; unmeasured row counts are interpolated."""
    seconds: dict[int, float] = field(default_factory=dict)
    prior_row_fraction: float = 0.05  # an extra row costs this fraction of a pass until measured

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else (1 - TIME_EMA) * old + TIME_EMA * seconds

    def estimate(self, rows: int) -> float:
        """Measured, else interpolated between the nearest measured row counts, else extended from the largest with
        the slope of the last two (a prior fraction of a pass a row with one). Never dearer than the neighbours
        say: a row count estimated too dear is never chosen, so never measured (a line through the one-row pass,
        the GPU's dearer first extra row on its slope, kept 4 slots to about one draft a step: 2026-12-06)."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = sorted(r for r in self.seconds if r < rows)
        above = min((r for r in self.seconds if r > rows), default=None)
        if not below:
            first = self.seconds[above] if above is not None else 1.0
            return first * max(1.0 - self.prior_row_fraction * ((above or 1) - rows), 0.5)
        lo = below[-1]
        if above is not None:
            return self.seconds[lo] + (self.seconds[above] - self.seconds[lo]) * (rows - lo) / (above - lo)
        slope = ((self.seconds[lo] - self.seconds[below[-2]]) / (lo - below[-2]) if len(below) > 1
                 else self.prior_row_fraction * self.seconds[lo])
        return self.seconds[lo] + max(slope, 0.0) * (rows - lo)


@dataclass
class DraftCost:
    """Seconds a drafter spends per proposal: a fixed part and a part per drafted token."""
    per_token: float = 0.0
    measured: bool = False

    def observe(self, tokens: int, seconds: float) -> None:
        per = seconds / max(tokens, 1)
        self.per_token = per if not self.measured else (1 - TIME_EMA) * self.per_token + TIME_EMA * per
        self.measured = True


def expected_tokens(rate: float, k: int) -> float:
    """1 + a + ... + a^k: tokens produced by a pass verifying k drafts (the bonus included)."""
    return sum(rate ** i for i in range(k + 1))


def best_length(rate: float, k_max: int, target: TargetCost, draft: DraftCost) -> int:
    """The k in 0..k_max with the most expected tokens per second."""
    best_k, best_speed = 0, expected_tokens(rate, 0) / max(target.estimate(1), 1e-9)
    for k in range(1, k_max + 1):
        seconds = target.estimate(k + 1) + draft.per_token * k
        speed = expected_tokens(rate, k) / max(seconds, 1e-9)
        if speed > best_speed * (1 + 1e-9):
            best_k, best_speed = k, speed
    return best_k


def shadow_matches(proposal: list[int], produced: list[int]) -> tuple[int, bool]:
    """A proposal that was not verified, judged against the tokens the target produced instead:
    (leading matches, whether a mismatch was seen). Equal to what verification would have kept
    at temperature 0, and an unbiased estimate of it for a one-hot drafter at temperature > 0."""
    n = 0
    while n < len(proposal) and n < len(produced) and proposal[n] == produced[n]:
        n += 1
    return n, n < len(proposal) and n < len(produced)


def joint_draft_lengths(rates: list[float], drafted: list[int], cost: TargetCost) -> list[int]:
    """How many of each slot's drafts to verify when all slots share one pass (batched
    speculation): the pass has one row per slot plus the kept drafts, and costs cost.estimate(rows).
    The j-th draft of slot i adds rate_i^(j+1) expected tokens; drafts are taken best first while
    they raise the expected tokens per second of the whole pass."""
    gains = sorted(((rates[i] ** (j + 1), i) for i, n in enumerate(drafted) for j in range(n)), reverse=True)
    keep = [0] * len(drafted)
    rows = len(drafted)
    tokens = float(rows)  # each slot's pending row gives one token whatever is accepted
    for gain, i in gains:
        if (tokens + gain) / max(cost.estimate(rows + 1), 1e-12) <= tokens / max(cost.estimate(rows), 1e-12):
            break
        keep[i] += 1
        rows += 1
        tokens += gain
    return keep

"""Speculative-decoding counters of one request: plain bookkeeping, no tensors.

steps counts the target's decode passes (with or without drafts), so
mean_accepted_length = 1 + accepted / steps is the tokens produced per target pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DrafterCounts:
    proposals: int = 0  # steps in which this drafter contributed tokens
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"proposals": self.proposals, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance}


@dataclass
class SpecStats:
    method: str = ""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: drafts with a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: of those, accepted
    by_drafter: dict[str, DrafterCounts] = field(default_factory=dict)

    def record(self, sources: list[str], accepted: int) -> None:
        """One target pass that verified len(sources) drafted tokens (sources[i]: who drafted i)."""
        assert 0 <= accepted <= len(sources), (accepted, len(sources))
        self.steps += 1
        self.drafted += len(sources)
        self.accepted += accepted
        while len(self.drafted_per_position) < len(sources):
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i, name in enumerate(sources):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
            counts = self.by_drafter.setdefault(name, DrafterCounts())
            counts.drafted += 1
            counts.accepted += i < accepted
        for name in dict.fromkeys(sources):
            self.by_drafter[name].proposals += 1

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.steps if self.steps else 0.0

    def merge(self, other: "SpecStats") -> None:
        """Add another request's counters (bench sums them per category)."""
        self.method = self.method or other.method
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        for name, c in other.by_drafter.items():
            mine = self.by_drafter.setdefault(name, DrafterCounts())
            mine.proposals += c.proposals
            mine.drafted += c.drafted
            mine.accepted += c.accepted

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "mean_accepted_length": self.mean_accepted_length,
                "drafted_per_position": list(self.drafted_per_position),
                "accepted_per_position": list(self.accepted_per_position),
                "by_drafter": {name: c.as_dict() for name, c in self.by_drafter.items()}}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "SpecStats":
        return SpecStats(method=data.get("method", ""), steps=data["steps"], drafted=data["drafted"],
                         accepted=data["accepted"], drafted_per_position=list(data["drafted_per_position"]),
                         accepted_per_position=list(data["accepted_per_position"]),
                         by_drafter={n: DrafterCounts(c["proposals"], c["drafted"], c["accepted"])
                                     for n, c in data["by_drafter"].items()})

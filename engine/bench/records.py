"""What a benchmark measures, as plain records shared by model runs, suites and HTTP runs."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for fewer than two samples)."""
    if not xs:
        return 0.0, 0.0
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; 0 for no samples."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Measurement:
    """One llama-bench style test (e.g. pp512, tg128, pp512+tg128, at a depth), all repetitions."""
    name: str
    n_prompt: int
    n_gen: int
    depth: int
    samples_seconds: list[float] = field(default_factory=list)  # timed part of each repetition
    speculative: Any = None  # SpecStats of the decode, when speculative

    @property
    def tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def samples_tps(self) -> list[float]:
        return [self.tokens / s for s in self.samples_seconds if s > 0]

    def summary(self) -> dict[str, Any]:
        m, sd = mean_std(self.samples_tps)
        return {"name": self.name, "n_prompt": self.n_prompt, "n_gen": self.n_gen, "depth": self.depth,
                "tokens_per_second": m, "stddev": sd, "samples_tps": self.samples_tps,
                "samples_seconds": self.samples_seconds,
                **({"speculative": self.speculative.as_dict()} if self.speculative is not None else {})}


@dataclass
class SuitePrompt:
    """One prompt of a task suite: a conversation to answer."""
    id: str
    category: str
    messages: list[dict[str, str]]
    max_tokens: int = 128


@dataclass
class PromptResult:
    """One prompt run once (locally or through a server)."""
    prompt_id: str
    category: str
    prompt_tokens: int
    generated_tokens: int
    ttft_seconds: float
    decode_tokens_per_second: float
    total_seconds: float
    finish_reason: str
    cached_tokens: int = 0
    inter_token_seconds: list[float] = field(default_factory=list)
    server_timings: dict[str, Any] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    drafted: int | None = None  # speculative decoding, when active
    accepted: int | None = None
    steps: int | None = None
    speculative: dict[str, Any] | None = None  # local runs: the full draft statistics (SpecStats.as_dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

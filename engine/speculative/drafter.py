"""The drafter interface every drafter (n-gram, draft model, MTP, DFlash, mix) implements.

A generation with speculation runs, per step:
    draft = drafter.propose(context, k)          # context = prompt + tokens accepted so far
    logits = target scores [last accepted] + draft.tokens in one pass (k + 1 rows)
    accepted = verify(...)                       # equal-to-target (T = 0) or min(1, p/q) (T > 0)
    target cache rewinds past the rejected drafts
    drafter.observe(Feedback(...))               # so it can rewind its own state or learn
Drafters that condition on the target's hidden states (MTP, DFlash) name the layers they need in
`hidden_layers`; the runner then returns those layers' outputs for the verified rows and they
arrive in `Feedback.hidden`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Draft:
    """Up to k proposed tokens. probs: the drafter's distribution at each proposed position
    ([len(tokens), V], already shaped by the request's sampling parameters), or None when the
    drafter has none (verification then counts q = 1 for its token)."""
    tokens: list[int]
    probs: torch.Tensor | None = None  # [n, V]
    source: str = ""  # name of the drafter that produced each proposal (per-drafter statistics)
    sources: list[str] = field(default_factory=list)  # per token, when a mix combined several

    def __post_init__(self) -> None:
        if self.probs is not None:
            assert self.probs.shape[0] == len(self.tokens), (self.probs.shape, len(self.tokens))
        if not self.sources:
            self.sources = [self.source] * len(self.tokens)


@dataclass
class Feedback:
    """What happened to the last draft: `accepted` drafted tokens were kept (a prefix of the
    draft), then the target added `bonus` (its own token at the first mismatch, or after a fully
    accepted draft). hidden: layer index → [accepted + 1, hidden] target hidden states of the
    verified rows that were kept (only the layers the drafter asked for). When drafters are mixed,
    every member observes every step and `draft` may come from another member. verify_seconds:
    wall time of the target's pass over len(draft.tokens) + 1 rows (0 when not measured)."""
    draft: Draft
    accepted: int
    bonus: int
    hidden: dict[int, torch.Tensor] | None = None
    verify_seconds: float = 0.0

    @property
    def produced(self) -> list[int]:
        """The tokens this step added to the output: the accepted drafts and the bonus."""
        return self.draft.tokens[:self.accepted] + [self.bonus]


@runtime_checkable
class Drafter(Protocol):
    """Optional attributes (read with getattr): `draftless` (True: proposing costs no model pass,
    so a mix may ask it every step) and `max_draft_tokens` (a block size: a larger k is refused
    when the drafter is built)."""
    name: str
    hidden_layers: tuple[int, ...]  # target layers whose outputs it conditions on ((): none)

    def begin(self, prompt: list[int]) -> None:
        """A new request starts (the target has the prompt, or a reused prefix of it, cached)."""

    def propose(self, context: list[int], k: int) -> Draft:
        """At most k tokens continuing `context` (prompt + accepted output); may return none."""

    def observe(self, feedback: Feedback) -> None:
        """The outcome of the last verification: rewind own state past the rejected tokens, learn."""

"""Several drafters as one: per step the member (and draft length) with the best expected speed.

Members are an ordered list (ties go to the earlier one). Draftless members (n-gram) propose
every step, since that costs nothing; a member that runs a model is asked only when its plan
wins. The plan (engine.speculative.planner) weighs each member's running acceptance against the
measured cost of its tokens and of the target's wider pass, and may say "do not draft" (plain
step). A model member's short draft is extended with a draftless member's continuation of it.
Draftless members that were not used are judged against what the target produced, so their
acceptance stays current. With one member, this is that drafter with an adaptive draft length.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.speculative.drafter import Draft, Drafter, Feedback
from engine.speculative.planner import (Acceptance, DraftCost, TargetCost, best_length, expected_tokens,
                                        shadow_matches)

PROBE_EVERY = 16  # a model member whose plan says "do not draft" still drafts one token this often
REMEASURE_EVERY = 64  # a plain step this often keeps the cost of a one-row pass current


@dataclass
class Member:
    drafter: Drafter
    acceptance: Acceptance = field(default_factory=Acceptance)
    cost: DraftCost = field(default_factory=DraftCost)
    draftless: bool = False
    shadow: list[int] = field(default_factory=list)  # this step's unverified proposal


class MixDrafter:
    draftless = False

    def __init__(self, drafters: list[Drafter], adaptive: bool = True):
        assert drafters
        self.name = "mix" if len(drafters) > 1 else drafters[0].name
        self.members = [Member(d, draftless=bool(getattr(d, "draftless", False))) for d in drafters]
        self.adaptive = adaptive
        self.target = TargetCost()
        self.hidden_layers = tuple(sorted({i for d in drafters for i in d.hidden_layers}))
        self.prompt_rows = max((getattr(d, "prompt_rows", 0) for d in drafters), default=0)
        limits = [getattr(d, "max_draft_tokens", None) for d in drafters]
        limits = [x for x in limits if x is not None]
        self.max_draft_tokens = min(limits) if limits else None
        self._steps = 0
        self._spans: list[tuple[Member, int, int]] = []  # (member, start, end) of the last draft
        self.catch_up_seconds = 0.0
        self.catch_up_tokens = 0
        self.hold_back = False  # set by the step: members that would first feed unseen tokens sit this proposal out

    def set_sampling(self, params) -> None:
        for m in self.members:
            configure = getattr(m.drafter, "set_sampling", None)
            if configure is not None:
                configure(params)

    def begin(self, prompt: list[int]) -> None:
        for m in self.members:
            m.drafter.begin(prompt)

    def _backlog(self, m: Member, length: int) -> int:
        return m.drafter.backlog(length) if hasattr(m.drafter, "backlog") else 0

    def backlog(self, length: int) -> int:
        """The tokens a proposal may feed first (DraftModelDrafter.backlog): the most of the members' (the mix
        may choose any); `least_backlog` what drafting with the members at hand costs (n-gram lookup: none)."""
        return max((self._backlog(m, length) for m in self.members), default=0)

    def least_backlog(self, length: int) -> int:
        return min((self._backlog(m, length) for m in self.members), default=0)

    def observe_prompt(self, hidden) -> None:
        """The prompt's hidden states, for the members that take them in."""
        for m in self.members:
            if getattr(m.drafter, "prompt_rows", 0):
                m.drafter.observe_prompt(hidden)

    def _plan(self, m: Member, k: int) -> int:
        if not self.adaptive:
            return k
        return best_length(m.acceptance.rate, k, self.target, m.cost)

    def _speed(self, m: Member, k: int) -> float:
        seconds = self.target.estimate(k + 1) + m.cost.per_token * k
        return expected_tokens(m.acceptance.rate, k) / max(seconds, 1e-9)

    def _timed(self, m: Member, context: list[int], k: int, extra: list[int] | None = None) -> Draft:
        start = time.perf_counter()
        draft = m.drafter.propose_after(context, extra, k) if extra else m.drafter.propose(context, k)
        # a draft model catching up on plain steps would otherwise look as costly as those steps, and
        # never be asked again
        caught_up = getattr(m.drafter, "catch_up_seconds", 0.0)
        self.catch_up_seconds += caught_up
        self.catch_up_tokens += getattr(m.drafter, "catch_up_tokens", 0)
        m.cost.observe(len(draft.tokens), time.perf_counter() - start - caught_up)
        return draft

    def propose(self, context: list[int], k: int) -> Draft:
        self._steps += 1
        self._spans = []
        self.catch_up_seconds, self.catch_up_tokens = 0.0, 0  # of this proposal's members: feeding unseen tokens
        candidates = []
        for order, m in enumerate(self.members):
            m.shadow = []
            if k <= 0 or (self.hold_back and self._backlog(m, len(context))):
                continue
            draft = None
            if m.draftless:
                draft = self._timed(m, context, k)
                m.shadow = draft.tokens
                plan = min(self._plan(m, k), len(draft.tokens))
            else:
                plan = self._plan(m, k)
                if plan == 0 and self._steps % PROBE_EVERY == 0:
                    plan = 1
            if plan > 0:
                candidates.append(((self._speed(m, plan), -order), m, draft, plan))
        plain_step = self.adaptive and (1 not in self.target.seconds or self._steps % REMEASURE_EVERY == 0)
        if not candidates or plain_step:
            return Draft([], source=self.name)
        _, chosen, draft, plan = max(candidates, key=lambda c: c[0])
        if draft is None:
            draft = self._timed(chosen, context, plan)
        draft = _truncate(draft, plan)
        chosen.shadow = []
        self._spans = [(chosen, 0, len(draft.tokens))]
        return self._extend(context, draft, chosen, k)

    def _extend(self, context: list[int], draft: Draft, chosen: Member, k: int) -> Draft:
        """Continue a model member's draft with a draftless member's continuation of it."""
        if chosen.draftless or not draft.tokens or len(draft.tokens) >= k:
            return draft
        for m in self.members:
            if not m.draftless or not hasattr(m.drafter, "propose_after"):
                continue
            room = self._plan(m, k - len(draft.tokens))
            more = self._timed(m, context, room, extra=draft.tokens) if room else Draft([])
            if more.tokens:
                n = len(draft.tokens)
                probs = None
                if draft.probs is not None:  # q of the extension is one-hot at its tokens
                    onehot = torch.nn.functional.one_hot(torch.tensor(more.tokens, device=draft.probs.device),
                                                         draft.probs.shape[-1]).to(draft.probs.dtype)  # [e, V]
                    probs = torch.cat([draft.probs, onehot])  # [n + e, V]
                self._spans.append((m, n, n + len(more.tokens)))
                return Draft(draft.tokens + more.tokens, probs, self.name,
                             sources=draft.sources[:n] + more.sources)
        return draft

    def observe(self, feedback: Feedback) -> None:
        if feedback.verify_seconds > 0:
            self.target.observe(len(feedback.draft.tokens) + 1, feedback.verify_seconds)
        accepted = feedback.accepted
        for m, start, end in self._spans:
            if accepted >= start:  # its tokens were judged
                m.acceptance.update(min(accepted, end) - start, accepted < end)
        produced = feedback.produced
        used = {id(m) for m, _, _ in self._spans}
        for m in self.members:
            if m.shadow and id(m) not in used:
                matches, rejected = shadow_matches(m.shadow, produced)
                m.acceptance.update(matches, rejected)
            m.drafter.observe(feedback)


def _truncate(draft: Draft, n: int) -> Draft:
    if len(draft.tokens) <= n:
        return draft
    probs = draft.probs[:n] if draft.probs is not None else None
    return Draft(draft.tokens[:n], probs, draft.source, draft.sources[:n])

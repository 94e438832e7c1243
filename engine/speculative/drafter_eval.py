"""Greedy acceptance of a drafter against its target, measured by drafting for real: a minimal
greedy speculative loop (propose k, verify in one pass, accept while equal to the target's argmax,
take the bonus, rewind) over held-out prompts. Its output is the target's plain greedy decoding;
the tests check that. This is a measuring instrument for `train-drafter`, not the generation core.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.runner import ModelRunner
from engine.speculative.drafter import Drafter, Feedback


@dataclass
class AcceptanceStats:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps that carried a draft
    per_position: list[int] = field(default_factory=list)  # accepted count at draft position i
    offered: list[int] = field(default_factory=list)  # drafts offered at position i

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + accepted drafts."""
        return 1 + self.accepted / self.steps if self.steps else 1.0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        while len(self.offered) < drafted:
            self.offered.append(0)
            self.per_position.append(0)
        for i in range(drafted):
            self.offered[i] += 1
            self.per_position[i] += int(i < accepted)

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": [a / o if o else 0.0 for a, o in zip(self.per_position, self.offered)]}


def count_accepted(draft: list[int], target_choice: list[int]) -> int:
    """How many leading drafts equal the target's argmax at their row (greedy verification)."""
    n = 0
    while n < len(draft) and draft[n] == target_choice[n]:
        n += 1
    return n


@torch.inference_mode()
def greedy_speculative(runner: ModelRunner, drafter: Drafter, prompt: list[int], max_new_tokens: int, k: int,
                       stats: AcceptanceStats | None = None, stop_ids: frozenset[int] = frozenset(),
                       slot_index: int = 0) -> list[int]:
    """Greedy-decode max_new_tokens after `prompt` (up to and including a stop id) with `drafter`
    proposing up to k tokens per step; returns the generated ids (identical to plain greedy
    decoding) and adds to `stats`."""
    slot = runner.slot(slot_index)
    slot.reset()
    drafter.begin(prompt)
    out = [int(runner.prefill(slot, prompt).argmax())]
    while len(out) < max_new_tokens and slot.length + 1 < slot.capacity and out[-1] not in stop_ids:
        room = min(k, max_new_tokens - len(out) - 1, slot.capacity - slot.length - 1)
        draft = drafter.propose(prompt + out, room)
        assert len(draft.tokens) <= room, (len(draft.tokens), room)
        rows = [out[-1], *draft.tokens]
        logits, hidden = runner.verify(slot, rows, tuple(drafter.hidden_layers))  # [n + 1, V]
        choice = logits.argmax(-1).tolist()
        accepted = count_accepted(draft.tokens, choice)
        slot.rewind(len(rows) - (accepted + 1))
        kept = {i: h[:accepted + 1] for i, h in hidden.items()} if hidden else None
        drafter.observe(Feedback(draft, accepted, choice[accepted], kept))
        if stats is not None:
            stats.record(len(draft.tokens), accepted)
        out += draft.tokens[:accepted] + [choice[accepted]]
    for i, token in enumerate(out):
        if token in stop_ids:
            return out[:i + 1]
    return out[:max_new_tokens]


def measure_acceptance(runner: ModelRunner, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int,
                       k: int, stop_ids: frozenset[int] = frozenset()) -> AcceptanceStats:
    stats = AcceptanceStats()
    for prompt in prompts:
        greedy_speculative(runner, drafter, prompt, max_new_tokens, k, stats, stop_ids)
    return stats

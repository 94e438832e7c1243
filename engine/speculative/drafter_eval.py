"""Greedy acceptance of a drafter against its target, measured by drafting for real: held-out
prompts decoded greedily by the engine with the drafter proposing (speculative decoding, so the
output is the target's plain greedy decoding), the draft statistics read per position. And the same
figure from one teacher-forced pass per prompt (`teacher_forced_acceptance`), which the tests check
against the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.decoding.engine import Engine
from engine.decoding.generate import generate_text
from engine.decoding.sampling import greedy_tokens
from engine.decoding.sequence import Request
from engine.runtime.runner import ModelRunner
from engine.speculative.drafter import Drafter
from engine.speculative.stats import SpecStats


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

    def add(self, spec: SpecStats) -> None:
        """A request's draft statistics (its steps without a draft do not count here)."""
        self.drafted += spec.drafted
        self.accepted += spec.accepted
        self.steps += spec.drafted_per_position[0] if spec.drafted_per_position else 0
        for i, (offered, accepted) in enumerate(zip(spec.drafted_per_position, spec.accepted_per_position)):
            if i == len(self.offered):
                self.offered.append(0)
                self.per_position.append(0)
            self.offered[i] += offered
            self.per_position[i] += accepted

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


def measure_acceptance(runner: ModelRunner, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int,
                       k: int, tokenizer=None) -> AcceptanceStats:
    """Greedy-decode max_new_tokens after each prompt (up to an end-of-sequence token of `tokenizer`,
    when given) with `drafter` proposing up to k tokens per step; the drafts' acceptance."""
    engine = Engine(runner, tokenizer, drafters=[drafter], num_draft_tokens=k)
    stats = AcceptanceStats()
    for prompt in prompts:
        request = Request(prompt, max_tokens=max_new_tokens, ignore_eos=tokenizer is None, text=False,
                          reuse_prefix=False)
        stats.add(generate_text(engine, request)[3].speculative)
    return stats


@torch.inference_mode()
def draft_predictions(target_loaded, module, prompt: list[int], continuation: list[int], k: int) -> dict[int, list[int]]:
    """For every bonus position b after the first generated token: the k tokens the drafter proposes
    after prompt + continuation[:b - len(prompt) + 1], computed in one pass of the whole-sequence
    (training) forward. Drafts after an accepted prefix see exactly what drafting one step at a
    time sees, so walking these reproduces greedy acceptance (tests check it against the loop)."""
    from engine.speculative import dflash, mtp
    from engine.speculative.draft_layers import shared_logits
    seq = prompt + continuation
    p, t = len(prompt), len(seq)
    runner = ModelRunner(target_loaded, max_seq_len=t + 1)
    layers = tuple(module.cfg.target_layers)
    _, hidden = runner.verify(runner.slot(0), seq, layers)  # {layer: [T, H]}
    device, dtype = target_loaded.device, next(module.parameters()).dtype
    pad = max(k, module.cfg.block_size) + 1
    tokens = torch.tensor([seq + [0] * pad], device=device)  # [1, T + pad]
    hidden = {i: torch.nn.functional.pad(h.to(dtype), (0, 0, 0, pad))[None] for i, h in hidden.items()}
    starts = torch.tensor([p], device=device)
    bonus = list(range(p + 1, t))
    if not bonus:
        return {}
    if module.cfg.kind == "mtp":
        outs = mtp.train_forward(module, target_loaded.model, tokens, hidden[-1], starts, k)
        rows = torch.stack([o[0, p:t - 1] for o in outs], dim=1)  # [n, k, H]: row b - 1 for bonus b
    else:
        anchors = torch.tensor([bonus], device=device)  # [1, n]
        rows = dflash.train_forward(module, target_loaded.model, tokens, hidden, starts, anchors)[0, :, :k]  # [n, k, H]
    logits = shared_logits(target_loaded.model, rows)  # [n, k, V]
    width = logits.shape[1]
    choice = greedy_tokens(logits.flatten(0, 1))  # [n · k]: the drafts, one read-back
    return {b: choice[i * width:(i + 1) * width] for i, b in enumerate(bonus)}


def teacher_forced_acceptance(target_loaded, module, prompts: list[list[int]], continuations: list[list[int]],
                              k: int, stats: AcceptanceStats | None = None) -> AcceptanceStats:
    """Greedy acceptance of `module` drafting k tokens per step along the target's greedy
    continuations: the steps measure_acceptance takes, from one batched pass per prompt."""
    stats = stats or AcceptanceStats()
    for prompt, continuation in zip(prompts, continuations):
        predictions = draft_predictions(target_loaded, module, prompt, continuation, k)
        seq, n = prompt + continuation, len(continuation)
        produced = 2  # the first step has no rows to draft from: the target alone adds a token
        while produced < n:
            room = min(k, n - produced - 1)
            b = len(prompt) + produced - 1  # position of the newest token (the last bonus)
            draft = predictions[b][:room] if room > 0 else []
            accepted = count_accepted(draft, seq[b + 1:b + 1 + room])
            stats.record(len(draft), accepted)
            produced += accepted + 1
    return stats

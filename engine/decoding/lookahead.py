"""One decode step launched ahead: the host's work on a step's tokens overlaps the next step on the device.

After a plain decode step chose every row's token, the engine launches the next step for the same rows at
once (`launch`: a CUDA-graph replay, asynchronous) and only then turns the chosen tokens into text, events
and end checks, which cost ~0.5 ms a token on the host (issue 20: the server decoded at 76% of the engine's
speed). The next iteration takes those logits (`take`) if it decodes exactly those rows with exactly those
tokens; otherwise (a row ended, was cancelled or forced other tokens, a request arrived) the launched step
is dropped: each of its slots forgets the token it fed (`KVSlot.rewind`; the row it wrote is overwritten
later), so every slot holds exactly what its requests decoded and outputs equal those without it. Logits
of a row depend only on its slot's tokens, so taking them one iteration later changes nothing.
"""
from __future__ import annotations

import torch


class Lookahead:
    def __init__(self, runner):  # noqa: ANN001 - engine.runtime.runner.Runner
        self.runner = runner
        self.rows: list[int] = []  # slot indices of the step launched ahead, in its row order
        self.tokens: list[int] = []  # the token each row fed
        self.logits: torch.Tensor | None = None  # [B, V]

    def launch(self, rows: list[int], tokens: list[int]) -> None:
        """Start the decode step of `rows` (slot indices) feeding `tokens`; its slots hold the tokens now."""
        assert not self.rows, "one step ahead at most"
        self.logits = self.runner.decode_batch([self.runner.slot(i) for i in rows], tokens)  # [B, V]
        self.rows, self.tokens = list(rows), list(tokens)

    def take(self, rows: list[int], tokens: list[int]) -> torch.Tensor | None:
        """The logits [B, V] of the step launched ahead if it is this one (same rows, same tokens), else None
        (and the step launched ahead, if any, is dropped)."""
        if self.rows and self.rows == rows and self.tokens == tokens:
            logits = self.logits
            self.rows, self.tokens, self.logits = [], [], None
            return logits
        self.drop_all()
        return None

    def drop(self, index: int) -> None:
        """Slot `index` leaves (its request ended or failed): the step launched ahead is dropped."""
        if index in self.rows:
            self.drop_all()

    def drop_all(self) -> None:
        for i in self.rows:
            self.runner.slot(i).rewind(1)
        self.rows, self.tokens, self.logits = [], [], None

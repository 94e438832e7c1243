"""One decode step launched ahead: the host's work on a step's tokens overlaps the next step on the device.

After a plain decode step's tokens are chosen, the engine launches the next step for the same rows at once (`launch`:
a CUDA-graph replay, asynchronous) and only then turns the chosen tokens into text, events and end checks, which cost
~0.5 ms a token on the host (issue 20: the server decoded at 76% of the engine's speed). Where the runner takes its
input tokens on the device (`Runner.takes_device_tokens`), the step is launched with the sampler's tensor before the
host reads it (`TokenReadback`): the device queue then never waits for the host's read-back, its Python or a thread
holding the interpreter, as long as the host's iteration is shorter than a step; the tokens are written into the slots
once read (`settle`). The next iteration takes those logits (`take`) if it decodes exactly those rows with exactly
those tokens; otherwise (a request arrived, a row was forced other tokens) the launched step is dropped: each of its
slots forgets the token it fed (`KVSlot.rewind`; the row it wrote is overwritten later), so every slot holds exactly
what its requests decoded and outputs equal those without it. A row that ends (its end-of-sequence token, a stop
string, a cancel) leaves alone (`drop`): the other rows' logits are still this step's. Logits of a row depend only on
its slot's tokens, so taking them one iteration later changes nothing.
"""
from __future__ import annotations

import os
import time

import torch


class TokenReadback:
    """The sampler's tokens [B] (a device tensor) read back without waiting for what the stream runs after them: on
    CUDA a copy into pinned host memory and an event recorded behind it (`start`), waited for alone (`wait`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host: torch.Tensor | None = None  # [n] int64 pinned, grown on demand
        self.event = torch.cuda.Event() if self.cuda else None
        self.tokens: torch.Tensor | None = None
        self.waited = 0.0  # seconds the last `wait` waited for the device (the host ahead of it: ~0)

    def start(self, tokens: torch.Tensor) -> None:
        """Queue the copy of tokens [B] (int64) behind the work that makes them."""
        if not self.cuda:
            self.tokens = tokens
            return
        n = tokens.shape[0]
        if self.host is None or self.host.shape[0] < n:
            self.host = torch.empty(max(n, 16), dtype=torch.long, pin_memory=True)
        self.tokens = self.host[:n]
        self.tokens.copy_(tokens, non_blocking=True)
        self.event.record()

    def wait(self) -> list[int]:
        """The tokens as ints, once their copy is done (not what was queued after it)."""
        assert self.tokens is not None, "start first"
        start = time.perf_counter()
        if self.cuda:
            self.event.synchronize()
        out, self.tokens = self.tokens.tolist(), None
        self.waited = time.perf_counter() - start
        return out


class Lookahead:
    def __init__(self, runner):  # noqa: ANN001 - engine.runtime.runner.Runner
        self.runner = runner
        # the tokens fed on the device where the runner takes them; BONSAI_TOKEN_FEED=host launches the step after the
        # read-back (session 34's way: the in-run baseline of docs/perf.md)
        self.on_device = getattr(runner, "takes_device_tokens", False) and os.environ.get("BONSAI_TOKEN_FEED") != "host"
        self.rows: list[int] = []  # slot indices of the step launched ahead, in its row order
        self.tokens: list[int] | None = []  # the token each row fed (None: fed from the device, not read back yet)
        self.logits: torch.Tensor | None = None  # [B, V]
        self.keep: list[int] = []  # the rows of logits still wanted (rows that ended were dropped alone)

    def launch(self, rows: list[int], tokens: list[int] | torch.Tensor) -> None:
        """Start the decode step of `rows` (slot indices) feeding `tokens` (ints, or the sampler's tensor [B] on the
        device: then `settle` with their values); its slots hold the tokens now."""
        assert not self.rows, "one step ahead at most"
        self.logits = self.runner.decode_batch([self.runner.slot(i) for i in rows], tokens)  # [B, V]
        self.rows, self.keep = list(rows), list(range(len(rows)))
        self.tokens = None if isinstance(tokens, torch.Tensor) else list(tokens)

    def settle(self, tokens: list[int]) -> None:
        """The values of the device tokens the step launched ahead fed, read back: into its slots."""
        if not self.rows or self.tokens is not None:
            return
        assert len(tokens) == len(self.rows)
        for i, token in zip(self.rows, tokens):
            self.runner.slot(i).tokens[-1] = token
        self.tokens = list(tokens)

    def take(self, rows: list[int], tokens: list[int]) -> torch.Tensor | None:
        """The logits [B, V] of the step launched ahead if it is this one (same rows, same tokens), else None
        (and the step launched ahead, if any, is dropped)."""
        if self.rows and self.rows == rows and self.tokens == tokens:
            logits = self.logits if len(self.keep) == self.logits.shape[0] else self.logits[self.keep]
            self.rows, self.tokens, self.logits, self.keep = [], [], None, []
            return logits
        self.drop_all()
        return None

    def drop(self, index: int) -> None:
        """Slot `index` leaves (its request ended or failed): its row of the step launched ahead is dropped, its slot
        forgets the token it fed; the other rows stay."""
        if index not in self.rows:
            return
        at = self.rows.index(index)
        self.runner.slot(index).rewind(1)
        del self.rows[at], self.keep[at]
        if self.tokens is not None:
            del self.tokens[at]
        if not self.rows:
            self.tokens, self.logits = [], None

    def drop_all(self) -> None:
        for i in self.rows:
            self.runner.slot(i).rewind(1)
        self.rows, self.tokens, self.logits, self.keep = [], [], None, []

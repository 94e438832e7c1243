"""What rank 0 tells every stage before each pass: a small command of integers (pure).

A command says what the pass is (plain rows of tokens through `Transformer.forward_hidden`, or one
token per row through the fused decode step), where its rows go in the KV cache (slot and start
position of each row), and what comes back. Positions and slots travel with every command, so a
rewind (speculative decoding) needs no message: the next pass simply writes over the rejected rows —
except for a hybrid, whose DeltaNet states cannot forget tokens: rank 0 tells each rewind (RESTORE) and
each prefix point it keeps (SAVE_POINT), and every stage does the same with its own layers' states.
The hidden states that follow a command, and the logits the last stage returns, have the shapes
the command implies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STOP, PLAIN, ROWS, PREPARE, CALIBRATE, SAVE_POINT, RESTORE = 0, 1, 2, 3, 4, 5, 6
STATE_OPS = (SAVE_POINT, RESTORE)  # a hybrid's DeltaNet states (no hidden states follow, nothing comes back)
RECORD = 1  # PLAIN arg: a verify pass (a hybrid keeps each position's DeltaNet state for the rewind)
MAX_ROWS = 64  # rows one command describes (runtime.max_batch_size is at most 64)
WORDS = 6 + 2 * MAX_ROWS


@dataclass(frozen=True)
class Command:
    op: int
    slots: tuple[int, ...] = ()  # the KV slot of each row
    starts: tuple[int, ...] = ()  # PLAIN: each row's first position; ROWS: each row's position
    num_tokens: int = 1  # PLAIN: tokens per row (T)
    num_logits: int = 1  # PLAIN: logits of the last n positions; -1: all; 0: nothing comes back
    arg: int = 0  # PREPARE: capture the fused step for 2..arg rows; PLAIN: RECORD or 0
    # CALIBRATE: num_tokens calibration tokens through a scratch float cache; each stage sets its
    # quantized cache's key offsets (engine.runtime.kv_calibration), then builds its fused step
    # SAVE_POINT (a hybrid): slot slots[0]'s DeltaNet state after starts[0] tokens into prefix-point entry arg;
    # RESTORE: back to its state after starts[0] tokens, from prefix-point entry arg (-1: its verify's snapshot)

    def __post_init__(self) -> None:
        assert len(self.slots) == len(self.starts) <= MAX_ROWS, (len(self.slots), len(self.starts))

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def kv_len(self) -> int:
        """PLAIN: the keys attention reads (the furthest row's end)."""
        return max(self.starts) + self.num_tokens

    @property
    def wants_output(self) -> bool:
        return self.op == ROWS or (self.op == PLAIN and self.num_logits != 0)  # CALIBRATE: nothing back

    def hidden_shape(self, hidden_size: int) -> tuple[int, ...]:
        """The hidden states one stage passes to the next: PLAIN [B, T, H] (model dtype), ROWS [M, H] (float32)."""
        if self.op == CALIBRATE:
            return (1, self.num_tokens, hidden_size)
        return (self.rows, self.num_tokens, hidden_size) if self.op == PLAIN else (self.rows, hidden_size)

    def output_shape(self, vocab_size: int) -> tuple[int, ...]:
        """The float32 logits the last stage returns: PLAIN [B, n, V], ROWS [M, V]."""
        if self.op == ROWS:
            return (self.rows, vocab_size)
        n = self.num_tokens if self.num_logits < 0 else min(self.num_logits, self.num_tokens)
        return (self.rows, n, vocab_size)

    def encode(self) -> torch.Tensor:
        words = [self.op, self.rows, self.num_tokens, self.num_logits, self.arg, 0]
        words += list(self.slots) + [0] * (MAX_ROWS - self.rows) + list(self.starts) + [0] * (MAX_ROWS - self.rows)
        return torch.tensor(words, dtype=torch.int64)  # [WORDS]

    @staticmethod
    def decode(t: torch.Tensor) -> "Command":
        w = t.tolist()
        op, rows, num_tokens, num_logits, arg = w[:5]
        slots = tuple(w[6:6 + rows])
        starts = tuple(w[6 + MAX_ROWS:6 + MAX_ROWS + rows])
        return Command(op, slots, starts, num_tokens, num_logits, arg)


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """n rows as `parts` (at most n) contiguous micro-batches, the first ones one row larger."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def micro_batches(rows: int, stages: int, max_rows: int, flat_cost: bool) -> list[tuple[int, int]]:
    """How a step of `rows` rows goes through the pipeline: contiguous micro-batches, in flight
    together. Never more than max_rows rows in one (the fused step's limit; 0: no limit). Where a
    pass costs about the same for any row count up to max_rows (flat_cost: the fused step on a GPU
    reads all of the stage's weights whatever the rows), a step of at most max_rows rows stays whole:
    split in two it would read every weight twice and take 3 half-steps instead of 2. Where the
    cost grows with the rows (a CPU), it is split into one micro-batch per stage, so that stage k
    runs micro-batch i + 1 while stage k + 1 runs micro-batch i."""
    parts = -(-rows // max_rows) if max_rows else 1
    if not flat_cost:
        parts = max(parts, stages)
    return split_rows(rows, parts)

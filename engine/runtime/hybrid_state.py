"""Per-slot state of a hybrid model's DeltaNet layers: the fp32 recurrent state [Hv, Dk, Dv] and the conv
window (the last K-1 conv inputs) per layer per slot, next to the attention layers' KV rows.

A state holds a slot's whole past, so a slot cannot forget tokens the way KV rows can. What it can do:
- start over: a pass that starts at position 0 ignores what the state holds (the zero state);
- roll back after a verify pass: while `recording`, each DeltaNet layer keeps the state after every
  position of the pass (`write(..., kept)`), and `HybridSlot.rewind` copies the one of the accepted
  length back; any later pass over the slot drops those copies;
- go back to a prefix point: after every prompt pass of more than one token (a prefill chunk) the runner saves the
  slot's state with the tokens it holds (`save_point`; the newest POINTS per slot, in host memory), so a later
  request sharing a prefix restarts from the longest saved point inside it (the same prompt again, a conversation
  whose earlier answer the template re-renders differently: a thinking model's stripped reasoning). A point is
  used only while the slot's tokens up to it are still the ones it was saved with.
Every other rewind is refused (one line): callers ask `keepable` first.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.errors import BonsaiError
from engine.runtime.kv_cache import KVSlot
from engine.sources.model_config import ModelConfig


@dataclass
class _RowSnapshot:
    """A fused step's rollback points for one slot: `entries[j]` of the row buffers holds the state after j
    of its rows (j = 0: the state before them); valid while those entries are still its own (`token`)."""
    start: int
    entries: list[int]
    token: int


@dataclass
class _Snapshot:
    start: int  # the slot's length before the recorded pass
    recurrent: list[torch.Tensor]  # per layer [T+1, Hv, Dk, Dv]: after 0..T tokens of the pass
    seen: list[torch.Tensor]  # per layer [C, K-1+T]: the conv inputs (window, then the pass's)


POINTS = 2  # prefix points kept per slot (host memory: engine.memory.plan counts them)


class HybridStates:
    recording = False  # set around a verify pass (ModelRunner.verify)

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        hc = config.hybrid
        layers = hc.counts()["linear_attention"]
        self.kernel = hc.conv_kernel
        self.conv = torch.zeros(layers, num_slots, hc.conv_dim, hc.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(layers, num_slots, hc.linear_num_value_heads, hc.linear_key_head_dim,
                                     hc.linear_value_head_dim, dtype=torch.float32, device=device)
        self.snapshots: dict[int, _Snapshot | _RowSnapshot] = {}
        self._pending: dict[int, _Snapshot] = {}
        # a fused step's rows of one slot (a verify): the state after each row, [L, R, ...] (allocate_rows)
        self.row_recurrent: torch.Tensor | None = None  # [L, R, Hv, Dk, Dv] float32
        self.row_conv: torch.Tensor | None = None  # [L, R, C, K-1]
        self._owners: list[int] = []  # per row-buffer entry: the token of the snapshot that holds it
        self._cursor = 0  # the next free entry (the buffers are used round-robin)
        self._tokens = 0
        # prefix points: per slot POINTS host copies of (conv, recurrent) and, oldest first, (tokens, copy index)
        self._points: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[tuple[int, ...], int]]]] = {}

    @property
    def row_capacity(self) -> int:
        return 0 if self.row_recurrent is None else self.row_recurrent.shape[1]

    def ensure_rows(self, rows: int) -> bool:
        """Room for the rollback points of `rows` rows of one slot; True where the buffers were made anew (fused
        steps captured with the old ones must be captured again)."""
        if self.row_capacity >= rows:
            return False
        self.allocate_rows(rows)
        return True

    def allocate_rows(self, rows: int) -> None:
        """Room for the rollback points of a fused step of `rows` rows (the memory plan's verify states)."""
        layers = self.recurrent.shape[0]
        self.row_recurrent = torch.zeros(layers, rows, *self.recurrent.shape[2:], dtype=torch.float32,
                                         device=self.recurrent.device)
        self.row_conv = torch.zeros(layers, rows, *self.conv.shape[2:], dtype=self.conv.dtype, device=self.conv.device)
        self._owners, self._cursor = [0] * rows, 0

    def row_snapshots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row buffers of one DeltaNet layer ([R, Hv, Dk, Dv], [R, C, K-1]); before allocate_rows, a
        slot's own state stands in (written only at snap_idx >= 0, which then names no row)."""
        if self.row_recurrent is None:
            return self.recurrent[layer], self.conv[layer]
        return self.row_recurrent[layer], self.row_conv[layer]

    def begin_row_runs(self, runs: list[tuple[int, int, int]]) -> list[int]:
        """Before a fused step whose rows are `runs` (slot, start, n) in row order: the slots' old rollback
        points are dropped, a run of n > 1 rows keeps its state before them (copied now) and after each of its
        rows but the last (the kernels, at the returned snap_idx per row; -1: not kept). Entries are taken
        round-robin, so the passes of one engine step (a verify per slot) keep each other's."""
        snap_idx = []
        for slot, start, n in runs:
            self.snapshots.pop(slot, None)
            if n == 1:
                snap_idx.append(-1)
                continue
            assert n <= self.row_capacity, f"{n} rows of slot {slot}: the row buffers hold {self.row_capacity}"
            entry = self._cursor if self._cursor + n <= self.row_capacity else 0
            self._cursor, self._tokens = entry + n, self._tokens + 1
            self._owners[entry:entry + n] = [self._tokens] * n
            self.row_recurrent[:, entry] = self.recurrent[:, slot]
            self.row_conv[:, entry] = self.conv[:, slot]
            self.snapshots[slot] = _RowSnapshot(start, list(range(entry, entry + n)), self._tokens)
            snap_idx += list(range(entry + 1, entry + n)) + [-1]
        return snap_idx

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def read(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The window [B, C, K-1] and recurrent state [B, Hv, Dk, Dv] of each row's slot, zeros where it starts at 0
        (copies; one slot by its index, no index tensor: a prefill chunk stays capturable in a CUDA graph)."""
        rows = list(batch.slots)
        if len(rows) == 1:
            window, rec = self.conv[layer, rows[0]][None].clone(), self.recurrent[layer, rows[0]][None].clone()
            if batch.starts[0] == 0:
                window.zero_()
                rec.zero_()
            return window, rec
        window, rec = self.conv[layer, rows], self.recurrent[layer, rows]  # copies (advanced indexing)
        fresh = [i for i, start in enumerate(batch.starts) if start == 0]
        if fresh:
            window[fresh] = 0
            rec[fresh] = 0
        return window, rec

    def write(self, layer: int, batch, seen: torch.Tensor, rec: torch.Tensor, kept: torch.Tensor | None) -> None:
        """After a pass: each row's new window (the last K-1 of seen [B, C, K-1+T]) and state [B, Hv, Dk, Dv];
        kept [B, T+1, Hv, Dk, Dv] (recording: one row) is kept for a rollback."""
        rows = list(batch.slots)
        window = seen[:, :, seen.shape[-1] - (self.kernel - 1):]  # [B, C, K-1]
        if len(rows) == 1:
            self.conv[layer, rows[0]].copy_(window[0])
            self.recurrent[layer, rows[0]].copy_(rec[0])
        else:
            self.conv[layer, rows] = window.to(self.conv.dtype)
            self.recurrent[layer, rows] = rec
        if layer == 0:
            for slot in rows:
                self.forget(slot)
        if kept is not None:
            assert len(rows) == 1, "a recorded (verify) pass runs one slot"
            snap = self._pending.setdefault(rows[0], _Snapshot(batch.starts[0], [], []))
            snap.recurrent.append(kept[0])
            snap.seen.append(seen[0])

    def save_point(self, slot: int, tokens: list[int]) -> int | None:
        """Keep the slot's state after `tokens` (what it holds now) as a prefix point, over its oldest one; the entry
        it went to (None: that point is kept already). The copies are queued on the current stream (the slot's next
        pass, also queued there, cannot overtake them)."""
        key = tuple(tokens)
        saved = self._points[slot][2] if slot in self._points else []
        if any(t == key for t, _ in saved):  # (a prompt prefilled again from a point: the same state)
            return None
        entry = saved[0][1] if len(saved) == POINTS else len(saved)  # a free entry, else the oldest one's
        self.save_entry(slot, entry, key)
        return entry

    def save_entry(self, slot: int, entry: int, key: tuple = ()) -> None:
        """The slot's state into prefix-point entry `entry`, as the point of `key` (its tokens; a later pipeline
        stage, which restores by entry, keeps none)."""
        if slot not in self._points:
            shapes = (((POINTS, *self.conv[:, slot].shape), self.conv.dtype),
                      ((POINTS, *self.recurrent[:, slot].shape), torch.float32))
            pin = self.recurrent.is_cuda
            try:  # pinned: the copies overlap the host; pageable where pinning is refused (they then wait)
                conv, rec = (torch.empty(shape, dtype=dtype, pin_memory=pin) for shape, dtype in shapes)
            except RuntimeError:
                conv, rec = (torch.empty(shape, dtype=dtype) for shape, dtype in shapes)
            self._points[slot] = (conv, rec, [])
        conv, rec, saved = self._points[slot]
        saved[:] = [(t, e) for t, e in saved if e != entry]
        conv[entry].copy_(self.conv[:, slot], non_blocking=True)
        rec[entry].copy_(self.recurrent[:, slot], non_blocking=True)
        saved.append((key, entry))

    def _matching(self, slot: int, tokens: list[int]):
        """(length, entry) of every saved point whose tokens `tokens` still begin with."""
        saved = self._points[slot][2] if slot in self._points else []
        return [(len(t), entry) for t, entry in saved if tuple(tokens[:len(t)]) == t]

    def best_point(self, slot: int, n: int, tokens: list[int]) -> int:
        """The longest saved prefix point of at most n tokens that `tokens` (the slot's) still begin with; 0: none."""
        return max((length for length, _ in self._matching(slot, tokens) if length <= n), default=0)

    def restore_point(self, slot: int, length: int, tokens: list[int]) -> int | None:
        """Put back the state a prefix point of `length` tokens saved, if `tokens` still begin with its tokens: its
        entry (None: no such point)."""
        entry = next((e for n, e in self._matching(slot, tokens) if n == length), None)
        if length == 0 or entry is None:
            return None
        self.restore_entry(slot, entry)
        return entry

    def restore_entry(self, slot: int, entry: int) -> None:
        conv, rec, _ = self._points[slot]
        self.conv[:, slot].copy_(conv[entry], non_blocking=True)
        self.recurrent[:, slot].copy_(rec[entry], non_blocking=True)

    def forget(self, slot: int) -> None:
        """The slot's rollback points are gone (its state moved on). A replayed prefill graph does not run the
        host side of `write`: the runner calls this before the replay."""
        self.snapshots.pop(slot, None)

    def end_recording(self) -> None:
        """The recorded pass is over: its per-position states become the slots' rollback points."""
        self.snapshots.update(self._pending)
        self._pending = {}

    def restore(self, slot: int, length: int) -> bool:
        """Put back the state of `slot` after its first `length` tokens, if a snapshot holds it."""
        snap = self.snapshots.get(slot)
        if isinstance(snap, _RowSnapshot):
            j = length - snap.start
            if any(self._owners[e] != snap.token for e in snap.entries) or not 0 <= j <= len(snap.entries):
                return False
            if j < len(snap.entries):  # (j = all its rows: the slot's state is that already)
                self.recurrent[:, slot] = self.row_recurrent[:, snap.entries[j]]
                self.conv[:, slot] = self.row_conv[:, snap.entries[j]]
            return True
        if snap is None or not snap.start <= length <= snap.start + snap.recurrent[0].shape[0] - 1:
            return False
        j = length - snap.start
        for layer, (rec, seen) in enumerate(zip(snap.recurrent, snap.seen)):
            self.recurrent[layer, slot] = rec[j]
            self.conv[layer, slot] = seen[:, j:j + self.kernel - 1]
        return True


@dataclass
class HybridSlot(KVSlot):
    """A slot of a hybrid model: its rewinds restore the DeltaNet state (or are refused). on_restore(slot, length,
    entry) is told each restore (entry: the prefix point's, -1 a verify's snapshot): a pipeline's rank 0 has the
    other stages restore theirs."""
    states: HybridStates | None = field(default=None, repr=False)
    on_restore: Callable[[int, int, int], None] | None = field(default=None, repr=False)

    def keepable(self, n: int) -> int:
        """The longest prefix of at most n tokens the slot can be cut back to: all of it, else its longest prefix
        point within n (HybridStates.save_point), else nothing."""
        return n if n >= self.length else self.states.best_point(self.index, n, self.tokens)

    def rewind(self, n: int) -> None:
        if n == 0:
            return
        target = self.length - n
        if target > 0:
            entry = -1 if self.states.restore(self.index, target) else \
                self.states.restore_point(self.index, target, self.tokens)
            if entry is None:
                raise BonsaiError(f"slot {self.index} of a hybrid (DeltaNet) model cannot go back {n} tokens: its "
                                  "state was not saved there; this decoding path is not supported for hybrid models")
            if self.on_restore is not None:
                self.on_restore(self.index, target, entry)
        super().rewind(n)


@contextmanager
def recording(states: HybridStates | None, on: bool = True) -> Iterator[None]:
    """Around a verify pass of the model's path: every position's state kept; after it, those states are the slots'
    rollback points (HybridStates.end_recording). Nothing for a dense model (states None) or with on False."""
    if states is None or not on:
        yield
        return
    states.recording = True
    try:
        yield
    finally:
        states.recording = False
        states.end_recording()


def attach_states(cache, config: ModelConfig) -> None:
    """Give a KV cache (engine.runtime.kv_cache.KVCache) of a hybrid model its DeltaNet states and slots."""
    cache.states = HybridStates(config, len(cache.slots), cache.dtype, cache.device)
    cache.slots = [HybridSlot(s.index, s.capacity, states=cache.states) for s in cache.slots]

"""Per-slot state of a hybrid model's DeltaNet layers: the fp32 recurrent state [Hv, Dk, Dv] and the conv
window (the last K-1 conv inputs) per layer per slot, next to the attention layers' KV rows.

A state holds a slot's whole past, so a slot cannot forget tokens the way KV rows can. What it can do:
- start over: a pass that starts at position 0 ignores what the state holds (the zero state);
- roll back after a verify pass: while `recording`, each DeltaNet layer keeps the state after every
  position of the pass (`write(..., kept)`), and `HybridSlot.rewind` copies the one of the accepted
  length back; any later pass over the slot drops those copies.
Every other rewind is refused (one line): callers ask `keepable` first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import BonsaiError
from engine.runtime.kv_cache import KVSlot
from engine.sources.model_config import ModelConfig


@dataclass
class _Snapshot:
    start: int  # the slot's length before the recorded pass
    recurrent: list[torch.Tensor]  # per layer [T+1, Hv, Dk, Dv]: after 0..T tokens of the pass
    seen: list[torch.Tensor]  # per layer [C, K-1+T]: the conv inputs (window, then the pass's)


class HybridStates:
    recording = False  # set around a verify pass (ModelRunner.verify)

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        hc = config.hybrid
        layers = hc.counts()["linear_attention"]
        self.kernel = hc.conv_kernel
        self.conv = torch.zeros(layers, num_slots, hc.conv_dim, hc.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(layers, num_slots, hc.linear_num_value_heads, hc.linear_key_head_dim,
                                     hc.linear_value_head_dim, dtype=torch.float32, device=device)
        self.snapshots: dict[int, _Snapshot] = {}
        self._pending: dict[int, _Snapshot] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def read(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The window [B, C, K-1] and recurrent state [B, Hv, Dk, Dv] of each row's slot, zeros where it starts at 0."""
        rows = list(batch.slots)
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
        self.conv[layer, rows] = seen[:, :, seen.shape[-1] - (self.kernel - 1):].to(self.conv.dtype)
        self.recurrent[layer, rows] = rec
        if layer == 0:
            for slot in rows:
                self.snapshots.pop(slot, None)
        if kept is not None:
            assert len(rows) == 1, "a recorded (verify) pass runs one slot"
            snap = self._pending.setdefault(rows[0], _Snapshot(batch.starts[0], [], []))
            snap.recurrent.append(kept[0])
            snap.seen.append(seen[0])

    def end_recording(self) -> None:
        """The recorded pass is over: its per-position states become the slots' rollback points."""
        self.snapshots.update(self._pending)
        self._pending = {}

    def restore(self, slot: int, length: int) -> bool:
        """Put back the state of `slot` after its first `length` tokens, if a snapshot holds it."""
        snap = self.snapshots.get(slot)
        if snap is None or not snap.start <= length <= snap.start + snap.recurrent[0].shape[0] - 1:
            return False
        j = length - snap.start
        for layer, (rec, seen) in enumerate(zip(snap.recurrent, snap.seen)):
            self.recurrent[layer, slot] = rec[j]
            self.conv[layer, slot] = seen[:, j:j + self.kernel - 1]
        return True


@dataclass
class HybridSlot(KVSlot):
    """A slot of a hybrid model: its rewinds restore the DeltaNet state (or are refused)."""
    states: HybridStates | None = field(default=None, repr=False)

    def keepable(self, n: int) -> int:
        """The longest prefix of at most n tokens the slot can be cut back to: all of it, or nothing."""
        return n if n >= self.length else 0

    def rewind(self, n: int) -> None:
        if n == 0:
            return
        target = self.length - n
        if target > 0 and not self.states.restore(self.index, target):
            raise BonsaiError(f"slot {self.index} of a hybrid (DeltaNet) model cannot go back {n} tokens: its "
                              "state was not saved there; this decoding path is not supported for hybrid models")
        super().rewind(n)


def attach_states(cache, config: ModelConfig) -> None:
    """Give a KV cache (engine.runtime.kv_cache.KVCache) of a hybrid model its DeltaNet states and slots."""
    cache.states = HybridStates(config, len(cache.slots), cache.dtype, cache.device)
    cache.slots = [HybridSlot(s.index, s.capacity, states=cache.states) for s in cache.slots]


def check_hybrid_run(kv_type, kv_offload: bool, offload_layers) -> None:
    """One line for each run option the hybrid (DeltaNet) path does not support yet."""
    name = getattr(kv_type, "name", kv_type)
    if name not in ("bf16", "float"):
        raise BonsaiError(f"KV type {name} is not supported for hybrid (Qwen3.5/3.6) models yet: use kv_type bf16")
    if kv_offload:
        raise BonsaiError("KV offload is not supported for hybrid (Qwen3.5/3.6) models yet: drop kv_offload")
    if offload_layers is not None:
        raise BonsaiError("weight offload is not supported for hybrid (Qwen3.5/3.6) models yet: drop weight_offload")

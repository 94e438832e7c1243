"""A static, preallocated KV cache shared by sequence slots, each of which can be rewound.

Tensors are allocated once ([layers, slots, kv_heads, max_seq, head_dim]) so shapes never change;
each slot is a handle with its own length and the token ids it holds (for prefix reuse).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.model_config import ModelConfig


@dataclass
class KVSlot:
    """Bookkeeping of one sequence slot: which tokens its rows of the cache hold."""
    index: int
    capacity: int
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rewind(self, n: int) -> None:
        """Forget the last n tokens (their cache rows are overwritten by later writes)."""
        assert 0 <= n <= self.length, (n, self.length)
        del self.tokens[self.length - n:]

    def reset(self) -> None:
        self.tokens.clear()

    def common_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` this slot already holds."""
        n = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class CacheBatch:
    """Where one forward pass's rows go: slot indices and start positions as plain ints (so the
    single-sequence path never reads a device tensor back), and the same as device tensors."""
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    positions: torch.Tensor  # [B, T] absolute positions of the new tokens
    slot_ids: torch.Tensor  # [B]

    @staticmethod
    def make(slots: list[int], starts: list[int], num_tokens: int, device: torch.device | str) -> "CacheBatch":
        assert len(slots) == len(starts) and num_tokens > 0
        offsets = torch.arange(num_tokens, device=device)
        positions = torch.tensor(starts, device=device)[:, None] + offsets[None, :]  # [B, T]
        return CacheBatch(tuple(slots), tuple(starts), positions, torch.tensor(slots, device=device))


class KVCache:
    streamed = False  # True where the storage lives elsewhere and layers are streamed in (engine.kv_offload)

    def __init__(self, config: ModelConfig, max_seq_len: int, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        # every storage tensor is [L, slots, kv_heads, S, X] (X: elements per row in its format), so
        # code that moves whole rows (offload, slot copies) can treat them alike
        self.tensors: dict[str, torch.Tensor] = {
            "k": torch.zeros(shape, dtype=dtype, device=device),  # [L, slots, kv_heads, S, D]
            "v": torch.zeros(shape, dtype=dtype, device=device),  # [L, slots, kv_heads, S, D]
        }
        self.max_seq_len = max_seq_len
        self.slots = [KVSlot(i, max_seq_len) for i in range(num_slots)]
        self.device = torch.device(device)  # where attention reads the cache
        # per layer, views of every storage tensor: {name: [slots, kv_heads, S, X]} (made once: no
        # per-step view creation on the decode path)
        self._layers = [{name: t[i] for name, t in self.tensors.items()} for i in range(config.num_layers)]

    @property
    def k(self) -> torch.Tensor:
        return self.tensors["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.tensors["v"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Where layer i's rows are read and written during a forward pass: {name: [slots, kv_heads, S, X]}
        on self.device. Layers are visited in order within a pass (an offloaded cache streams them in)."""
        return self._layers[i]

    def begin_pass(self, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> None:
        """A forward pass is about to write positions [starts[r], ends[r]) of slot slots[r] for each row r
        and read the positions before them. The resident cache has nothing to do (only `streamed` caches
        are told, so the resident decode path makes no extra call)."""

    def write(self, layer: int, batch: CacheBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of new tokens: k, v [B, kv_heads, T, D] at batch.positions [B, T]."""
        kv = self.layer(layer)
        if len(batch.slots) == 1:
            slot, start, t = batch.slots[0], batch.starts[0], k.shape[2]
            kv["k"][slot, :, start:start + t] = k[0]
            kv["v"][slot, :, start:start + t] = v[0]
            return
        heads = torch.arange(k.shape[1], device=k.device)
        index = (batch.slot_ids[:, None, None], heads[None, :, None], batch.positions[:, None, :])  # → [B, H, T]
        kv["k"].index_put_(index, k)
        kv["v"].index_put_(index, v)

    def read(self, layer: int, batch: CacheBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the first `length` positions: two [B, kv_heads, length, D]."""
        kv = self.layer(layer)
        k, v = kv["k"], kv["v"]  # [slots, kv_heads, S, D]
        if len(batch.slots) == 1:
            slot = batch.slots[0]
            return k[slot, :, :length].unsqueeze(0), v[slot, :, :length].unsqueeze(0)
        first = batch.slots[0]
        if batch.slots == tuple(range(first, first + len(batch.slots))):  # consecutive slots: a view, no copy
            rows = slice(first, first + len(batch.slots))
            return k[rows, :, :length], v[rows, :, :length]
        return k[batch.slot_ids, :, :length], v[batch.slot_ids, :, :length]

"""A static, preallocated KV cache shared by sequence slots, each of which can be rewound.

Tensors are allocated once ([layers, slots, kv_heads, max_seq, head_dim]) so shapes never change;
each slot is a handle with its own length and the token ids it holds (for prefix reuse).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def k(self) -> torch.Tensor:
        return self.tensors["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.tensors["v"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, layer: int, batch: CacheBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of new tokens: k, v [B, kv_heads, T, D] at batch.positions [B, T]."""
        if len(batch.slots) == 1:
            slot, start, t = batch.slots[0], batch.starts[0], k.shape[2]
            self.k[layer, slot, :, start:start + t] = k[0]
            self.v[layer, slot, :, start:start + t] = v[0]
            return
        heads = torch.arange(k.shape[1], device=k.device)
        index = (batch.slot_ids[:, None, None], heads[None, :, None], batch.positions[:, None, :])  # → [B, H, T]
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def read(self, layer: int, batch: CacheBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the first `length` positions: two [B, kv_heads, length, D]."""
        if len(batch.slots) == 1:
            slot = batch.slots[0]
            return self.k[layer, slot, :, :length].unsqueeze(0), self.v[layer, slot, :, :length].unsqueeze(0)
        first = batch.slots[0]
        if batch.slots == tuple(range(first, first + len(batch.slots))):  # consecutive slots: a view, no copy
            rows = slice(first, first + len(batch.slots))
            return self.k[layer, rows, :, :length], self.v[layer, rows, :, :length]
        return self.k[layer, batch.slot_ids, :, :length], self.v[layer, batch.slot_ids, :, :length]

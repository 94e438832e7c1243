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


class KVCache:
    def __init__(self, config: ModelConfig, max_seq_len: int, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kv_heads, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kv_heads, S, D]
        self.max_seq_len = max_seq_len
        self.slots = [KVSlot(i, max_seq_len) for i in range(num_slots)]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of new tokens: k, v [B, kv_heads, T, D] at positions [B, T]."""
        if slot_ids.numel() == 1:
            slot, start, t = int(slot_ids[0]), int(positions[0, 0]), positions.shape[1]
            self.k[layer, slot, :, start:start + t] = k[0]
            self.v[layer, slot, :, start:start + t] = v[0]
            return
        heads = torch.arange(k.shape[1], device=k.device)
        index = (slot_ids[:, None, None], heads[None, :, None], positions[:, None, :])  # → [B, H, T]
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def read(self, layer: int, slot_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the first `length` positions: two [B, kv_heads, length, D]."""
        if slot_ids.numel() == 1:
            slot = int(slot_ids[0])
            return self.k[layer, slot, :, :length].unsqueeze(0), self.v[layer, slot, :, :length].unsqueeze(0)
        return self.k[layer, slot_ids, :, :length], self.v[layer, slot_ids, :, :length]

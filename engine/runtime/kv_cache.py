"""A static, preallocated KV cache shared by sequence slots, each of which can be rewound.

Tensors are allocated once ([layers, slots, kv_heads, max_seq, X]) so shapes never change;
each slot is a handle with its own length and the token ids it holds (for prefix reuse).
With a quantized KV type (quant/kv_format.py) rows are quantized as they are written (k, v hold
the codes; k_scale, k_min, v_scale, v_min their float16 scales and minima) and dequantized to the
model's dtype as they are read; the fused decode step's kernels read the codes directly.
Quantized keys are stored minus a fixed per-(layer, kv head) vector, `key_offset`: every key of a
query shifts its score by the same q·offset, so attention is unchanged, while the keys' large
shared component (most of their norm in Llama-family models) no longer takes the quantization range.
Then, with `key_rotation`, they are rotated by the orthonormal Hadamard matrix H over head_dim
(quant/kv_quant.py): a key's outlier channels are spread over all of its elements before the row is
quantized. Attention over rotated keys takes queries rotated alike ((qH)·(kH) = q·k): every reader of
a quantized cache gets its queries through `key_space` (the plain path) or from the rope / KV-write
kernel, which rotates q when it is given `k_rotate` (`layer_write_args`: the fused prefill prologue,
the decode step). Keys read back (`read`) are the stored ones: centred and rotated.
int4 values are rotated alike (`value_rotation`); the attention kernels then rotate their output back
(`layer_read_args` gives them `v_rotate`), and `read` returns the stored, rotated values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.errors import BonsaiError
from engine.sources.model_config import ModelConfig
from quant.kv_format import KV_TYPES, KVType
from quant.kv_quant import dequantize_rows, quantize_rows, row_parts, transform_queries


@dataclass
class KVSlot:
    """Bookkeeping of one sequence slot: which tokens its rows of the cache hold."""
    index: int
    capacity: int
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def check_room(self, n: int) -> None:
        """One clear error if n more tokens do not fit the slot's context."""
        if self.length + n > self.capacity:
            raise BonsaiError(f"the sequence needs {self.length + n} positions but the context holds "
                              f"{self.capacity}: shorten the prompt or raise max_seq_len")

    def keepable(self, n: int) -> int:
        """The longest prefix of at most n tokens this slot can be cut back to (a KV slot: any)."""
        return n

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


def kv_type_of(name: str | KVType) -> KVType:
    """A KV type by name (bf16 | int8 | int4 | k8v4); an unknown name is a one-line error."""
    if isinstance(name, KVType):
        return name
    if name not in KV_TYPES:
        raise BonsaiError(f"unknown KV type '{name}': use one of {', '.join(KV_TYPES)}")
    return KV_TYPES[name]


class KVCache:
    streamed = False  # True where the storage lives elsewhere and layers are streamed in (engine.memory.kv_offload)
    states = None  # a hybrid model's DeltaNet states (engine.runtime.hybrid_state.attach_states)

    def __init__(self, config: ModelConfig, max_seq_len: int, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_type: str | KVType = "bf16"):
        """dtype: the model's dtype (what reads return, and the storage of a float KV type);
        kv_type: bf16 (rows in dtype) | int8 | int4 | k8v4 (quant/kv_format.py)."""
        self.kv_type = kv_type_of(kv_type)
        self.dtype = dtype
        self.elements = {"k": self.kv_type.key, "v": self.kv_type.value}
        lead = (config.num_kv_layers, num_slots, config.num_kv_heads, max_seq_len)
        # every storage tensor is [L, slots, kv_heads, S, X] (X: elements per row in its format), so
        # code that moves whole rows (offload, slot copies) can treat them alike
        self.tensors: dict[str, torch.Tensor] = {}
        self.parts: dict[str, tuple[str, ...]] = {}  # "k" / "v" → the parts of its rows ("" = codes or values)
        for name, element in self.elements.items():
            try:
                parts = row_parts(element, config.head_dim, dtype)
            except ValueError as e:
                raise BonsaiError(f"KV type {self.kv_type.name} does not fit this model: {e}; "
                                  "use bf16 or int8") from None
            self.parts[name] = tuple(parts)
            for part, (width, part_dtype) in parts.items():
                self.tensors[self._name(name, part)] = torch.zeros(*lead, width, dtype=part_dtype, device=device)
        self.max_seq_len = max_seq_len
        self.slots = [KVSlot(i, max_seq_len) for i in range(num_slots)]
        # [L, KV, D] float32, subtracted from quantized keys as they are written (reads return keys
        # minus it: the same attention). A constant of the model (engine/runtime/kv_calibration.py), not
        # state of a sequence: set once before the first write, never moved with the rows.
        self.key_offset: torch.Tensor | None = None
        # quantized keys are stored rotated by H (needs a power-of-two head_dim; the fast Hadamard
        # transform); a property of the cache's layout, fixed at construction
        d = config.head_dim
        self.key_rotation = self.kv_type.key != "float" and d & (d - 1) == 0
        # int4 values are stored rotated by H too, and attention outputs rotated back (o = H·Σ p·(H v));
        # int8 values are near-lossless as they are (docs/quality.md)
        self.value_rotation = self.kv_type.value == "int4" and d & (d - 1) == 0
        self.device = torch.device(device)  # where attention reads the cache
        # per layer, views of every storage tensor: {name: [slots, kv_heads, S, X]} (made once: no
        # per-step view creation on the decode path)
        self._layers = [{name: t[i] for name, t in self.tensors.items()} for i in range(config.num_kv_layers)]

    @staticmethod
    def _name(name: str, part: str) -> str:
        return f"{name}_{part}" if part else name

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The scale / min tensors of one layer, [slots, kv_heads, S, G] each, by name (k_scale, ...):
        the keyword arguments the KV kernels take next to the code tensors."""
        return {name: t for name, t in self.layer(layer).items() if name not in ("k", "v")}

    def layer_write_args(self, layer: int) -> dict:
        """`layer_scales` plus the layer's key offset [KV, D] if any and `k_rotate` if keys are rotated:
        what the rope / KV-write kernel takes (it then returns q rotated alike, ready for attention)."""
        args: dict = self.layer_scales(layer)
        if self.key_offset is not None:
            args["k_offset"] = self.key_offset[layer]
        if self.key_rotation:
            args["k_rotate"] = True
        if self.value_rotation:
            args["v_rotate"] = True
        return args

    def layer_read_args(self, layer: int) -> dict:
        """`layer_scales` plus `v_rotate` if values are rotated: what the attention kernels take (they then
        rotate their output back)."""
        args: dict = self.layer_scales(layer)
        if self.value_rotation:
            args["v_rotate"] = True
        return args

    def key_space(self, q: torch.Tensor) -> torch.Tensor:
        """Queries [.., D] as attention over this cache's stored keys needs them: rotated by H where the
        keys are (the key offset needs nothing: it shifts all of a query's scores alike)."""
        return transform_queries(q, self.key_rotation)

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
        for name, rows in (("k", k), ("v", v)):
            offset = self.key_offset[layer][:, None] if name == "k" and self.key_offset is not None else None
            parts = quantize_rows(self.elements[name], rows, self.dtype, offset,
                                  rotate=self.key_rotation if name == "k" else self.value_rotation)
            for part, values in parts.items():
                store = self.layer(layer)[self._name(name, part)]  # [slots, kv_heads, S, X]
                if len(batch.slots) == 1:
                    slot, start, t = batch.slots[0], batch.starts[0], rows.shape[2]
                    store[slot, :, start:start + t] = values[0]
                else:
                    heads = torch.arange(rows.shape[1], device=rows.device)
                    index = (batch.slot_ids[:, None, None], heads[None, :, None], batch.positions[:, None, :])
                    store.index_put_(index, values)  # index → [B, H, T]

    def read(self, layer: int, batch: CacheBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the first `length` positions, in the model's dtype: two [B, kv_heads, length, D]."""
        if len(batch.slots) == 1:
            rows = slice(batch.slots[0], batch.slots[0] + 1)
        else:
            first = batch.slots[0]
            consecutive = batch.slots == tuple(range(first, first + len(batch.slots)))
            rows = slice(first, first + len(batch.slots)) if consecutive else batch.slot_ids  # a view where it can
        out, kv = [], self.layer(layer)
        for name in ("k", "v"):
            parts = {part: kv[self._name(name, part)][rows, :, :length] for part in self.parts[name]}
            out.append(parts[""] if self.elements[name] == "float" else
                       dequantize_rows(self.elements[name], parts, self.dtype))  # [B, kv_heads, length, D]
        return out[0], out[1]

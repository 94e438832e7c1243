"""KV offload: the KV pool lives in (pinned) host memory; each layer's rows are streamed to the GPU just
ahead of use and the rows a pass writes go back to the host pool.

The GPU holds a ring of two layer buffers. During a pass, while layer i computes in one buffer, the
side stream fills the other with layer i+1 (the positions in use of each slot the pass touches, not the
whole context), after writing layer i-1's new rows back to the host. CUDA events order the side stream
and the compute stream both ways (engine.memory.host_copies). The model reaches the cache through
`layer(i)` (the buffer holding layer i) and is told each pass's rows by `begin_pass`, so every path
runs unchanged: prefill chunks, one-token decode (fused step or plain), several slots, speculative
verification (several rows of one slot), rewinds (the host pool's rows past a slot's length are stale
and never copied in).

Offloaded decoding runs eagerly, never CUDA-graphed: a step moves the whole context over PCIe (4.8 GB
per token for an 8B model at 32K), so the copies, not the launches, decide its time.

Both pools use a position-major storage: [.., S, kv_heads, X] underneath the [.., kv_heads, S, X] view
every KVCache tensor has, so the positions in use of one (layer, slot) are one contiguous block and
stream in as one copy (the kernels take strides and read the view as they read the resident cache).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from engine.errors import BonsaiError
from engine.memory.host_copies import CopyStream, HostAllocator
from engine.runtime.kv_cache import KVCache
from engine.sources.model_config import ModelConfig

RING = 2  # GPU layer buffers


def _position_major(shape: tuple[int, ...], make) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor stored as [.., S, KV, X] and its [.., KV, S, X] view (the KVCache layout)."""
    *lead, kv, s, x = shape
    storage = make((*lead, s, kv, x))
    return storage, storage.transpose(-3, -2)


class OffloadedKVCache(KVCache):
    """A KVCache whose `tensors` ([L, slots, kv_heads, S, X], the host pool) live in host memory.
    Storage tensors (names, element widths, dtypes) are those a resident KVCache of the same arguments
    would have, whatever they are (keys and values, quantized codes and their scales): each is copied
    row by row alike."""

    streamed = True

    def __init__(self, config: ModelConfig, max_seq_len: int, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 host_bytes: int | None = None, overlap: bool = True, deferred_copies: bool = False,
                 **cache_options):
        """host_bytes: the host memory granted to the pool (memory.host_kv_mib); None: what it needs.
        overlap: prefetch the next layer while one computes (False: copy each layer just before its
        use, to measure what the overlap gains). deferred_copies: tests on the CPU (engine.memory.host_copies)."""
        # the resident cache's constructor on the meta device: its storage tensors (names, shapes,
        # dtypes) and bookkeeping, without memory; then the storage moves to the host
        super().__init__(config, max_seq_len, num_slots, dtype=dtype, device="meta", **cache_options)
        template, self._layers = dict(self.tensors), None
        need = self.nbytes
        if host_bytes is not None and need > host_bytes:
            raise BonsaiError(f"the offloaded KV cache needs {math.ceil(need / 2**20)} MiB of host memory "
                              f"({max_seq_len} positions x {num_slots} slots) but memory.host_kv_mib grants "
                              f"{host_bytes // 2**20}: raise host_kv_mib or lower max_seq_len / max_batch_size")
        self.device = torch.device(device)
        self.num_layers = config.num_kv_layers  # a hybrid: its attention layers only
        self.allocator = HostAllocator(pin=self.device.type == "cuda", what="offloaded KV cache")
        self._host_storage: dict[str, torch.Tensor] = {}  # [L, slots, S, KV, X]
        self.tensors: dict[str, torch.Tensor] = {}  # [L, slots, KV, S, X] views: the host pool
        self._work_storage: list[dict[str, torch.Tensor]] = [{} for _ in range(RING)]  # [slots, S, KV, X]
        self._work: list[dict[str, torch.Tensor]] = [{} for _ in range(RING)]  # [slots, KV, S, X] views
        for name, t in template.items():
            self._host_storage[name], self.tensors[name] = _position_major(
                tuple(t.shape), lambda shape: self.allocator.empty(shape, t.dtype))
            for b in range(RING):
                self._work_storage[b][name], self._work[b][name] = _position_major(
                    tuple(t.shape[1:]), lambda shape: torch.zeros(shape, dtype=t.dtype, device=self.device))
        self.copies = CopyStream(self.device, deferred=deferred_copies)
        self.overlap = overlap
        self._ready: list = [None] * RING  # marker of the copies that filled each buffer
        self._rows: dict[int, tuple[int, int]] = {}  # this pass: slot → (first new position, end)
        self._current = -1  # the layer the compute stream is in
        self._unsaved: tuple[int, dict[int, tuple[int, int]]] | None = None  # (layer, rows) not yet written back

    @property
    def working_nbytes(self) -> int:
        """Bytes of the GPU layer buffers."""
        return sum(t.numel() * t.element_size() for ring in self._work_storage for t in ring.values())

    def begin_pass(self, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> None:
        rows: dict[int, tuple[int, int]] = {}
        for slot, start, end in zip(slots, starts, ends):
            first, last = rows.get(slot, (start, end))
            rows[slot] = (min(first, start), max(last, end))
        assert all(end <= self.max_seq_len for _, end in rows.values()), rows
        self.copies.after_compute()  # both buffers are free once the previous pass is done
        self._write_back_unsaved()
        self._rows = rows
        self._current = -1
        if self.overlap:
            for layer in range(min(RING, self.num_layers)):
                self._prefetch(layer)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        if i != self._current:
            assert i == self._current + 1, f"layers are visited in order: {self._current} then {i}"
            if i > 0:
                # layer i-1's attention is enqueued: its new rows go home, then its buffer takes layer i+1
                self.copies.after_compute()
                self._write_back_unsaved()
                if self.overlap and i + 1 < self.num_layers:
                    self._prefetch(i + 1)
            if not self.overlap:
                self._prefetch(i)
            self.copies.compute_waits(self._ready[i % RING])
            self._current = i
            self._unsaved = (i, self._rows)
        return self._work[i % RING]

    def synchronize(self) -> None:
        """Write the last pass's remaining rows back and wait: the host pool (`tensors`) is then complete."""
        self.copies.after_compute()
        self._write_back_unsaved()
        self.copies.synchronize()

    def _prefetch(self, layer: int) -> None:
        """Copy the positions before each row's new ones (the slot's content) of `layer` into its buffer."""
        buffer = self._work_storage[layer % RING]
        for slot, (start, _) in self._rows.items():
            if start == 0:
                continue
            for name, host in self._host_storage.items():
                self.copies.copy(buffer[name][slot, :start], host[layer, slot, :start])  # [start, KV, X]
        self._ready[layer % RING] = self.copies.mark()

    def _write_back_unsaved(self) -> None:
        if self._unsaved is None:
            return
        layer, rows = self._unsaved
        buffer = self._work_storage[layer % RING]
        for slot, (start, end) in rows.items():
            for name, host in self._host_storage.items():
                self.copies.copy(host[layer, slot, start:end], buffer[name][slot, start:end])  # [T, KV, X]
        self._unsaved = None

    def transfer_bytes(self, context: int, rows: int = 1) -> int:
        """Bytes one pass moves host → GPU for `rows` slots each holding `context` positions."""
        per_position = sum(t[0, 0, :, 0].numel() * t.element_size() for t in self.tensors.values())
        return self.num_layers * rows * context * per_position

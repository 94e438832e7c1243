"""Weight offload: chosen blocks keep their weights (packed words and scales, float matrices, norms,
biases) in pinned host memory and are streamed into a GPU staging buffer block by block, just ahead of
use; the embedding table lives on the host (only the current tokens' rows cross over).

Each offloaded block's tensors are packed into one flat byte buffer on the host, so loading a block is
one copy. The GPU holds two staging buffers; the k-th offloaded block's tensors are views into buffer
k % 2, bound once, so the model code runs unchanged. While block k computes, the side stream loads
block k+1 into the other buffer (the last block of a pass loads the first one of the next pass when
their buffers differ). The loader makes the offloaded blocks in host memory already
(engine.weights.loader, `host_layers`: never on the GPU); each is copied into its pinned flat buffer
and its loaded tensors freed one block at a time. Ordering as in engine.memory.kv_offload (engine.memory.host_copies).

The fused decode step of a streamed run is CUDA-graphed (engine.runtime.cuda_graphs) when every host
buffer is pinned (`graphable`): the copies and their event waits are captured with the compute, so a
pass costs its PCIe time instead of the host's launch time (an eager pass of a 64-block model is
host-bound far above its copies: docs/perf.md, session 11). A graph cannot wait on an event from outside
it, so a replay starts from a fixed state: with an even number of streamed blocks (`wraps`) the first
one is already in its buffer (the previous pass prefetched it; `before_replay` loads it when an eager
pass or nothing did), else the graph loads it itself; every copy a graph issues is joined into it
(`join`) before it ends. Eager passes (prefill chunks) and replays may alternate.

`bytes_per_layer` and `embedding_bytes` are what the memory plan weighs when it picks the layers.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.memory.host_copies import CopyStream, HostAllocator
from engine.memory.host_embedding import HostEmbedding

RING = 2
ALIGN = 256  # bytes: every tensor in a flat buffer starts aligned (a dtype view needs it)


def block_tensors(block: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every weight of a block: (module, attribute, tensor) of its parameters and buffers."""
    found = []
    for module in block.modules():
        for table in (module._parameters, module._buffers):
            found.extend((module, name, t) for name, t in table.items() if t is not None)
    return found


def bytes_per_layer(model: nn.Module) -> list[int]:
    """Bytes of each block's weights (what offloading it saves on the GPU and costs in PCIe per pass).
    Pure: reads shapes and dtypes only (a model on the meta device works)."""
    return [sum(t.numel() * t.element_size() for _, _, t in block_tensors(block)) for block in model.layers]


def embedding_bytes(model: nn.Module) -> int:
    """Bytes the embedding table frees on the GPU when it lives on the host (0 when the output layer
    is tied to it: the output then reads the whole table every step and it must stay)."""
    if model.lm_head is None:
        return 0
    w = model.embed.weight
    return w.numel() * w.element_size()


def _layout(tensors: list[tuple[nn.Module, str, torch.Tensor]]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for _, _, t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, total


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return flat[offset:offset + nbytes].view(like.dtype).view(like.shape)


class WeightStreamer:
    """Streams the weights of the blocks in `layers` from host memory into two GPU staging buffers;
    `model.weight_stream` is set to it, and the model calls `begin_pass` before the embedding and
    `enter(i)` before block i. embedding: put the embedding table on the host (when untied)."""

    def __init__(self, model: nn.Module, layers: Iterable[int], device: torch.device | str,
                 embedding: bool = True, overlap: bool = True, deferred_copies: bool = False):
        self.device = torch.device(device)
        self.order = sorted(set(layers))
        if any(not 0 <= i < len(model.layers) for i in self.order):
            raise ValueError(f"offload layers {self.order} outside 0..{len(model.layers) - 1}")
        self.rank = {layer: r for r, layer in enumerate(self.order)}
        self.overlap = overlap
        self.allocator = HostAllocator(pin=self.device.type == "cuda", what="offloaded weights")
        self.copies = CopyStream(self.device, deferred=deferred_copies)
        self.host: list[torch.Tensor] = []  # per offloaded block: its flat bytes in host memory
        self.layer_bytes = [_layout(block_tensors(model.layers[layer]))[1] for layer in self.order]
        size = max(self.layer_bytes, default=0)
        self.staging = [torch.zeros(size, dtype=torch.uint8, device=self.device)
                        for _ in range(min(RING, len(self.order)))]
        for r, layer in enumerate(self.order):  # a block at a time: its loaded tensors are freed as it is bound
            tensors = block_tensors(model.layers[layer])
            offsets, total = _layout(tensors)
            flat = self.allocator.empty((total,), torch.uint8)
            for (module, name, t), offset in zip(tensors, offsets):
                _view(flat, offset, t).copy_(t)
                view = _view(self.staging[r % RING], offset, t)  # bound to its staging buffer: the loaded copy goes
                if name in module._parameters:
                    module._parameters[name] = nn.Parameter(view, requires_grad=False)
                else:
                    module._buffers[name] = view
            del tensors, t
            self.host.append(flat)
        already = isinstance(model.embed, HostEmbedding)  # memory.embedding_on_host: loaded there
        self.embedding_on_host = already or (embedding and model.lm_head is not None)
        if self.embedding_on_host and not already:
            table = model.embed.weight
            host_table = torch.empty(table.shape, dtype=table.dtype)  # pageable: rows are gathered on the CPU
            host_table.copy_(table)
            model.embed = HostEmbedding(host_table, self.device, self.allocator)
        self._ready: list = [None] * RING
        self._first_loaded = False  # the first offloaded block of the next pass is already on its way
        model.weight_stream = self

    @property
    def offloaded_bytes(self) -> int:
        """Bytes streamed in per forward pass."""
        return sum(self.layer_bytes)

    @property
    def staging_nbytes(self) -> int:
        return sum(t.numel() for t in self.staging)

    def begin_pass(self) -> None:
        if self.order and self.overlap and not self._first_loaded:
            self.copies.after_compute()  # the previous pass is done with staging buffer 0
            self._prefetch(0)
        self._first_loaded = False

    def enter(self, layer: int) -> None:
        r = self.rank.get(layer)
        if r is None:
            return
        if not self.overlap:
            self.copies.after_compute()
            self._prefetch(r)
        self.copies.compute_waits(self._ready[r % RING])
        if self.overlap:
            nxt = (r + 1) % len(self.order)  # after the last block: the first one of the next pass
            if nxt % RING != r % RING:  # its buffer is not the one block r computes in
                self.copies.after_compute()  # block r-1 (the buffer's last user) is done
                self._prefetch(nxt)
                self._first_loaded = nxt == 0

    def synchronize(self) -> None:
        self.copies.synchronize()

    @property
    def graphable(self) -> bool:
        """A pass can be captured in a CUDA graph: on a GPU, every host buffer pinned (a copy from pageable
        memory is not capturable), copies overlapped."""
        return (self.copies.cuda and self.allocator.pinned_all and self.overlap and bool(self.order)
                and all(t.is_pinned() for t in self.host))  # torch refuses a captured copy it does not see pinned

    @property
    def wraps(self) -> bool:
        """The last streamed block of a pass prefetches the first one of the next (their ring buffers differ)."""
        n = len(self.order)
        return self.overlap and n > 1 and (n - 1) % RING != 0

    def prepare_capture(self) -> None:
        """Before capturing a pass: every copy so far complete, and the state each replay starts from (the
        first block already loaded when the passes wrap; no event from outside the graph to wait on)."""
        self.synchronize()
        self.replay_entry()

    def replay_entry(self) -> None:
        """The state a captured pass is recorded from (and each replay runs from)."""
        self._ready = [None] * RING
        self._first_loaded = self.wraps

    def end_capture(self) -> None:
        """After a capture (the captured copies did not run): nothing is known to be loaded."""
        self._ready = [None] * RING
        self._first_loaded = False

    def join(self) -> None:
        """The compute stream waits for every copy issued so far (the end of a captured pass)."""
        self.copies.compute_waits(self.copies.mark())

    def before_replay(self) -> None:
        """Make the state a replay starts from true: with wrapping passes the first block in its buffer,
        ordered before the replay (an eager pass may have left its copy in flight, or nothing loaded it)."""
        if not self.wraps:
            return
        if not self._first_loaded:
            self.copies.after_compute()
            self._prefetch(0)
        self.copies.compute_waits(self._ready[0])
        self._ready[0] = None

    def after_replay(self) -> None:
        """A replay ended with its copies joined (and, wrapping, the next pass's first block loaded)."""
        self.replay_entry()

    def _prefetch(self, r: int) -> None:
        self.copies.copy(self.staging[r % RING][:self.layer_bytes[r]], self.host[r])
        self._ready[r % RING] = self.copies.mark()

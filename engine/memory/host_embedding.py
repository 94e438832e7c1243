"""The embedding table in host memory (`memory.embedding_on_host`, and weight offload).

A step reads one row of the table per token: 10 kB of a 27B model's 1.5 GB table. The rows of the
step's tokens are gathered on the host into a small pinned staging buffer and copied to the device.
The fused decode step (engine.runtime.decode_step) takes them as a static input buffer, so it stays
CUDA-graphed: `rows_into` fills that buffer before each replay, on the compute stream, and the graph
never reads the table. Prefill and the plain model path call the module like nn.Embedding.

Two staging buffers take turns; before the host overwrites one it waits for the copy that last read
it (a CUDA event), so a copy still in flight never sees the next step's rows. On the CPU the
"host" and "device" are the same memory: the rows are gathered straight into the output.

The output layer never reads this table: a model whose output layer is tied to the embedding in
float keeps the table on the device (`check_embedding_on_host` refuses the combination).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.errors import BonsaiError
from engine.memory.host_copies import HostAllocator

RING = 2
MIN_STAGING_ROWS = 64


def check_embedding_on_host(tied: bool, head_type: str) -> None:
    """The one-line refusal of a host embedding the output layer would read whole every step."""
    if tied and head_type == "bf16":
        raise BonsaiError("the embedding table cannot live in host memory: this model's output layer is tied to it "
                          "and reads all of it every step; give the output layer its own packed copy "
                          "(--head-weights int4 / model.head_type: int4) or keep the embedding on the GPU")


class HostEmbedding(nn.Module):
    """nn.Embedding's forward over a table in host memory; `rows_into` fills a static device buffer."""

    def __init__(self, weight: torch.Tensor, device: torch.device | str, allocator: HostAllocator | None = None):
        super().__init__()
        self.device = torch.device(device)
        self.weight = weight  # [V, H] host memory (a plain attribute: model.to() leaves it there)
        self.allocator = allocator or HostAllocator(pin=self.device.type == "cuda", what="embedding rows")
        self._staging: list[torch.Tensor | None] = [None] * RING  # [n, H] pinned, taking turns
        self._copied = [torch.cuda.Event() if self.device.type == "cuda" else None for _ in range(RING)]
        self._turn = 0

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).cpu()  # [N] on the host: on a GPU one sync (eager passes only)
        out = torch.empty(ids.numel(), self.weight.shape[1], dtype=self.weight.dtype, device=self.device)  # [N, H]
        self.rows_into(ids, out)
        return out.view(*tokens.shape, -1)  # [.., H]

    def rows_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [N, H] on the device ← the table's rows of ids [N] (host int64), copied on the current
        stream (a graph replayed after this reads them)."""
        n = ids.numel()
        if self.device.type != "cuda":
            torch.index_select(self.weight, 0, ids, out=out)
            return
        turn = self._turn
        self._turn = (turn + 1) % RING
        self._copied[turn].synchronize()  # the copy that last read this staging buffer is done
        staging = self._staging[turn]
        if staging is None or staging.shape[0] < n:
            staging = self.allocator.empty((max(n, MIN_STAGING_ROWS), self.weight.shape[1]), self.weight.dtype)
            self._staging[turn] = staging
        rows = torch.index_select(self.weight, 0, ids, out=staging[:n])  # [N, H] pinned
        out.copy_(rows, non_blocking=True)
        self._copied[turn].record()

"""The one place that captures CUDA graphs: the fused decode step, once per row count in use.

A graphed step owns static input buffers (tokens, positions, slots, lengths) and a static logits
output; `run` copies the new inputs in, replays the graph and returns the output buffer (valid
until the next replay). Without CUDA (or with graphs off) the same step runs eagerly.
"""
from __future__ import annotations

import torch

from engine.decode_step import StepInputs, Workspace, decode_step, make_ops
from engine.kv_cache import KVCache
from engine.model import Transformer


class DecodeStepRunner:
    """Runs `decode_step` for a fixed number of rows, graphed on CUDA."""

    def __init__(self, model: Transformer, cache: KVCache, rows: int, num_splits: int, use_graph: bool = True,
                 kernels: bool | None = None):
        device = cache.device
        self.model, self.cache, self.rows, self.num_splits = model, cache, rows, num_splits
        self.ops = make_ops(device, kernels)
        self.inputs = StepInputs(tokens=torch.zeros(rows, dtype=torch.long, device=device),
                                 positions=torch.zeros(rows, dtype=torch.int32, device=device),
                                 slot_ids=torch.zeros(rows, dtype=torch.int32, device=device),
                                 seq_lens=torch.ones(rows, dtype=torch.int32, device=device),
                                 hidden=None if model.takes_tokens else  # a later pipeline stage's input
                                 torch.zeros(rows, model.config.hidden_size, device=device))
        self.workspace = Workspace.make(model, rows, device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        streamed = cache.streamed or model.weight_stream is not None  # offloaded KV or weights: eager
        if use_graph and device.type == "cuda" and not streamed:
            self._capture()

    def _eager(self) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.inputs, self.ops, self.num_splits, self.workspace)

    @torch.inference_mode()
    def _capture(self) -> None:
        # Warm up on a side stream (Triton compiles, cuBLAS picks algorithms), then capture. The
        # warm-up writes K/V (and a quantized cache's scales) at position 0 of slot 0: saved and put
        # back, so a capture in the middle of a generation (a new verify width) leaves the cache as it was.
        saved = {name: t[:, 0, :, 0].clone() for name, t in self.cache.tensors.items()}  # [L, KV, X] each
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager()
        torch.cuda.current_stream().wait_stream(stream)
        for name, rows in saved.items():
            self.cache.tensors[name][:, 0, :, 0].copy_(rows)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._eager()

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], slots: list[int],
            hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits float32 [rows, V]; the rows' K/V are written at their positions. A pipeline stage
        (engine.pipeline) after the first takes `hidden` [rows, H] float32 instead of tokens; one
        before the last returns its residual stream [rows, H] float32 instead of logits."""
        assert len(positions) == len(slots) == self.rows
        if self.inputs.hidden is not None:
            self.inputs.hidden.copy_(hidden, non_blocking=True)
        else:
            assert len(tokens) == self.rows
            self.inputs.tokens.copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int32)
        self.inputs.positions.copy_(pos, non_blocking=True)
        self.inputs.seq_lens.copy_(pos + 1, non_blocking=True)
        self.inputs.slot_ids.copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        if self.cache.streamed:  # KV offload (eager, never graphed): each row writes its own position
            self.cache.begin_pass(slots, positions, [p + 1 for p in positions])
        if self.graph is None:
            return self._eager()
        self.graph.replay()
        return self.logits

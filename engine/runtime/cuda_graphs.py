"""The one place that captures CUDA graphs: the fused decode step, once per row count in use, and
full prefill chunks (`PrefillGraphs`).

A graphed step owns static input buffers (tokens, positions, slots, lengths; the rows' embeddings
when the table lives in host memory, engine.memory.host_embedding) and a static logits output; `run` copies
the new inputs in, replays the graph and returns the output buffer (valid until the next replay).
Without CUDA (or with graphs off) the same step runs eagerly.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from engine.runtime.decode_step import StepInputs, Workspace, decode_step, make_ops
from engine.memory.host_embedding import HostEmbedding
from engine.runtime.kv_cache import CacheBatch, KVCache
from engine.runtime.model import Transformer

log = logging.getLogger(__name__)


def capture(graph: torch.cuda.CUDAGraph, step, pool=None):
    """step() captured into graph (its result: the graph's static outputs). A capture that fails leaves the
    device's random generator marked as capturing, and every later random draw on the device (sampling) then
    raises 'Offset increment outside graph capture': the generator's state from before is put back first."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    before = generator.clone_state()
    try:
        with torch.cuda.graph(graph, pool=pool):
            return step()
    except BaseException:
        generator.graphsafe_set_state(before)
        raise


class DecodeStepRunner:
    """Runs `decode_step` for a fixed number of rows, graphed on CUDA."""

    def __init__(self, model: Transformer, cache: KVCache, rows: int, num_splits: int, use_graph: bool = True,
                 kernels: bool | None = None, persistent_ffn: bool = False):
        device = cache.device
        self.model, self.cache, self.rows, self.num_splits = model, cache, rows, num_splits
        self.ops = make_ops(device, kernels)
        self.inputs = StepInputs(tokens=torch.zeros(rows, dtype=torch.long, device=device),
                                 positions=torch.zeros(rows, dtype=torch.int32, device=device),
                                 slot_ids=torch.zeros(rows, dtype=torch.int32, device=device),
                                 seq_lens=torch.ones(rows, dtype=torch.int32, device=device),
                                 hidden=None if model.takes_tokens else  # a later pipeline stage's input
                                 torch.zeros(rows, model.config.hidden_size, device=device))
        if cache.states is not None and rows > 1:  # a hybrid's wider steps also take rows of one slot (a verify)
            self.inputs.run_len = torch.ones(rows, dtype=torch.int32, device=device)
            self.inputs.snap_idx = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.host_embedding = model.embed if isinstance(model.embed, HostEmbedding) else None
        if self.host_embedding is not None and model.takes_tokens:  # the graph reads the rows from here
            table = self.host_embedding.weight
            self.inputs.embedded = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=device)  # [M, H]
        # persistent_ffn: one launch an FFN
        self.workspace = Workspace.make(model, rows, device, persistent_ffn, cache=cache)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # offloaded KV: eager; streamed weights: graphed with their copies where every host buffer is pinned
        self.weight_stream = model.weight_stream
        streamed = cache.streamed or (self.weight_stream is not None and not self.weight_stream.graphable)
        # the plain-torch references (kernels off) index with masks, which sync: not capturable, eager
        if use_graph and device.type == "cuda" and not streamed and self.ops.fast:
            self._capture()

    def _eager(self) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.inputs, self.ops, self.num_splits, self.workspace)

    @torch.inference_mode()
    def _capture(self) -> None:
        # Warm up on a side stream (Triton compiles, cuBLAS picks algorithms), then capture. The
        # warm-up writes K/V (and a quantized cache's scales) at position 0 of slot 0: saved and put
        # back, so a capture in the middle of a generation (a new verify width) leaves the cache as it was.
        saved = {name: t[:, 0, :, 0].clone() for name, t in self.cache.tensors.items()}  # [L, KV, X] each
        states = self.cache.states  # a hybrid: the warm-up also steps slot 0's DeltaNet state
        saved_states = [t[:, 0].clone() for t in (states.conv, states.recurrent)] if states is not None else []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager()
        torch.cuda.current_stream().wait_stream(stream)
        for name, rows in saved.items():
            self.cache.tensors[name][:, 0, :, 0].copy_(rows)
        for t, before in zip((states.conv, states.recurrent) if states is not None else (), saved_states):
            t[:, 0].copy_(before)
        self.graph = torch.cuda.CUDAGraph()
        stream = self.weight_stream
        if stream is None:
            self.logits = capture(self.graph, self._eager)
            return
        stream.prepare_capture()  # the copies and their waits are captured too, joined before the graph ends
        try:
            self.logits = capture(self.graph, lambda: (self._eager(), stream.join())[0])
        except RuntimeError as e:  # stay correct: the streamed step runs eagerly
            self.graph, self.logits = None, None
            log.warning("the streamed decode step runs eagerly: capturing it failed (%s)", str(e).splitlines()[0])
        finally:
            stream.end_capture()

    @torch.inference_mode()
    def run(self, tokens: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits float32 [rows, V]; the rows' K/V are written at their positions. A pipeline stage
        (engine.pipeline) after the first takes `hidden` [rows, H] float32 instead of tokens; one
        before the last returns its residual stream [rows, H] float32 instead of logits."""
        assert len(positions) == len(slots) == self.rows
        if self.inputs.hidden is not None:
            self.inputs.hidden.copy_(hidden, non_blocking=True)
        else:
            assert len(tokens) == self.rows
            on_device = isinstance(tokens, torch.Tensor)  # [M] int64: the sampler's (engine.decoding.lookahead)
            ids = tokens if on_device else torch.tensor(tokens, dtype=torch.long)  # [M]
            self.inputs.tokens.copy_(ids, non_blocking=True)
            if self.inputs.embedded is not None:
                assert not on_device, "a host embedding table takes host token ids"
                self.host_embedding.rows_into(ids, self.inputs.embedded)
        if self.cache.states is not None:  # a hybrid: each row steps its own slot's DeltaNet state in place
            self._hybrid_runs(slots, positions)
        pos = torch.tensor(positions, dtype=torch.int32)
        self.inputs.positions.copy_(pos, non_blocking=True)
        self.inputs.seq_lens.copy_(pos + 1, non_blocking=True)
        self.inputs.slot_ids.copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        if self.cache.streamed:  # KV offload (eager, never graphed): each row writes its own position
            self.cache.begin_pass(slots, positions, [p + 1 for p in positions])
        if self.graph is None:
            return self._eager()
        if self.weight_stream is not None:
            self.weight_stream.before_replay()
        self.graph.replay()
        if self.weight_stream is not None:
            self.weight_stream.after_replay()
        return self.logits


    def _hybrid_runs(self, slots: list[int], positions: list[int]) -> None:
        """The rows as runs of one slot each (a verify: consecutive rows at consecutive positions), their
        rollback points set up (HybridStates.begin_row_runs) and the run inputs filled."""
        runs: list[tuple[int, int, int]] = []
        for slot, pos in zip(slots, positions):
            if runs and runs[-1][0] == slot and runs[-1][1] + runs[-1][2] == pos:
                runs[-1] = (slot, runs[-1][1], runs[-1][2] + 1)
            else:
                assert all(r[0] != slot for r in runs), f"rows of slot {slot} are not consecutive at consecutive positions"
                runs.append((slot, pos, 1))
        assert len(runs) == len(slots) or self.inputs.run_len is not None, "a one-row step has one slot"
        snap_idx = self.cache.states.begin_row_runs(runs)
        if self.inputs.run_len is not None:
            lens = [n if j == 0 else 0 for _, _, n in runs for j in range(n)]
            self.inputs.run_len.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
            self.inputs.snap_idx.copy_(torch.tensor(snap_idx, dtype=torch.int32), non_blocking=True)


class PrefillGraphs:
    """Full prefill chunks replayed from CUDA graphs: a chunk of `chunk` tokens at a start that is a
    multiple of it, one graph per (slot, start) — the shapes long prompts repeat. Prefill of a
    packed model is otherwise bound by the host (hundreds of kernel launches per layer, see
    docs/perf.md). The graphs share one memory pool (they never run at the same time), so together
    they hold about one chunk's activations; the oldest is dropped beyond `max_graphs`. Not with the
    embedding table in host memory (the eager gather reads the tokens back: engine.runtime.runner leaves
    prefill eager then)."""

    def __init__(self, model: Transformer, cache: KVCache, chunk: int, max_graphs: int = 64):
        self.model, self.cache, self.chunk, self.max_graphs = model, cache, chunk, max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        # (slot, start) → (graph, tokens [1, T], logits [1, 1, V], the batch its positions come from)
        self.graphs: OrderedDict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, CacheBatch]] \
            = OrderedDict()
        self.failed = False  # a capture failed: every chunk runs eagerly from then on

    def handles(self, start: int, num_tokens: int, num_logits: int | None) -> bool:
        return not self.failed and num_tokens == self.chunk and start % self.chunk == 0 and num_logits == 1

    @torch.inference_mode()
    def run(self, slot: int, start: int, tokens: list[int]) -> torch.Tensor:
        """Logits float32 [1, V] after the chunk (a copy); the chunk's K/V are written."""
        key = (slot, start)
        entry = self.graphs.get(key)
        if entry is None:
            return self._capture(key, tokens)
        graph, ids, logits, _ = entry
        self.graphs.move_to_end(key)
        ids.copy_(torch.tensor([tokens], dtype=torch.long), non_blocking=True)
        graph.replay()
        return logits[0].clone()

    def _capture(self, key: tuple[int, int], tokens: list[int]) -> torch.Tensor:
        # The eager run on a side stream computes this chunk (and warms up Triton and cuBLAS); the
        # capture then only records the same launches.
        slot, start = key
        device = self.cache.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)  # [1, T]
        batch = CacheBatch.make([slot], [start], self.chunk, device)
        kv_len = start + self.chunk
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self.model(ids, batch, self.cache, kv_len, 1)[0].clone()  # [1, V]
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            logits = capture(graph, lambda: self.model(ids, batch, self.cache, kv_len, 1), self.pool)  # [1, 1, V]
        except RuntimeError as e:  # a step that syncs the host cannot be captured: stay correct, eager
            self.failed = True
            self.graphs.clear()
            log.warning("prefill chunks run eagerly: capturing one failed (%s)", str(e).splitlines()[0])
            return out  # the eager run above computed this chunk and wrote its K/V
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        self.graphs[key] = (graph, ids, logits, batch)
        return out


class KeyedGraphs:
    """Functions over static buffers replayed from CUDA graphs, one per key, captured on first use (a warm-up run
    on a side stream computes that call, then the capture records the same launches); all in one memory pool.
    Off CUDA (`graphed` False) each call runs eagerly. What a drafter's fixed-shape steps use
    (engine.speculative.mtp_graph)."""

    def __init__(self, graphed: bool):
        self.graphed = graphed
        self.pool = torch.cuda.graph_pool_handle() if graphed else None
        self.graphs: dict = {}
        self.failed = False  # a capture failed: eager from then on

    @torch.inference_mode()
    def run(self, key, fn) -> None:
        if not self.graphed or self.failed:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # this call's result (and Triton's / cuBLAS's warm-up)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            capture(graph, fn, self.pool)
        except RuntimeError as e:  # stay correct: eager
            self.failed = True
            log.warning("a drafter step runs eagerly: capturing it failed (%s)", str(e).splitlines()[0])
            return
        self.graphs[key] = graph

"""The model runner: the one object that runs the model on its device and owns the KV cache.

`Runner` is what the rest of the engine needs of one: ModelRunner (one device) and
engine.pipeline.runner.PipelineRunner (rank 0 of a pipeline over several) both are one.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Protocol

import torch

from engine.errors import BonsaiError
from engine.runtime.decode_step import MAX_STEP_ROWS
from engine.runtime.hybrid_state import recording
from engine.runtime.kv_cache import CacheBatch, KVCache, KVSlot
from engine.weights.loader import LoadedModel

# Prompt chunks up to this long run through the fused step, 16 positions a pass (`ModelRunner._short_prefill`).
# Measured on an H200 (8B ternary, int4 head): an eager prefill chunk costs ~45-60 ms whatever its length up
# to a few hundred tokens (launches, and every packed matrix unpacked for cuBLAS); a graphed 16-row step
# ~4.1 ms (tensor-core rows kernel): 40 tokens ~11 ms, 128 ~33 ms.
SHORT_PREFILL_TOKENS = 128

log = logging.getLogger(__name__)



class Runner(Protocol):
    """Slots of a KV cache and the passes that fill them; the callers keep each slot's bookkeeping
    (KVSlot.tokens) true to what its KV holds."""
    loaded: LoadedModel  # (a pipeline: stage 0's part; its config is the whole model's)
    device: torch.device
    cache: KVCache
    max_seq_len: int
    prefill_chunk_size: int
    decoder: object  # the fused one-row decode step (engine.runtime.cuda_graphs.DecodeStepRunner), None: plain path
    weight_stream: object  # engine.memory.weight_offload.WeightStreamer, None: weights on the device
    takes_device_tokens: bool  # decode_batch takes the sampler's device tensor (engine.decoding.lookahead)

    def slot(self, index: int = 0) -> KVSlot: ...

    def forward(self, slot: KVSlot, tokens: list[int], num_logits: int | None = 1) -> torch.Tensor: ...

    def prefill(self, slot: KVSlot, tokens: list[int]) -> torch.Tensor: ...

    def decode_batch(self, slots: list[KVSlot], tokens: list[int] | torch.Tensor) -> torch.Tensor: ...

    def verify(self, slot: KVSlot, tokens: list[int], hidden_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]: ...

    def step_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor: ...

    def record_prompt_rows(self, index: int, rows: int) -> None: ...

    def take_prompt_rows(self, index: int) -> torch.Tensor | None: ...

    def prepare_rows(self, max_rows: int) -> None: ...

    def warm_up(self) -> None: ...

    def close(self) -> None: ...


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_seq_len: int | None = None, num_slots: int = 1,
                 prefill_chunk_size: int = 512, fast_decode: bool | None = None, kv_type: str = "bf16",
                 kv_offload: bool = False, host_kv_bytes: int | None = None,
                 offload_layers: Iterable[int] | None = None, prefill_graphs: bool | None = None):
        """fast_decode: one-token steps through the fused decode step (CUDA-graphed on a GPU);
        default on for CUDA devices. kv_type: the KV cache's element type (bf16 = the model's
        dtype, int8, int4, k8v4: quant/kv_format.py). kv_offload: the KV pool lives in host memory
        (engine.memory.kv_offload; host_kv_bytes: the memory granted to it, None: what it needs).
        offload_layers: weight offload (engine.memory.weight_offload) of these blocks, and the embedding
        table on the host; None: off. With KV offload steps run eagerly (no CUDA graph); with weight offload the
        decode step is graphed with its copies (pinned host memory) and prompts run as eager chunks.
        prefill_graphs: full prefill chunks replayed from CUDA graphs (engine.runtime.cuda_graphs.PrefillGraphs;
        their pool keeps one chunk's activations reserved), where the decode step is graphed. None: on
        there (a 512-token chunk of an 8B-class packed model: 2.1-2.5x faster on an H200, docs/perf.md);
        callers under a memory cap pass False (the pool is not in the memory plan)."""
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.max_seq_len = int(max_seq_len or min(cfg.max_position_embeddings, 4096))
        if self.max_seq_len <= 1:
            raise BonsaiError(f"max_seq_len must be > 1, got {self.max_seq_len}")
        if prefill_chunk_size < 1:
            raise BonsaiError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        self.prefill_chunk_size = prefill_chunk_size
        self.hybrid = cfg.hybrid is not None
        if self.hybrid:
            # The fused (graphed) decode step runs DeltaNet layers (engine.runtime.hybrid_step) for rows of
            # distinct slots and for a verify's rows of one slot (stepped in order, each row's state kept for the
            # rollback: HybridStates.begin_row_runs). Full prefill chunks are graphed as the dense models' are (a
            # chunk reads and writes its one slot's state by index); short prompts are not stepped through the
            # fused step (each row would keep a rollback state).
            # a slot's state cannot forget a token for free: the Engine's lookahead stays off
            self.rewinds_for_free = False
        if kv_offload:
            from engine.memory.kv_offload import OffloadedKVCache
            self.cache = OffloadedKVCache(cfg, self.max_seq_len, num_slots, dtype=loaded.dtype, device=self.device,
                                          host_bytes=host_kv_bytes, kv_type=kv_type)
        else:
            self.cache = KVCache(cfg, self.max_seq_len, num_slots, dtype=loaded.dtype, device=self.device,
                                 kv_type=kv_type)
        if self.hybrid:
            from engine.runtime.hybrid_state import attach_states
            attach_states(self.cache, cfg)
        self.weight_stream = None
        if offload_layers is not None:  # before any pass: the loader may have made these blocks in host memory
            from engine.memory.weight_offload import WeightStreamer
            self.weight_stream = WeightStreamer(self.model, offload_layers, self.device)
        if self.cache.kv_type.key != "float":  # quantized keys are stored minus their mean (kv_calibration)
            from engine.runtime.kv_calibration import calibration_ids, key_offsets
            ids = calibration_ids(loaded.tokenizer, cfg.vocab_size)
            self.cache.key_offset = key_offsets(self.model, cfg, ids, loaded.dtype, self.device)
        self.use_graph = not kv_offload
        self.decoder = None
        self._row_steps: dict = {}  # row count → DecodeStepRunner (verify widths, batched decode)
        self._prompt_rows: dict[int, tuple[int, torch.Tensor | None]] = {}  # slot → (rows kept, hidden [n, H])
        if fast_decode if fast_decode is not None else self.device.type == "cuda":
            if self.hybrid:  # the DeltaNet gate projections as one matmul in the step (before any capture)
                from engine.runtime.hybrid_step import join_gates
                join_gates(self.model, frozenset(offload_layers or ()))
            self.decoder = self._make_decoder()
        # the attention prologue kernel also serves prefill where the fused step runs (same shapes)
        # (not a hybrid's gated attention: the prologue kernel rotates whole heads and has no output gate)
        self.model.use_fused_prologue(self.decoder is not None and self.decoder.ops.fast and not self.hybrid)
        self.prefill_graphs = None
        graphed = self.decoder is not None and self.decoder.graph is not None
        if self.weight_stream is not None:  # every pass streams the blocks: one eager chunk beats 16-row passes
            prefill_graphs = False
        # prompt chunks of up to short_prefill_tokens run through the fused step, short_prefill_rows positions
        # a pass (0: never), where it is graphed and prefill graphs are allowed (the memory plan then counts
        # the steps of 1..MAX_STEP_ROWS rows); `prepare_rows` captures them
        self.short_prefill_tokens = SHORT_PREFILL_TOKENS
        self.short_prefill_rows = MAX_STEP_ROWS if graphed and prefill_graphs is not False and not self.hybrid else 0
        from engine.memory.host_embedding import HostEmbedding
        # decode_batch takes the sampler's tokens as a device tensor (a step launched ahead: decoding.lookahead)
        self.takes_device_tokens = not isinstance(self.model.embed, HostEmbedding)
        if graphed and prefill_graphs is not False and not isinstance(self.model.embed, HostEmbedding):
            from engine.runtime.cuda_graphs import PrefillGraphs
            self.prefill_graphs = PrefillGraphs(self.model, self.cache, prefill_chunk_size)

    def _make_decoder(self):
        from engine.runtime.cuda_graphs import DecodeStepRunner
        from engine.kernels.attention_decode import default_num_splits
        try:
            cfg = self.loaded.config
            splits = default_num_splits(self.max_seq_len, cfg.num_kv_heads, head_dim=cfg.head_dim)
            return DecodeStepRunner(self.model, self.cache, rows=1, num_splits=splits, use_graph=self.use_graph)
        except ValueError as e:  # a shape the kernels do not handle: the plain path still works
            log.warning("fused decode step unavailable (%s); decoding through the plain model path", e)
            return None

    def slot(self, index: int = 0) -> KVSlot:
        return self.cache.slots[index]

    def record_prompt_rows(self, index: int, rows: int) -> None:
        """From now until `take_prompt_rows`, the prompt chunks fed to slot `index` also keep their last-block
        hidden states (the newest `rows`): what a drafter reading the target's hidden states takes in."""
        self._prompt_rows[index] = (rows, None)

    def take_prompt_rows(self, index: int) -> torch.Tensor | None:
        """The kept prompt rows [n, H] of slot `index` (None: none recorded), and the recording stopped."""
        return self._prompt_rows.pop(index, (0, None))[1]

    @torch.inference_mode()
    def forward(self, slot: KVSlot, tokens: list[int], num_logits: int | None = 1) -> torch.Tensor:
        """Run `tokens` after the slot's content, append them to it; logits [n, V] of the last n. A hybrid saves
        the slot's DeltaNet state after a pass of several tokens as a prefix point (engine.runtime.hybrid_state)."""
        logits = self._forward(slot, tokens, num_logits)
        if self.hybrid and len(tokens) > 1:
            self.cache.states.save_point(slot.index, slot.tokens)
        return logits

    def _forward(self, slot: KVSlot, tokens: list[int], num_logits: int | None) -> torch.Tensor:
        slot.check_room(len(tokens))
        start, t = slot.length, len(tokens)
        if t > 1 and slot.index in self._prompt_rows:  # a chunk whose hidden states a drafter takes in (eager)
            logits, hidden = self._recorded_pass(slot.index, start, tokens, (-1,), num_logits)
            keep, rows = self._prompt_rows[slot.index]
            rows = hidden[-1] if rows is None else torch.cat([rows, hidden[-1]])  # [n, H]
            self._prompt_rows[slot.index] = (keep, rows[-keep:])
            slot.tokens.extend(tokens)
            return logits
        if t == 1 and self.decoder is not None:
            logits = self.decoder.run(tokens, [start], [slot.index])  # [1, V]
            slot.tokens.extend(_held(tokens))
            return logits.clone()
        if num_logits == 1 and 1 < t <= self.short_prefill_tokens and self.short_prefill_rows > 1:
            return self._short_prefill(slot, tokens)  # [1, V]
        if self.prefill_graphs is not None and self.prefill_graphs.handles(start, t, num_logits):
            if self.hybrid:  # what the replay's HybridStates.write does not do on the host
                self.cache.states.forget(slot.index)
            logits = self.prefill_graphs.run(slot.index, start, tokens)  # [1, V]
            slot.tokens.extend(tokens)
            return logits
        ids = _ids(tokens, self.device)[None]  # [1, T]
        batch = CacheBatch.make([slot.index], [start], t, self.device)
        logits = self.model(ids, batch, self.cache, start + t, num_logits)  # [1, n, V]
        slot.tokens.extend(_held(tokens))
        return logits[0]

    @torch.inference_mode()
    def decode_batch(self, slots: list[KVSlot], tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """One token for each of several slots (each at its own position) in one forward pass, and
        append it to its slot: logits [B, V]. Through the fused step (graphed per row count) where
        there is one, else the model's batched path (per-row positions, masked attention). tokens: ints, or
        [B] int64 on the device where `takes_device_tokens` (the slots then hold PENDING until the caller
        writes the values in, engine.decoding.lookahead)."""
        assert len(slots) == len(tokens) and len({s.index for s in slots}) == len(slots)
        if len(slots) == 1:
            return self.forward(slots[0], tokens, num_logits=1)
        for slot in slots:
            slot.check_room(1)
        starts = [s.length for s in slots]
        if self.decoder is not None and len(slots) <= MAX_STEP_ROWS:
            logits = self.step_rows(tokens, starts, [s.index for s in slots])  # [B, V]
        else:
            ids = _ids(tokens, self.device)[:, None]  # [B, 1]
            batch = CacheBatch.make([s.index for s in slots], starts, 1, self.device)
            logits = self.model(ids, batch, self.cache, max(starts) + 1, 1)[:, -1]  # [B, V]
        for slot, token in zip(slots, _held(tokens)):
            slot.tokens.append(token)
        return logits

    @torch.inference_mode()
    def verify(self, slot: KVSlot, tokens: list[int], hidden_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Score `tokens` (the last accepted token + drafts) after the slot's content in one pass and
        append them: logits [T, V] of every row, and {layer: [T, hidden]} for `hidden_layers`.
        The caller rewinds the slot past the rejected rows (`slot.rewind`). Without hidden states,
        where a decode step runs fused, the rows run through the same fused step (CUDA-graphed per
        row count), so each row's logits are those plain decoding would compute."""
        slot.check_room(len(tokens))
        start, t = slot.length, len(tokens)
        last_only = set(hidden_layers) <= {-1, self.loaded.config.num_layers - 1}  # what the fused step gives
        fused = t <= MAX_STEP_ROWS and self.decoder is not None and (t > 1 or hidden_layers) and last_only
        if fused:  # each verified token is one row of the fused step: row i attends to keys 0..start+i
            logits, step = self._step_rows(tokens, list(range(start, start + t)), [slot.index] * t)  # [T, V]
            slot.tokens.extend(tokens)
            last = step.workspace.hidden[:t].to(self.loaded.dtype, copy=True) if hidden_layers else None  # [T, H]
            return logits, {i: last for i in hidden_layers}
        logits, hidden = self._recorded_pass(slot.index, start, tokens, hidden_layers)
        slot.tokens.extend(tokens)
        return logits, hidden

    def _recorded_pass(self, index: int, start: int, tokens: list[int], hidden_layers: tuple[int, ...] = (),
                       num_logits: int | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """tokens after position `start` of slot `index` in one model pass: logits [n, V] of the last n rows (all by
        default) and {layer: [T, H]}; a hybrid keeps every position's DeltaNet state (the caller's rewind restores
        one) when all rows' logits are asked for (a verify)."""
        t = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        batch = CacheBatch.make([index], [start], t, self.device)
        with recording(self.cache.states, num_logits is None):
            logits, hidden = self.model.forward_hidden(ids, batch, self.cache, start + t, num_logits, hidden_layers)
        return logits[0], {i: h[0] for i, h in hidden.items()}  # [T, V], {i: [T, H]}

    def _short_prefill(self, slot: KVSlot, tokens: list[int]) -> torch.Tensor:
        """A short prompt through the fused (graphed) decode step, P = short_prefill_rows consecutive
        positions of the slot a replay (as a verify pass runs them: row i attends to keys 0..start+i): no
        eager launches, no unpacked weights. Logits [1, V] of the last token."""
        rows, start = self.short_prefill_rows, slot.length
        logits = None
        for i in range(0, len(tokens), rows):
            piece = tokens[i:i + rows]
            logits = self.step_rows(piece, list(range(start + i, start + i + len(piece))),
                                    [slot.index] * len(piece))  # [P, V]
        slot.tokens.extend(tokens)
        return logits[-1:]

    def warm_up(self) -> None:
        """Compile now what the first long prompt would compile on a request's critical path (seen: a 1.3 s
        first-token stall on a fresh GPU machine): one eager prefill chunk past the short-prefill length in
        slot 0, then the slot emptied. Only where kernels compile (CUDA); a no-op without a free slot."""
        if self.device.type != "cuda" or not self.cache.slots or self.slot(0).length:
            return
        n = min(max(self.short_prefill_tokens + 1, 2), self.max_seq_len - 1, self.prefill_chunk_size)
        slot = self.slot(0)
        try:
            self.forward(slot, [0] * n)
        finally:
            slot.reset()

    def prepare_rows(self, max_rows: int) -> None:
        """Capture the fused step for every row count up to max_rows now (a capture costs a
        fraction of a second: better before a generation than in the middle of one)."""
        if self.decoder is None:
            return
        from engine.runtime.cuda_graphs import DecodeStepRunner
        wide = min(max_rows, MAX_STEP_ROWS)
        if self.hybrid and wide > len(self.cache.slots) and self.cache.states.ensure_rows(wide):
            self._row_steps.clear()  # verify rows of one slot (speculation): their rollback points
        for rows in range(2, min(max(max_rows, self.short_prefill_rows), MAX_STEP_ROWS) + 1):
            if rows not in self._row_steps:
                self._row_steps[rows] = DecodeStepRunner(self.model, self.cache, rows=rows,
                                                         num_splits=self.decoder.num_splits,
                                                         use_graph=self.decoder.graph is not None)

    def step_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One token per row through the fused (graphed) decode step: rows may be several slots
        (batched decode) or consecutive positions of one slot (speculative verification). Writes
        each row's K/V at its position; logits [M, V] (a copy). Slot bookkeeping is the caller's.
        Needs the fused step (`fast_decode`); one graph is captured per row count on first use."""
        return self._step_rows(tokens, positions, slots)[0]

    def _step_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> tuple[torch.Tensor, Any]:
        """`step_rows`, and the step that ran (its workspace holds the rows' last hidden states)."""
        assert self.decoder is not None and 0 < len(tokens) <= MAX_STEP_ROWS
        rows = len(tokens)
        if self.hybrid and len(set(slots)) < rows:  # rows of one slot: its DeltaNet state stepped row by row
            if self.cache.states.ensure_rows(rows):  # room for the rollback points (steps recaptured with it)
                self._row_steps.clear()
        step = self.decoder if rows == 1 else self._row_steps.get(rows)
        if step is None:
            from engine.runtime.cuda_graphs import DecodeStepRunner
            step = DecodeStepRunner(self.model, self.cache, rows=rows, num_splits=self.decoder.num_splits,
                                    use_graph=self.decoder.graph is not None)
            self._row_steps[rows] = step
        return step.run(tokens, positions, slots).clone(), step

    def prefill(self, slot: KVSlot, tokens: list[int]) -> torch.Tensor:
        """Feed tokens in chunks; logits [V] after the last one."""
        assert tokens
        logits = None
        for i in range(0, len(tokens), self.prefill_chunk_size):
            logits = self.forward(slot, tokens[i:i + self.prefill_chunk_size], num_logits=1)
        return logits[-1]

    def close(self) -> None:
        """Nothing to end on one device (its memory goes with the runner)."""


PENDING = -1  # what a slot holds for a token fed from the device until its value is read back


def _ids(tokens: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids [T] int64 on the device, from ints or a device tensor (as is)."""
    if isinstance(tokens, torch.Tensor):
        return tokens.to(device=device, dtype=torch.long)
    return torch.tensor(tokens, dtype=torch.long, device=device)


def _held(tokens: list[int] | torch.Tensor) -> list[int]:
    """What a slot records for tokens: the ints, or PENDING for each one fed from the device."""
    return [PENDING] * len(tokens) if isinstance(tokens, torch.Tensor) else list(tokens)

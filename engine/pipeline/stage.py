"""One pipeline stage on its device: its part of the model, its KV cache, its fused decode steps.

Rank 0 (stage 0) and every worker run their part of each pass through the same object: `plain`
runs `Transformer.forward_hidden` over the stage's blocks, `rows` the fused decode step over them
(CUDA-graphed per row count on a GPU, the kernels' references on a CPU). A stage takes token ids
(the first) or the previous stage's hidden states, and gives logits (the last) or its hidden states.
"""
from __future__ import annotations

import logging

import torch

from engine.pipeline.protocol import CALIBRATE, PLAIN, RECORD, RESTORE, ROWS, SAVE_POINT, Command
from engine.pipeline.split import Stage, stage_config
from engine.runtime.decode_step import MAX_STEP_ROWS
from engine.runtime.hybrid_state import recording
from engine.runtime.kv_cache import CacheBatch, KVCache
from engine.weights.loader import LoadedModel

log = logging.getLogger(__name__)



class StageExecutor:
    def __init__(self, loaded: LoadedModel, stage: Stage, max_seq_len: int, num_slots: int,
                 kv_type: str = "bf16", fast_decode: bool | None = None):
        """A quantized KV cache needs its key offsets (`calibrate`) before `start_steps`; a float one
        calls `start_steps` at once."""
        self.loaded, self.stage, self.model = loaded, stage, loaded.model
        self.device = loaded.device
        self.stage_config = stage_config(loaded.config, stage.first, stage.end)  # its own layers only
        self.cache = KVCache(self.stage_config, max_seq_len, num_slots, dtype=loaded.dtype, device=self.device,
                             kv_type=kv_type)
        self.hybrid = loaded.config.hybrid is not None
        if self.hybrid:  # its DeltaNet layers' states, and its slots that restore them
            from engine.runtime.hybrid_state import attach_states
            attach_states(self.cache, self.stage_config)
        self.steps: dict = {}  # row count → DecodeStepRunner over this stage's blocks
        self.num_splits = 1
        self.fast = fast_decode if fast_decode is not None else self.device.type == "cuda"
        if self.fast:
            from engine.kernels.attention_decode import default_num_splits
            cfg = loaded.config
            self.num_splits = default_num_splits(max_seq_len, cfg.num_kv_heads, head_dim=cfg.head_dim)
            if self.hybrid:  # the DeltaNet gate projections as one matmul in the step (before any capture)
                from engine.runtime.hybrid_step import join_gates
                join_gates(self.model)

    @property
    def needs_calibration(self) -> bool:
        return self.cache.kv_type.key != "float" and self.cache.key_offset is None

    def start_steps(self) -> None:
        """Build (capture, on a GPU) the one-row fused step, after the key offsets are known."""
        assert not self.needs_calibration
        if self.fast:
            try:
                self._step(1)
            except ValueError as e:  # a shape the kernels do not handle: the plain path still works
                log.warning("fused decode step unavailable (%s); decoding through the plain model path", e)
        # (not a hybrid's gated attention: the prologue kernel rotates whole heads and has no output gate)
        self.model.use_fused_prologue(1 in self.steps and self.steps[1].ops.fast and not self.hybrid)

    @torch.inference_mode()
    def calibrate(self, x: torch.Tensor) -> torch.Tensor:
        """The key offsets of this stage's layers (engine.runtime.kv_calibration.key_offsets, by stage): the
        calibration tokens [1, n] (stage 0) or the previous stage's hidden states [1, n, H] go through
        a float cache of n positions; the mean key of each layer and kv head over positions 1..
        Returns the hidden states for the next stage."""
        from engine.runtime.kv_calibration import calibration_cache, mean_keys
        n = x.shape[1]
        scratch = calibration_cache(self.stage_config, n, self.loaded.dtype, self.device)
        out, _ = self.model.forward_hidden(x, CacheBatch.make([0], [0], n, self.device), scratch, n, 1)
        self.cache.key_offset = mean_keys(scratch)  # [L_stage, KV, D]
        return out

    @property
    def fused(self) -> bool:
        return 1 in self.steps

    def _step(self, rows: int):
        step = self.steps.get(rows)
        if step is None:
            from engine.runtime.cuda_graphs import DecodeStepRunner
            step = DecodeStepRunner(self.model, self.cache, rows=rows, num_splits=self.num_splits,
                                    use_graph=self.device.type == "cuda")
            self.steps[rows] = step
        return step

    def prepare_rows(self, max_rows: int) -> None:
        """Capture the fused step for every row count up to max_rows now, not in the middle of a request."""
        if self.fused:
            if min(max_rows, MAX_STEP_ROWS) > len(self.cache.slots):  # verify rows of one slot (speculation)
                self._room_for_rows(min(max_rows, MAX_STEP_ROWS))
            for rows in range(2, min(max_rows, MAX_STEP_ROWS) + 1):
                self._step(rows)

    def _room_for_rows(self, rows: int) -> None:
        """A hybrid's rollback points for `rows` verify rows of one slot (the steps of several rows captured anew
        with the bigger buffers), as ModelRunner.step_rows makes them."""
        if self.cache.states is not None and self.cache.states.ensure_rows(rows):
            self.steps = {r: step for r, step in self.steps.items() if r == 1}

    def run_state(self, cmd: Command) -> None:
        """SAVE_POINT / RESTORE of a hybrid slot's DeltaNet state (rank 0 decided the entry: protocol.Command)."""
        states, slot, length = self.cache.states, cmd.slots[0], cmd.starts[0]
        if cmd.op == SAVE_POINT:
            states.save_entry(slot, cmd.arg)
        elif cmd.arg < 0:
            assert states.restore(slot, length), f"stage {self.stage.index}: slot {slot} has no snapshot at {length}"
        else:
            states.restore_entry(slot, cmd.arg)

    @torch.inference_mode()
    def run(self, cmd: Command, x: torch.Tensor | list) -> torch.Tensor:
        """This stage's part of the pass `cmd`: x is token ids (stage 0: [B, T] for PLAIN, a list of M
        for ROWS) or the previous stage's hidden states. Logits (last stage) or hidden states out."""
        if cmd.op == CALIBRATE:
            ids = x if torch.is_tensor(x) else torch.tensor(x, dtype=torch.long, device=self.device)
            return self.calibrate(ids)
        if cmd.op == PLAIN:
            ids = x if torch.is_tensor(x) else torch.tensor(x, dtype=torch.long, device=self.device)
            batch = CacheBatch.make(list(cmd.slots), list(cmd.starts), cmd.num_tokens, self.device)
            n = None if cmd.num_logits < 0 else max(cmd.num_logits, 1)
            with recording(self.cache.states, cmd.arg == RECORD):  # a verify: every position's state kept
                out, _ = self.model.forward_hidden(ids, batch, self.cache, cmd.kv_len, n)  # [B, n, V] or [B, T, H]
            return out
        assert cmd.op == ROWS and self.fused
        if len(set(cmd.slots)) < cmd.rows:  # rows of one slot (a verify): a hybrid keeps each row's state
            self._room_for_rows(cmd.rows)
        step = self._step(cmd.rows)
        if self.stage.takes_tokens:
            return step.run(x, list(cmd.starts), list(cmd.slots)).clone()  # [M, V] or [M, H]
        return step.run([], list(cmd.starts), list(cmd.slots), hidden=x).clone()  # [M, V] or [M, H]

    def hidden_dtype(self, cmd: Command) -> torch.dtype:
        """What flows between stages: the model's dtype on the plain path, float32 (the fused step's
        residual stream) on the fused one."""
        return torch.float32 if cmd.op == ROWS else self.loaded.dtype

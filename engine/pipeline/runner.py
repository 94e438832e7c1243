"""PipelineRunner: the Runner interface (engine.runtime.runner) over a model split across devices
(rank 0's side).

Rank 0 is the driver (tokenizer, sampling, scheduler, drafters: generate, speculative decoding and
the server use this runner as they use ModelRunner) and also runs stage 0. Each pass sends a
command to every worker (protocol.py), runs stage 0's blocks, sends the hidden states on, and
receives the last stage's logits. Slot bookkeeping lives here only: a rewind is a shorter slot,
and the next command's positions overwrite the rejected rows on every stage.

Several passes are in flight at once where they do not depend on each other's logits, so that
the stages work at the same time: the rows of a batched step (several slots, or a verify step's
rows) go through as micro-batches (stage 0 runs the second while stage 1 runs the first; on a GPU
only where the rows exceed one fused step, see protocol.micro_batches), and a prompt's prefill
chunks follow each other without waiting for logits (only the last one's come back).
"""
from __future__ import annotations

import contextlib

import torch

from engine.errors import BonsaiError
from engine.runtime.kv_cache import KVSlot
from engine.weights.loader import LoadedModel
from engine.pipeline.launch import Links, ModelSource, RunSpec, start_workers, wait_ready
from engine.pipeline.protocol import (CALIBRATE, MAX_ROWS, PLAIN, PREPARE, RECORD, RESTORE, ROWS, SAVE_POINT, Command,
                                     micro_batches)
from engine.pipeline.split import Stage
from engine.pipeline.stage import StageExecutor
from engine.runtime.decode_step import MAX_STEP_ROWS


class PipelineRunner:
    def __init__(self, loaded: LoadedModel, links: Links, executor: StageExecutor, prefill_chunk_size: int = 512,
                 flat_step_cost: bool | None = None):
        """loaded: stage 0's part (its config is the whole model's); links: rank 0's end of the
        process groups; executor: stage 0 on this process. flat_step_cost: how a batched step is
        cut into micro-batches (protocol.micro_batches; default: flat on a GPU)."""
        if prefill_chunk_size < 1:
            raise BonsaiError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        self.loaded, self.links, self.executor = loaded, links, executor
        self.model = loaded.model  # stage 0's part
        self.device = loaded.device
        self.cache = executor.cache  # its slots are the run's bookkeeping
        self.max_seq_len = executor.cache.max_seq_len
        self.prefill_chunk_size = prefill_chunk_size
        self.stages = links.stages
        self.weight_stream = None
        self.takes_device_tokens = False  # a step's tokens go out in its command to the stages, as ints
        # a fused step's cost is flat in its rows on a GPU (weight reads): steps of <= 16 rows stay whole there
        self.flat_step_cost = self.device.type == "cuda" if flat_step_cost is None else flat_step_cost
        self.hybrid = loaded.config.hybrid is not None
        if self.hybrid:  # DeltaNet states on every stage: each rewind and prefix point is told to all of them
            self.rewinds_for_free = False  # (a slot's state cannot forget a token for free: no lookahead)
            for slot in self.cache.slots:
                slot.on_restore = self._restore_everywhere

    # -- ModelRunner's interface --
    @property
    def decoder(self):
        """The fused decode step of one row where it runs (None: the plain path)."""
        return self.executor.steps.get(1)

    def slot(self, index: int = 0) -> KVSlot:
        return self.cache.slots[index]

    @torch.inference_mode()
    def forward(self, slot: KVSlot, tokens: list[int], num_logits: int | None = 1) -> torch.Tensor:
        """Run `tokens` after the slot's content, append them to it; logits [n, V] of the last n."""
        slot.check_room(len(tokens))
        if len(tokens) == 1 and self.decoder is not None:
            [logits] = self._passes([(Command(ROWS, (slot.index,), (slot.length,)), tokens)])  # [1, V]
        else:
            cmd = Command(PLAIN, (slot.index,), (slot.length,), len(tokens), -1 if num_logits is None else num_logits)
            [logits] = self._passes([(cmd, [tokens], self._point_after(slot.index, slot.tokens, tokens))])
            logits = logits[0]  # [n, V]
        slot.tokens.extend(tokens)
        return logits

    def _point_after(self, index: int, before: list[int], tokens: list[int]):
        """For a hybrid's pass of several tokens after `before` in slot `index`: saving the prefix point once stage
        0 has run it (as ModelRunner.forward saves one), told to the other stages; else None."""
        if not self.hybrid or len(tokens) < 2:
            return None
        seen = before + tokens

        def save() -> None:
            entry = self.cache.states.save_point(index, seen)
            if entry is not None:
                self.links.send_command(Command(SAVE_POINT, (index,), (len(seen),), arg=entry))
        return save

    def _restore_everywhere(self, index: int, length: int, entry: int) -> None:
        """Stage 0's slot `index` went back to its state after `length` tokens (HybridSlot.rewind): the others too."""
        if self.links.failure is not None:
            raise BonsaiError(f"the pipeline stopped: {self.links.failure}")
        self.links.send_command(Command(RESTORE, (index,), (length,), arg=entry))
        self.links.flush_sends()

    @torch.inference_mode()
    def prefill(self, slot: KVSlot, tokens: list[int]) -> torch.Tensor:
        """Feed tokens in chunks, all in flight at once; logits [V] after the last one."""
        assert tokens
        slot.check_room(len(tokens))
        size, start = self.prefill_chunk_size, slot.length
        passes = []
        for i in range(0, len(tokens), size):
            chunk = tokens[i:i + size]
            last = i + size >= len(tokens)
            passes.append((Command(PLAIN, (slot.index,), (start + i,), len(chunk), 1 if last else 0), [chunk],
                           self._point_after(slot.index, slot.tokens + tokens[:i], chunk)))
        logits = self._passes(passes)[-1]  # [1, 1, V]
        slot.tokens.extend(tokens)
        return logits[0, -1]

    @torch.inference_mode()
    def decode_batch(self, slots: list[KVSlot], tokens: list[int]) -> torch.Tensor:
        """One token for each of several slots, in micro-batches through the stages: logits [B, V]."""
        assert len(slots) == len(tokens) and len({s.index for s in slots}) == len(slots)
        if len(slots) == 1:
            return self.forward(slots[0], tokens, num_logits=1)
        for slot in slots:
            slot.check_room(1)
        logits = self.step_rows(tokens, [s.length for s in slots], [s.index for s in slots])
        for slot, token in zip(slots, tokens):
            slot.tokens.append(token)
        return logits

    def record_prompt_rows(self, index: int, rows: int) -> None:
        """Hidden-state drafters are refused with pipeline stages (verify): nothing to record."""

    def take_prompt_rows(self, index: int) -> torch.Tensor | None:
        return None

    @torch.inference_mode()
    def verify(self, slot: KVSlot, tokens: list[int], hidden_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Score `tokens` after the slot's content and append them: logits [T, V]; the caller rewinds."""
        if hidden_layers:
            raise BonsaiError("drafters that read the target's hidden states (mtp, dflash) are not available "
                              "with pipeline parallelism; use ngram or draft:PATH")
        slot.check_room(len(tokens))
        t = len(tokens)
        if 1 < t <= MAX_STEP_ROWS and self.decoder is not None:
            logits = self.step_rows(tokens, list(range(slot.length, slot.length + t)), [slot.index] * t)
        else:  # a hybrid keeps every position's DeltaNet state (RECORD) for the rewind
            cmd = Command(PLAIN, (slot.index,), (slot.length,), t, -1, arg=RECORD if self.hybrid else 0)
            [logits] = self._passes([(cmd, [tokens])])
            logits = logits[0]  # [T, V]
        slot.tokens.extend(tokens)
        return logits, {}

    @torch.inference_mode()
    def step_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One token per row at its own position and slot (several slots, or consecutive positions of
        one slot): logits [M, V]. Rows go as micro-batches in order (a later row of a slot reads the
        keys an earlier micro-batch wrote; protocol.micro_batches says how many). Through the fused
        step where it runs, else the plain path."""
        assert 0 < len(tokens) == len(positions) == len(slots) <= MAX_ROWS
        passes = []
        fused = self.decoder is not None
        # a hybrid's rows of one slot stay in one pass: a pass drops the slot's rollback points of the one before
        whole = fused and (self.flat_step_cost or (self.hybrid and len(set(slots)) < len(slots)))
        for a, b in micro_batches(len(tokens), len(self.stages), MAX_STEP_ROWS if fused else 0, whole):
            if fused:
                passes.append((Command(ROWS, tuple(slots[a:b]), tuple(positions[a:b])), tokens[a:b]))
            else:
                ids = [[t] for t in tokens[a:b]]
                passes.append((Command(PLAIN, tuple(slots[a:b]), tuple(positions[a:b]), 1, 1), ids))
        parts = self._passes(passes)
        return torch.cat([p if p.dim() == 2 else p[:, -1] for p in parts])  # [M, V]

    def warm_up(self) -> None:
        """Nothing: each stage compiles its kernels at its first pass (a pipeline serves long prompts)."""

    def prepare_rows(self, max_rows: int) -> None:
        """Capture the fused step of every row count a micro-batch can have, on every stage, now."""
        if self.decoder is None:
            return
        self.executor.prepare_rows(max_rows)
        self.links.send_command(Command(PREPARE, arg=max_rows))
        self.links.flush_sends()

    # -- the passes --
    def _passes(self, passes: list[tuple]) -> list[torch.Tensor]:
        """Run passes through the pipeline one after another without waiting between them; the
        logits of those that want them, in order."""
        if self.links.failure is not None:
            raise BonsaiError(f"the pipeline stopped: {self.links.failure}")
        # GPU-specific: the engine thread's current device is stage 0's (CUDA keeps one per host thread)
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with device:
                return self._run_passes(passes)
        except RuntimeError as e:  # a worker is gone (gloo tells; NCCL is watched in launch._watch)
            raise BonsaiError(f"the pipeline stopped: {self.links.failure or e}") from None

    def _run_passes(self, passes: list[tuple]) -> list[torch.Tensor]:
        """passes: (command, token ids[, after]): `after` (or None) runs once stage 0 has run the pass."""
        links, vocab = self.links, self.loaded.config.vocab_size
        pending = []
        for cmd, ids, *after in passes:
            links.send_command(cmd)
            if cmd.wants_output:  # posted first: the last stage can send whenever it is done
                pending.append(links.post_recv(cmd.output_shape(vocab), torch.float32, links.last, back=True))
            x = self.executor.run(cmd, ids if cmd.op == ROWS else torch.tensor(ids, dtype=torch.long, device=self.device))
            links.send(x, 1)
            if after and after[0] is not None:
                after[0]()
        out = [links.finish(p) for p in pending]
        links.flush_sends()
        return out

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self.links.close()

    def __enter__(self) -> "PipelineRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_pipeline(source: ModelSource, stages: list[Stage], backend: str, max_seq_len: int, num_slots: int = 1,
                   prefill_chunk_size: int = 512, kv_type: str = "bf16", fast_decode: bool | None = None,
                   max_gpu_memory: int | None = None) -> PipelineRunner:
    """Start the workers, load stage 0 here while they load theirs, and wait until all are ready.
    max_gpu_memory: every GPU's allocator is capped at it (engine.memory.limit)."""
    import atexit
    if len(stages) < 2:
        raise BonsaiError("a pipeline needs two or more stages")
    run = RunSpec(max_seq_len, num_slots, kv_type, fast_decode, max_gpu_memory)
    links = start_workers(source, run, stages, backend)
    atexit.register(links.close)
    try:
        run.limit_memory(stages[0].device)
        loaded = source.load(stages[0].device, stages[0])
        executor = StageExecutor(loaded, stages[0], max_seq_len, num_slots, kv_type, fast_decode)
        wait_ready(links)
        if executor.needs_calibration:  # every stage measures its layers' key offsets in one pass
            from engine.runtime.kv_calibration import calibration_ids
            ids = calibration_ids(loaded.tokenizer, loaded.config.vocab_size)
            cmd = Command(CALIBRATE, num_tokens=len(ids))
            links.send_command(cmd)
            links.send(executor.run(cmd, [ids]), 1)
            links.flush_sends()
        executor.start_steps()
    except BaseException:
        links.failure = links.failure or "rank 0 failed while loading"
        links.close(timeout=5)
        raise
    return PipelineRunner(loaded, links, executor, prefill_chunk_size)

"""The engine loop: one thread owns the model runner and advances every active request.

Each iteration: requests that were cancelled (client gone) leave their slot; waiting requests get
free slots (longest cached prefix first, see scheduler.py); prompt chunks run for the requests that
still have prompt (or inserted) tokens to feed, oldest first, at most `prefill_budget` tokens while
other slots decode (scheduler.plan_prefill); then one batched decode step runs the next token of
every decoding slot together, in one forward. So a running request waits for at most one budget of
prefill between two of its tokens, and a new request's first token comes from its last chunk. Events go back to each request through its
`emit` callback (the API side turns them into an asyncio queue). A step that fails ends the
requests it served with an error and resets their slots; the loop and the other requests go on.

With speculative decoding (a SpeculativeStep, engine/decoding/spec_step.py) the decode step is a
verification step instead: each decoding slot's drafter proposes tokens, all slots' rows are
scored together (one fused step_rows call where it exists), each slot keeps its accepted run plus
the target's token and rewinds past the rest, so its cached tokens stay exactly what its KV holds
and prefix reuse keeps working. Each slot's drafter is begun on the whole prompt of the request
that takes the slot (the reused prefix included).
"""
from __future__ import annotations

import logging
import threading

import torch

from engine.errors import BonsaiError
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import sample_rows
from engine.decoding.metrics import Metrics
from engine.decoding.scheduler import Scheduler, plan_prefill
from engine.decoding.sequence import Failed, Sequence, ServeRequest, ThinkingRules
from engine.speculative.config import SpeculativeConfig
from engine.sources.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, slot_context: int, max_queue: int = 16,
                 rules: ThinkingRules | None = None, metrics: Metrics | None = None,
                 speculative: SpeculativeConfig | None = None, prefill_budget: int | None = None):
        """speculative: the drafters every slot runs (None: plain decoding). prefill_budget: prompt
        tokens run between two decode steps while slots decode (None: one prefill chunk); it also
        caps the chunk size."""
        self.runner, self.tokenizer = runner, tokenizer
        if prefill_budget is not None and prefill_budget < 1:
            raise BonsaiError(f"the prefill budget must be >= 1 token per step, got {prefill_budget}")
        self.prefill_budget = prefill_budget or runner.prefill_chunk_size
        self.prefill_chunk = min(runner.prefill_chunk_size, self.prefill_budget)
        self.slot_context = min(slot_context, runner.max_seq_len)
        self.rules = rules or ThinkingRules()
        # ids the tokenizer can turn into text: a model's padded vocabulary (or a borrowed tokenizer's
        # smaller one) is cut to it before sampling
        self.vocab = min(runner.loaded.config.vocab_size, tokenizer.vocab_size)
        self.metrics = metrics or Metrics()
        self.scheduler: Scheduler[ServeRequest] = Scheduler(runner.cache.slots, max_queue)
        self.metrics.slots_total = len(runner.cache.slots)
        self.active: dict[int, Sequence] = {}  # slot index → its request
        self.spec = None
        if speculative is not None:
            from engine.decoding.spec_step import SpeculativeStep
            self.spec = SpeculativeStep(runner, speculative, self.slot_context, self.vocab, self.metrics)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._to_begin: list[int] = []  # slots whose new request's drafter is not begun yet
        self._thread = threading.Thread(target=self._run, name="bonsai-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, request: ServeRequest) -> None:
        """Queue a request; raises scheduler.QueueFull when the server is full."""
        if not request.prompt_ids:
            raise BonsaiError("the prompt is empty: give at least one token of input")
        if len(request.prompt_ids) >= self.slot_context:
            raise BonsaiError(f"the prompt has {len(request.prompt_ids)} tokens but a slot's context holds "
                              f"{self.slot_context}: shorten it or raise model.max_context")
        with self._lock:
            if self._stopping:
                raise BonsaiError("the server is shutting down")
            self.scheduler.submit(request, request.prompt_ids)
            self.metrics.queue_waiting = self.scheduler.waiting
            self._wake.notify()

    def cancel(self, request: ServeRequest) -> None:
        """The client went away: free its slot (or queue place) at the next iteration."""
        request.cancelled.set()
        with self._lock:
            self._wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def slots(self) -> list[dict]:
        """What /slots shows."""
        out = []
        for slot in self.runner.cache.slots:
            info = self.scheduler.info(slot.index)
            seq = self.active.get(slot.index)
            out.append({"id": slot.index, "n_ctx": self.slot_context, "is_processing": seq is not None,
                        "n_cached": slot.length, "requests_served": info.requests_served,
                        "cache_hits": info.cache_hits,
                        "drafter": None if self.spec is None else self.spec.info(slot.index),
                        "task": None if seq is None else {
                            "id": seq.request.id, "n_prompt_tokens": len(seq.request.prompt_ids),
                            "n_cached": seq.cached, "n_decoded": seq.generated}})
        return out

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.active and not self.scheduler.waiting:
                    self._wake.wait()
                if self._stopping:
                    break
                self._admit()
            try:
                self._step()
            except Exception as e:  # a bug in the loop itself: fail what is active, keep serving
                log.exception("engine step failed")
                for index in list(self.active):
                    self._fail(index, f"internal error: {type(e).__name__}: {e}")
        for index in list(self.active):
            self._fail(index, "the server is shutting down", status=503)
        for request in self.scheduler.drain():
            request.emit(Failed("the server is shutting down", 503))

    def _admit(self) -> None:
        for _ in self.scheduler.drop_waiting(lambda r: r.cancelled.is_set()):
            self.metrics.count_request("cancelled")
        for a in self.scheduler.assign():
            seq = Sequence(a.request, self.tokenizer, self.rules, self.vocab, self.runner.device, a.reused)
            self.active[a.slot.index] = seq
            self._to_begin.append(a.slot.index)
            self.metrics.count_prompt(len(a.request.prompt_ids), a.reused)
        self.metrics.queue_waiting = self.scheduler.waiting
        self.metrics.slots_busy = self.scheduler.busy

    def _step(self) -> None:
        for index, seq in list(self.active.items()):
            if seq.request.cancelled.is_set():
                self._end(index, "cancelled")
        for index in self._to_begin:
            if self.spec is not None and index in self.active:
                try:
                    self.spec.begin(index, self.active[index])
                except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
                    log.exception("drafter begin failed")
                    self._fail(index, _message(e))
        self._to_begin.clear()
        self._prefill()
        self._decode_all()
        for index, seq in list(self.active.items()):
            if seq.done:
                self._end(index, None)

    def _room(self, index: int) -> int:
        return self.slot_context - self.runner.slot(index).length

    def _prefill(self) -> None:
        """This iteration's prompt chunks (scheduler.plan_prefill): oldest request first (`active`
        keeps admission order), within the budget while any slot decodes."""
        live = [(i, s) for i, s in self.active.items() if not s.done]
        decoding = any(len(s.pending) == 1 for _, s in live)
        waiting = [(i, len(s.pending)) for i, s in live if len(s.pending) > 1]
        if not waiting:
            return
        for part in plan_prefill(waiting, self.prefill_chunk, self.prefill_budget if decoding else None):
            if part.slot in self.active:  # not failed by an earlier chunk of this iteration
                self._prefill_chunk(part.slot, part.size)

    def _prefill_chunk(self, index: int, size: int) -> None:
        seq, slot = self.active[index], self.runner.slot(index)
        chunk = seq.pending[:size]
        try:
            if len(chunk) > self._room(index):
                raise BonsaiError(f"the context of the slot ({self.slot_context} tokens) is full")
            logits = self.runner.forward(slot, chunk, num_logits=1)  # [1, V]
            seq.pending = seq.pending[len(chunk):]
            self.metrics.count_prefill()
            if not seq.pending:
                seq.on_logits(logits[-1], self._room(index))
        except Exception as e:
            self._fail(index, _message(e), 400 if isinstance(e, BonsaiError) else 500)

    def _decode_all(self) -> None:
        rows = [i for i, s in sorted(self.active.items()) if len(s.pending) == 1 and not s.done]
        if not rows:
            return
        if self.spec is not None:
            self.spec.step(self.active, rows, lambda i, e: self._fail(i, _message(e)))
            return
        slots = [self.runner.slot(i) for i in rows]
        tokens = [self.active[i].pending[0] for i in rows]
        try:
            logits = self.runner.decode_batch(slots, tokens)  # [B, V]
        except Exception as e:
            log.exception("batched decode failed")
            for i in rows:
                self._fail(i, _message(e))
            return
        seqs = [self.active[i] for i in rows]
        before = sum(seq.generated for seq in seqs)
        try:
            cut = logits[:, :self.vocab]  # [B, V] the ids the tokenizer knows
            if any(seq.seen is not None for seq in seqs):
                cut = torch.stack([seq.penalized(cut[row]) for row, seq in enumerate(seqs)])  # [B, V]
            # every row's token in one call and one read-back (greedy rows: one argmax for all)
            choices = sample_rows(cut, [seq.request.sampling for seq in seqs], [seq.generator for seq in seqs])
        except Exception as e:
            log.exception("sampling failed")
            for i in rows:
                self._fail(i, _message(e))
            return
        for row, (i, seq) in enumerate(zip(rows, seqs)):
            try:
                seq.on_logits(cut[row], self._room(i), choices[row])
            except Exception as e:
                log.exception("sampling failed")
                self._fail(i, _message(e))
        self.metrics.count_step(len(rows), sum(seq.generated for seq in seqs) - before)

    def _end(self, index: int, outcome: str | None) -> None:
        seq = self.active.pop(index)
        if outcome == "cancelled":
            seq.done = True
            log.info("request %s cancelled (client gone); slot %d is free", seq.request.id, index)
        with self._lock:
            self.scheduler.release(self.runner.slot(index))  # its tokens stay cached for the next request
            self.metrics.slots_busy = self.scheduler.busy
        self.metrics.count_request(outcome or seq.finish_reason or "stop")

    def _fail(self, index: int, message: str, status: int = 500) -> None:
        seq = self.active.pop(index, None)
        if seq is None:
            return
        seq.done = True
        self.runner.slot(index).reset()  # what its KV holds is no longer known
        seq.request.emit(Failed(message, status))
        with self._lock:
            self.scheduler.release(self.runner.slot(index))
            self.metrics.slots_busy = self.scheduler.busy
        self.metrics.count_request("error")


def _message(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text if isinstance(e, BonsaiError) else f"internal error: {type(e).__name__}: {text}"


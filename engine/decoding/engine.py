"""The engine: the one place where logits become tokens, for one request or many.

`step()` advances every active request by one iteration: cancelled requests leave their slot; waiting requests get free
slots (longest cached prefix first, scheduler.py); prompt chunks run for the requests with prompt (or inserted) tokens
to feed, oldest first, at most `prefill_budget` tokens while other slots decode (scheduler.plan_prefill); then one
batched decode step runs the next token of every decoding slot in one forward, prompts riding in the rows its pass
leaves free (scheduler.plan_riders: short ones, or up to a chunk while slots decode; with no slot decoding, a wave of
short ones shares passes). A new request's first token comes from its last chunk. Events go back through
each request's `emit` (sequence.py). A step that fails ends the requests it served with an error and resets their
slots; the others go on; admission is guarded the same way, and an event callback that raises ends only its own
request. `close` (the server's thread ending, `failure` saying why) fails every active and waiting request and refuses
new ones: nothing ever waits on a dead engine.

Offline generation is `submit` + `step` until done (generate.py: chat, generate, bench, the drafter trainer; one slot);
the server (engine/server/engine_thread.py) drives it from its own thread. `submit` and `cancel`: from any thread.

With drafters (one per slot, speculation: spec_step.py) the decode step is a verification step (unless the gate
keeps it plain, spec_gate.py, or prompts ride in it): each decoding slot's drafter proposes tokens, all slots' rows
are scored together, each slot keeps its accepted run plus the target's token and rewinds past the rest, so its cached
tokens stay what its KV holds and prefix reuse keeps working. A slot's drafter is begun on the request's whole prompt."""
from __future__ import annotations

import logging
import threading
import time

import torch

from engine.decoding.grammar_match import mask_rows
from engine.decoding.lookahead import Lookahead, TokenReadback
from engine.decoding.metrics import Metrics
from engine.decoding.spec_gate import SpecGate
from engine.decoding.sampling import sample_rows_on_device
from engine.decoding.scheduler import PrefillChunk, Scheduler, plan_prefill, plan_riders
from engine.decoding.sequence import Failed, Request, Sequence, ThinkingRules, emit_failure
from engine.decoding.spec_step import SpeculativeStep
from engine.errors import BonsaiError, ServiceUnavailable, error_message, first_line
from engine.runtime.runner import Runner
from engine.sources.tokenizer import Tokenizer
from engine.speculative.drafter import Drafter

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer | None, slot_context: int | None = None, max_queue: int = 16,
                 rules: ThinkingRules | None = None, metrics: Metrics | None = None, drafters: list[Drafter] | None = None,
                 num_draft_tokens: int = 4, prefill_budget: int | None = None, spec_method: str | None = None,
                 lookahead: bool | None = None, spec_gate: bool | None = None, mixed_prefill: bool = True):
        """tokenizer None: token ids only (generated weights).
        slot_context: positions one request may use (default: the runner's context). drafters: one per
        slot (speculative decoding), None: plain decoding; num_draft_tokens: k, the most each drafts
        a step (spec_method: the name /slots shows, default the drafter's). prefill_budget: prompt
        tokens run between two decode steps while slots decode (None: one prefill chunk, or two passes
        of the runner's short prefill for a prompt that runs that way); it also caps the chunk size.
        lookahead: launch each plain decode step before the host handles the last one's tokens (lookahead.py; CUDA: on).
        spec_gate: with drafters, speculate only while measured faster (engine.decoding.spec_gate; default:
        on a CUDA device; elsewhere the drafters' planners alone decide, by the pass costs they measure).
        mixed_prefill: short prompts ride in the rows a decode pass leaves free (or share passes) instead of
        running passes of their own (engine.decoding.scheduler.plan_riders)."""
        self.runner, self.tokenizer = runner, tokenizer
        if prefill_budget is not None and prefill_budget < 1:
            raise BonsaiError(f"the prefill budget must be >= 1 token per step, got {prefill_budget}")
        self.prefill_chunk = min(runner.prefill_chunk_size, prefill_budget or runner.prefill_chunk_size)
        # a prompt whose rest fits the runner's short prefill (graphed passes of short_prefill_rows) runs two of those
        # between decode steps: ITL p99 48 → 15 ms at 8 slots (docs/perf.md, session 10); longer ones: whole chunks
        rows = getattr(runner, "short_prefill_rows", 0)
        self.short_cut = min(rows, self.prefill_chunk) if rows > 1 else 0
        self.short_tokens = getattr(runner, "short_prefill_tokens", 0) if rows > 1 else 0
        self.prefill_budget = prefill_budget or (2 * self.short_cut if self.short_cut else runner.prefill_chunk_size)
        # mixed passes: a decode step of B slots runs in the fused step's pass of up to `mix_rows` rows, the free ones
        # fed with short prompts' next tokens: decoding slots wait for no prefill (with drafters: the step is plain)
        self.mix_rows = rows if mixed_prefill and rows > 1 else 0
        self.min_riders = max(1, self.mix_rows // 4)  # fewer free rows: the prompt would crawl
        # while slots decode, prompts up to a chunk ride too: an eager chunk stalls them all (docs/perf.md, session 26)
        self.ride_tokens = max(self.short_tokens, self.prefill_chunk) if self.mix_rows else 0
        self.slot_context = min(slot_context or runner.max_seq_len, runner.max_seq_len)
        self.rules = rules or ThinkingRules()
        # ids the tokenizer can turn into text: a model's padded vocabulary (or a borrowed tokenizer's smaller one) is cut
        vocab = runner.loaded.config.vocab_size
        self.vocab = min(vocab, tokenizer.vocab_size) if tokenizer is not None else vocab
        self.metrics, self.scheduler = metrics or Metrics(), Scheduler(runner.cache.slots, max_queue)
        self.metrics.slots_total = len(runner.cache.slots)
        self.active: dict[int, Sequence] = {}  # slot index → its request
        self.spec = None
        if drafters is not None:
            assert len(drafters) == len(runner.cache.slots), "one drafter per slot"
            self.spec = SpeculativeStep(runner, drafters, num_draft_tokens, self.slot_context, self.vocab,
                                        self.metrics, spec_method)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)  # notified on submit / cancel (a thread driving step() waits)
        self.closed, self.failure = False, None  # failure: why the server's engine thread ended on its own (a str)
        self._to_begin: list[int] = []  # slots whose new request's drafter is not begun yet
        kind = runner.device.type
        on = lookahead if lookahead is not None else kind == "cuda"
        self.ahead = Lookahead(runner) if on and getattr(runner, "rewinds_for_free", True) else None
        self.feed_ahead = self.ahead is not None and self.ahead.on_device  # launched before the tokens are read back
        self.readback = TokenReadback(runner.device)
        gate = (spec_gate if spec_gate is not None else kind == "cuda") and self.spec is not None  # spec_gate.py
        self.gate = SpecGate.for_device(kind) if gate and not any(d.hidden_layers for d in drafters) else None

    @property
    def has_work(self) -> bool:
        return bool(self.active) or self.scheduler.waiting > 0

    def submit(self, request: Request) -> None:
        """Queue a request; raises scheduler.QueueFull when every slot and the queue are taken,
        ServiceUnavailable when the engine is closed (stopping, or stopped by a failure)."""
        if not request.prompt_ids:
            raise BonsaiError("the prompt is empty: give at least one token of input")
        if len(request.prompt_ids) >= self.slot_context:
            raise BonsaiError(f"the prompt has {len(request.prompt_ids)} tokens but the context holds {self.slot_context}"
                              ": shorten it or raise the context (model.max_context, --max-seq-len)")
        with self.lock:
            if self.closed:
                raise ServiceUnavailable(self.failure or "the server is shutting down")
            self.scheduler.submit(request, request.prompt_ids if request.reuse_prefix else [])
            self.metrics.queue_waiting = self.scheduler.waiting
            self.wake.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: free its slot (or queue place) at the next step."""
        request.cancelled.set()
        with self.lock:
            self.wake.notify()

    def close(self, message: str = "the server is shutting down", status: int = 503) -> None:
        """Refuse new requests; end the active and waiting ones with `message`."""
        with self.lock:
            self.closed = True
            waiting = self.scheduler.drain()
        for index in list(self.active):
            self._fail(index, message, status)
        for request in waiting:
            emit_failure(request, Failed(message, status))

    def forget(self) -> None:
        """Empty the cache of every slot no request is using (the next prompts are computed afresh)."""
        with self.lock:
            for slot in self.runner.cache.slots:
                if slot.index not in self.active:
                    slot.reset()

    def slots(self) -> list[dict]:
        out = []  # what /slots shows
        for slot in self.runner.cache.slots:
            info, seq = self.scheduler.info(slot.index), self.active.get(slot.index)
            out.append({"id": slot.index, "n_ctx": self.slot_context, "is_processing": seq is not None,
                        "n_cached": slot.length, "requests_served": info.requests_served, "cache_hits": info.cache_hits,
                        "drafter": None if self.spec is None else self.spec.info(slot.index),
                        "task": None if seq is None else {
                            "id": seq.request.id, "n_prompt_tokens": len(seq.request.prompt_ids),
                            "n_cached": seq.stats.cached_tokens, "n_decoded": seq.generated}})
        return out

    def step(self) -> None:
        """Admit what waits, then one round of prefill chunks and one decode (or verify) step."""
        if self.scheduler.waiting:  # a request submitted meanwhile is admitted at the next step
            with self.lock:
                self._admit()
        try:
            self._step()
        except Exception as e:  # a bug in the engine itself: fail what is active, keep going
            log.exception("engine step failed")
            for index in list(self.active):
                self._fail(index, f"internal error: {type(e).__name__}: {first_line(e)}")

    def _admit(self) -> None:
        """Waiting requests into free slots (called holding the lock); one that cannot start fails alone."""
        for _ in self.scheduler.drop_waiting(lambda r: r.cancelled.is_set()):
            self.metrics.count_request("cancelled")
        for a in self.scheduler.assign():
            method = self.spec.method if self.spec is not None else None
            try:
                seq = Sequence(a.request, self.tokenizer, self.rules, self.vocab, self.runner.device, a.reused,
                               method)
            except Exception as e:  # noqa: BLE001 - this request fails, the others are admitted
                log.log(logging.WARNING if isinstance(e, BonsaiError) else logging.ERROR,
                        "request %s could not start: %s", a.request.id, error_message(e),
                        exc_info=not isinstance(e, BonsaiError))
                self.scheduler.release(a.slot)  # nothing ran: its cached tokens are still valid
                self.metrics.count_request("error")
                emit_failure(a.request, Failed(error_message(e), 400 if isinstance(e, BonsaiError) else 500))
                continue
            self.active[a.slot.index] = seq
            self._to_begin.append(a.slot.index)
            self.metrics.count_prompt(len(a.request.prompt_ids), a.reused)
        self.metrics.queue_waiting = self.scheduler.waiting
        self.metrics.slots_busy = self.scheduler.busy

    def _step(self) -> None:
        for index in [i for i, seq in self.active.items() if seq.request.cancelled.is_set()]:
            self._end(index, "cancelled")
        for index in self._to_begin:
            if self.spec is not None and index in self.active:
                try:
                    self.spec.begin(index, self.active[index])
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    log.exception("drafter begin failed")
                    self._fail(index, error_message(e))
        self._to_begin.clear()
        riders, limit = self._riders()
        self._prefill(riding=limit if riders else 0)
        self._decode_all(riders)
        for index, seq in list(self.active.items()):
            if seq.done:
                self._end(index, None)

    def _room(self, index: int) -> int:
        return self.slot_context - self.runner.slot(index).length

    def _riders(self) -> tuple[list[PrefillChunk], int]:
        """Prompts' pieces riding in this decode pass (scheduler.plan_riders) and the longest prompt that may ride (short
        ones, up to a chunk while slots decode); none if a step runs ahead or drafters decode every step (no gate). With
        the gate a step with riders is plain: a prompt's own passes stalled the drafting slots for longer (docs/perf.md)."""
        if not self.mix_rows or (self.ahead is not None and self.ahead.rows):
            return [], 0
        decoding = sum(1 for s in self.active.values() if len(s.pending) == 1 and not s.done)
        if self.spec is not None and decoding and self.gate is None:
            return [], 0
        limit = self.ride_tokens if decoding else self.short_tokens
        waiting = [(i, len(s.pending)) for i, s in self.active.items() if 1 < len(s.pending) <= limit and not s.done]
        return (plan_riders(decoding, waiting, self.mix_rows, self.min_riders) if waiting else []), limit

    def _prefill(self, riding: int = 0) -> None:
        """This iteration's prompt chunks (scheduler.plan_prefill): oldest request first (`active`
        keeps admission order), within the budget while any slot decodes. riding: prompts up to this long ride in the
        decode pass instead (all of them: one that found no free row waits for the next)."""
        waiting = [(i, len(s.pending), self._chunk(len(s.pending))) for i, s in self.active.items()
                   if len(s.pending) > max(riding, 1) and not s.done]
        decoding = any(len(s.pending) == 1 and not s.done for s in self.active.values())
        for part in plan_prefill(waiting, self.prefill_budget if decoding else None):
            if part.slot in self.active:  # not failed by an earlier chunk of this iteration
                self._prefill_chunk(part.slot, part.size)

    def _chunk(self, left: int) -> int:
        """The chunk of a prompt with `left` tokens to feed: from the prompt alone, never the load."""
        return self.short_cut if self.short_cut and left <= self.short_tokens else self.prefill_chunk

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
            self._fail(index, error_message(e), 400 if isinstance(e, BonsaiError) else 500)

    def _decode_all(self, riders: list[PrefillChunk] = ()) -> None:
        rows = [i for i, s in sorted(self.active.items()) if len(s.pending) == 1 and not s.done]
        if not rows:
            if riders:  # prompts sharing a pass, nobody decoding yet
                self._mixed_pass([], [], riders)
            return
        speculate = self._drafting(rows) and not riders and self.spec.gated(self.gate, self.active, rows)
        if self.gate is not None:
            self.gate.begin(speculate, len(rows), self.metrics.generated_tokens, self.metrics.prefill_chunks,
                            time.perf_counter())
        if speculate:
            if self.ahead is not None:  # a plain step launched ahead is not this one: its slots forget its token
                self.ahead.drop_all()
            caught_up = self.spec.step(self.active, rows, lambda i, e: self._fail(i, error_message(e)))
            if self.gate is not None:  # drafters feeding tokens they did not see (a prompt): not this step's rate
                self.gate.exclude(*caught_up)
            return
        seqs = [self.active[i] for i in rows]
        if riders and len(rows) + sum(p.size for p in riders) > self.mix_rows:  # a prompt's prefill ended: more rows
            riders = plan_riders(len(rows), [(p.slot, p.size) for p in riders], self.mix_rows, self.min_riders)
        try:
            fed = [seq.pending[0] for seq in seqs]
            logits = self.ahead.take(rows, fed) if self.ahead is not None else None  # [B, V]: launched ahead
            if logits is None and riders:
                logits = self._mixed_pass(rows, fed, riders)  # [B, V]
            elif logits is None:
                logits = self.runner.decode_batch([self.runner.slot(i) for i in rows], fed)  # [B, V]
        except Exception as e:
            log.exception("batched decode failed")
            for i in rows:
                self._fail(i, error_message(e))
            return
        before = sum(seq.generated for seq in seqs)
        try:
            cut = logits[:, :self.vocab] if logits.shape[-1] > self.vocab else logits  # [B, V] ids the tokenizer knows
            if any(seq.adjusts for seq in seqs):
                cut = torch.stack([seq.penalized(cut[row]) for row, seq in enumerate(seqs)])  # [B, V]
            constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
            if constrained:  # a grammar's rows masked (a copy); the other rows untouched, at no cost
                cut = mask_rows(cut, [seqs[row].grammar for row in constrained], constrained)  # [B, V]
            # every row's token in one call and one read-back (greedy rows: one argmax for all)
            chosen = sample_rows_on_device(cut, [seq.request.sampling for seq in seqs],
                                           [seq.generator for seq in seqs])  # [B] on the device
            self.readback.start(chosen)  # a copy to the host queued behind them (lookahead.TokenReadback)
            if self.feed_ahead:  # the next step takes them on the device, launched before they are read back
                self._launch_ahead(rows, seqs, chosen)
            choices = self.readback.wait()
        except Exception as e:
            log.exception("sampling failed")
            for i in rows:  # (each row of a step launched ahead leaves with its request)
                self._fail(i, error_message(e))
            return
        if self.feed_ahead:
            self.ahead.settle(choices)  # (if a step was launched)
        else:
            self._launch_ahead(rows, seqs, choices)  # the next step runs while the host handles these tokens
        for row, (i, seq) in enumerate(zip(rows, seqs)):
            try:
                # its row only where logprobs are asked for: a view per token costs, on the fast path
                seq.take(choices[row], cut[row] if seq.request.top_logprobs is not None else None, self._room(i))
            except Exception as e:
                log.exception("sampling failed")
                self._fail(i, error_message(e))
        self.metrics.count_step(len(rows), sum(seq.generated for seq in seqs) - before, self.readback.waited)

    def _mixed_pass(self, rows: list[int], fed: list[int], riders: list[PrefillChunk]) -> torch.Tensor:
        """One fused pass: the decode rows' tokens, then each rider's prompt piece at its slot's next positions; the
        riders' prompts move on (one that ends chooses its first token from its last row). Logits [B, V] of the decode rows."""
        runner, pieces = self.runner, []
        tokens, positions, slots = list(fed), [runner.slot(i).length for i in rows], list(rows)
        for i in rows:
            runner.slot(i).check_room(1)
        for part in riders:
            piece, start = self.active[part.slot].pending[:part.size], runner.slot(part.slot).length
            if len(piece) > self._room(part.slot):
                self._fail(part.slot, f"the context of the slot ({self.slot_context} tokens) is full", 400)
                continue
            pieces.append((part.slot, piece, len(tokens)))
            tokens, slots = tokens + piece, slots + [part.slot] * len(piece)
            positions += range(start, start + len(piece))
        try:
            logits = runner.step_rows(tokens, positions, slots)  # [M, V]
        except Exception as e:
            for index, _, _ in pieces:  # their KV rows are not known either
                self._fail(index, error_message(e))
            raise
        for i, token in zip(rows, fed):
            runner.slot(i).tokens.append(token)
        for index, piece, first in pieces:
            seq = self.active[index]
            runner.slot(index).tokens.extend(piece)
            seq.pending = seq.pending[len(piece):]
            self.metrics.count_prefill()
            if not seq.pending:
                try:
                    seq.on_logits(logits[first + len(piece) - 1], self._room(index))
                except Exception as e:  # noqa: BLE001 - this request fails, the decode rows go on
                    self._fail(index, error_message(e), 400 if isinstance(e, BonsaiError) else 500)
        return logits[:len(rows)]

    def _drafting(self, rows: list[int]) -> bool:
        """Speculation on, and some row's request allows drafts (every row's `draft_tokens=0`: a plain step)."""
        return self.spec is not None and any(self.active[i].request.draft_tokens != 0 for i in rows)

    def _launch_ahead(self, rows: list[int], seqs: list[Sequence], choices: list[int] | torch.Tensor) -> None:
        """Launch the next decode step of `rows` feeding their chosen tokens (ints, or the sampler's [B] on the device)
        unless it will not be the next step: a request waits or prefills, the gate will speculate, a row ends now (its
        last token; its end-of-sequence token where known). A row ending another way leaves it alone (`_end`)."""
        gate_speculates = self.gate is not None and self._drafting(rows) and self.gate.peek(len(rows))
        known = choices if isinstance(choices, list) else [None] * len(rows)
        if self.ahead is None or self.scheduler.waiting or len(rows) != len(self.active) or gate_speculates or any(
                choice in seq.eos or seq.generated + 1 >= seq.request.max_tokens
                for seq, choice in zip(seqs, known)):
            return
        try:
            self.ahead.launch(rows, choices)  # (a list is copied there; a tensor is taken as is)
        except Exception:  # noqa: BLE001 - the step is made again, plainly, at the next iteration
            log.exception("decode step launched ahead failed")
            self.ahead.drop_all()

    def _end(self, index: int, outcome: str | None) -> None:
        if self.ahead is not None:
            self.ahead.drop(index)
        seq = self.active.pop(index)
        if outcome == "cancelled":
            seq.done = True
            log.info("request %s cancelled (client gone); slot %d is free", seq.request.id, index)
        with self.lock:
            self.scheduler.release(self.runner.slot(index))  # its tokens stay cached for the next request
            self.metrics.slots_busy = self.scheduler.busy
        self.metrics.count_request(outcome or seq.finish_reason or "stop", seq.started - seq.request.arrived,
                                   seq.stats.prefill_seconds)

    def _fail(self, index: int, message: str, status: int = 500) -> None:
        seq = self.active.pop(index, None)
        if seq is None:
            return
        seq.done = True
        if self.ahead is not None:
            self.ahead.drop(index)
        self.runner.slot(index).reset()  # what its KV holds is no longer known
        emit_failure(seq.request, Failed(message, status))
        with self.lock:
            self.scheduler.release(self.runner.slot(index))
            self.metrics.slots_busy = self.scheduler.busy
        self.metrics.count_request("error")


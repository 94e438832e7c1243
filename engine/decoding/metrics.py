"""Server counters and their Prometheus text form (plain Python, thread-safe)."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

PREFIX = "bonsai"


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # finish reason / outcome → count
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (not reused from a cache)
    cached_tokens: int = 0
    cache_hit_requests: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # rows of all batched decode steps (mean batch = rows / steps)
    # seconds the engine waited for plain decode steps' tokens (their read-back): a GPU-bound engine waits most of a
    # step, a host-bound one (its Python, a server's other threads) ~0
    decode_wait_seconds: float = 0.0
    prefill_chunks: int = 0  # prompt forwards (chunks of at most the prefill chunk size)
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_drafted_per_position: Counter = field(default_factory=Counter)  # position (0 = first draft) → drafts
    spec_accepted_per_position: Counter = field(default_factory=Counter)
    spec_verify_steps: int = 0  # slot-steps that verified at least one draft
    # ended requests that were admitted: seconds waiting for a slot (arrival → admission) and from admission to
    # the first token (its prompt's prefill, shared passes included), summed (the means: / requests_timed)
    requests_timed: int = 0
    queue_seconds: float = 0.0
    first_token_seconds: float = 0.0
    slots_total: int = 0
    slots_busy: int = 0
    queue_waiting: int = 0
    _recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) of decode steps
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count_request(self, outcome: str, queued: float | None = None, first_token: float | None = None) -> None:
        """A request ended with `outcome`; an admitted one also gives its seconds waiting for a slot and from
        admission to its first token (0 when it ended before one)."""
        with self._lock:
            self.requests[outcome] += 1
            if queued is not None:
                self.requests_timed += 1
                self.queue_seconds += max(queued, 0.0)
                self.first_token_seconds += max(first_token or 0.0, 0.0)

    def count_prompt(self, prompt: int, cached: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.prompt_tokens_computed += prompt - cached
            self.cache_hit_requests += cached > 0

    def count_prefill(self) -> None:
        """One prompt chunk ran (its tokens are counted by count_prompt)."""
        with self._lock:
            self.prefill_chunks += 1

    def count_step(self, rows: int, tokens: int, waited: float = 0.0) -> None:
        with self._lock:
            self.decode_steps += 1
            self.decode_wait_seconds += waited
            self.decode_rows += rows
            self.generated_tokens += tokens
            self._recent.append((time.monotonic(), tokens))

    def count_spec(self, drafted: int, accepted: int) -> None:
        """One slot's verification: `drafted` draft tokens scored, the first `accepted` kept."""
        if not drafted:
            return
        with self._lock:
            self.spec_verify_steps += 1
            self.spec_drafted += drafted
            self.spec_accepted += accepted
            for position in range(drafted):
                self.spec_drafted_per_position[position] += 1
                self.spec_accepted_per_position[position] += position < accepted

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now = time.monotonic()
        with self._lock:
            n = sum(t for when, t in self._recent if now - when <= window)
        return n / window

    def prometheus(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {PREFIX}_{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}_{name} {kind}")
            lines.extend(f"{PREFIX}_{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            requests = sorted(self.requests.items())
            per_pos = sorted(self.spec_accepted_per_position.items())
            drafted_pos = sorted(self.spec_drafted_per_position.items())
            snapshot = dict(vars(self))
        metric("requests_total", "counter", "Requests by outcome (stop, length, cancelled, error).",
               [(f'{{outcome="{k}"}}', v) for k, v in requests] or [('{outcome="stop"}', 0)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished and running requests.",
               [("", snapshot["prompt_tokens"])])
        metric("prompt_tokens_computed_total", "counter", "Prompt tokens run through the model.",
               [("", snapshot["prompt_tokens_computed"])])
        metric("prompt_cache_tokens_total", "counter", "Prompt tokens reused from a slot's cache.",
               [("", snapshot["cached_tokens"])])
        metric("prompt_cache_hits_total", "counter", "Requests that reused part of a slot's cache.",
               [("", snapshot["cache_hit_requests"])])
        metric("request_timed_total", "counter", "Admitted requests that ended (the count of the two sums below).",
               [("", snapshot["requests_timed"])])
        metric("request_queue_seconds_total", "counter", "Seconds requests waited for a slot, summed.",
               [("", snapshot["queue_seconds"])])
        metric("request_first_token_seconds_total", "counter",
               "Seconds from a request's admission to its first token, summed.",
               [("", snapshot["first_token_seconds"])])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", snapshot["generated_tokens"])])
        metric("decode_steps_total", "counter", "Batched decode steps.", [("", snapshot["decode_steps"])])
        metric("decode_rows_total", "counter", "Rows (requests) over all decode steps.",
               [("", snapshot["decode_rows"])])
        metric("decode_wait_seconds_total", "counter", "Seconds the engine waited for plain decode steps' tokens.",
               [("", snapshot["decode_wait_seconds"])])
        metric("prefill_chunks_total", "counter", "Prompt chunks run (one forward each).",
               [("", snapshot["prefill_chunks"])])
        metric("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
               [("", self.tokens_per_second())])
        metric("slots_total", "gauge", "Slots (requests decoded together).", [("", snapshot["slots_total"])])
        metric("slots_busy", "gauge", "Slots working on a request.", [("", snapshot["slots_busy"])])
        metric("queue_waiting", "gauge", "Requests waiting for a slot.", [("", snapshot["queue_waiting"])])
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
               [("", snapshot["spec_drafted"])])
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [("", snapshot["spec_accepted"])])
        metric("spec_decode_num_drafts_total", "counter", "Verifications of a slot's draft (slot-steps with drafts).",
               [("", snapshot["spec_verify_steps"])])
        if drafted_pos:
            metric("spec_decode_num_draft_tokens_per_pos_total", "counter", "Draft tokens by position in the draft.",
                   [(f'{{position="{p}"}}', v) for p, v in drafted_pos])
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted drafts by position.",
                   [(f'{{position="{p}"}}', v) for p, v in per_pos])
        return "\n".join(lines) + "\n"

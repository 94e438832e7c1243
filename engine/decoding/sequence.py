"""One request inside the engine: its sampling state, text pipeline, thinking budget and timings.

The engine loop feeds `pending` tokens to the model for this request's slot and hands the logits
of the last one to `on_logits`, which samples the next token and turns it into events: text pieces
(split into reasoning and answer), then one `Finished`. Tokens the server inserts itself (the end
of a thought whose budget is spent, or the lead into an answer) join `pending` and the output
like sampled ones.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.decoding.detokenize import StreamDecoder
from engine.decoding.sampling import SamplingParams, apply_penalties, make_generator, sample
from engine.decoding.reasoning import ReasoningSplitter
from engine.decoding.stop import StopStringMatcher
from engine.sources.tokenizer import Tokenizer


@dataclass
class Delta:
    reasoning: str
    content: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # "stop" | "length"
    usage: dict[str, Any]
    timings: dict[str, Any]


@dataclass
class Failed:
    message: str
    status: int = 500


@dataclass
class ServeRequest:
    """What the API hands the engine. `emit` is called from the engine thread with each event."""
    id: str
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[Delta | Finished | Failed], None]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    thinking_budget: int | None = None
    thinking_at_start: bool = False  # the prompt ends inside an opened thought
    split_reasoning: bool = True  # chat: thoughts go out as reasoning; raw completions: all text is content
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the n most likely
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class ThinkingRules:
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    end_message: str = ""


class Sequence:
    def __init__(self, request: ServeRequest, tokenizer: Tokenizer, rules: ThinkingRules, vocab: int,
                 device: torch.device, reused: int):
        self.request, self.tokenizer, self.rules, self.vocab = request, tokenizer, rules, vocab
        params = request.sampling
        self.generator = None if params.greedy else make_generator(params, device)
        self.seen = self.output = None
        if params.uses_penalties:
            self.seen = torch.bincount(torch.tensor(request.prompt_ids, device=device), minlength=vocab).float()
            self.output = torch.zeros(vocab, device=device)  # [V]
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = StopStringMatcher(request.stop)
        self.splitter = ReasoningSplitter(rules.start_tag, rules.end_tag, request.thinking_at_start,
                                          enabled=request.split_reasoning)
        self.eos = tokenizer.eos_ids
        self.pending: list[int] = request.prompt_ids[reused:]
        self.cached = reused
        self.generated = 0
        self.thinking_tokens = 0
        self.budget_spent = False
        self.led_into_answer = False
        self.done = False
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.first_token: float | None = None
        self.last_token = self.started
        self.draft_n = self.draft_accepted = 0  # speculative decoding fills these

    # -- the engine loop calls these ------------------------------------------------------------
    def on_logits(self, logits: torch.Tensor, room: int, choice: int | None = None) -> None:
        """Sample after logits [V]; `room`: positions still free in the slot's context budget;
        `choice`: the token already picked from these logits (then they are already penalized)."""
        params = self.request.sampling
        logits = logits[:self.vocab]  # [V] the ids the tokenizer knows
        if choice is not None:
            self.take(choice, logits, room)
            return
        if self.seen is not None:
            logits = apply_penalties(logits, self.seen, self.output, params)
        self.take(sample(logits, params, self.generator), logits, room)

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (cut to the vocabulary) with this request's penalties applied (as sampled)."""
        if self.seen is None:
            return logits
        return apply_penalties(logits, self.seen, self.output, self.request.sampling)

    def accept(self, tokens: list[int], logits: torch.Tensor, room: int) -> int:
        """Tokens a speculative step verified (the accepted drafts, then the target's bonus), taken
        one by one as if sampled; logits [n, V]: their rows (cut to the vocabulary, penalized), for
        logprobs; room: as for the first of them. Returns how many were used: fewer than n when one
        ended the output (EOS, stop string, max_tokens, context) or the server inserted tokens after
        it (thinking budget), so the rest are dropped as plain decoding would never have made them."""
        for i, token in enumerate(tokens):
            self.take(token, logits[i], room - i)
            if self.done or self.pending != [token]:
                return i + 1
        return len(tokens)

    def take(self, token: int, logits: torch.Tensor, room: int) -> None:
        """One chosen token (sampled, or verified) into events; logits [V] (cut, penalized): its row."""
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.pending = []
        if token in self.eos:
            if not self._lead_into_answer():
                self.finish("stop")
            elif len(self.pending) > room:
                self.finish("length")
            return
        logprobs = self._logprobs(logits, token) if self.request.top_logprobs is not None else []
        if self.seen is not None:
            self.seen[token] += 1
            self.output[token] += 1
        was_thinking = self.splitter.thinking
        if self._push_token(token, logprobs):
            return
        self.thinking_tokens += was_thinking
        self.pending = [token]
        budget = self.request.thinking_budget
        if self.splitter.thinking and budget is not None and self.thinking_tokens >= budget and not self.budget_spent:
            self.budget_spent = True
            message = f"\n{self.rules.end_message}\n" if self.rules.end_message else "\n"
            self._force(message + self.rules.end_tag + "\n\n")
        if self.done:
            return
        if self.generated >= self.request.max_tokens or len(self.pending) > room:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.done:
            return
        tail, stopped = self.matcher.push(self.decoder.flush())
        tail += "" if stopped else self.matcher.flush()
        r, c = self.splitter.push(tail)
        r2, c2 = self.splitter.flush()
        if r + r2 or c + c2:
            self.request.emit(Delta(r + r2, c + c2))
        self.done = True
        self.finish_reason = reason
        self.pending = []
        self.request.emit(Finished(reason, self.usage(), self.timings()))

    def usage(self) -> dict[str, Any]:
        n = len(self.request.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": self.generated, "total_tokens": n + self.generated,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def timings(self) -> dict[str, Any]:
        """llama.cpp's `timings` object."""
        first = self.first_token or self.last_token
        prompt_n = len(self.request.prompt_ids) - self.cached
        prompt_ms = (first - self.started) * 1000
        predicted_ms = (self.last_token - first) * 1000
        predicted_n = self.generated
        out = {"cache_n": self.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
               "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
               "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
               "predicted_n": predicted_n, "predicted_ms": predicted_ms,
               "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
               "predicted_per_second": 1000 * (predicted_n - 1) / predicted_ms if predicted_ms > 0 else 0.0,
               "draft_n": self.draft_n, "draft_n_accepted": self.draft_accepted}
        return out

    # -- internals ------------------------------------------------------------------------------
    def _push_token(self, token: int, logprobs: list[dict[str, Any]]) -> bool:
        """Count and emit one output token; True when a stop string ended the output."""
        self.generated += 1
        text, stopped = self.matcher.push(self.decoder.push(token))
        r, c = self.splitter.push(text)
        if r or c or logprobs:
            self.request.emit(Delta(r, c, logprobs))
        if stopped:
            self.finish("stop")
        return stopped

    def _force(self, text: str) -> None:
        """Insert text into the output as if the model had written it (fed to the model next)."""
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if self._push_token(token, []):
                return
            self.pending.append(token)

    def _lead_into_answer(self) -> bool:
        """A model that ends inside its thought, or right after it with no answer, is led into the
        answer once (the end tag if needed and a blank line) instead of returning an empty answer."""
        s = self.splitter
        if self.led_into_answer or not s.thought or (not s.thinking and s.answer_chars > 0):
            return False
        self.led_into_answer = True
        self._force((self.rules.end_tag if s.thinking else "") + "\n\n")
        return not self.done and bool(self.pending)

    def _logprobs(self, logits: torch.Tensor, token: int) -> list[dict[str, Any]]:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        n = self.request.top_logprobs or 0
        top = torch.topk(logp, n) if n else None

        def entry(t: int, lp: float) -> dict[str, Any]:
            s = self.tokenizer.decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        item = entry(token, float(logp[token]))
        item["top_logprobs"] = ([entry(int(t), float(v)) for v, t in zip(top.values.tolist(), top.indices.tolist())]
                                if top is not None else [])
        return [item]

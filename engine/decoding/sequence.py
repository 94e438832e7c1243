"""One request inside the engine: its sampling state, text pipeline, end rules, thinking budget, stats.

The engine feeds `pending` tokens to the model for the request's slot and hands the logits of the
last one to `on_logits`, which chooses the next token (a batch's tokens, chosen together, go to
`take`) and turns it into events: a `Delta` per token (its id, the text it completed, split into
reasoning and answer), then one `Finished`. The end rules are those of plain decoding: an end-of-
sequence token (not emitted), a stop string (the text cut before it), max_tokens, and the slot's
context. Tokens the engine inserts itself (the end of a thought whose budget is spent, or the lead
into an answer) join `pending` and the output like chosen ones. Without a tokenizer (generated
weights) only token ids come out, and nothing but max_tokens and the context ends them; with
`Request.text` off the end-of-sequence token still ends the output (unless `ignore_eos`), but no
text, stop strings or thinking rules are made.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.decoding.detokenize import StreamDecoder
from engine.decoding.grammar import GrammarSpec
from engine.decoding.grammar_match import GrammarMatch
from engine.decoding.reasoning import ReasoningSplitter
from engine.decoding.sampling import (SamplingParams, apply_logit_bias, apply_penalties, bias_tensors, make_generator,
                                     sample, top_logprobs)
from engine.decoding.stats import GenerationStats
from engine.decoding.stop import StopStringMatcher
from engine.errors import BonsaiError, first_line
from engine.sources.tokenizer import Tokenizer
from engine.speculative.stats import SpecStats


@dataclass
class Delta:
    token_ids: list[int]  # the tokens this event adds to the output (empty: text only)
    reasoning: str = ""
    content: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # "stop" | "length"
    usage: dict[str, Any]
    timings: dict[str, Any]
    stats: GenerationStats
    stop_sequence: str | None = None  # the stop string that ended the output, if one did


@dataclass
class Failed:
    message: str
    status: int = 500


@dataclass
class Request:
    """What a front end hands the engine. `emit` is called from the engine's thread with each event."""
    prompt_ids: list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    reuse_prefix: bool = True  # start from the slot whose cached tokens share the longest prefix
    text: bool = True  # False: token ids only, no text (bench runs, the drafter trainer)
    thinking_budget: int | None = None
    thinking_at_start: bool = False  # the prompt ends inside an opened thought
    split_reasoning: bool = True  # thoughts go out as reasoning; off (raw completions): all text is content
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the n most likely
    grammar: GrammarSpec | None = None  # the output must match it (tokens it refuses are masked; it ends the output)
    draft_tokens: int | None = None  # the most tokens drafted a step for it (None: the engine's; 0: plain decoding)
    id: str = ""
    emit: Callable[[Delta | Finished | Failed], None] = lambda event: None
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise BonsaiError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.draft_tokens is not None and self.draft_tokens < 0:
            raise BonsaiError(f"draft_tokens must be >= 0 (0: no speculation for the request), got {self.draft_tokens}")


@dataclass
class ThinkingRules:
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    end_message: str = ""


class Sequence:
    def __init__(self, request: Request, tokenizer: Tokenizer | None, rules: ThinkingRules, vocab: int,
                 device: torch.device, reused: int, method: str | None = None):
        """method: the drafters' name when the engine speculates (the request then counts its drafts)."""
        self.request, self.rules, self.vocab = request, rules, vocab
        self.tokenizer = tokenizer if request.text else None
        params = request.sampling
        self.generator = None if params.greedy else make_generator(params, device)
        self.seen = self.output = None
        if params.uses_penalties:
            self.seen = torch.bincount(torch.tensor(request.prompt_ids, device=device), minlength=vocab).float()
            self.output = torch.zeros(vocab, device=device)  # [V]
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise BonsaiError(f"logit_bias names token id {bad[0]}, but the vocabulary has ids 0..{vocab - 1}")
        self.bias = bias_tensors(params.logit_bias, device) if params.logit_bias else None  # (ids [n], values [n])
        self.grammar: GrammarMatch | None = None
        if request.grammar is not None:
            if self.tokenizer is None:
                raise BonsaiError("a grammar needs the model's tokenizer and text output: this request has neither")
            self.grammar = GrammarMatch(request.grammar, self.tokenizer, vocab)
        tok = self.tokenizer
        self.decoder = StreamDecoder(tok) if tok is not None else None
        self.matcher = StopStringMatcher(request.stop)
        self.splitter = ReasoningSplitter(rules.start_tag, rules.end_tag, request.thinking_at_start,
                                          enabled=request.split_reasoning and tok is not None)
        self.eos = tokenizer.eos_ids if tokenizer is not None and not request.ignore_eos else frozenset()
        self.pending: list[int] = request.prompt_ids[reused:]
        self.stats = GenerationStats(len(request.prompt_ids), reused)
        if method is not None:
            self.stats.speculative = SpecStats(method)
        self.thinking_tokens = 0
        self.budget_spent = False
        self.led_into_answer = False
        self.done = False
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.first_token: float | None = None

    @property
    def adjusts(self) -> bool:
        """Whether its logits change before choosing (penalties, logit_bias): `penalized` must run."""
        return self.seen is not None or self.bias is not None

    @property
    def generated(self) -> int:
        return self.stats.generated_tokens

    # -- the engine calls these ------------------------------------------------------------------
    def on_logits(self, logits: torch.Tensor, room: int) -> None:
        """Choose after logits [V] and take the token; `room`: positions still free in the slot's
        context budget."""
        logits = self.penalized(logits[:self.vocab])  # [V] the ids the tokenizer knows
        if self.grammar is not None:
            logits = self.grammar.masked(logits)  # [V] refused ids at -inf
        self.take(sample(logits, self.request.sampling, self.generator), logits, room)

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (cut to the vocabulary) with this request's penalties and logit_bias applied."""
        if self.seen is not None:
            logits = apply_penalties(logits, self.seen, self.output, self.request.sampling)
        return apply_logit_bias(logits, self.bias) if self.bias is not None else logits

    def accept(self, tokens: list[int], logits: torch.Tensor, room: int) -> int:
        """Tokens a speculative step verified (the accepted drafts, then the target's bonus), taken
        one by one as if chosen; logits [n, V]: their rows (cut to the vocabulary, penalized), for
        logprobs; room: as for the first of them. Returns how many were used: fewer than n when one
        ended the output (EOS, stop string, max_tokens, context) or the engine inserted tokens after
        it (thinking budget), so the rest are dropped as plain decoding would never have made them."""
        for i, token in enumerate(tokens):
            self.take(token, logits[i], room - i)
            if self.done or self.pending != [token]:
                return i + 1
        return len(tokens)

    def take(self, token: int, logits: torch.Tensor | None, room: int) -> None:
        """One chosen token (sampled, or verified) into events; logits [V] (cut, penalized): its row,
        for logprobs (None when the request asks for none)."""
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.stats.prefill_seconds = now - self.started
        self.stats.decode_seconds = now - self.first_token
        self.pending = []
        if self.grammar is not None and not self.grammar.accept(token):
            raise AssertionError(f"token {token} was chosen under a mask that refuses it")
        if token in self.eos:
            if not self._lead_into_answer():
                self.finish("stop")
            elif len(self.pending) > room:
                self.finish("length")
            return
        logprobs = []
        if self.request.top_logprobs is not None and self.tokenizer is not None and logits is not None:
            logprobs = [top_logprobs(logits, token, self.request.top_logprobs, self.tokenizer.decode)]
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
        if self.grammar is not None and self.grammar.is_terminated():
            self.finish("stop")  # the grammar is complete: nothing more may follow
            return
        if self.generated >= self.request.max_tokens or len(self.pending) > room:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.done:
            return
        if self.decoder is not None:
            tail, stopped = self.matcher.push(self.decoder.flush())
            tail += "" if stopped else self.matcher.flush()
            r, c = self.splitter.push(tail)
            r2, c2 = self.splitter.flush()
            if r + r2 or c + c2:
                self.request.emit(Delta([], r + r2, c + c2))
        self.done = True
        self.finish_reason = reason
        self.pending = []
        self.request.emit(Finished(reason, self.usage(), self.stats.timings(), self.stats, self.matcher.matched))

    def usage(self) -> dict[str, Any]:
        n, out = self.stats.prompt_tokens, self.generated
        return {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out,
                "prompt_tokens_details": {"cached_tokens": self.stats.cached_tokens}}

    # -- internals ------------------------------------------------------------------------------
    def _push_token(self, token: int, logprobs: list[dict[str, Any]]) -> bool:
        """Count and emit one output token; True when a stop string ended the output."""
        self.stats.generated_tokens += 1
        if self.decoder is None:
            self.request.emit(Delta([token]))
            return False
        text, stopped = self.matcher.push(self.decoder.push(token))
        r, c = self.splitter.push(text)
        self.request.emit(Delta([token], r, c, logprobs))
        if stopped:
            self.finish("stop")
        return stopped

    def _force(self, text: str) -> None:
        """Insert text into the output as if the model had written it (fed to the model next)."""
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if self.grammar is not None and not self.grammar.accept(token):
                self.finish("stop")  # the grammar refuses the inserted text: the output ends here
                return
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


def emit_failure(request: Request, event: Failed) -> None:
    """Tell a request it failed; a callback that raises (its client's loop is gone) is logged, not raised."""
    try:
        request.emit(event)
    except Exception as e:  # noqa: BLE001 - one broken callback never ends the others' requests
        logging.getLogger(__name__).warning("request %s: its error could not be delivered (%s: %s)", request.id,
                                            type(e).__name__, first_line(e))

"""The generation core: one generator of events that chat, generate, bench and the server consume."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.decoding.detokenize import StreamDecoder
from engine.errors import BonsaiError
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams, apply_penalties, make_generator, sample
from engine.speculative.drafter import Drafter
from engine.speculative.stats import SpecStats
from engine.decoding.stop import StopStringMatcher
from engine.sources.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    reuse_prefix: bool = True  # reuse the slot's cached prefix of the prompt

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise BonsaiError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not recomputed
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # prompt processing up to the first sampled token (TTFT)
    decode_seconds: float = 0.0  # after the first token until the last
    speculative: SpecStats | None = None  # draft statistics when a drafter runs

    @property
    def ttft_seconds(self) -> float:
        return self.prefill_seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_seconds if self.decode_seconds > 0 and n > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "ttft_seconds": self.ttft_seconds,
                "prefill_tokens_per_second": self.prefill_tokens_per_second,
                "decode_tokens_per_second": self.decode_tokens_per_second,
                **({"speculative": self.speculative.as_dict()} if self.speculative is not None else {})}


@dataclass
class GenerationEvent:
    """One step of generation: the new token(s), the text they completed, and, last, why it ended."""
    token_ids: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"


class _Sink:
    """Takes sampled tokens one at a time and applies plain decoding's end rules: EOS (not
    emitted), stop strings (text cut before them), max_tokens, and the context's capacity."""

    def __init__(self, tokenizer: Tokenizer, request: GenerationRequest, stats: GenerationStats,
                 capacity: int, start: float, counts: tuple[torch.Tensor, torch.Tensor] | None):
        self.request, self.stats, self.capacity, self.start, self.counts = request, stats, capacity, start, counts
        self.stop_ids = frozenset() if request.ignore_eos else tokenizer.eos_ids
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = StopStringMatcher(request.stop)
        self.first_token_time: float | None = None

    @property
    def generated(self) -> int:
        return self.stats.generated_tokens

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - self.stats.generated_tokens

    def push(self, token: int) -> tuple[bool, str, str | None]:
        """(emitted, text, finish reason or None)."""
        stats, matcher = self.stats, self.matcher
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
            stats.prefill_seconds = now - self.start
        stats.decode_seconds = now - self.first_token_time
        if token in self.stop_ids:
            tail, _ = matcher.push(self.decoder.flush())
            return False, tail + matcher.flush(), "stop"
        stats.generated_tokens += 1
        if self.counts is not None:
            self.counts[0][token] += 1
            self.counts[1][token] += 1
        text, stopped = matcher.push(self.decoder.push(token))
        if stopped:
            return True, text, "stop"
        # the token is not in the cache yet: the cache holds the prompt and the tokens before it
        if stats.generated_tokens >= self.request.max_tokens or \
                stats.prompt_tokens + stats.generated_tokens - 1 >= self.capacity:
            tail, stopped = matcher.push(self.decoder.flush())
            return True, text + tail + ("" if stopped else matcher.flush()), "stop" if stopped else "length"
        return True, text, None


def stream_generate(runner: ModelRunner, tokenizer: Tokenizer, prompt_ids: list[int],
                    request: GenerationRequest, slot_index: int = 0, drafter: Drafter | None = None,
                    num_draft_tokens: int = 4) -> Iterator[GenerationEvent]:
    """Prefill the prompt, then decode, yielding an event per step: one token per step, or with a
    drafter (speculative decoding) the accepted drafts and the target's own token per step."""
    if not prompt_ids:
        raise BonsaiError("the prompt is empty: give at least one token of input")
    slot = runner.slot(slot_index)
    if len(prompt_ids) >= slot.capacity:
        raise BonsaiError(f"the prompt has {len(prompt_ids)} tokens but the context holds {slot.capacity}: "
                          "shorten the prompt or raise max_seq_len")
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    params = request.sampling
    vocab = runner.loaded.config.vocab_size
    device = runner.device
    generator = make_generator(params, device) if not params.greedy else None
    seen_counts = output_counts = None
    if params.uses_penalties:
        seen_counts = torch.bincount(torch.tensor(prompt_ids, device=device), minlength=vocab).float()
        output_counts = torch.zeros(vocab, device=device)
    start = time.perf_counter()
    sink = _Sink(tokenizer, request, stats, slot.capacity, start,
                 (seen_counts, output_counts) if seen_counts is not None else None)
    if request.reuse_prefix:
        stats.cached_tokens = runner.reuse_prefix(slot, prompt_ids)
    else:
        slot.reset()
    logits = runner.prefill(slot, prompt_ids[slot.length:])
    if drafter is not None:
        from engine.speculative.decode import speculative_decode
        stats.speculative = SpecStats(method=drafter.name)
        for ids, text, finish in speculative_decode(runner, slot, drafter, num_draft_tokens, logits,
                                                    list(prompt_ids), sink, params, generator, seen_counts,
                                                    output_counts, stats.speculative):
            yield GenerationEvent(ids, text, stats, finish)
        return
    while True:
        if seen_counts is not None:
            logits = apply_penalties(logits, seen_counts, output_counts, params)
        token = sample(logits, params, generator)
        emitted, text, finish = sink.push(token)
        yield GenerationEvent([token] if emitted else [], text, stats, finish)
        if finish:
            return
        logits = runner.forward(slot, [token])[-1]


def generate_text(runner: ModelRunner, tokenizer: Tokenizer, prompt_ids: list[int],
                  request: GenerationRequest, slot_index: int = 0, drafter: Drafter | None = None,
                  num_draft_tokens: int = 4) -> tuple[str, list[int], str, GenerationStats]:
    """Run the stream to its end: (text, token ids, finish reason, stats)."""
    pieces: list[str] = []
    ids: list[int] = []
    finish, stats = "length", GenerationStats()
    for event in stream_generate(runner, tokenizer, prompt_ids, request, slot_index, drafter, num_draft_tokens):
        pieces.append(event.text)
        ids.extend(event.token_ids)
        stats = event.stats
        if event.finish_reason:
            finish = event.finish_reason
    return "".join(pieces), ids, finish, stats

"""The speculative decode loop: draft, verify in one target pass, keep the accepted run, rewind.

`engine.decoding.generate.stream_generate` runs it after the prefill when given a drafter; the tokens it
produces go through the same sink as plain decoding (EOS, stop strings, max_tokens, context), so
a run cut inside an accepted run ends exactly where plain decoding would have ended, with the
target's cache holding what plain decoding's would hold.
"""
from __future__ import annotations

import time
from typing import Iterator, Protocol

import torch

from engine.runtime.kv_cache import KVSlot
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams, apply_penalties, sample
from engine.speculative.drafter import Draft, Drafter, Feedback
from engine.speculative.stats import SpecStats
from engine.speculative.verify import verify_draft


class TokenSink(Protocol):
    generated: int  # tokens emitted so far
    remaining: int  # tokens max_tokens still allows

    def push(self, token: int) -> tuple[bool, str, str | None]:
        """(emitted: not an EOS, text it completes, finish reason or None)."""


def speculative_decode(runner: ModelRunner, slot: KVSlot, drafter: Drafter, num_draft_tokens: int,
                       logits: torch.Tensor, context: list[int], sink: TokenSink, params: SamplingParams,
                       generator: torch.Generator | None, seen_counts: torch.Tensor | None,
                       output_counts: torch.Tensor | None, stats: SpecStats
                       ) -> Iterator[tuple[list[int], str, str | None]]:
    """logits [V]: the target's after the prompt (already in `slot`); context: the prompt ids
    (extended in place with the output). Yields (token ids, text, finish reason) per step."""
    if seen_counts is not None:
        logits = apply_penalties(logits, seen_counts, output_counts, params)
    token = sample(logits, params, generator)
    emitted, text, finish = sink.push(token)
    yield ([token] if emitted else []), text, finish
    if finish:
        return
    configure = getattr(drafter, "set_sampling", None)
    if configure is not None:
        configure(params)
    drafter.begin(list(context))
    runner.prepare_rows(num_draft_tokens + 1)  # verify widths captured now, not mid-answer
    context.append(token)
    hidden_layers = tuple(drafter.hidden_layers)
    while True:
        # rows: the pending token + k drafts must fit the context; no draft past max_tokens
        k = min(num_draft_tokens, slot.capacity - slot.length - 1, sink.remaining - 1)
        draft = drafter.propose(context, max(k, 0))  # k = 0 too: every observe follows its propose
        if len(draft.tokens) > k:
            draft = Draft(draft.tokens[:k], draft.probs[:k] if draft.probs is not None else None,
                          draft.source, draft.sources[:k])
        start = time.perf_counter()
        rows = [context[-1]] + draft.tokens
        hidden = None
        if draft.tokens or hidden_layers:
            logits, hidden = runner.verify(slot, rows, hidden_layers)  # [k + 1, V]
        else:
            logits = runner.forward(slot, rows)  # [1, V]: a plain step (the fast decode path)
        verdict = verify_draft(logits, draft.tokens, draft.probs, params, generator, seen_counts, output_counts)
        seconds = time.perf_counter() - start
        slot.rewind(len(draft.tokens) - verdict.accepted)
        stats.record(draft.sources, verdict.accepted)
        ids: list[int] = []
        texts: list[str] = []
        for used, token in enumerate(verdict.tokens, start=1):
            emitted, text, finish = sink.push(token)
            ids += [token] if emitted else []
            texts.append(text)
            if finish:
                break
        kept = {i: h[:verdict.accepted + 1] for i, h in hidden.items()} if hidden else None
        drafter.observe(Feedback(draft, verdict.accepted, verdict.bonus, kept, seconds))
        if finish:
            # the slot holds every token before the last one sampled, as after plain decoding
            slot.rewind(verdict.accepted - (used - 1))
            yield ids, "".join(texts), finish
            return
        context.extend(verdict.tokens)
        yield ids, "".join(texts), None

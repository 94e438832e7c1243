"""Prompt token ids of a chat (template + context policy) or of a raw completion prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import BonsaiError
from engine.decoding.context_policy import fit_conversation
from engine.sources.tokenizer import Tokenizer


@dataclass
class Prompt:
    ids: list[int]
    thinking_at_start: bool  # the generation prompt opened a thought (e.g. ends with <think>)
    dropped_messages: int = 0


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], context: int, compress_at: float,
                start_tag: str) -> Prompt:
    def render(msgs: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)

    cache: dict[int, str] = {}

    def count(msgs: list[dict[str, Any]]) -> int:
        text = render(msgs)
        cache[len(msgs)] = text
        return len(tokenizer.encode(text, add_special_tokens=False))

    def estimate(message: dict[str, Any]) -> int:  # one message's share: its text and the role's few tokens
        text = str(message.get("content") or "") + str(message.get("reasoning_content") or "")
        return len(tokenizer.encode(text, add_special_tokens=False)) + 4

    fitted = fit_conversation(messages, count, context, compress_at, estimate)
    text = cache.get(len(fitted.messages)) or render(fitted.messages)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Prompt(ids, text.rstrip().endswith(start_tag), fitted.dropped)


def completion_prompt(tokenizer: Tokenizer, prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    else:
        vocab = tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise BonsaiError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        ids = list(prompt)
    return Prompt(ids, False)

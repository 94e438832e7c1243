"""Prompt token ids of a chat (template + context policy) or of a raw completion prompt."""
from __future__ import annotations

import json
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


RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools")


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], context: int, compress_at: float,
                start_tag: str, tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """tools: rendered by the template (its own tool prompt); template_kwargs: its other variables
    (e.g. enable_thinking). Assistant tool calls and tool results go through the template too."""
    kwargs = dict(template_kwargs or {})
    clash = next((k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES or k in tokenizer.special_tokens_map), None)
    if clash is not None:
        raise BonsaiError(f"chat_template_kwargs may not set '{clash}' (the server sets it); leave it out")
    if tools:
        kwargs["tools"] = tools
    messages = template_messages(messages)

    def render(msgs: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)

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


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: a call's JSON arguments string parsed to the object the
    templates render with `tojson`, and every tool result matched to a call earlier in the chat."""
    called: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call["function"]
                try:
                    args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
                except ValueError:
                    raise BonsaiError(f"messages[{i}]: the arguments of tool call '{call['id']}' are not valid JSON; "
                                      "send them as a JSON object text") from None
                called.add(call["id"])
                calls.append({**call, "function": {"name": fn["name"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool":
            if m.get("tool_call_id") is None:
                raise BonsaiError(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers")
            if m["tool_call_id"] not in called:
                raise BonsaiError(f"messages[{i}]: the tool message answers '{m['tool_call_id']}', which no earlier "
                                  "assistant message called; send the assistant's tool_calls before their results")
        out.append(m)
    return out


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

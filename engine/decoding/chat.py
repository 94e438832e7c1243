"""A multi-turn conversation through the engine: history, system message, template, context policy.

Each turn renders the whole history through the chat template (prompts.chat_prompt: when it outgrows
`compress_at` of the context the oldest turns go, and leave the history too) and sends it as one
request; the engine reuses the slot's cached prefix, so only the new turn is computed. The answer
(and its thought, when the model thinks) joins the history when the stream ends; a failed or
interrupted turn leaves none.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from engine.decoding.engine import Engine
from engine.decoding.generate import GenerationEvent, generate
from engine.decoding.prompts import chat_prompt
from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Request
from engine.decoding.stats import GenerationStats


@dataclass
class ChatSession:
    engine: Engine
    system: str | None = None
    compress_at: float = 0.9  # context.compress_at
    thinking_budget: int | None = None  # thinking.budget
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_stats: GenerationStats | None = None

    def reset(self) -> None:
        """Forget the conversation (and what the engine's idle slots hold of it)."""
        self.messages.clear()
        self.engine.forget()

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def conversation(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def send(self, user_text: str, max_tokens: int, sampling: SamplingParams) -> Iterator[GenerationEvent]:
        """Stream the assistant's answer (its `text`, and `reasoning` while it thinks)."""
        engine = self.engine
        self.messages.append({"role": "user", "content": user_text})
        reasoning, content = [], []
        try:
            prompt = chat_prompt(engine.tokenizer, self.conversation(), engine.slot_context, self.compress_at,
                                 engine.rules.start_tag)
            if prompt.dropped_messages:
                del self.messages[:prompt.dropped_messages]  # the history the model sees from now on
            request = Request(prompt.ids, max_tokens=max_tokens, sampling=sampling, id=f"chat-{uuid.uuid4().hex[:12]}",
                              thinking_budget=self.thinking_budget, thinking_at_start=prompt.thinking_at_start)
            for event in generate(engine, request):
                reasoning.append(event.reasoning)
                content.append(event.text)
                self.last_stats = event.stats
                yield event
        except BaseException:
            self.messages.pop()  # a failed or interrupted turn leaves no half answer in the history
            raise
        answer: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if any(reasoning):
            answer["reasoning_content"] = "".join(reasoning)
        self.messages.append(answer)

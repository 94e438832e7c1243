"""A multi-turn conversation over one KV slot: history, system prompt, template, prefix reuse."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.decoding.generate import GenerationEvent, GenerationRequest, GenerationStats, stream_generate
from engine.runtime.runner import ModelRunner
from engine.speculative.drafter import Drafter
from engine.sources.tokenizer import Tokenizer


@dataclass
class ChatSession:
    runner: ModelRunner
    tokenizer: Tokenizer
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    slot_index: int = 0
    last_stats: GenerationStats | None = None
    drafter: Drafter | None = None  # speculative decoding when set
    num_draft_tokens: int = 4

    def reset(self) -> None:
        self.messages.clear()
        self.runner.slot(self.slot_index).reset()

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def conversation(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def prompt_ids(self) -> list[int]:
        text = self.tokenizer.apply_chat_template(self.conversation(), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def send(self, user_text: str, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Stream the assistant's answer; it joins the history when the stream ends."""
        self.messages.append({"role": "user", "content": user_text})
        pieces: list[str] = []
        try:
            ids = self.prompt_ids()
            for event in stream_generate(self.runner, self.tokenizer, ids, request, self.slot_index,
                                         self.drafter, self.num_draft_tokens):
                pieces.append(event.text)
                self.last_stats = event.stats
                yield event
        except BaseException:
            self.messages.pop()  # a failed or interrupted turn leaves no half answer in the history
            raise
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

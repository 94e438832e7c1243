"""A conversation through the server's engine in this process (`bonsai chat --config serve.yaml`):
same slots, prefix reuse, thinking budget and context policy as `bonsai serve`, no HTTP."""
from __future__ import annotations

import queue
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from engine.errors import BonsaiError
from engine.decoding.sampling import SamplingParams
from engine.server.engine_thread import Served
from engine.decoding.prompts import chat_prompt
from engine.decoding.sequence import Delta, Failed, Finished, ServeRequest


@dataclass
class EngineChat:
    served: Served
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    last: Finished | None = None

    def reset(self) -> None:
        self.messages.clear()

    def conversation(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def send(self, text: str, max_tokens: int, sampling: SamplingParams) -> Iterator[Delta]:
        """Stream the answer's pieces (reasoning and content); it joins the history at the end."""
        engine, cfg = self.served.engine, self.served.config
        self.messages.append({"role": "user", "content": text})
        events: queue.Queue = queue.Queue()
        request = None
        reasoning, content = [], []
        try:
            prompt = chat_prompt(engine.tokenizer, self.conversation(), engine.slot_context, cfg.context.compress_at,
                                 cfg.thinking.start_tag)
            if prompt.dropped_messages:
                del self.messages[:prompt.dropped_messages]  # the history the model sees from now on
            request = ServeRequest(id=f"chat-{uuid.uuid4().hex[:12]}", prompt_ids=prompt.ids, max_tokens=max_tokens,
                                   emit=events.put, sampling=sampling, thinking_budget=cfg.thinking.budget,
                                   thinking_at_start=prompt.thinking_at_start)
            engine.submit(request)
            while True:
                event = events.get()
                if isinstance(event, Delta):
                    reasoning.append(event.reasoning)
                    content.append(event.content)
                    yield event
                elif isinstance(event, Failed):
                    raise BonsaiError(event.message)
                elif isinstance(event, Finished):
                    self.last = event
                    break
        except BaseException:
            if request is not None:
                engine.cancel(request)
            self.messages.pop()  # a failed or interrupted turn leaves no half answer in the history
            raise
        answer: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if any(reasoning):
            answer["reasoning_content"] = "".join(reasoning)
        self.messages.append(answer)

"""Server-sent events as OpenAI clients read them: `data: {json}` lines, ended by `data: [DONE]`."""
from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: Any) -> str:
    return f"data: {_encode(obj)}\n\n"


class ChunkLines:
    """The SSE lines of one streamed response's text chunks (no logprobs, no finish reason), equal
    to `sse(protocol.chat_chunk(...))` / `sse(protocol.text_chunk(...))` byte for byte: the fields
    every chunk repeats are encoded once, only the new text is encoded per token."""

    def __init__(self, rid: str, model: str, created: int, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_encode(rid)},"object":"{kind}","created":{_encode(created)},'
                      f'"model":{_encode(model)},"choices":[{{"index":0,')
        self._tail = ',"logprobs":null,"finish_reason":null}]}\n\n'

    def delta(self, delta: dict[str, str]) -> str:
        """A chat chunk whose delta is `delta` (reasoning_content and/or content)."""
        return f'{self._head}"delta":{_encode(delta)}{self._tail}'

    def text(self, text: str) -> str:
        """A completions chunk carrying `text`."""
        return f'{self._head}"text":{_encode(text)}{self._tail}'

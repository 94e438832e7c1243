"""Server-sent events as OpenAI clients read them: `data: {json}` lines, ended by `data: [DONE]`."""
from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

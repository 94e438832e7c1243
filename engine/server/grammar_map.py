"""response_format and tool_choice as a grammar for the decoding core (engine/decoding/grammar.py)."""
from __future__ import annotations

from typing import Any

from engine.server.request_error import RequestError


def chat_grammar(req: Any, tokenizer: Any) -> Any:
    """The GrammarSpec a chat request asks for, or None (free text, or tools with tool_choice auto)."""
    fmt = req.response_format
    mode, _ = req.tool_mode()
    if fmt is not None and fmt.type != "text":
        raise RequestError(f"response_format {fmt.type} needs grammar-constrained decoding, which this build "
                           "does not have yet; send response_format text or leave it out", "response_format")
    if mode in ("required", "named"):
        raise RequestError(f"tool_choice {mode} needs grammar-constrained decoding, which this build does not have "
                           "yet; send tool_choice auto", "tool_choice")
    return None


def tools_grammar(tools: list[dict[str, Any]], mode: str, name: str | None, parallel: bool, tokenizer: Any) -> Any:
    """A forced call (mode required: any of the tools; named: that one) as a grammar."""
    raise RequestError(f"a forced tool call ({mode}) needs grammar-constrained decoding, which this build does not "
                       "have yet; let the model choose (tool_choice auto)", "tool_choice")

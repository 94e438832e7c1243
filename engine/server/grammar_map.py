"""response_format and tool_choice as a grammar for the decoding core (engine/decoding/grammar.py)."""
from __future__ import annotations

from typing import Any

from engine.server.request_error import RequestError


def chat_grammar(req: Any, tokenizer: Any, family: str | None) -> Any:
    """The GrammarSpec a chat request asks for (response_format json, or its tools), or None."""
    fmt = req.response_format
    mode, name = req.tool_mode()
    if fmt is not None and fmt.type != "text":
        raise RequestError(f"response_format {fmt.type} needs grammar-constrained decoding, which this build "
                           "does not have yet; send response_format text or leave it out", "response_format")
    if mode == "none":
        return None
    return tools_grammar(req.template_tools(), mode, name, req.parallel_tool_calls, tokenizer, family)


def tools_grammar(tools: list[dict[str, Any]], mode: str, name: str | None, parallel: bool, tokenizer: Any,
                  family: str | None) -> Any:
    """The calls of `family`'s syntax as a grammar: required / named force a call, auto is lazy."""
    if mode == "auto":
        return None  # free text with the parsers until the grammar lands
    raise RequestError(f"a forced tool call ({mode}) needs grammar-constrained decoding, which this build does not "
                       "have yet; let the model choose (tool_choice auto)", "tool_choice")

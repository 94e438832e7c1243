"""response_format and tool_choice as a grammar for the decoding core (engine/decoding/grammar.py):
json_object / json_schema constrain the answer; tool_choice required / named force a schema-valid call
in the model's own syntax; auto is the lazy grammar that switches on at the call's trigger."""
from __future__ import annotations

from typing import Any

from engine.decoding.grammar import GrammarError, GrammarSpec, check
from engine.server.request_error import RequestError


def chat_grammar(req: Any, tokenizer: Any, family: str | None) -> GrammarSpec | None:
    """The GrammarSpec a chat request asks for (its response_format, or its tools), or None."""
    fmt = req.response_format
    mode, name = req.tool_mode()
    if fmt is not None and fmt.type != "text":
        if mode != "none":
            raise RequestError("response_format json and tools cannot constrain one answer together; send "
                               "tool_choice none, or leave response_format out", "response_format")
        spec = _built(lambda: GrammarSpec.json_object() if fmt.type == "json_object" else
                      GrammarSpec.json_schema(fmt.json_schema.schema_),
                      "response_format")
        return _checked(spec, tokenizer, "response_format")
    if mode == "none":
        return None
    return tools_grammar(req.template_tools(), mode, name, req.parallel_tool_calls, tokenizer, family)


def tools_grammar(tools: list[dict[str, Any]], mode: str, name: str | None, parallel: bool, tokenizer: Any,
                  family: str | None) -> GrammarSpec | None:
    """The calls of `family`'s syntax as a grammar: required / named force a call, auto is lazy."""
    if family is None:
        return None  # tools_family refused the request already; nothing to constrain
    spec = _built(lambda: GrammarSpec.tool_calls(tools, fmt=family, mode=mode, name=name, parallel=parallel), "tools")
    return _checked(spec, tokenizer, "tools")


def _built(make, param: str) -> GrammarSpec:
    try:
        return make()
    except GrammarError as e:
        raise RequestError(f"{param}: {e}", param) from None


def _checked(spec: GrammarSpec, tokenizer: Any, param: str) -> GrammarSpec:
    try:
        check(spec, tokenizer)
    except GrammarError as e:
        raise RequestError(f"{param}: {e}", param) from None
    return spec

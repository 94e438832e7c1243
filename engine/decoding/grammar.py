"""What a constrained request's output must match: a JSON object, a JSON schema, or tool calls.

A `GrammarSpec` is the front ends' description (OpenAI `response_format`, `tools` + `tool_choice`);
`structural_tag(spec)` turns it into one xgrammar structural tag (the library chosen by measurement:
docs/perf.md), compiled once per tokenizer (grammar_vocab.py) and followed token by token by a
per-sequence matcher (grammar_match.py). `check(spec, tokenizer)` compiles it up front so that a
schema the library refuses is a one-line GrammarError (HTTP 400) before any slot is taken.

Tool-call formats (field-notes §12): `hermes` (Hermes/Qwen2.5/Qwen3: `<tool_call>\\n{"name": N,
"arguments": {...}}\\n</tool_call>`), `qwen3_xml` (Qwen3.5/3.6/Coder: `<tool_call>\\n<function=N>\\n
<parameter=p>v</parameter>...</function>\\n</tool_call>`), `llama3_json` (`{"name": N, "parameters":
{...}}`, an optional `<|python_tag|>` before it, calls separated by `;`). Modes: `required` (only
calls, at least one), `named` (only calls of `name`), `auto` (a lazy grammar: free text until the
format's trigger, then the call's grammar, then free text again).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.decoding import grammar_vocab
from engine.errors import BonsaiError, one_line

FORMATS = ("hermes", "qwen3_xml", "llama3_json")
MODES = ("required", "named", "auto")
# whitespace characters in a row inside JSON (llama.cpp's JSON grammar allows a newline and 20): room for
# pretty-printed output, never an endless run of blanks from a small model
MAX_WHITESPACE = 12
REASONING = (None, "tag", "opened")  # no prefix; the model writes <think>…</think>; the prompt opened it


class GrammarError(BonsaiError):
    """A grammar that cannot be built: a schema the library cannot compile, a bad tool list."""


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json_object" | "json_schema" | "tool_calls". schema: the JSON schema as JSON text (kept
    as text: the spec is frozen and hashable, a cache key). tools: ((name, parameters JSON text), ...).
    reasoning: free text inside <think>…</think> allowed before the constraint (`with_reasoning`)."""
    kind: str
    schema: str = ""
    tools: tuple[tuple[str, str], ...] = ()
    fmt: str = "hermes"
    mode: str = "required"
    name: str | None = None
    parallel: bool = True
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "tool_calls"):
            raise GrammarError(f"unknown grammar kind {self.kind!r}: use json_object, json_schema or tool_calls")
        if self.reasoning not in REASONING:
            raise GrammarError(f"unknown reasoning prefix {self.reasoning!r}: use 'tag' or 'opened'")
        if self.kind == "json_schema":
            _schema_object(json.loads(self.schema), "the response_format schema")
        if self.kind != "tool_calls":
            return
        if self.fmt not in FORMATS:
            raise GrammarError(f"unknown tool-call format {self.fmt!r}: use one of {', '.join(FORMATS)}")
        if self.mode not in MODES:
            raise GrammarError(f"unknown tool_choice mode {self.mode!r}: use one of {', '.join(MODES)}")
        if not self.tools:
            raise GrammarError("tool calls were asked for but no tools were given: add at least one tool")
        names = [n for n, _ in self.tools]
        if len(set(names)) != len(names):
            raise GrammarError(f"two tools share a name among {names}: give each tool its own name")
        if self.mode == "named" and self.name not in names:
            raise GrammarError(f"tool_choice names {self.name!r}, which is not among the tools {names}: "
                               "name one of them")

    # -- constructors --------------------------------------------------------------------------
    @staticmethod
    def json_object() -> GrammarSpec:
        return GrammarSpec("json_object")

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> GrammarSpec:
        """The output always matches the schema (OpenAI's `strict: true`; xgrammar has no looser mode, so a
        request's `strict: false` gets the same: the server says so in its API notes)."""
        _schema_object(schema, "the response_format schema")
        return GrammarSpec("json_schema", schema=_dump(schema, "the response_format schema"))

    @staticmethod
    def tool_calls(tools: list[dict[str, Any]], fmt: str = "hermes", mode: str = "required",
                   name: str | None = None, parallel: bool = True) -> GrammarSpec:
        """tools: OpenAI function dicts ({"name", "parameters"}, or wrapped as {"type": "function",
        "function": {...}})."""
        pairs = []
        for i, tool in enumerate(tools):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise GrammarError(f"tool {i} has no name: give each tool a function name")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            what = f"the parameters of tool {fn['name']!r}"
            _schema_object(params, what)
            pairs.append((fn["name"], _dump(params, what)))
        return GrammarSpec("tool_calls", tools=tuple(pairs), fmt=fmt, mode=mode, name=name, parallel=parallel)

    def with_reasoning(self, opened: bool = False) -> GrammarSpec:
        """The same constraint after a thought: `<think>` (unless the prompt `opened` it), any text,
        `</think>`, then whitespace."""
        return GrammarSpec(**{**self.__dict__, "reasoning": "opened" if opened else "tag"})


def _schema_object(schema: Any, what: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object (a JSON schema), got {type(schema).__name__}")


def _dump(schema: Any, what: str) -> str:
    try:
        return json.dumps(schema, allow_nan=False)  # key order kept: properties come in it
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{what} is not valid JSON: {one_line(e)}") from None


# -- the structural tag --------------------------------------------------------------------------
def _json(schema_text: str, style: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "json_schema", "json_schema": json.loads(schema_text),
                           "max_whitespace_cnt": MAX_WHITESPACE}
    if style:
        out["style"] = style
    return out


def _call_tags(spec: GrammarSpec) -> tuple[list[dict[str, Any]], list[str], str]:
    """(the tag of each allowed tool's call, the triggers that start one, the separator of calls)."""
    tools = [t for t in spec.tools if spec.mode != "named" or t[0] == spec.name]
    if spec.fmt == "hermes":
        tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{n}", "arguments": ', "content": _json(p),
                 "end": "}\n</tool_call>"} for n, p in tools]
        return tags, ["<tool_call>"], "\n"
    if spec.fmt == "qwen3_xml":
        tags = [{"type": "tag", "begin": f"<tool_call>\n<function={n}>\n", "content": _json(p, "qwen_xml"),
                 "end": "\n</function>\n</tool_call>"} for n, p in tools]
        return tags, ["<tool_call>"], "\n"
    tags = []
    for lead in ("", "<|python_tag|>"):
        tags += [{"type": "tag", "begin": f'{lead}{{"name": "{n}", "parameters": ', "content": _json(p),
                  "end": "}"} for n, p in tools]
    return tags, ['{"name": ', "<|python_tag|>"], ";"


def structural_tag(spec: GrammarSpec) -> dict[str, Any]:
    """The xgrammar structural tag (as a dict) of a spec."""
    if spec.kind == "json_object":
        body: dict[str, Any] = _json('{"type": "object"}')
    elif spec.kind == "json_schema":
        body = _json(spec.schema)
    else:
        tags, triggers, separator = _call_tags(spec)
        if spec.mode == "auto":
            body = {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": False,
                    "stop_after_first": not spec.parallel}
        else:
            body = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
                    "stop_after_first": not spec.parallel}
    if spec.reasoning is not None:
        thought = {"type": "tag", "begin": "<think>" if spec.reasoning == "tag" else "",
                   "content": {"type": "any_text"}, "end": "</think>"}
        body = {"type": "sequence", "elements": [thought, {"type": "regex", "pattern": r"\s*"}, body]}
    return {"type": "structural_tag", "format": body}


def compile_spec(spec: GrammarSpec, tokenizer: Any, vocab: int | None = None) -> Any:
    """The xgrammar CompiledGrammar of `spec` for `tokenizer` (vocab: the logits width; default the
    tokenizer's), cached by the tokenizer's compiler; a GrammarError if the library cannot compile it."""
    compiler = grammar_vocab.compiler(tokenizer, vocab)
    try:
        return compiler.compile_structural_tag(json.dumps(structural_tag(spec)))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors for bad schemas
        what = "a tool's parameters" if spec.kind == "tool_calls" else "the JSON schema"
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise GrammarError(f"{what} cannot be compiled into a grammar: {one_line(reason)}") from None


def check(spec: GrammarSpec, tokenizer: Any, vocab: int | None = None) -> None:
    """Compile `spec` for `tokenizer` now (cached), so a bad one is a GrammarError before it runs."""
    compile_spec(spec, tokenizer, vocab)

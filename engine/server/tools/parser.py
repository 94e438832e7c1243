"""The model's output text split into content and tool calls, piece by piece as it streams.

One state machine serves streaming and whole answers (`parse_tool_calls` feeds it the full text), so
both always agree. Content that could be the start of a call's markup is held back until it is known
not to be one: raw markup never reaches the client's content. Each call gets a stable `index` and an
id `call_...`; its name comes first, then its arguments as they arrive:
- hermes: `<tool_call>{"name": N, "arguments": {...}}</tool_call>`: the arguments object is passed on
  character by character while a string-aware scanner tracks where it ends;
- qwen3_xml: `<tool_call><function=N><parameter=K>V</parameter>...</function></tool_call>`: each
  parameter becomes one `"K": V` piece when it closes (V typed by the tool's schema);
- llama3_json and the bare/fenced JSON fallback (Qwen2.5-Coder often answers ```json {"name":...,
  "arguments":...}``` instead of the tags): the JSON is held whole, and becomes calls only when every
  call names one of the given tools; otherwise it is content, as written.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.server.tools.family import HERMES, LLAMA3_JSON, QWEN3_XML

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
PYTHON_TAG = "<|python_tag|>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_XML_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_XML_END = re.compile(r"\s*</function>")


@dataclass
class CallDelta:
    """A piece of call `index`: its id and name on the first piece, then arguments text."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ToolCallParser:
    def __init__(self, family: str, tools: dict[str, dict[str, Any]], fence_fallback: bool = False):
        """tools: name → the function's JSON schema of parameters (types the XML values)."""
        self.family, self.tools = family, tools
        self.fence_fallback = fence_fallback and family == HERMES
        self.triggers = ((OPEN,) if family in (HERMES, QWEN3_XML) else ()) + ((FENCE,) if self.fence_fallback else ())
        self.calls = 0
        self._buf = ""
        self._state = "text"
        self._any_content = False  # the bare-JSON forms only count at the start of the answer
        self._scan: _ArgScanner | None = None
        self._params, self._name = 0, ""

    # -- public -----------------------------------------------------------------------------------
    def push(self, text: str) -> list[str | CallDelta]:
        """Feed output text; returns content strings and call pieces, in order."""
        self._buf += text
        out: list[str | CallDelta] = []
        while self._step(out):
            pass
        return out

    def flush(self) -> list[str | CallDelta]:
        """The end of the output: held text is content, or the held JSON's calls."""
        out: list[str | CallDelta] = []
        buf, state, self._buf, self._state = self._buf, self._state, "", "text"
        if state == "bare":
            out += self._json_calls(buf) or [buf]
        elif state == "fence":
            out += self._json_calls(_fence_body(buf + FENCE)) or [buf]
        elif state == "text":
            if buf.strip() and (self.family == LLAMA3_JSON or self.fence_fallback) and not self._any_content:
                out += self._json_calls(buf) or [buf]
            elif buf:
                out.append(buf)
        # inside a tagged call cut short (max_tokens): what arrived of it stays the call's, never content
        return [x for x in out if not (isinstance(x, str) and not x)]

    # -- the machine ------------------------------------------------------------------------------
    def _step(self, out: list) -> bool:
        """One transition on the buffer; False when it needs more text."""
        state, buf = self._state, self._buf
        if state == "text":
            return self._text(out)
        if state == "bare":
            return False
        if state == "fence":
            end = buf.find(FENCE, len(FENCE))
            if end < 0:
                return False
            block, self._buf, self._state = buf[:end + len(FENCE)], buf[end + len(FENCE):], "text"
            calls = self._json_calls(_fence_body(block))
            out += calls or [block]
            self._any_content = self._any_content or not calls
            return True
        if state == "head":
            return self._head(out)
        if state == "args":
            used, piece, done = self._scan.feed(buf)
            self._buf = buf[used:]
            if piece:
                out.append(CallDelta(self.calls - 1, piece))
            if done:
                self._state = "tail"
            return done
        if state == "xml_params":
            return self._xml_params(out)
        if state == "tail":
            end = buf.find(CLOSE)
            if end < 0:
                self._buf = buf[len(buf) - _partial_suffix(buf, (CLOSE,)):]
                return False
            self._buf, self._state = buf[end + len(CLOSE):], "text"
            return True
        raise AssertionError(state)

    def _text(self, out: list) -> bool:
        buf = self._buf
        if not self._any_content and (self.family == LLAMA3_JSON or self.fence_fallback):
            stripped = buf.lstrip()
            if not stripped:
                return False
            if stripped.startswith(PYTHON_TAG) or stripped.startswith("{") or stripped.startswith("["):
                self._buf, self._state = stripped.removeprefix(PYTHON_TAG), "bare"
                return False
            if PYTHON_TAG.startswith(stripped):
                return False
        hits = [(buf.find(t), t) for t in self.triggers if buf.find(t) >= 0]
        if hits:
            at, tag = min(hits)
            self._content(out, buf[:at])
            if tag == FENCE:
                self._buf, self._state = buf[at:], "fence"
            else:
                self._buf, self._state = buf[at + len(tag):], "head"
            return True
        keep = _partial_suffix(buf, self.triggers)
        self._content(out, buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _content(self, out: list, text: str) -> None:
        if text:
            out.append(text)
            self._any_content = self._any_content or bool(text.strip())

    def _head(self, out: list) -> bool:
        buf = self._buf
        m = (_XML_FUNCTION if self.family == QWEN3_XML else _HERMES_HEAD).match(buf)
        if m:
            name = m.group(1).strip() if self.family == QWEN3_XML else json.loads(f'"{m.group(1)}"')
            out.append(CallDelta(self.calls, id=new_call_id(), name=name))
            self.calls += 1
            self._buf = buf[m.end():]
            if self.family == QWEN3_XML:
                self._state, self._params, self._name = "xml_params", 0, name
            else:
                self._state, self._scan = "args", _ArgScanner()
            return True
        end = buf.find(CLOSE)
        if end < 0:
            return False
        block, self._buf, self._state = buf[:end], buf[end + len(CLOSE):], "text"
        calls = self._json_calls(block, need_known=False) if self.family == HERMES else []
        out += calls or [OPEN + block + CLOSE]  # not a call we can read: the client sees what was written
        return True

    def _xml_params(self, out: list) -> bool:
        buf = self._buf
        m = _XML_PARAM.match(buf)
        if m:
            key = m.group(1).strip()
            value = _typed(m.group(2), self.tools.get(self._name, {}), key)
            lead = "{" if self._params == 0 else ", "
            out.append(CallDelta(self.calls - 1, f"{lead}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"))
            self._params += 1
            self._buf = buf[m.end():]
            return True
        m = _XML_END.match(buf)
        if m:
            out.append(CallDelta(self.calls - 1, "}" if self._params else "{}"))
            self._buf, self._state = buf[m.end():], "tail"
            return True
        if CLOSE in buf:  # a call ended without </function>: close its arguments
            out.append(CallDelta(self.calls - 1, "}" if self._params else "{}"))
            self._state = "tail"
            return True
        return False

    def _json_calls(self, text: str, need_known: bool = True) -> list[CallDelta]:
        """The calls a JSON text holds ({...}, [{...}, ...] or {...}; {...}), [] unless it is only calls."""
        items = _json_items(text)
        if not items:
            return []
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return []
            if not isinstance(args, dict) or (need_known and item["name"] not in self.tools):
                return []
            calls.append((item["name"], args))
        out = []
        for name, args in calls:
            out.append(CallDelta(self.calls, id=new_call_id(), name=name))
            out.append(CallDelta(self.calls, json.dumps(args, ensure_ascii=False)))
            self.calls += 1
        return out


class _ArgScanner:
    """Where a JSON value that streams in ends: depth, strings and escapes tracked char by char."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.started = 0, False, False, False
        self.string_value = False  # the arguments came as a JSON string holding the object
        self._held = ""

    def feed(self, text: str) -> tuple[int, str, bool]:
        """(chars of text consumed, the arguments text they carry, whether the value ended there)."""
        begin = 0
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    begin = i + 1
                    continue
                self.started, self.string_value = True, ch == '"'
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1, self._out(text[begin:i + 1], True), True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, self._out(text[begin:i + 1], True), True
        return len(text), self._out(text[begin:], False), False

    def _out(self, piece: str, done: bool) -> str:
        if not self.string_value:
            return piece
        self._held += piece  # a string value is decoded once it is whole
        if not done:
            return ""
        try:
            value = json.loads(self._held)
        except ValueError:
            return self._held
        return value if isinstance(value, str) else self._held


def _fence_body(block: str) -> str:
    body = block[len(FENCE):-len(FENCE)]
    first, _, rest = body.partition("\n")
    return rest if first.strip() in ("json", "") or not rest else body


def _json_items(text: str) -> list[Any]:
    text = text.strip()
    if not text:
        return []
    try:
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    except ValueError:
        pass
    try:
        return [json.loads(part) for part in text.split(";") if part.strip()]
    except ValueError:
        return []


def _typed(raw: str, schema: dict[str, Any], key: str) -> Any:
    """An XML parameter's text as the JSON value its schema asks for (text when unsure)."""
    kind = (schema.get("properties") or {}).get(key, {}).get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or isinstance(kind, list) and "string" in kind:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_tool_calls(parser: ToolCallParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole answer through a fresh parser: (its content, its calls in OpenAI's shape)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for item in parser.push(text) + parser.flush():
        if isinstance(item, str):
            content.append(item)
        elif item.name is not None:
            calls[item.index] = {"id": item.id, "type": "function", "function": {"name": item.name, "arguments": ""}}
        else:
            calls[item.index]["function"]["arguments"] += item.arguments
    return "".join(content), [calls[i] for i in sorted(calls)]

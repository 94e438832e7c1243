"""The tool-call parsers on model outputs as the models write them: whole, and streamed split at every
character (the same calls, names first, arguments concatenating to the same JSON, no markup in content)."""
from __future__ import annotations

import json

import pytest

from engine.server.tools import ToolCallParser, detect_family, parse_tool_calls
from engine.server.tools.parser import CallDelta
from tests.serve_scripted import QWEN_TEMPLATE

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}}, "required": ["city"]}
TOOLS = {"get_weather": WEATHER, "search": {"type": "object", "properties": {"query": {"type": "string"}}}}

# (family, fence fallback, output, expected content, expected calls)
CASES = [
    # Qwen2.5-Coder-1.5B, tool_choice auto (recorded)
    ("hermes", True, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "days": 3})]),
    # two calls and text before them; braces and a quote inside a string argument
    ("hermes", True, 'I will look both up.\n<tool_call>\n{"name": "search", "arguments": {"query": "a {b} \\"c\\""}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "I will look both up.", [("search", {"query": 'a {b} "c"'}), ("get_weather", {"city": "Rome"})]),
    # Qwen2.5-Coder-0.5B answering in a fence instead of the tags (recorded)
    ("hermes", True, '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n```',
     "", [("get_weather", {"city": "Oslo"})]),
    # bare JSON naming a given tool
    ("hermes", True, '{"name": "search", "arguments": {"query": "bonsai"}}', "", [("search", {"query": "bonsai"})]),
    # a code fence that is no call stays content, as written
    ("hermes", True, "Use this:\n```python\nprint({'name': 1})\n```\nDone.", "Use this:\n```python\nprint({'name': 1})"
     "\n```\nDone.", []),
    # a fence naming an unknown tool is content
    ("hermes", True, '```json\n{"name": "rm_rf", "arguments": {}}\n```', '```json\n{"name": "rm_rf", "arguments": {}}\n```',
     []),
    # arguments sent as a JSON string (some fine-tunes do)
    ("hermes", False, '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>', "",
     [("search", {"query": "x"})]),
    # plain text with a lone '<' that is no tag
    ("hermes", False, "3 < 4 and <tool is not a tag", "3 < 4 and <tool is not a tag", []),
    # Qwen3-Coder / Qwen3.5 XML, values typed by the schema
    ("qwen3_xml", False, "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>",
     "Checking.", [("get_weather", {"city": "São Paulo", "days": 2, "metric": True})]),
    ("qwen3_xml", False, "<tool_call>\n<function=search>\n</function>\n</tool_call>", "", [("search", {})]),
    # Llama 3.1 JSON, with and without the python tag, two calls separated by ';'
    ("llama3_json", False, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}', "",
     [("get_weather", {"city": "Lima"})]),
    ("llama3_json", False, '{"name": "search", "parameters": {"query": "a"}}; {"name": "search", "parameters": '
     '{"query": "b"}}', "", [("search", {"query": "a"}), ("search", {"query": "b"})]),
    ("llama3_json", False, "The answer is 42.", "The answer is 42.", []),
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("family, fallback, text, content, calls", CASES)
def test_whole_output(family, fallback, text, content, calls):
    got_content, got_calls = parse_tool_calls(ToolCallParser(family, TOOLS, fallback), text)
    assert got_content.strip() == content and _calls(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("family, fallback, text, content, calls", CASES)
def test_streamed_at_every_split(family, fallback, text, content, calls):
    """Each split point, and one character at a time: the same result, names before arguments."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        parser = ToolCallParser(family, TOOLS, fallback)
        items = [x for p in pieces for x in parser.push(p)] + parser.flush()
        text_out = "".join(x for x in items if isinstance(x, str))
        assert text_out.strip() == content, pieces
        assert "<tool_call>" not in text_out or not calls
        deltas = [x for x in items if isinstance(x, CallDelta)]
        named: dict[int, list] = {}
        for d in deltas:
            if d.name is not None:
                assert d.index not in named and d.index == len(named)  # stable, in order, named first
                named[d.index] = [d.name, d.arguments]
            else:
                named[d.index][1] += d.arguments
        assert [(n, json.loads(a)) for n, a in named.values()] == calls, pieces


def test_cut_short_call_leaks_no_markup():
    """max_tokens inside a call: the client gets the name and what came of the arguments, no tag."""
    parser = ToolCallParser("hermes", TOOLS)
    items = parser.push('Sure\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par') + parser.flush()
    assert "".join(x for x in items if isinstance(x, str)) == "Sure\n"
    assert [d.name for d in items if isinstance(d, CallDelta) and d.name] == ["get_weather"]


def test_unreadable_tagged_block_is_passed_on_as_written():
    text = "<tool_call>\nnot json at all\n</tool_call>"
    content, calls = parse_tool_calls(ToolCallParser("hermes", TOOLS), text)
    assert calls == [] and content == text


@pytest.mark.parametrize("template, family", [
    (QWEN_TEMPLATE, "hermes"),
    ("{% if tools %}{{ tools }}{% endif %}<tool_call>\n<function=x>\n<parameter=y>", "qwen3_xml"),
    ("{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary}{% endif %}"
     "<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_family_from_the_template_text(template, family):
    assert detect_family(template) == family

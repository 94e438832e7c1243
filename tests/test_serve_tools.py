"""Tool calls on /v1/chat/completions through the real server path (a scripted engine plays the
model's answer back token by token): parsed calls, finish_reason, streaming deltas, tool messages
rendered through the template, and the 400s of bad tool input with the server still up."""
from __future__ import annotations

import json

import pytest

from tests.serve_inproc import call
from tests.serve_scripted import scripted_app

CHAT = "/v1/chat/completions"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = 'On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(smollm2_tok):
    answers = {"text": CALL}
    app, engine = scripted_app(smollm2_tok, lambda job: answers["text"])
    return app, engine, answers


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_call_parsed_with_finish_reason_tool_calls(served):
    app, engine, _ = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, "tools": TOOLS, "logprobs": True, "top_logprobs": 1})])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["id"].startswith("call_") and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    assert choice["logprobs"]["content"]  # logprobs still come with tools
    prompt = engine.tokenizer.decode(engine.jobs[-1].prompt_ids)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # rendered by the model's template


def test_streamed_call_deltas(served):
    app, _, _ = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, "tools": TOOLS, "stream": True, "logprobs": True})])
    chunks = sse_data(r.text)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "<tool_call>" not in content and "tool_call" not in content and content.strip() == "On it."
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    assert all(d["index"] == 0 for d in deltas) and all("name" not in d["function"] for d in deltas[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert any(c["choices"][0]["logprobs"] for c in chunks)


def test_tool_round_trip_renders_the_call_and_its_result(served):
    app, engine, answers = served
    answers["text"] = "It is sunny in Paris."
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    try:
        r, = call(app, [("POST", CHAT, {"messages": history, "tools": TOOLS})])
    finally:
        answers["text"] = CALL
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "It is sunny in Paris."
    assert "tool_calls" not in choice["message"]
    prompt = engine.tokenizer.decode(engine.jobs[-1].prompt_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # a dict, not a doubly encoded string
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_tool_choice_none_renders_no_tools_and_parses_nothing(served):
    app, engine, _ = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"})])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "<tool_call>" in choice["message"]["content"]
    assert "<tools>" not in engine.tokenizer.decode(engine.jobs[-1].prompt_ids)


@pytest.mark.parametrize("body, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": PARAMS}}]}, "tool name"),
    ({"tools": TOOLS * 2}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
     "properties"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "no earlier assistant"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "needs the tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "not valid JSON"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set 'tools'"),
])
def test_bad_tool_input_is_a_400_and_the_server_stays_up(served, body, needle):
    app, _, _ = served
    r, health = call(app, [("POST", CHAT, {"messages": ASK, "tools": TOOLS, **body}), ("GET", "/health", None)])
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]
    assert health.status_code == 200


def test_a_template_without_tool_calls_refuses_tools(smollm2_tok):
    app, _ = scripted_app(smollm2_tok, lambda job: "hi", template="{% for m in messages %}{{ m.content }}{% endfor %}")
    r, plain = call(app, [("POST", CHAT, {"messages": ASK, "tools": TOOLS}), ("POST", CHAT, {"messages": ASK})])
    assert r.status_code == 400 and "no tool-call format" in r.json()["error"]["message"]
    assert plain.status_code == 200


def test_forced_call_on_a_real_engine_is_schema_valid(tiny_engine_model, smollm2_tok):
    """tool_choice required on the tiny random model: the grammar in the decoding core makes even noise
    a valid call of the given tool, which the parser hands back as tool_calls."""
    import copy

    from tests.serve_inproc import tiny_server
    from tests.serve_scripted import QWEN_TEMPLATE
    tok = copy.copy(smollm2_tok)
    tok.chat_template = QWEN_TEMPLATE
    app, engine = tiny_server(tiny_engine_model, tok, context=512, default_max_tokens=160)
    unit = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_unit", "parameters": unit}}]
    try:
        r, = call(app, [("POST", CHAT, {"messages": ASK, "tools": tools, "tool_choice": "required", "seed": 3,
                                        "temperature": 1.0})])
    finally:
        engine.stop()
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_unit" and json.loads(tc["function"]["arguments"])["unit"] in ("C", "F")

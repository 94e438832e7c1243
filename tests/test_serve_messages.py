"""Anthropic's /v1/messages and OpenAI's /v1/responses through the real server path (scripted engine):
shapes, tool_use / function_call round trips, the streamed events in their documented order, errors."""
from __future__ import annotations

import json

import pytest

from tests.serve_inproc import call
from tests.serve_scripted import scripted_app

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}]
R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(smollm2_tok):
    answers = {"text": CALL}
    app, engine = scripted_app(smollm2_tok, lambda job: answers["text"], api_key="key-0123456789")
    return app, engine, answers


def post(app, path, body, headers=None):
    import asyncio

    import httpx

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, headers=headers or {"x-api-key": "key-0123456789"})
    return asyncio.run(run())


def events(text: str) -> list[tuple[str, dict]]:
    out, kind = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
    return out


def test_messages_tool_use_and_usage(served):
    app, engine, _ = served
    r = post(app, "/v1/messages", {"model": "m", "max_tokens": 200, "system": "Be brief.",
                                   "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": A_TOOLS})
    body = r.json()
    assert r.status_code == 200 and body["type"] == "message" and body["stop_reason"] == "tool_use"
    text, use = body["content"]
    assert text == {"type": "text", "text": "Checking."}
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    assert use["id"].startswith("toolu_") and body["usage"]["input_tokens"] == len(engine.jobs[-1].prompt_ids)
    assert "Be brief." in engine.tokenizer.decode(engine.jobs[-1].prompt_ids)


def test_messages_tool_result_round_trip_and_stop_sequence(served):
    app, engine, answers = served
    answers["text"] = "Sunny. END and more"
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    try:
        r = post(app, "/v1/messages", {"max_tokens": 50, "messages": history, "tools": A_TOOLS,
                                       "stop_sequences": ["END"], "temperature": 0, "top_k": 5})
    finally:
        answers["text"] = CALL
    body = r.json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"
    assert body["content"] == [{"type": "text", "text": "Sunny. "}]
    assert "<tool_response>\nsunny\n</tool_response>" in engine.tokenizer.decode(engine.jobs[-1].prompt_ids)


def test_messages_stream_events_in_documented_order(served):
    app, _, _ = served
    r = post(app, "/v1/messages", {"max_tokens": 200, "stream": True, "tools": A_TOOLS,
                                   "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    evs = events(r.text)
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert all(k == d["type"] for k, d in evs)
    starts = [d for k, d in evs if k == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"] and [s["index"] for s in starts] == [0, 1]
    # each block: start, deltas, stop, before the next starts
    order = [(k, d.get("index")) for k, d in evs if k.startswith("content_block")]
    assert order.index(("content_block_stop", 0)) < order.index(("content_block_start", 1))
    partial = "".join(d["delta"]["partial_json"] for k, d in evs if k == "content_block_delta"
                      and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use" and evs[-2][1]["usage"]["output_tokens"] > 0


def test_messages_errors_in_anthropic_shape(served):
    app, _, _ = served
    bad = post(app, "/v1/messages", {"messages": [{"role": "user", "content": "hi"}]})  # no max_tokens
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.json()["error"]["message"]
    unknown = post(app, "/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                         "tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}})
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]
    auth = post(app, "/v1/messages", {"max_tokens": 5, "messages": []}, headers={"x-api-key": "wrong-key-000"})
    assert auth.status_code == 401 and auth.json()["error"]["type"] == "authentication_error"
    bearer = post(app, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]},
                  headers={"Authorization": "Bearer key-0123456789"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


def test_responses_function_call_and_output_round_trip(served):
    app, engine, answers = served
    r = post(app, "/v1/responses", {"input": "Weather in Paris?", "instructions": "Be brief.", "tools": R_TOOLS,
                                    "max_output_tokens": 200, "store": False})
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    message, fc = body["output"]
    assert message["content"][0]["text"] == "Checking."
    assert fc["type"] == "function_call" and fc["name"] == "get_weather" and json.loads(fc["arguments"]) == {"city": "Paris"}
    answers["text"] = "Sunny."
    try:
        r2 = post(app, "/v1/responses", {"tools": R_TOOLS, "input": [
            {"role": "user", "content": "Weather in Paris?"}, fc | {"status": None},
            {"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny"}]})
    finally:
        answers["text"] = CALL
    assert r2.json()["output"][0]["content"][0]["text"] == "Sunny."
    assert "<tool_response>\nsunny\n</tool_response>" in engine.tokenizer.decode(engine.jobs[-1].prompt_ids)


def test_responses_stream_events(served):
    app, _, _ = served
    r = post(app, "/v1/responses", {"input": "Weather in Paris?", "tools": R_TOOLS, "stream": True})
    evs = events(r.text)
    kinds = [k for k, _ in evs]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    text = "".join(d["delta"] for k, d in evs if k == "response.output_text.delta")
    args = "".join(d["delta"] for k, d in evs if k == "response.function_call_arguments.delta")
    assert text.strip() == "Checking." and json.loads(args) == {"city": "Paris"}
    assert evs[-1][1]["response"]["output"][1]["type"] == "function_call"


@pytest.mark.parametrize("body, needle", [
    ({"store": True}, "stateless"), ({"previous_response_id": "resp_1"}, "stateless"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "must describe an object"),
])
def test_responses_refusals(served, body, needle):
    app, _, _ = served
    r = post(app, "/v1/responses", {"input": "hi", **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert call(app, [("GET", "/health", None)])[0].status_code == 200


HOSTILE = [None, -1, 2**70, 1e308, "x" * 300, [], {}, [{}], {"type": "nope"}, [[[[1]]]], True, "\u0000"]
VALID = {"/v1/messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
         "/v1/responses": {"input": "hi", "max_output_tokens": 5},
         "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
         "/tokenize": {"content": "hi"}, "/detokenize": {"tokens": [1, 2]}}
FIELDS = {"/v1/messages": ["max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
                           "top_k", "thinking", "stream"],
          "/v1/responses": ["input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning",
                            "temperature"],
          "/v1/messages/count_tokens": ["messages", "tools"], "/tokenize": ["content", "with_pieces"],
          "/detokenize": ["tokens"]}


@pytest.mark.parametrize("path", list(VALID))
def test_hostile_bodies_are_4xx_never_500(served, path):
    app, _, _ = served
    for field in FIELDS[path]:
        for value in HOSTILE:
            r = post(app, path, {**VALID[path], field: value})
            assert r.status_code < 500, (field, value, r.text)
            if r.status_code >= 400:
                message = r.json()["error"]["message"]
                assert message and "\n" not in message
    assert call(app, [("GET", "/health", None)])[0].status_code == 200


@pytest.mark.parametrize("path, body, mode", [
    ("/v1/messages", {"max_tokens": 50, "tools": A_TOOLS, "tool_choice": {"type": "any"}}, "required"),
    ("/v1/messages", {"max_tokens": 50, "tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}},
     "named"),
    ("/v1/messages", {"max_tokens": 50, "tools": A_TOOLS}, "auto"),
    ("/v1/responses", {"tools": R_TOOLS, "tool_choice": "required"}, "required"),
])
def test_forced_tool_choice_is_the_jobs_grammar(served, path, body, mode):
    app, engine, _ = served
    ask = {"messages": [{"role": "user", "content": "Weather in Paris?"}]} if path == "/v1/messages" else \
        {"input": "Weather in Paris?"}
    r = post(app, path, {**ask, **body})
    assert r.status_code == 200, r.text
    assert engine.jobs[-1].grammar.kind == "tool_calls" and engine.jobs[-1].grammar.mode == mode

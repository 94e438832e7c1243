"""The body fields clients always send, and the probe endpoints: implemented ones change the job,
harmless ones are accepted, the ones we cannot honour are a 400 that says why."""
from __future__ import annotations

import pytest

from engine.server.protocol_body import EFFORT_BUDGET, MAX_CHOICES
from tests.serve_inproc import call
from tests.serve_scripted import scripted_app

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served(smollm2_tok):
    return scripted_app(smollm2_tok, lambda job: "Hello there.")


def test_clients_harmless_fields_are_accepted(served):
    app, _ = served
    body = {"messages": ASK, "parallel_tool_calls": False, "response_format": {"type": "text"}, "logit_bias": {},
            "store": False, "metadata": {"a": "b"}, "service_tier": "auto", "user": "u1", "cache_prompt": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r, = call(app, [("POST", CHAT, body)])
    assert r.status_code == 200 and "Hello" in r.text and '"usage"' in r.text


def test_n_choices_with_seeds_derived_per_choice(served):
    app, engine = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, "n": 3, "seed": 7, "temperature": 0.8})])
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello there." for c in body["choices"])
    jobs = engine.jobs[-3:]
    assert [j.sampling.seed for j in jobs] == [7, 8, 9] and len({j.id for j in jobs}) == 3
    each = len(engine.tokenizer.encode("Hello there.", add_special_tokens=False))
    assert body["usage"]["completion_tokens"] == 3 * each  # every choice's tokens, the prompt once
    assert body["usage"]["prompt_tokens"] == len(jobs[0].prompt_ids)
    stream, = call(app, [("POST", CHAT, {"messages": ASK, "n": 2, "stream": True})])
    assert '"index":1' in stream.text.replace(" ", "") and stream.text.count("finish_reason\":\"stop") == 2


def test_echo_on_completions(served):
    app, _ = served
    r, s = call(app, [("POST", TEXT, {"prompt": "Once upon", "echo": True}),
                      ("POST", TEXT, {"prompt": "Once upon", "echo": True, "stream": True})])
    assert r.json()["choices"][0]["text"] == "Once uponHello there."
    assert '"text":"Once upon"' in s.text  # the first chunk


def test_chat_template_kwargs_and_reasoning_effort(served):
    app, engine = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False},
                                    "reasoning_effort": "low"})])
    assert r.status_code == 200
    job = engine.jobs[-1]
    assert engine.tokenizer.decode(job.prompt_ids).endswith("<think>\n\n</think>\n\n")
    assert job.thinking_budget == EFFORT_BUDGET["low"]


@pytest.mark.parametrize("body, needle", [
    ({"n": MAX_CHOICES + 1}, f"n={MAX_CHOICES + 1}"),
    ({"store": True}, "stateless"),
    ({"logit_bias": {"abc": 1}}, "not a token id"),
    ({"logit_bias": {"5": 500}}, "outside -100..100"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"functions": []}, "unknown field 'functions'"),
])
def test_fields_we_cannot_honour_are_400s(served, body, needle):
    app, _ = served
    r, health = call(app, [("POST", CHAT, {"messages": ASK, **body}), ("GET", "/health", None)])
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert health.status_code == 200


def test_probe_endpoints(served):
    app, engine = served
    tok, detok, pieces, props, model, other, emb, bad = call(app, [
        ("POST", "/tokenize", {"content": "Hello world"}), ("POST", "/detokenize", {"tokens": [19556, 905]}),
        ("POST", "/tokenize", {"content": "Hi", "with_pieces": True}), ("GET", "/props", None),
        ("GET", "/v1/models/scripted", None), ("GET", "/v1/models/other", None),
        ("POST", "/v1/embeddings", {"input": "x"}), ("POST", "/detokenize", {"tokens": [-1]})])
    ids = tok.json()["tokens"]
    assert ids == engine.tokenizer.encode("Hello world", add_special_tokens=False)
    assert detok.json()["content"] == engine.tokenizer.decode([19556, 905])
    assert "".join(p["piece"] for p in pieces.json()["tokens"]) == "Hi"
    assert props.json()["n_ctx"] == 4096 and props.json()["tool_call_format"] == "hermes"
    assert model.json()["id"] == "scripted" and other.status_code == 404
    assert emb.status_code == 404 and "not offered" in emb.json()["error"]["message"]
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("body, kind, mode, name", [
    ({"response_format": {"type": "json_object"}}, "json_object", None, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}}, "strict": True}}}, "json_schema", None, None),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_calls", "required", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_calls", "named",
     "get_weather"),
    ({"tools": TOOLS}, "tool_calls", "auto", None),  # auto: the lazy grammar, on at <tool_call>
    ({"tools": TOOLS, "tool_choice": "none"}, None, None, None),
    ({"response_format": {"type": "text"}}, None, None, None),
])
def test_response_format_and_tool_choice_become_the_jobs_grammar(served, body, kind, mode, name):
    app, engine = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, **body})])
    assert r.status_code == 200, r.text
    grammar = engine.jobs[-1].grammar
    assert (grammar and grammar.kind) == kind
    if mode is not None:
        assert (grammar.mode, grammar.name, grammar.fmt) == (mode, name, "hermes")


def test_logit_bias_reaches_the_sampler(served):
    app, engine = served
    r, = call(app, [("POST", CHAT, {"messages": ASK, "logit_bias": {"5": 2.5, "17": -100}})])
    assert r.status_code == 200 and engine.jobs[-1].sampling.logit_bias == {5: 2.5, 17: -100.0}


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "together"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "cannot be compiled"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
])
def test_grammars_we_cannot_build_are_400s(served, body, needle):
    app, _ = served
    r, health = call(app, [("POST", CHAT, {"messages": ASK, **body}), ("GET", "/health", None)])
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert "\n" not in r.json()["error"]["message"] and health.status_code == 200

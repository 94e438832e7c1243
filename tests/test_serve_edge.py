"""Issue 24, class 4: whatever body the JSON parser accepts, the server answers a 4xx with a message
(or serves it), never a 500, and logs no traceback. The body is decoded in one place
(protocol.decode_body: depth, NaN/Infinity, numbers beyond a double, lone surrogates) before the
strict request models see it. The cases the issue listed, more of each kind, then a seeded fuzz of
hostile values in every field of both endpoints."""
from __future__ import annotations

import json
import logging
import random

import pytest

from engine.server import protocol as P
from tests.serve_inproc import call, tiny_server

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def app(tiny_engine_model, smollm2_tok):
    app, engine = tiny_server(tiny_engine_model, smollm2_tok, max_body_bytes=1 << 20)
    yield app
    engine.stop()
    assert engine.failure is None


@pytest.fixture
def quiet_log(caplog):
    """The log must hold no traceback and no error: every refusal here is the client's."""
    caplog.set_level(logging.INFO)
    yield
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


def chat_body(**raw: str) -> str:
    """A chat body as JSON text, each keyword's value given as raw JSON (so escapes reach the parser)."""
    fields = {"messages": '[{"role":"user","content":"hi"}]', "max_tokens": "2", **raw}
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields.items()) + "}"


@pytest.mark.parametrize("path, body, needle", [
    # the cases
    (CHAT, "[" * 10_000 + "]" * 10_000, "nested too deeply"),
    (CHAT, chat_body(messages='[{"role":"user","content":"\\ud800"}]'), "lone surrogate"),
    (TEXT, '{"prompt":"\\ud800","max_tokens":2}', "lone surrogate"),
    (CHAT, chat_body(repetition_penalty="1e-300"), "repetition_penalty"),
    # more of each kind: depth
    (CHAT, '{"messages":' + "[" * 40 + "]" * 40 + "}", "nested too deeply"),
    (CHAT, '{"a":' * 5000 + "1" + "}" * 5000, "nested too deeply"),
    (CHAT, chat_body(stop="[" * 17 + "]" * 17), "nested too deeply"),
    # lone surrogates anywhere: a low one, a high one at the end, in a key, a name, a stop string, a part
    (CHAT, chat_body(messages='[{"role":"user","content":"ok \\udc00 ok"}]'), "lone surrogate"),
    (CHAT, chat_body(messages='[{"role":"user","content":"\\ud83d"}]'), "lone surrogate"),
    (CHAT, chat_body(**{"\ud800": "1"}).replace("\ud800", "\\ud800"), "lone surrogate"),
    (CHAT, chat_body(messages='[{"role":"user","content":"hi","name":"\\udfff"}]'), "lone surrogate"),
    (CHAT, chat_body(stop='["\\ud800"]'), "lone surrogate"),
    (CHAT, chat_body(user='"\\ud800"'), "lone surrogate"),
    (CHAT, chat_body(messages='[{"role":"user","content":[{"type":"text","text":"\\ud800"}]}]'), "lone surrogate"),
    (TEXT, '{"prompt":["\\ud800"],"max_tokens":2}', "lone surrogate"),
    # numbers JSON does not have, or a double cannot hold
    (CHAT, chat_body(temperature="NaN"), "NaN"),
    (CHAT, chat_body(temperature="Infinity"), "Infinity"),
    (CHAT, chat_body(top_p="-Infinity"), "Infinity"),
    (CHAT, chat_body(temperature="1e400"), "out of range"),
    (CHAT, chat_body(presence_penalty="-1e999"), "out of range"),
    (CHAT, chat_body(seed="1" + "0" * 5000), "not valid JSON"),
    (CHAT, chat_body(seed="18446744073709551616"), "seed"),
    (CHAT, chat_body(max_tokens="1e3"), "max_tokens"),
    (CHAT, chat_body(repetition_penalty="1e300"), "repetition_penalty"),
    (TEXT, '{"prompt":[1,2,99999999999999999999],"max_tokens":2}', "outside the vocabulary"),
    (TEXT, '{"prompt":[1,-5],"max_tokens":2}', "outside the vocabulary"),
    # work bombs
    (CHAT, chat_body(stop=json.dumps(["x" * 60_000])), "stop string"),
    (CHAT, chat_body(stop=json.dumps(["a"] * 17)), "16 strings"),
    # shapes the models refuse
    (CHAT, chat_body(messages='[{"role":"user","content":[{"type":"image_url"}]}]'), "messages"),
    (CHAT, chat_body(messages='[{"role":"user","content":{"a":1}}]'), "messages"),
    (CHAT, chat_body(messages='[null]'), "messages"),
    (CHAT, chat_body(messages='"hi"'), "messages"),
    (CHAT, '"just a string"', "JSON object"),
    (CHAT, "", "not valid JSON"),
    (CHAT, b"\xff\xfe{", "not valid JSON"),
    (CHAT, b'{"messages": "\xc3\x28"}', "not valid JSON"),
])
def test_hostile_bodies_get_a_4xx_with_a_message(app, quiet_log, path, body, needle):
    r = call(app, [("POST", path, body)])[0]
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert needle in error["message"], error
    assert "\n" not in error["message"] and error["type"] == "invalid_request_error"


def test_decode_body_keeps_what_json_allows():
    body = P.decode_body('{"a": [1, 2.5, -0.0, 1e-400, "é \\ud83d\\ude00", null, true], "b": {"c": {}}}'.encode())
    assert body["a"][4] == "é \U0001F600" and body["a"][3] == 0.0
    assert P.decode_body(json.dumps({"x": [[[[[[[[1]]]]]]]]}).encode())  # 9 levels: well within the limit


STRINGS = ['"\\ud800"', '"a\\udc00b"', '"\\ud83d"', '"\\u0000"', '"<|im_end|><|im_start|>system"', '""',
           '"{{ 7*7 }}{% for x in range(99) %}{% endfor %}"', '"' + "x" * 3000 + '"', '"' + "é" * 500 + '"',
           '"\\n\\r\\t"', '"user"', '"assistant"', '"\\udbff\\udfff"']
HOSTILE = STRINGS + [
    "1e400", "-1e400", "1e-400", "18446744073709551616", "-9223372036854775809", "1" + "0" * 5000,
    "1.7976931348623157e308", "5e-324", "NaN", "Infinity", "null", "true", "false", "[]", "{}",
    "[" * 30 + "]" * 30, '{"a":' * 30 + "1" + "}" * 30, "[1,2,3]", "[-1,99999999]", '[{"type":"text","text":"\\ud800"}]',
    '[{"type":"text","text":"hi"}]', '[{"type":"image_url"}]', "0", "-0.0", "1e308", "2", "-1", "0.5", "3000000000",
    '[{"role":"user"}]', '[{"role":"assistant","content":"x"}]', '[{"role":"user","content":null}]',
    '{"include_usage":true}', '["\\n\\n", "."]', '["\\ud800"]']
CHAT_FIELDS = ["messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "n", "stream",
               "stream_options", "logprobs", "top_logprobs", "thinking_budget", "user", "speculative.n_max", "frobnicate"]
TEXT_FIELDS = ["prompt", "max_tokens", "temperature", "seed", "stop", "logprobs", "stream", "echo", "top_k"]
MESSAGE_FIELDS = ["role", "content", "content", "name", "reasoning_content", "tool_calls"]


def fuzz_body(rng: random.Random) -> tuple[str, str]:
    """A path and a body: a valid request with mostly one field (a message's, or the prompt) made
    hostile, so that what reaches the template and the tokenizer is hostile too."""
    count = rng.choices([1, 2, 3], [7, 2, 1])[0]
    if rng.random() < 0.3:
        fields = {"prompt": '"The capital of France is"', "max_tokens": "2"}
        for name in rng.sample(TEXT_FIELDS, count):
            fields[name] = rng.choice(STRINGS if name == "prompt" and rng.random() < 0.7 else HOSTILE)
        path = TEXT
    else:
        message = {"role": '"user"', "content": '"hi"'}
        if rng.random() < 0.5:
            name = rng.choice(MESSAGE_FIELDS)
            message[name] = rng.choice(STRINGS if rng.random() < 0.7 else HOSTILE)
            count -= 1
        fields = {"messages": "[" + "{" + ",".join(f'"{k}":{v}' for k, v in message.items()) + "}]",
                  "max_tokens": "2"}
        for name in rng.sample(CHAT_FIELDS, count):
            fields[name] = rng.choice(HOSTILE)
        path = CHAT
    return path, "{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}"


def test_fuzzed_bodies_are_served_or_refused_with_a_4xx_and_no_traceback(app, quiet_log, one_thread):
    rng = random.Random(24)
    cases = [fuzz_body(rng) for _ in range(200)]
    responses = call(app, [("POST", path, body) for path, body in cases], timeout=300)
    statuses = {}
    for (path, body), r in zip(cases, responses):
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body[:300], r.text[:300])
        if r.status_code >= 400:
            message = r.json()["error"]["message"]
            assert message and "\n" not in message, (body[:200], message)
        elif '"stream":true' in body:
            assert r.text.rstrip().endswith("data: [DONE]") or '"error"' in r.text, r.text[-300:]
        else:
            assert r.json()["choices"], r.text[:300]
    assert statuses.get(200, 0) >= 20 and sum(v for k, v in statuses.items() if k >= 400) >= 100, statuses

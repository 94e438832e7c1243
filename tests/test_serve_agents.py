"""The real `openai` and `anthropic` client packages against `bonsai serve` on the real
Qwen2.5-Coder-0.5B-Instruct on the CPU (greedy): a tool round trip, the same call streamed, the
Messages API with tools and streaming, and the Responses API. Skipped unless the model is pulled."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from engine.sources import store  # noqa: E402
from tests.serve_process import start_server  # noqa: E402
from tests.tool_prompts import TOOLS  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-0.5b"
KEY = "agents-key-0123456789"
ASK = [{"role": "user", "content": "What's the weather in Paris right now?"}]
GREEDY = {"temperature": 0}  # anthropic 2.x's create() takes no temperature argument: sent in the body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = store.find_pulled(MODEL)
    if path is None:
        pytest.skip(f"needs `bonsai pull {MODEL}`")
    tmp = tmp_path_factory.mktemp("agents")
    (tmp / "serve.yaml").write_text(f"model:\n  path: {path}\n  max_context: 2048\nruntime:\n  device: cpu\n"
                                    f"  max_batch_size: 1\nserver:\n  api_key: {KEY}\n  default_max_tokens: 96\n")
    proc = start_server(tmp / "serve.yaml", tmp / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=600)


def test_tool_round_trip_with_openai(oai):
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=96)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and "paris" in json.loads(tc.function.arguments)["city"].lower()
    assert "<tool_call>" not in (choice.message.content or "")
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]
    second = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=64)
    assert second.choices[0].finish_reason in ("stop", "length") and "21" in second.choices[0].message.content

    # the same request streamed: the same call, assembled from its deltas
    name, args, indices, content = "", "", set(), ""
    for chunk in oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=96,
                                             stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            indices.add(d.index)
            name += d.function.name or ""
            args += d.function.arguments or ""
    assert indices == {0} and name == "get_weather" and json.loads(args) == json.loads(tc.function.arguments)
    assert "<tool_call>" not in content


def test_messages_api_with_anthropic(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=600)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msg = client.messages.create(model=MODEL, max_tokens=96, messages=ASK, tools=tools, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    use = next(b for b in msg.content if b.type == "tool_use")
    assert use.name == "get_weather" and "paris" in use.input["city"].lower()
    reply = client.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=tools, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C and sunny"}]}])
    assert reply.content[0].type == "text" and reply.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=16, system="Answer in one word.", extra_body=GREEDY,
                                messages=[{"role": "user", "content": "What is the capital of France?"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text and final.stop_reason in ("end_turn", "max_tokens")


def test_responses_api_with_openai(oai):
    r = oai.responses.create(model=MODEL, input="What is the capital of France? One word.", instructions="Be brief.",
                             max_output_tokens=16, temperature=0)
    assert "Paris" in r.output_text

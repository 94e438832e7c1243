"""The real `bonsai serve` process on 127.0.0.1 with SmolLM2, driven by the `openai` package and raw
HTTP: one server for the whole module (4 slots, an API key, a chat template that thinks on demand)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.serve_process import ROOT, start_server  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "test-key-0123456789"
# SmolLM2's ChatML, plus a thought opened in the generation prompt when the last message asks "/think"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if '/think' in messages[-1].content %}<think>\n{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "template.jinja").write_text(TEMPLATE)
    (tmp / "serve.yaml").write_text(
        f"model:\n  path: {smollm2_gguf}\n  max_context: 256\n  chat_template: {tmp / 'template.jinja'}\n"
        "runtime:\n  device: cpu\n  max_batch_size: 4\n  prefill_chunk_size: 128\n"
        f"server:\n  api_key: {KEY}\n  max_queue: 4\n  max_body_bytes: 65536\n  default_max_tokens: 8\n")
    proc = start_server(tmp / "serve.yaml", tmp / "server.log")
    yield {"url": proc.url, "health": proc.health, "log": proc.log}
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["url"] + path, headers=headers, timeout=120,
                      **({"content": body} if isinstance(body, (bytes, str)) else {"json": body}), **kw)


def test_health_reports_loading_then_ok(server):
    statuses = [s for s, _ in server["health"]]
    assert statuses[-1] == 200 and server["health"][-1][1] == {"status": "ok"}
    loading = [body for s, body in server["health"] if s == 503]
    assert loading, "the model loaded before the first /health answer"
    assert loading[0]["error"]["message"] == "Loading model" and loading[0]["error"]["type"] == "unavailable_error"
    assert 0 <= loading[0]["progress"] < 1 and loading[0]["stage"]


def test_api_key_is_required_except_on_health(server):
    assert httpx.get(server["url"] + "/health").status_code == 200
    r = httpx.get(server["url"] + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server["url"] + "/v1/models", headers={"Authorization": "Bearer wrong-key-000000"})
    assert r.status_code == 401


def test_chat_non_stream_usage_and_timings(client):
    r = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens <= 8
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == r.usage.completion_tokens
    assert timings["cache_n"] + timings["prompt_n"] == r.usage.prompt_tokens
    assert {"draft_n", "draft_n_accepted", "prompt_per_second", "predicted_per_second"} <= set(timings)


def test_stream_events_in_order_and_equal_to_non_stream(server, client):
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "timings" in finish[0] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] <= 4 and chunks.index(finish[0]) == len(chunks) - 2
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, temperature=0)
    assert text == plain.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == text


def test_stop_strings_cut_the_answer(client):
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=10, temperature=0, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
    assert r.choices[0].message.content.startswith("The capital")


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=5,
              temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b and a
    extra = client.chat.completions.create(seed=7, extra_body={"top_k": 40, "min_p": 0.05}, presence_penalty=0.5,
                                           frequency_penalty=0.5, **kw)
    assert extra.choices[0].message.content


def test_reasoning_content_with_a_thinking_budget(client):
    messages = [{"role": "user", "content": "Count to ten. /think"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"thinking_budget": 4})
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and "<think>" not in message.content + reasoning
    assert "</think>" not in message.content + reasoning
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                 extra_body={"thinking_budget": 4}, stream=True))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                       if c.choices)
    assert streamed == reasoning


def test_completions_endpoint_stream_and_logprobs(client):
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    assert r.choices[0].text and r.usage.completion_tokens == len(r.choices[0].logprobs.tokens)
    assert all(len(t) == 2 for t in r.choices[0].logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    chat = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=3)
    first = chat.choices[0].logprobs.content[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 3 and first.top_logprobs[0].logprob >= first.logprob


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"messages": QUESTION, "max_tokens": "5"}, 400, "max_tokens"),
    ({"messages": QUESTION, "frobnicate": 1}, 400, "frobnicate"),
    ({"messages": QUESTION, "n": 17}, 400, "n=17"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "tokens"),
    ({"messages": [{"role": "user", "content": "x" * 70000}]}, 413, "bytes"),
    ([1, 2], 400, "JSON object"),
])
def test_malformed_requests_get_openai_errors(server, body, status, needle):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(server["url"] + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_prefix_reuse_shows_in_cache_n(client):
    first = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=6, temperature=0)
    turn2 = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="m", messages=turn2, max_tokens=6, temperature=0)
    assert second.model_extra["timings"]["cache_n"] >= first.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == second.model_extra["timings"]["cache_n"]


def stream_one(url: str, index: int, disconnect: bool, out: dict, answered: threading.Event | None = None,
               go: threading.Event | None = None) -> None:
    """One streaming request; `answered` is set once its status is known, and a client that
    will disconnect waits for `go` before it reads (so it holds its slot meanwhile)."""
    body = {"messages": [{"role": "user", "content": f"Write a poem about the number {index}."}],
            "max_tokens": 40 if disconnect else 4, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            if answered is not None:
                answered.set()
            if r.status_code != 200:
                out[index] = f"{r.status_code} retry-after {r.headers.get('retry-after')}"
                return
            if go is not None:
                go.wait(60)
            for line in r.iter_lines():
                if disconnect and '"content":"' in line and '"content":""' not in line:
                    out[index] = "left"
                    return  # closes the connection mid-stream
                if line == "data: [DONE]":
                    out[index] = "done"
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        out[index] = repr(e)
    finally:
        if answered is not None:
            answered.set()


def metric(server, name: str) -> float:
    text = httpx.get(server["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_concurrent_streams_some_disconnecting_and_a_full_queue(server):
    # 11 requests: 4 slots + 4 queue places take 8, the rest get 503. The 3 that will leave
    # mid-stream are admitted first and hold their slots until all others have their answer, so
    # exactly 3 of the other 8 find the server full.
    rows0, steps0 = metric(server, "bonsai_decode_rows_total"), metric(server, "bonsai_decode_steps_total")
    timed0, queued0 = metric(server, "bonsai_request_timed_total"), metric(server, "bonsai_request_queue_seconds_total")
    out: dict = {}
    go = threading.Event()
    answered = {i: threading.Event() for i in range(11)}
    leaving, staying = [i for i in range(11) if i % 4 == 0], [i for i in range(11) if i % 4]
    threads = {i: threading.Thread(target=stream_one, args=(server["url"], i, i in leaving, out, answered[i],
                                                             go if i in leaving else None)) for i in range(11)}
    for group in (leaving, staying):
        for i in group:
            threads[i].start()
        for i in group:
            assert answered[i].wait(120), f"request {i} got no status"
    go.set()
    for t in threads.values():
        t.join(300)
    busy = "503 retry-after 1"
    assert all(out.get(i) in (busy, "left" if i in leaving else "done") for i in range(11)), out
    results = list(out.values())
    assert results.count(busy) == 3 and results.count("left") == 3, out
    slots = httpx.get(server["url"] + "/slots", headers={"Authorization": f"Bearer {KEY}"}).json()
    deadline = time.time() + 30
    while any(s["is_processing"] for s in slots) and time.time() < deadline:
        time.sleep(0.2)
        slots = httpx.get(server["url"] + "/slots", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert len(slots) == 4 and not any(s["is_processing"] for s in slots) and slots[0]["n_ctx"] == 256
    assert metric(server, 'bonsai_requests_total{outcome="cancelled"}') >= results.count("left")
    assert metric(server, 'bonsai_requests_total{outcome="rejected_busy"}') == results.count(busy)
    rows, steps = metric(server, "bonsai_decode_rows_total") - rows0, metric(server, "bonsai_decode_steps_total") - steps0
    assert rows >= 1.5 * steps  # requests were decoded together (one after another: rows == steps)
    # the 8 admitted requests ended (3 left, 5 answered), and 4 of them waited for a slot held by a leaving one
    assert metric(server, "bonsai_request_timed_total") - timed0 == 8
    assert metric(server, "bonsai_request_queue_seconds_total") - queued0 > 0


def test_metrics_are_prometheus_text(server):
    r = httpx.get(server["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = set()
    for line in r.text.splitlines():
        if line.startswith("# TYPE"):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
    assert {"bonsai_requests_total", "bonsai_generation_tokens_total", "bonsai_prompt_cache_hits_total",
            "bonsai_slots_busy", "bonsai_spec_decode_num_draft_tokens_total"} <= names


def test_chat_command_runs_on_the_serve_config(smollm2_gguf, tmp_path):
    (tmp_path / "serve.yaml").write_text(f"model:\n  path: {smollm2_gguf}\n  max_context: 512\n")
    script = "My name is Ada.\nWhat is my name?\n/stats\n/exit\n"
    proc = subprocess.run([sys.executable, "-m", "bonsai_cli", "chat", "--config", str(tmp_path / "serve.yaml"),
                           "--temperature", "0", "-n", "16"], input=script, capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("bonsai> ") == 2 and "Ada" in proc.stdout.split("What is my name?")[1]
    reused = int(proc.stdout.split("tokens (")[1].split(" reused")[0])
    assert reused > 10  # the second turn reused the first turn's prefix in the engine's slot


def test_speculative_server_answers_as_the_plain_one_and_reuses_prefixes(server, smollm2_gguf, tmp_path):
    """The same SmolLM2 with n-gram speculation and 2 slots: greedy answers equal the plain server's,
    drafts are accepted, and a second turn reuses its prefix (cache_n) with speculation on."""
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    (tmp_path / "serve.yaml").write_text(
        f"model:\n  path: {smollm2_gguf}\n  max_context: 256\n  chat_template: {tmp_path / 'template.jinja'}\n"
        "runtime:\n  device: cpu\n  max_batch_size: 2\n  prefill_chunk_size: 128\n"
        "  decode_algorithm: speculative\n  draft_model: none\n"
        "speculative:\n  method: ngram\n  adaptive: false\n")
    spec = start_server(tmp_path / "serve.yaml", tmp_path / "server.log", threads=1)
    try:
        turn1 = [{"role": "user", "content": "Repeat this line twice: red fox, blue fox, red fox, blue fox."}]

        def ask(url: str, messages: list, key: str | None) -> dict:
            r = httpx.post(url + "/v1/chat/completions", timeout=300,
                           headers={"Authorization": f"Bearer {key}"} if key else {},
                           json={"messages": messages, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        a, b = ask(server["url"], turn1, KEY), ask(spec.url, turn1, None)
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert b["timings"]["draft_n_accepted"] > 0 and a["timings"]["draft_n"] == 0
        turn2 = turn1 + [a["choices"][0]["message"], {"role": "user", "content": "Once more."}]
        b = ask(spec.url, turn2, None)  # (its exactness after a reuse: tests/test_serve_spec*.py)
        assert b["timings"]["cache_n"] > 20 and b["timings"]["draft_n"] > 0
    finally:
        spec.stop()

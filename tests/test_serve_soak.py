"""Issue 24's soak test, and its shutdown case (classes 2 and 9), on one real `bonsai serve` process
(a tiny random model with SmolLM2's tokenizer, 127.0.0.1 only, bounded in count and time).

The soak: concurrent clients (seeded) mix streams, streams they drop mid-way, plain requests,
malformed bodies and oversized conversations. Afterwards the engine is alive, /health says so,
every request was answered or refused as its kind must be, the server's memory grew by a bounded
amount, and its log holds no traceback. It prints its figures.

Then SIGTERM while streams are open (and a long conversation's prompt is being fitted) ends every
open stream with an error event, the server exits 0 promptly, still with no traceback in its log
(before: streams cut without an event, two CancelledError tracebacks, and a long conversation in
flight held the process up for as long as its quadratic fitting took)."""
from __future__ import annotations

import collections
import json
import random
import signal
import threading
import time

import httpx
import pytest

from tests.serve_process import rss_bytes, start_server, tiny_serve_config

pytestmark = pytest.mark.slow
CLIENTS, PER_CLIENT, SLOTS, CONTEXT = 8, 15, 4, 512
MALFORMED = [b"{not json", b"[" * 5000 + b"]" * 5000, b'{"messages":[{"role":"user","content":"\\ud800"}]}',
             b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
             b'{"messages":[{"role":"user","content":"hi"}],"seed":18446744073709551616}',
             b'{"messages":[{"role":"user","content":"hi"}],"repetition_penalty":1e-300}',
             b'{"messages":[{"role":"wizard","content":"hi"}]}', b'{"messages":"hi"}', b'{"prompt":[1,-3]}',
             b'{"messages":[{"role":"user","content":"hi"}],"frobnicate":1}', b'\xff\xfe', b'"hi"']


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf):
    tmp = tmp_path_factory.mktemp("soak")
    config = tiny_serve_config(tmp, smollm2_gguf, slots=SLOTS, context=CONTEXT, max_queue=8, default_max_tokens=16)
    proc = start_server(config, tmp / "server.log", threads=1)
    yield proc
    if proc.proc.poll() is None:
        proc.stop()


def plan(rng: random.Random) -> tuple[str, dict | bytes, int]:
    """(kind, body, chunks to read before leaving) of one request."""
    kind = rng.choices(["stream", "leave", "plain", "malformed", "too_many", "long_history", "too_long", "too_big"],
                       [30, 15, 15, 20, 5, 6, 5, 4])[0]
    question = [{"role": "user", "content": f"Tell me about the number {rng.randint(0, 999)}."}]
    sampling = {"temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 2**32)}
    if kind == "malformed":
        return kind, rng.choice(MALFORMED), 0
    if kind == "too_many":
        return kind, {"messages": question * 2100, "max_tokens": 4}, 0  # over server.max_messages (2048)
    if kind == "long_history":  # fitted: the oldest turns dropped
        history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "many words here " * 3} for i in range(200)]
        return kind, {"messages": history + question, "max_tokens": 4, "stream": rng.random() < 0.5}, 0
    if kind == "too_long":
        return kind, {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}, 0
    if kind == "too_big":
        return kind, {"messages": [{"role": "user", "content": "x" * 1_100_000}]}, 0  # over max_body_bytes (1 MiB)
    body = {"messages": question, "max_tokens": rng.randint(4, 48) if kind != "leave" else 64, **sampling}
    if kind == "plain" and rng.random() < 0.4:
        body = {"prompt": "The number " + str(rng.randint(0, 999)), "max_tokens": rng.randint(2, 16)}
    return kind, {**body, "stream": kind != "plain"}, rng.randint(1, 4) if kind == "leave" else 0


def run_one(client: httpx.Client, url: str, kind: str, body, leave_after: int) -> str:
    """The outcome: "done", "left", "answered", "refused <status>", "busy", or something else (a failure)."""
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    with client.stream("POST", url + path, **kw) as r:
        if r.status_code == 503 and r.headers.get("retry-after"):
            return "busy"
        if r.status_code != 200:
            error = json.loads(r.read())["error"]
            assert error["message"] and "\n" not in error["message"], error
            return f"refused {r.status_code}"
        if not (isinstance(body, dict) and body.get("stream")):
            reply = json.loads(r.read())
            return "answered" if reply["choices"] else f"empty {reply}"
        chunks = 0
        for line in r.iter_lines():
            if '"error"' in line:
                return f"error event {line}"
            if '"content":"' in line and '"content":""' not in line:
                chunks += 1
                if leave_after and chunks >= leave_after:
                    return "left"  # closing the stream mid-way
            if line == "data: [DONE]":
                return "done"
        return "left" if leave_after else "cut"


EXPECTED = {"stream": {"done"}, "leave": {"left", "done"}, "plain": {"answered"}, "malformed": {"refused 400"},
            "too_many": {"refused 400"}, "long_history": {"done", "answered"}, "too_long": {"refused 400"},
            "too_big": {"refused 413"}}


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def wait_idle(url: str) -> list:
    deadline = time.monotonic() + 60
    slots = httpx.get(url + "/slots").json()
    while any(s["is_processing"] for s in slots) and time.monotonic() < deadline:
        time.sleep(0.1)
        slots = httpx.get(url + "/slots").json()
    return slots


def test_soak(server):
    url, pid = server.url, server.proc.pid
    rngs = [random.Random(24 + i) for i in range(CLIENTS)]
    plans = [[plan(rng) for _ in range(PER_CLIENT)] for rng in rngs]
    with httpx.Client(timeout=120) as warm:  # every kind once, so that what stays allocated is there before
        for kind in EXPECTED:
            body = next((p for ps in plans for p in ps if p[0] == kind), None)
            if body is not None:
                run_one(warm, url, *body)
    wait_idle(url)
    rss_before = rss_bytes(pid)
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()
    start = time.monotonic()

    def client(requests):
        with httpx.Client(timeout=120) as c:
            for kind, body, leave in requests:
                result = run_one(c, url, kind, body, leave)
                with lock:
                    outcomes.append((kind, result))

    threads = [threading.Thread(target=client, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    seconds = time.monotonic() - start
    slots = wait_idle(url)
    rss_after = rss_bytes(pid)
    by_kind = collections.Counter(kind for kind, _ in outcomes)
    by_result = collections.Counter(result for _, result in outcomes)
    print(f"\nsoak: {len(outcomes)} requests from {CLIENTS} clients in {seconds:.1f} s; by kind {dict(by_kind)}; "
          f"outcomes {dict(by_result)}; RSS {rss_before / 2**20:.1f} MiB before, {rss_after / 2**20:.1f} MiB after "
          f"(+{(rss_after - rss_before) / 2**20:.1f} MiB)")
    assert len(outcomes) == CLIENTS * PER_CLIENT, "a client did not finish"
    wrong = [(k, r) for k, r in outcomes if r not in EXPECTED[k] | {"busy"}]
    assert not wrong, wrong  # every request answered, or refused as its kind must be
    assert by_result["left"] >= 5 and by_result["refused 400"] >= 10
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert not any(s["is_processing"] for s in slots)
    again = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3}, timeout=60)
    assert again.status_code == 200 and again.json()["choices"]
    assert metric(url, 'bonsai_requests_total{outcome="error"}') == 0  # no request failed inside the engine
    assert rss_after - rss_before < 64 * 2**20
    log = server.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


LONG = {"messages": [{"role": "user", "content": "Count from one to a thousand."}], "max_tokens": 450,
        "temperature": 0, "stream": True}


def stream(url: str, body: dict, out: dict, key: str, started: threading.Event) -> None:
    """One stream; out[key]: "done", "error: <message>", "cut" or the HTTP status; `started` is set
    at its first text (it decodes) or, for a waiting one, at its first event (it is in the queue)."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                out[key] = r.status_code
                return
            for line in r.iter_lines():
                if line.startswith("data: ") and (not key.startswith("running") or '"content":"' in line and
                                                  '"content":""' not in line):
                    started.set()
                if line == "data: [DONE]":
                    out[key] = "done"
                    return
                if line.startswith("data: ") and '"error"' in line:
                    out[key] = "error: " + json.loads(line[6:])["error"]["message"]
                    return
            out[key] = "cut"
    except httpx.HTTPError as e:
        out[key] = f"cut ({type(e).__name__})"
    finally:
        started.set()


def test_sigterm_ends_open_streams_with_an_error_event(server):
    """Every slot decodes a 450-token answer and three more wait behind them when SIGTERM comes; a
    2,001-message conversation went in first. (SIGINT takes the same path: uvicorn gives both to
    the handle_exit that bonsai_cli.cmd_serve.end_streams_first wraps.)"""
    url, out = server.url, {}
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 20} for i in range(2001)]
    long = {"messages": history, "max_tokens": 50, "stream": True}  # 260 KB: fitted in a few renders (before: ~60 s)
    groups = [["long"], [f"running{i}" for i in range(SLOTS)], [f"queued{i}" for i in range(3)]]
    events = {key: threading.Event() for group in groups for key in group}
    threads = []
    for group in groups:
        for key in group:
            threads.append(threading.Thread(target=stream, args=(url, long if key == "long" else LONG, out, key,
                                                                 events[key])))
            threads[-1].start()
        for key in group:
            assert events[key].wait(60), out
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=30)
    for t in threads:
        t.join(30)
    log = server.log.read_text()
    assert code == 0, log[-3000:]
    assert not any(str(v).startswith("cut") for v in out.values()), sorted(out.items())
    ended = [k for k, v in out.items() if str(v).startswith("error: ")]
    assert any(k.startswith("queued") for k in ended) and all("shutting down" in out[k] for k in ended), out
    assert all(v == "done" or k in ended or v == 503 for k, v in out.items()), out
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


def test_uvicorn_sends_sigint_and_sigterm_to_the_wrapped_handler():
    import uvicorn.server
    assert {signal.SIGINT, signal.SIGTERM} <= set(uvicorn.server.HANDLED_SIGNALS)

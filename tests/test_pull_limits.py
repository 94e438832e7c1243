"""Issue 24, classes 3 and 9: `bonsai pull ORG/NAME` on a stalled network ends with one line saying
what timed out and how to retry (before: no exit after 320 s behind a silent proxy, 144 s when SYNs
were dropped). The network is simulated on 127.0.0.1 only: a server that accepts and never answers,
one whose accept queue is full (the kernel drops the SYNs), one that trickles its answer; the limits
are made small through their settings. Names the hub cannot have are refused before any network."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from engine.sources import store
from engine.errors import BonsaiError
from engine.sources.pull_limits import PullLimits


@contextmanager
def stalled(mode: str):
    """A loopback port that stalls a client: 'silent' accepts and never answers; 'full' never accepts
    (its queue is filled first, so new SYNs go unanswered); 'trickle' answers 200 with a body of one
    byte every 0.1 s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0 if mode == "full" else 8)
    port = server.getsockname()[1]
    held, stop = [], threading.Event()
    if mode == "full":
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            held.append(c)
    else:
        server.settimeout(0.1)

        def serve():
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                held.append(conn)
                if mode == "trickle":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
                    threading.Thread(target=drip, args=(conn,), daemon=True).start()

        def drip(conn):
            while not stop.wait(0.1):
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

        threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        for c in held:
            c.close()
        server.close()


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("BONSAI_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BONSAI_PULL_CONNECT_TIMEOUT", "0.5")
    monkeypatch.setenv("BONSAI_PULL_READ_TIMEOUT", "0.5")
    monkeypatch.setenv("BONSAI_PULL_TIMEOUT", "20")
    return monkeypatch


def pull_error(name: str, bound_s: float = 60) -> str:
    """store.pull(name)'s one-line error; the pull runs in a thread given `bound_s` to end (if it hangs
    the test fails instead of hanging the suite)."""
    out: dict = {}

    def run():
        try:
            store.pull(name)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"bonsai pull {name} did not end within {bound_s} s"
    assert isinstance(out.get("error"), BonsaiError), out
    message = str(out["error"])
    assert "\n" not in message
    return message


@pytest.mark.parametrize("mode, says", [
    ("silent", "{where} accepted the connection but sent nothing for 0.5 s (BONSAI_PULL_READ_TIMEOUT)"),
    ("full", "could not connect to {where} within 0.5 s (BONSAI_PULL_CONNECT_TIMEOUT)"),
], ids=["accepts and never answers", "never accepts"])
def test_a_stalled_server_ends_the_pull_saying_what_timed_out(hub_env, mode, says):
    with stalled(mode) as url:
        hub_env.setenv("HF_ENDPOINT", url)
        message = pull_error("acme/model")
    assert says.format(where=url.removeprefix("http://")) in message, message
    assert "run `bonsai pull acme/model` again" in message


def test_a_trickling_answer_stops_at_the_deadline(hub_env):
    """Every byte comes within the read timeout: only the overall deadline ends it."""
    hub_env.setenv("BONSAI_PULL_READ_TIMEOUT", "5")
    hub_env.setenv("BONSAI_PULL_TIMEOUT", "1.5")
    start = time.monotonic()
    with stalled("trickle") as url:
        hub_env.setenv("HF_ENDPOINT", url)
        message = pull_error("acme/model")
    assert "did not finish within 1.5 s (BONSAI_PULL_TIMEOUT)" in message, message
    assert time.monotonic() - start < 30  # (a generous bound: it ends because of the deadline)


def test_the_hub_client_is_put_back_after_a_pull(hub_env):
    from huggingface_hub.utils import _http
    with stalled("silent") as url:
        hub_env.setenv("HF_ENDPOINT", url)
        pull_error("acme/model")
    assert _http._GLOBAL_CLIENT_FACTORY is _http.default_client_factory


@pytest.mark.parametrize("text", ["0", "-1", "soon", "1e9"])
def test_a_bad_limit_setting_is_one_line(text):
    with pytest.raises(BonsaiError, match="BONSAI_PULL_TIMEOUT"):
        PullLimits.from_env({"BONSAI_PULL_TIMEOUT": text})


@pytest.mark.parametrize("name", ["a/..", "a/.", "../b", "a/b/c", "a/-b", "a/b-", "a/b--c", "a/b..c", "a/" + "x" * 97,
                                  "a/b c", "a/b\nc", "a/b\x1b[2J", "/b", "a/"])
def test_names_the_hub_cannot_have_are_refused_before_any_network(name, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the network was used")

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(BonsaiError, match="not a valid model name|unknown model name") as e:
        store.pull(name)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "a/b.c", "a_b/c-d", "Org/x" * 1 + "1"])
def test_names_the_hub_can_have_pass(name):
    assert store.valid_repo_id(name)


def test_an_error_with_a_newline_in_it_prints_as_one_line(capsys):
    from tests.test_cli_errors import assert_one_line_error, bonsai_in_process
    proc = bonsai_in_process(capsys, "generate", "no-such\nmodel\x1b[31m", "--prompt", "hi")
    assert_one_line_error(proc, "unknown model")
    assert "\\n" in proc.stderr and "\x1b" not in proc.stderr


def test_the_store_imports_without_the_hubs_http_client():
    """Every command imports engine.sources.store; a huggingface_hub built on another HTTP package (httpx before 2.0,
    httpx2 after) must not stop it (the GPU machine's hub has no httpx2: every test there failed to import)."""
    code = ("import sys; sys.modules['httpx2'] = None; sys.modules['httpx'] = None\n"
            "import engine.sources.store, engine.sources.pull_limits\nprint('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_deadline_stream_is_the_clients_own_stream_type():
    import importlib
    from engine.sources.pull_limits import deadline_stream_type
    name = "httpx2" if importlib.util.find_spec("httpx2") else "httpx"
    http = importlib.import_module(name)
    kind = deadline_stream_type(f"{name}._models")
    assert issubclass(kind, http.SyncByteStream) and deadline_stream_type(f"{name}._models") is kind

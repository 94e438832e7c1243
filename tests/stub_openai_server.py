"""A minimal OpenAI-compatible server for tests: canned streaming chat completions on 127.0.0.1.

    with running_stub(tokens=10, token_delay=0.02) as url:
        ...  # GET {url}/v1/models, POST {url}/v1/chat/completions (stream)

The body is sent with chunked transfer encoding and Nagle off, like llama.cpp's and vLLM's servers,
so the client sees each event when the stub writes it. ``mode`` plants one failure at a time.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

MODES = ("ok", "html_models", "empty_models", "error_500", "error_in_stream", "malformed", "cut", "drop",
         "zero_tokens")
SERVER_ERROR = "stub internal failure: the model crashed"
STREAM_ERROR = "stub ran out of KV cache"


@dataclass
class StubOptions:
    model: str = "stub-model"
    tokens: int = 8  # generated per request (capped by the request's max_tokens)
    tokens_per_chunk: int = 1
    reasoning_tokens: int = 0  # the first ones go out as reasoning_content
    first_token_delay: float = 0.0  # seconds between the role chunk and the first token
    token_delay: float = 0.0  # seconds per token after the first
    prompt_tokens: int = 12
    usage: bool = True  # send a usage chunk when the request asks for one
    timings: dict[str, Any] | None = None  # llama.cpp timings fields to send (merged into a full object)
    mode: str = "ok"
    api_key: str | None = None  # when set, other keys get HTTP 401
    requests_seen: list[dict[str, Any]] | None = None  # each request's path, headers and JSON body

    def __post_init__(self) -> None:
        assert self.mode in MODES, self.mode
        assert self.tokens_per_chunk >= 1


def _token(i: int) -> str:
    return f"tok{i} "


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _StubServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    @property
    def options(self) -> StubOptions:
        return self.server.options

    def _record(self, body: Any) -> None:
        if self.options.requests_seen is not None:
            self.options.requests_seen.append({"path": self.path, "headers": dict(self.headers), "body": body})

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _send_error(self, status: int, message: str, kind: str) -> None:
        self._send(status, json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode())

    def _authorized(self) -> bool:
        if self.options.api_key and self.headers.get("Authorization") != f"Bearer {self.options.api_key}":
            self._send_error(401, "Invalid API Key", "authentication_error")
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._record(None)
        if self.path != "/v1/models":
            self._send_error(404, f"no route {self.path}", "not_found_error")
        elif self.options.mode == "html_models":
            self._send(200, b"<!DOCTYPE html><html><body><h1>Welcome to nginx!</h1></body></html>", "text/html")
        elif self._authorized():
            data = [] if self.options.mode == "empty_models" else [
                {"id": self.options.model, "object": "model", "owned_by": "stub"},
                {"id": "other-model", "object": "model", "owned_by": "stub"}]
            self._send(200, json.dumps({"object": "list", "data": data}).encode())

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length", "0"))
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            request = None
        self._record(request)
        if self.path != "/v1/chat/completions":
            self._send_error(404, f"no route {self.path}", "not_found_error")
        elif not isinstance(request, dict):
            self._send_error(400, "the body is not a JSON object", "invalid_request_error")
        elif not self._authorized():
            pass
        elif self.options.mode == "error_500":
            self._send_error(500, SERVER_ERROR, "server_error")
        else:
            self._stream(request)

    # streaming

    def _write_chunk(self, payload: bytes) -> None:
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")

    def _event(self, obj: Any) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj)
        self._write_chunk(f"data: {text}\n\n".encode())

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.options.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    def _timings(self, n: int, seconds: float) -> dict[str, Any]:
        extra = self.options.timings or {}
        cache_n = int(extra.get("cache_n", 0))
        prompt_n = self.options.prompt_tokens - cache_n
        predicted_ms = seconds * 1000
        timings = {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 1.0, "prompt_per_token_ms": 1.0 / prompt_n,
                   "prompt_per_second": prompt_n * 1000.0, "predicted_n": n, "predicted_ms": predicted_ms,
                   "predicted_per_token_ms": predicted_ms / max(n, 1),
                   "predicted_per_second": n * 1000 / predicted_ms if predicted_ms > 0 else 0.0}
        return timings | extra

    def _stream(self, request: dict[str, Any]) -> None:
        opts = self.options
        max_tokens = int(request.get("max_tokens") or opts.tokens)
        n = 0 if opts.mode == "zero_tokens" else min(opts.tokens, max_tokens)
        finish = "length" if opts.tokens >= max_tokens else "stop"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        started = time.perf_counter()
        self._event(self._chunk({"role": "assistant", "content": None}))
        time.sleep(opts.first_token_delay)
        for first in range(0, n, opts.tokens_per_chunk):
            ids = range(first, min(first + opts.tokens_per_chunk, n))
            if first > 0:
                time.sleep(opts.token_delay * len(ids))
            if opts.mode in ("cut", "drop", "error_in_stream", "malformed") and first >= n // 2:
                return self._fail_mid_stream()
            reasoning = "".join(_token(i) for i in ids if i < opts.reasoning_tokens)
            content = "".join(_token(i) for i in ids if i >= opts.reasoning_tokens)
            delta = ({"reasoning_content": reasoning} if reasoning else {}) | ({"content": content} if content else {})
            self._event(self._chunk(delta))
        last = self._chunk({}, finish)
        wants_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        if opts.usage and wants_usage:
            self._event(last)
            last = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": opts.model, "choices": [],
                    "usage": {"prompt_tokens": opts.prompt_tokens, "completion_tokens": n,
                              "total_tokens": opts.prompt_tokens + n}}
        if opts.timings is not None:
            last["timings"] = self._timings(n, time.perf_counter() - started)
        self._event(last)
        self._event("[DONE]")
        self._write_chunk(b"")  # the terminating zero-length chunk

    def _fail_mid_stream(self) -> None:
        mode = self.options.mode
        if mode == "drop":  # the connection dies inside the chunked body
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "error_in_stream":
            self._event({"error": {"code": 500, "message": STREAM_ERROR, "type": "server_error"}})
            self._event("[DONE]")
        elif mode == "malformed":
            self._event('{"choices": [{"delta": {"content": "tok')
            self._event("[DONE]")
        self._write_chunk(b"")  # "cut": the body ends cleanly but without [DONE]


class _StubServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # do not wait for a stream a test has given up on

    def __init__(self, options: StubOptions) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.options = options

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up mid-stream is expected in failure tests


@contextmanager
def running_stub(**options: Any) -> Iterator[str]:
    """Serve a stub with these StubOptions on a free port of 127.0.0.1; yield its base URL."""
    server = _StubServer(StubOptions(**options))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def closed_port_url() -> str:
    """The URL of a port on 127.0.0.1 that nothing listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"

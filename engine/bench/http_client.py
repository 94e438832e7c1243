"""Measure any OpenAI-compatible server (ours, llama.cpp, vLLM) through streaming chat completions.

Only the standard library talks HTTP here (``http.client``), so ``bonsai bench --url`` needs nothing
the runtime does not already have. Every request is bounded by one ``timeout``: connecting, waiting
for the first token and reading the whole stream all count against it.
"""
from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urlsplit

from engine.bench.records import PromptResult, SuitePrompt, mean_std, percentile
from engine.errors import BonsaiError

MAX_LINE_BYTES = 1 << 20  # one SSE line; a longer one means the server is not streaming events
MAX_BODY_BYTES = 1 << 20  # a /v1/models list or an error body


@dataclass(frozen=True)
class _Endpoint:
    url: str  # as shown in messages, without a trailing slash
    https: bool
    host: str
    port: int
    prefix: str  # path in front of /v1 (a reverse proxy may mount the server under one)

    def path(self, api_path: str) -> str:
        return self.prefix + api_path

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


def _endpoint(url: str) -> _Endpoint:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BonsaiError(f"server URL {url!r} is not an http(s) URL; give one like http://127.0.0.1:8080")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise BonsaiError(f"server URL {url!r} has an invalid port; give one like http://127.0.0.1:8080") from None
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[: -len("/v1")]
    shown = f"{parts.scheme}://{parts.netloc}{prefix}"
    return _Endpoint(shown, parts.scheme == "https", parts.hostname, port, prefix)


def _headers(api_key: str | None, accept: str) -> dict[str, str]:
    headers = {"Accept": accept, "User-Agent": "bonsai-bench"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _reason(exc: BaseException, timeout: float) -> str:
    """Why a connection failed, in a few words."""
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({_one_line(str(exc))})"
    return _one_line(str(exc)) or type(exc).__name__


def _server_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, or the start of the body as text."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return _one_line(text) or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(error.get(key), str):
                    return _one_line(error[key])
        elif isinstance(error, str):
            return _one_line(error)
    return _one_line(text)


def _send(conn: Any, ep: Any, method: str, path: str, body: bytes | None, headers: dict[str, str], where: str,
          timeout: float) -> tuple[Any, Any]:
    """Send one request and read the status line: (response, socket), with one-line errors for a
    server that is down, hangs up, or does not speak HTTP."""
    try:
        conn.request(method, ep.path(path), body=body, headers=headers)
        sock = conn.sock  # getresponse() may hand the socket to the response and forget it
        return conn.getresponse(), sock
    except http.client.RemoteDisconnected:
        raise BonsaiError(f"{where} closed the connection without answering {method} {path}; is it an "
                          "OpenAI-compatible server, and is it still running?") from None
    except http.client.HTTPException as exc:
        raise BonsaiError(f"{where} is not an OpenAI-compatible server ({method} {path} got a reply that is "
                          f"not HTTP: {type(exc).__name__})") from None
    except OSError as exc:
        raise BonsaiError(f"cannot reach the server at {ep.url}: {_reason(exc, timeout)}; is it running?") from None


def probe_server(url: str, api_key: str | None, timeout: float) -> str:
    """GET {url}/v1/models and return the id of the first model it lists."""
    ep = _endpoint(url)
    conn = ep.connect(timeout)
    try:
        resp, _ = _send(conn, ep, "GET", "/v1/models", None, _headers(api_key, "application/json"), ep.url, timeout)
        try:
            body = resp.read(MAX_BODY_BYTES)
        except OSError as exc:
            raise BonsaiError(f"cannot reach the server at {ep.url}: {_reason(exc, timeout)}; is it running?") from None
    finally:
        conn.close()
    if resp.status in (401, 403):
        raise BonsaiError(f"the server at {ep.url} refused the request (GET /v1/models returned HTTP {resp.status}: "
                          f"{_server_message(body)}); pass the right API key")
    if not 200 <= resp.status < 300:
        raise BonsaiError(f"{ep.url} is not an OpenAI-compatible server (GET /v1/models returned HTTP {resp.status}: "
                          f"{_server_message(body)})")
    try:
        listing = json.loads(body.decode("utf-8", errors="replace"))
    except ValueError:
        kind = resp.getheader("Content-Type", "a body").split(";")[0]
        raise BonsaiError(f"{ep.url} is not an OpenAI-compatible server (GET /v1/models returned {kind} that is not "
                          f"JSON: {_one_line(body.decode('utf-8', errors='replace'), 60)})") from None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise BonsaiError(f"{ep.url} is not an OpenAI-compatible server (GET /v1/models returned JSON without a "
                          f"'data' list of models with ids: {_one_line(json.dumps(listing), 60)})")
    if not models:
        raise BonsaiError(f"the server at {ep.url} lists no models (GET /v1/models returned an empty list); "
                          f"load a model into it and retry")
    return models[0]["id"]


@dataclass
class _Stream:
    """What one streamed chat completion has told us so far."""
    url: str
    prompt_id: str
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carries text
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None

    @property
    def where(self) -> str:
        return f"the server at {self.url} (prompt {self.prompt_id})"

    def add(self, when: float, data: str) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            raise BonsaiError(f"{self.where} sent a malformed stream event (not JSON: {_one_line(data, 60)}); "
                              f"is it an OpenAI-compatible server?") from None
        if not isinstance(event, dict):
            raise BonsaiError(f"{self.where} sent a stream event that is not a JSON object: {_one_line(data, 60)}")
        if event.get("error"):
            raise BonsaiError(f"{self.where} reported an error mid-stream: {_server_message(data.encode())}")
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        if isinstance(event.get("timings"), dict):
            self.timings = event["timings"]
        choices = event.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise BonsaiError(f"{self.where} sent a stream event whose 'choices' is not a list of objects: "
                              f"{_one_line(data, 60)}")
        for choice in choices[:1]:  # we ask for one completion
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            piece = "".join(delta[key] for key in ("reasoning_content", "reasoning", "content")
                            if isinstance(delta.get(key), str))
            if piece:
                self.chunk_times.append(when)
                self.pieces.append(piece)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    def _timing(self, key: str) -> int | None:
        value = (self.timings or {}).get(key)
        return int(value) if isinstance(value, (int, float)) else None

    def result(self, prompt: SuitePrompt, start: float, end: float) -> PromptResult:
        if not self.chunk_times:
            raise BonsaiError(f"the server at {self.url} generated no tokens for prompt {prompt.id} "
                              f"(finish_reason={self.finish_reason}); check the model and max_tokens")
        usage = self.usage or {}
        generated = usage.get("completion_tokens")
        if not isinstance(generated, int):
            generated = self._timing("predicted_n") or len(self.chunk_times)
        cache_n = self._timing("cache_n")
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(prompt_tokens, int):
            prompt_tokens = (self._timing("prompt_n") or 0) + (cache_n or 0)
        details = usage.get("prompt_tokens_details")
        cached = cache_n if cache_n is not None else (
            details.get("cached_tokens") if isinstance(details, dict) else None)
        first, last = self.chunk_times[0], self.chunk_times[-1]
        decode_tps = (generated - 1) / (last - first) if generated > 1 and last > first else 0.0
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        return PromptResult(
            prompt_id=prompt.id, category=prompt.category, prompt_tokens=prompt_tokens, generated_tokens=generated,
            ttft_seconds=first - start, decode_tokens_per_second=decode_tps, total_seconds=end - start,
            finish_reason=self.finish_reason or "unknown", cached_tokens=int(cached or 0),
            inter_token_seconds=gaps, server_timings=self.timings, output_text="".join(self.pieces),
            drafted=self._timing("draft_n"), accepted=self._timing("draft_n_accepted"))


def _sse_data(resp: http.client.HTTPResponse, sock: socket.socket | None, deadline: float,
              where: str) -> Iterator[tuple[float, str]]:
    """Yield (arrival time, data) for each server-sent event until the body ends or the deadline passes."""
    lines: list[str] = []
    arrived = 0.0
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise TimeoutError
        if sock is not None:
            sock.settimeout(remaining)
        raw = resp.readline(MAX_LINE_BYTES + 1)
        now = time.perf_counter()
        if not raw:
            if lines:
                yield arrived, "\n".join(lines)
            return
        if len(raw) > MAX_LINE_BYTES:
            raise BonsaiError(f"{where} sent a stream line longer than {MAX_LINE_BYTES} bytes; "
                              f"is it an OpenAI-compatible server?")
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:  # a blank line ends an event
            if lines:
                yield arrived, "\n".join(lines)
                lines = []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            if not lines:
                arrived = now
            lines.append(value)
        elif name == "error":  # llama.cpp reports some failures as an `error:` line
            raise BonsaiError(f"{where} reported an error mid-stream: {_server_message(value.encode())}")
        # comments (":" keep-alives), event:, id: and retry: lines carry nothing we measure


def stream_chat(url: str, model: str, prompt: SuitePrompt, api_key: str | None, timeout: float,
                temperature: float = 0.0, seed: int | None = None, extra: dict[str, Any] | None = None) -> PromptResult:
    """Run one prompt as a streaming chat completion and measure it (extra: more fields of the request body).

    TTFT runs from just before the request is sent (connecting included) to the first chunk that
    carries text (content or reasoning). Inter-token latencies are the gaps between such chunks.
    Token counts come from the usage chunk, else llama.cpp's ``timings``, else the chunk count.
    """
    ep = _endpoint(url)
    payload: dict[str, Any] = {"model": model, "messages": prompt.messages, "max_tokens": prompt.max_tokens,
                               "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        payload["seed"] = seed
    body = json.dumps({**payload, **(extra or {})}).encode()
    headers = _headers(api_key, "text/event-stream") | {"Content-Type": "application/json"}
    stream = _Stream(ep.url, prompt.id)
    where = stream.where
    conn = ep.connect(timeout)
    start = time.perf_counter()
    try:
        resp, sock = _send(conn, ep, "POST", "/v1/chat/completions", body, headers, where, timeout)
        if not 200 <= resp.status < 300:
            message = _server_message(resp.read(MAX_BODY_BYTES))
            fix = "; pass the right API key" if resp.status in (401, 403) else ""
            raise BonsaiError(f"{where} answered HTTP {resp.status}: {message}{fix}")
        done = False
        try:
            for when, data in _sse_data(resp, sock, start + timeout, where):
                if data.strip() == "[DONE]":
                    done = True
                    break
                stream.add(when, data)
        except (socket.timeout, TimeoutError):
            raise BonsaiError(f"{where} did not finish within {timeout:g} s ({len(stream.chunk_times)} chunks "
                              f"so far); raise the timeout or lower max_tokens") from None
        except http.client.HTTPException:
            done = False  # a chunked body cut short: reported below like any stream without [DONE]
        except OSError as exc:
            raise BonsaiError(f"{where}: the connection broke after {len(stream.chunk_times)} chunks "
                              f"({_reason(exc, timeout)}); is the server still running?") from None
        end = time.perf_counter()
    finally:
        conn.close()
    if not done:
        raise BonsaiError(f"{where}: the stream ended before [DONE] after {len(stream.chunk_times)} chunks; "
                          f"the server may have crashed or cut the connection")
    return stream.result(prompt, start, end)


def run_concurrency(url: str, model: str, prompts: list[SuitePrompt], concurrency: int, api_key: str | None,
                    timeout: float, temperature: float = 0.0, seed: int | None = None,
                    extra: dict[str, Any] | None = None) -> tuple[list[PromptResult], float]:
    """Run every prompt with ``concurrency`` requests in flight; return results (in prompt order) and wall seconds.

    The first failing request's BonsaiError is raised; requests not yet started are cancelled.
    """
    if concurrency < 1:
        raise BonsaiError(f"concurrency must be at least 1, got {concurrency}")
    if not prompts:
        raise BonsaiError("no prompts to run against the server; the suite is empty")
    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(prompts)), thread_name_prefix="bonsai-bench")
    try:
        start = time.perf_counter()
        futures = [pool.submit(stream_chat, url, model, p, api_key, timeout, temperature, seed, extra) for p in prompts]
        wait(futures, return_when=FIRST_EXCEPTION)  # every request is bounded by its own timeout
        wall = time.perf_counter() - start
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [f.result() for f in futures], wall
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def aggregate_summary(results: list[PromptResult], wall_seconds: float) -> dict[str, float | int]:
    """Serving-style summary of one concurrency level: throughput, TTFT, ITL and per-request decode speed."""
    ttft_ms = [r.ttft_seconds * 1000 for r in results]
    itl_ms = [gap * 1000 for r in results for gap in r.inter_token_seconds]
    tpot_ms = [(r.total_seconds - r.ttft_seconds) * 1000 / (r.generated_tokens - 1)
               for r in results if r.generated_tokens > 1]
    decode_mean, decode_std = mean_std([r.decode_tokens_per_second for r in results if r.decode_tokens_per_second > 0])
    generated = sum(r.generated_tokens for r in results)
    drafted = sum(r.drafted or 0 for r in results)
    accepted = sum(r.accepted or 0 for r in results)
    return {
        "requests": len(results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "generated_tokens": generated,
        "wall_seconds": wall_seconds,
        "aggregate_tokens_per_second": generated / wall_seconds if wall_seconds > 0 else 0.0,
        "requests_per_second": len(results) / wall_seconds if wall_seconds > 0 else 0.0,
        "ttft_ms_mean": mean_std(ttft_ms)[0],
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p90": percentile(ttft_ms, 90),
        "ttft_ms_p99": percentile(ttft_ms, 99),
        "itl_ms_p50": percentile(itl_ms, 50),
        "itl_ms_p90": percentile(itl_ms, 90),
        "itl_ms_p99": percentile(itl_ms, 99),
        "tpot_ms_mean": mean_std(tpot_ms)[0],
        "decode_tps_mean": decode_mean,
        "decode_tps_std": decode_std,
        # speculative decoding on the server (timings.draft_n / draft_n_accepted; 0 without drafting)
        "draft_tokens": drafted,
        "draft_tokens_accepted": accepted,
        "draft_acceptance": accepted / drafted if drafted else 0.0,
    }

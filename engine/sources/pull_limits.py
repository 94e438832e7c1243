"""The network limits of `bonsai pull`: a connect timeout, a read timeout (the longest silence
between two bytes) and an overall deadline, so a stalled network (a proxy that accepts and never
answers, SYNs dropped, a server that trickles) ends the pull with one line saying what timed out.

The Hugging Face hub client passes `timeout=None` on some requests (repo_info: a pull that never
ends behind a silent proxy), so the timeouts are set on every request it sends, by an event hook
of the HTTP client installed for the pull; the deadline is checked before each request and at
each chunk of every response. Settings, in seconds: BONSAI_PULL_CONNECT_TIMEOUT (default 10),
BONSAI_PULL_READ_TIMEOUT (30), BONSAI_PULL_TIMEOUT (the deadline, 7200).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from functools import lru_cache
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from engine.errors import BonsaiError

SETTINGS = {"connect_s": ("BONSAI_PULL_CONNECT_TIMEOUT", 10.0), "read_s": ("BONSAI_PULL_READ_TIMEOUT", 30.0),
            "total_s": ("BONSAI_PULL_TIMEOUT", 7200.0)}


@dataclass(frozen=True)
class PullLimits:
    connect_s: float = 10.0
    read_s: float = 30.0
    total_s: float = 7200.0

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> "PullLimits":
        values = {}
        for field, (name, default) in SETTINGS.items():
            text = env.get(name)
            try:
                value = default if text in (None, "") else float(text)
            except ValueError:
                value = -1.0
            if not 0 < value < 1e7:
                raise BonsaiError(f"{name}={text!r} is not a number of seconds above 0")
            values[field] = value
        return PullLimits(**values)


class PullDeadline(Exception):
    """The pull passed its overall deadline (raised inside the HTTP client: never retried)."""


class PullWatch:
    """One pull's limits applied to each request and response of the hub's HTTP client."""

    def __init__(self, limits: PullLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.total_s

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise PullDeadline(f"past the {self.limits.total_s:g} s deadline")

    def on_request(self, request: Any) -> None:
        self.check()
        read = self.limits.read_s
        request.extensions["timeout"] = {"connect": self.limits.connect_s, "read": read, "write": read,
                                         "pool": self.limits.connect_s}

    def on_response(self, response: Any) -> None:
        response.stream = deadline_stream_type(type(response).__module__)(response.stream, self)


def http_module(name: str):
    """The HTTP client package a response type belongs to (httpx2 for huggingface_hub >= 2, httpx before)."""
    import importlib
    return importlib.import_module(name.split(".")[0])


@lru_cache(maxsize=None)
def deadline_stream_type(module_name: str) -> type:
    """A response body that stops at the deadline, however steadily it trickles in: a SyncByteStream of the
    client's own package (the client checks that type), made once per package."""
    http = http_module(module_name)

    def __init__(self, stream: Any, watch: PullWatch) -> None:
        self.stream, self.watch = stream, watch

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.stream:
            self.watch.check()
            yield chunk

    def close(self) -> None:
        self.stream.close()
    return type("DeadlineStream", (http.SyncByteStream,), {"__init__": __init__, "__iter__": __iter__, "close": close})


@contextmanager
def hub_limits(limits: PullLimits) -> Iterator[PullWatch]:
    """huggingface_hub's shared HTTP client, for the duration: its default one with the watch's hooks."""
    from huggingface_hub.utils import _http
    watch = PullWatch(limits)
    if not hasattr(_http, "set_client_factory"):  # a hub before its httpx client (< 1.0): its own timeouts only
        yield watch
        return

    def client():
        c = _http.default_client_factory()
        c.event_hooks["request"].append(watch.on_request)
        c.event_hooks["response"].append(watch.on_response)
        return c

    _http.set_client_factory(client)
    try:
        yield watch
    finally:
        _http.set_client_factory(_http.default_client_factory)


def timeout_in(error: BaseException) -> tuple[str, str] | None:
    """(what timed out: 'connect' | 'read' | 'deadline', host:port) if a timeout or the deadline
    caused `error` (anywhere in its chain: the hub wraps what it retried)."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PullDeadline):
            return "deadline", "the hub"
        name = type(e).__name__
        if name in ("ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout"):
            kind = "connect" if name in ("ConnectTimeout", "PoolTimeout") else "read"
            try:
                url = e.request.url  # httpx errors carry their request
                where = f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
            except (AttributeError, RuntimeError):
                where = "the hub"
            return kind, where
        e = e.__cause__ or e.__context__
    return None


def timeout_message(cause: tuple[str, str], limits: PullLimits, what: str, again: str) -> str:
    """The one line of a pull that timed out: what timed out, after how long, the setting, how to retry."""
    kind, where = cause
    if kind == "deadline":
        return (f"the download of {what} did not finish within {limits.total_s:g} s ({SETTINGS['total_s'][0]}): "
                f"check the network (or raise it), then {again}")
    if kind == "connect":
        return (f"could not connect to {where} within {limits.connect_s:g} s ({SETTINGS['connect_s'][0]}): check the "
                f"network or proxy, then {again}")
    return (f"{where} accepted the connection but sent nothing for {limits.read_s:g} s ({SETTINGS['read_s'][0]}): "
            f"the network or a proxy is stalled; {again}")

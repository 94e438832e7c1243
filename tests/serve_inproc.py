"""The server's app in this process, over a tiny random model with SmolLM2's tokenizer and chat
template: requests go through httpx's ASGI transport (no socket, no subprocess), so the edge's
tests cost milliseconds per request."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx

from engine.runtime.runner import ModelRunner
from engine.server.api import ServerState, create_app
from engine.server.config import ServeConfig
from engine.decoding.engine import Engine
from engine.server.engine_thread import Served
from tests.engine_runs import Threaded


def tiny_server(loaded, tokenizer, slots: int = 2, context: int = 96, **server: Any) -> tuple[Any, Threaded]:
    """(the FastAPI app, its started engine); `server`: keys of the config's server section."""
    config = ServeConfig.from_dict({"model": {"path": "tiny", "max_context": context},
                                    "runtime": {"max_batch_size": slots},
                                    "server": {"default_max_tokens": 4, **server}})
    runner = ModelRunner(loaded, max_seq_len=context, num_slots=slots, prefill_chunk_size=32)
    engine = Threaded(Engine(runner, tokenizer, context, config.server.max_queue))
    state = ServerState(config, served=Served(engine.engine, engine.thread, "tiny", config))
    return create_app(state), engine


def call(app, requests: list[tuple[str, str, Any]], timeout: float = 120) -> list[httpx.Response]:
    """Each (method, path, body) in turn; a body of bytes or str is sent as it is, else as JSON."""
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny",
                                     timeout=timeout) as client:
            out = []
            for method, path, body in requests:
                kw = {} if body is None else ({"content": body} if isinstance(body, (bytes, str)) else {"json": body})
                out.append(await client.request(method, path, **kw))
            return out
    return asyncio.run(asyncio.wait_for(run(), timeout))

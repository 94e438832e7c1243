"""The HTTP side: FastAPI routes of the OpenAI API, /health, /metrics, /slots.

The model loads in a background thread after the server starts listening; until it is ready every
route but /health answers 503 and /health reports the stage. Requests are validated strictly
(protocol.py), turned into prompt ids, and handed to the engine loop; its events come back through
an asyncio queue per request (relay.py: one loop wake-up for all the events of a decode step). A
client that disconnects cancels its request, which frees the slot at the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import threading
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.decoding.metrics import Metrics
from engine.decoding.prompts import chat_prompt, completion_prompt
from engine.decoding.scheduler import QueueFull
from engine.decoding.sequence import Delta, Failed, Finished
from engine.decoding.sequence import Request as Job
from engine.errors import BonsaiError, ServiceUnavailable
from engine.server import protocol as P
from engine.server.config import ServeConfig
from engine.server.engine_thread import Served
from engine.server.relay import EventRelay
from engine.server.sse import DONE, ChunkLines, sse

log = logging.getLogger("bonsai.server")


@dataclass
class ServerState:
    config: ServeConfig
    metrics: Metrics = field(default_factory=Metrics)
    stage: str = "starting"
    progress: float = 0.0
    served: Served | None = None
    load_error: str | None = None
    on_load_error: Callable[[str], None] = lambda message: None

    def load(self, loader: Callable[..., Served]) -> None:
        def progress(stage: str, fraction: float) -> None:
            self.stage, self.progress = stage, fraction
            log.info("loading: %s", stage)
        try:
            self.served = loader(self.config, self.metrics, progress)
        except BaseException as e:  # noqa: BLE001 - reported to the command, which exits 1
            self.load_error = str(e).splitlines()[0] if isinstance(e, BonsaiError) else f"{type(e).__name__}: {e}"
            log.error("loading failed: %s", self.load_error)
            self.on_load_error(self.load_error)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: Any = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, kind, param, code), status_code=status, headers=headers)


def _from_exception(e: BonsaiError) -> JSONResponse:
    if isinstance(e, P.RequestError):
        return _error(e.status, str(e), e.kind, e.param, e.code, e.headers)
    if isinstance(e, ServiceUnavailable):
        return _error(503, str(e), "unavailable_error", code=503)
    return _error(400, str(e))


def create_app(state: ServerState, loader: Callable[..., Served] | None = None) -> FastAPI:
    cfg = state.config
    key = cfg.server.api_key

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if loader is not None:
            threading.Thread(target=state.load, args=(loader,), name="bonsai-load", daemon=True).start()
        yield
        if state.served is not None:  # shutdown: running requests end with a 503 event, the engine stops
            await asyncio.get_running_loop().run_in_executor(None, state.served.stop)

    app = FastAPI(title="bonsai", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    relays: dict[asyncio.AbstractEventLoop, EventRelay] = {}  # the server's loop → its relay

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if path != "/health":
            if key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                    return _error(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                                  "authentication_error", code="invalid_api_key")
            if state.served is None:
                return _loading_response(state)
        try:
            return await call_next(request)
        except Exception as e:  # noqa: BLE001 - one failing request never takes the server down
            log.exception("request %s failed", path)
            return _error(500, f"internal error: {type(e).__name__}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.get("/health")
    async def health():
        if state.served is None:
            return _loading_response(state)
        if not state.served.alive:  # stopped by a failure, or shutting down: truthfully not serving
            return _error(503, state.served.engine.failure or "the server is shutting down", "unavailable_error",
                          code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        served = state.served
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                             "owned_by": "bonsai", "meta": {"n_ctx_slot": served.engine.slot_context,
                                                                            "slots": len(served.engine.runner.cache.slots)}}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/slots")
    async def slots():
        return state.served.engine.slots()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, chat=False)

    async def _complete(request: Request, chat: bool) -> Response:
        served = state.served
        try:
            body = await _read_json(request, cfg.server.max_body_bytes)
            req = P.parse(P.ChatRequest if chat else P.CompletionRequest, body)
            req.check_size(cfg.server.max_messages, cfg.server.max_prompt_chars)
            loop = asyncio.get_running_loop()
            job = await loop.run_in_executor(None, _make_job, served, req, chat)  # template + tokenizer off the loop
            queue: asyncio.Queue = asyncio.Queue()
            relay = relays.get(loop) or relays.setdefault(loop, EventRelay(loop))
            job.emit = functools.partial(relay.post, queue)
            served.engine.submit(job)
        except QueueFull as e:
            state.metrics.count_request("rejected_busy")
            return _error(503, str(e), "unavailable_error", headers={"Retry-After": str(e.retry_after)})
        except BonsaiError as e:
            return _from_exception(e)
        log.info("request %s: %d prompt tokens, max_tokens %d, stream %s%s", job.id, len(job.prompt_ids),
                 job.max_tokens, req.stream, f", user {ascii(req.user)}" if req.user else "")
        meta = (job.id, served.model_id, P.now())
        if req.stream:
            return StreamingResponse(_stream(served, job, queue, meta, chat, req.include_usage()),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(served, request, job, queue, meta, chat)

    return app


def _loading_response(state: ServerState) -> JSONResponse:
    if state.load_error:
        return _error(500, f"the model failed to load: {state.load_error}", "server_error")
    body = P.error_body("Loading model", "unavailable_error", code=503)
    body["error"]["code"] = 503
    body["progress"], body["stage"] = round(state.progress, 3), state.stage
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise P.RequestError(f"the request body has {length} bytes, more than the {limit} allowed", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.RequestError(f"the request body is larger than the {limit} bytes allowed", status=413)
        chunks.append(chunk)
    return P.decode_body(b"".join(chunks))


def _make_job(served: Served, req: Any, chat: bool) -> Job:
    cfg, engine = served.config, served.engine
    tokenizer = engine.tokenizer
    context = engine.slot_context
    if chat:
        prompt = chat_prompt(tokenizer, [m.as_dict() for m in req.messages], context, cfg.context.compress_at,
                             cfg.thinking.start_tag)
        top = req.top_logprobs_wanted()
        budget = req.thinking_budget if req.thinking_budget is not None else cfg.thinking.budget
    else:
        prompt = completion_prompt(tokenizer, req.prompt_input())
        top, budget = req.logprobs, None
    limit = cfg.server.max_prompt_tokens or context - 1
    if len(prompt.ids) > limit or len(prompt.ids) >= context:
        raise P.RequestError(f"the prompt has {len(prompt.ids)} tokens, more than the {min(limit, context - 1)} "
                             "this server accepts; shorten it", "messages" if chat else "prompt",
                             code="context_length_exceeded")
    max_tokens = req.token_limit() or cfg.server.default_max_tokens
    return Job(prompt.ids, max_tokens=max_tokens, sampling=req.sampling(), stop=req.stops(),
               thinking_budget=budget, thinking_at_start=prompt.thinking_at_start, split_reasoning=chat,
               top_logprobs=top, id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24])


async def _next_event(served: Served, queue: asyncio.Queue) -> Any:
    """The request's next engine event, or None after half a second without one; a Failed (503)
    when the engine is no longer alive, so no request ever waits on a stopped engine."""
    try:
        return await asyncio.wait_for(queue.get(), timeout=0.5)
    except asyncio.TimeoutError:
        if not served.alive and queue.empty():
            return Failed(served.engine.failure or "the server is shutting down", 503)
        return None


async def _stream(served: Served, job: Job, queue: asyncio.Queue, meta: tuple, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    rid, model, created = meta
    lines = ChunkLines(rid, model, created, chat)  # a token's chunk: only its text is encoded
    try:
        if chat:
            yield sse(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        while True:
            event = await _next_event(served, queue)
            if event is None:
                continue
            if isinstance(event, Delta):
                if not (event.reasoning or event.content or event.logprobs):
                    continue  # a token that completed no text yet
                if chat:
                    delta = {k: v for k, v in (("reasoning_content", event.reasoning), ("content", event.content)) if v}
                    yield (sse(P.chat_chunk(rid, model, created, delta, logprobs=event.logprobs))
                           if event.logprobs else lines.delta(delta))
                else:
                    text = event.reasoning + event.content
                    yield (sse(P.text_chunk(rid, model, created, text, logprobs=event.logprobs))
                           if event.logprobs else lines.text(text))
            elif isinstance(event, Finished):
                last = (P.chat_chunk(rid, model, created, {}, event.reason) if chat
                        else P.text_chunk(rid, model, created, "", event.reason))
                last["timings"] = event.timings
                yield sse(last)
                if include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield sse(P.usage_chunk(rid, model, created, obj, event.usage))
                yield DONE
                return
            elif isinstance(event, Failed):
                kind = "unavailable_error" if event.status == 503 else "server_error"
                yield sse(P.error_body(event.message, kind, code=event.status))
                return
    finally:
        served.engine.cancel(job)  # a no-op when it finished; frees the slot when the client left


async def _collect(served: Served, request: Request, job: Job, queue: asyncio.Queue, meta: tuple,
                   chat: bool) -> Response:
    rid, model, created = meta
    reasoning, content, logprobs = [], [], []
    try:
        while True:
            event = await _next_event(served, queue)
            if event is None:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if isinstance(event, Delta):
                reasoning.append(event.reasoning)
                content.append(event.content)
                logprobs += event.logprobs
            elif isinstance(event, Failed):
                kind = "unavailable_error" if event.status == 503 else "server_error"
                return _error(event.status, event.message, kind)
            elif isinstance(event, Finished):
                break
    finally:
        served.engine.cancel(job)
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if any(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        choice = {"index": 0, "message": message, "logprobs": {"content": logprobs} if job.top_logprobs is not None
                  else None, "finish_reason": event.reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": "".join(reasoning) + "".join(content),
                  "logprobs": P.legacy_logprobs(logprobs) if job.top_logprobs is not None else None,
                  "finish_reason": event.reason}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                         "usage": event.usage, "timings": event.timings})

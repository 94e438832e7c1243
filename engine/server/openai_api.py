"""OpenAI's /v1/chat/completions and /v1/completions: tools, n choices, echo, logprobs, streaming."""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.decoding.prompts import completion_prompt
from engine.decoding.scheduler import QueueFull
from engine.decoding.sequence import Failed
from engine.decoding.sequence import Request as Job
from engine.errors import BonsaiError
from engine.server import protocol as P
from engine.server.engine_thread import Served
from engine.server.grammar_map import chat_grammar
from engine.server.protocol_body import EFFORT_BUDGET
from engine.server.serving import (ChatJob, End, Generation, Piece, busy, check_prompt_length, error, from_exception,
                                   make_chat_jobs, read_json, tool_family, total_usage)
from engine.server.sse import DONE, ChunkLines, sse

log = logging.getLogger("bonsai.server")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def add_routes(app: FastAPI, state: Any, relays: dict) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(state, relays, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(state, relays, request, chat=False)


async def _complete(state: Any, relays: dict, request: Request, chat: bool) -> Response:
    served, cfg = state.served, state.config
    try:
        body = await read_json(request, cfg.server.max_body_bytes)
        req = P.parse(P.ChatRequest if chat else P.CompletionRequest, body)
        req.check_size(cfg.server.max_messages, cfg.server.max_prompt_chars)
        family = tool_family(served, req.template_tools()) if chat else None
        loop = asyncio.get_running_loop()
        jobs, echo = await loop.run_in_executor(None, _make_jobs, served, req, chat, family)  # template + tokenizer
        gen = Generation(served, jobs, relays, family, req.tool_schemas() if chat else None)
        gen.submit()
    except QueueFull as e:
        return busy(state, e)
    except BonsaiError as e:
        return from_exception(e)
    job = jobs[0]
    log.info("request %s: %d prompt tokens, max_tokens %d, n %d, stream %s%s%s", job.id, len(job.prompt_ids),
             job.max_tokens, len(jobs), req.stream, f", {len(req.tools)} tools" if chat and req.tools else "",
             f", user {ascii(req.user)}" if req.user else "")
    meta = (job.id, served.model_id, P.now())
    if req.stream:
        return StreamingResponse(_stream(gen, meta, chat, req.include_usage(), echo), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    return await _collect(gen, request, meta, chat, echo)


def _make_jobs(served: Served, req: Any, chat: bool, family: str | None) -> tuple[list[Job], str]:
    engine = served.engine
    vocab = engine.tokenizer.vocab_size
    sampling = [req.sampling(vocab, i) for i in range(req.n)]
    if chat:
        budget = req.thinking_budget
        if budget is None and req.reasoning_effort is not None:
            budget = EFFORT_BUDGET[req.reasoning_effort]
        spec = ChatJob([m.as_dict() for m in req.messages], req.token_limit(), sampling, req.stops(),
                       req.template_tools(), req.tool_schemas(), req.chat_template_kwargs, budget,
                       req.top_logprobs_wanted(), chat_grammar(req, engine.tokenizer, family),
                       draft_tokens=req.draft_tokens)
        return make_chat_jobs(served, spec), ""
    prompt_in = req.prompt_input()
    prompt = completion_prompt(engine.tokenizer, prompt_in)
    check_prompt_length(served, len(prompt.ids), "prompt")
    max_tokens = req.token_limit() or served.config.server.default_max_tokens
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    echo = (prompt_in if isinstance(prompt_in, str) else engine.tokenizer.decode(prompt.ids)) if req.echo else ""
    return [Job(prompt.ids, max_tokens=max_tokens, sampling=s, stop=req.stops(), split_reasoning=False,
                top_logprobs=req.logprobs, draft_tokens=req.draft_tokens, id=rid if i == 0 else f"{rid}-{i}")
            for i, s in enumerate(sampling)], echo


def call_delta(c) -> dict[str, Any]:
    """An OpenAI streamed tool-call piece: id, type and name first, then arguments."""
    out: dict[str, Any] = {"index": c.index}
    if c.name is not None:
        out.update(id=c.id, type="function", function={"name": c.name, "arguments": c.arguments})
    else:
        out["function"] = {"arguments": c.arguments}
    return out


async def _stream(gen: Generation, meta: tuple, chat: bool, include_usage: bool, echo: str) -> AsyncIterator[str]:
    rid, model, created = meta
    lines = ChunkLines(rid, model, created, chat)  # a token's chunk: only its text is encoded
    one = len(gen.jobs) == 1
    ends: list[End] = []
    try:
        for i in range(len(gen.jobs)):
            if chat:
                yield sse(_indexed(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}), i))
            elif echo:
                yield sse(_indexed(P.text_chunk(rid, model, created, echo), i))
        async for event in gen.events():
            if event is None:
                continue
            if isinstance(event, Piece):
                if not (event.reasoning or event.content or event.calls or event.logprobs):
                    continue  # a token that completed no text yet
                if chat:
                    delta: dict[str, Any] = {k: v for k, v in (("reasoning_content", event.reasoning),
                                                               ("content", event.content)) if v}
                    if event.calls:
                        delta["tool_calls"] = [call_delta(c) for c in event.calls]
                    if one and not event.logprobs and not event.calls:
                        yield lines.delta(delta)
                    else:
                        yield sse(_indexed(P.chat_chunk(rid, model, created, delta, logprobs=event.logprobs or None),
                                           event.choice))
                else:
                    text = event.reasoning + event.content
                    yield (lines.text(text) if one and not event.logprobs else
                           sse(_indexed(P.text_chunk(rid, model, created, text, logprobs=event.logprobs or None),
                                        event.choice)))
            elif isinstance(event, End):
                ends.append(event)
                last = (P.chat_chunk(rid, model, created, {}, event.reason) if chat
                        else P.text_chunk(rid, model, created, "", event.reason))
                last["timings"] = event.timings
                yield sse(_indexed(last, event.choice))
            elif isinstance(event, Failed):
                kind = "unavailable_error" if event.status == 503 else "server_error"
                yield sse(P.error_body(event.message, kind, code=event.status))
                return
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield sse(P.usage_chunk(rid, model, created, obj, total_usage(ends)))
        yield DONE
    finally:
        gen.cancel()


def _indexed(chunk: dict[str, Any], choice: int) -> dict[str, Any]:
    chunk["choices"][0]["index"] = choice
    return chunk


async def _collect(gen: Generation, request: Request, meta: tuple, chat: bool, echo: str) -> Response:
    rid, model, created = meta
    n = len(gen.jobs)
    reasoning, content = [[] for _ in range(n)], [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    calls: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]
    ends: dict[int, End] = {}
    try:
        async for event in gen.events(request):
            if isinstance(event, Piece):
                i = event.choice
                reasoning[i].append(event.reasoning)
                content[i].append(event.content)
                logprobs[i] += event.logprobs
                for c in event.calls:
                    if c.name is not None:
                        calls[i][c.index] = {"id": c.id, "type": "function",
                                             "function": {"name": c.name, "arguments": c.arguments}}
                    else:
                        calls[i][c.index]["function"]["arguments"] += c.arguments
            elif isinstance(event, Failed):
                kind = "unavailable_error" if event.status == 503 else "server_error"
                return error(event.status, event.message, kind)
            elif isinstance(event, End):
                ends[event.choice] = event
    finally:
        gen.cancel()
    if len(ends) < n:
        return Response(status_code=499)  # the client left
    want_logprobs = gen.jobs[0].top_logprobs is not None
    choices = []
    for i in range(n):
        if chat:
            text = "".join(content[i])
            message: dict[str, Any] = {"role": "assistant", "content": (text.strip() or None) if calls[i] else text}
            if any(reasoning[i]):
                message["reasoning_content"] = "".join(reasoning[i])
            if calls[i]:
                message["tool_calls"] = [calls[i][k] for k in sorted(calls[i])]
            choices.append({"index": i, "message": message, "logprobs": {"content": logprobs[i]} if want_logprobs
                            else None, "finish_reason": ends[i].reason})
        else:
            choices.append({"index": i, "text": echo + "".join(reasoning[i]) + "".join(content[i]),
                            "logprobs": P.legacy_logprobs(logprobs[i]) if want_logprobs else None,
                            "finish_reason": ends[i].reason})
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": total_usage([ends[i] for i in range(n)]),
                         "timings": ends[0].timings})

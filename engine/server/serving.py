"""What every API front end shares: errors, the body, the jobs of a chat, and their output events.

A request becomes one engine job per choice (`n`); `Generation` relays their events from the engine
thread (relay.py), passes each choice's answer text through its tool-call parser, and yields
`Piece`s (text, call pieces, logprobs) and one `End` per choice; the front ends (openai_api.py,
anthropic_api.py, responses_api.py) only shape them into their protocol.
"""
from __future__ import annotations

import asyncio
import functools
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.decoding.grammar import GrammarSpec
from engine.decoding.prompts import chat_prompt
from engine.decoding.sampling import SamplingParams
from engine.decoding.scheduler import QueueFull
from engine.decoding.sequence import Delta, Failed, Finished
from engine.decoding.sequence import Request as Job
from engine.errors import BonsaiError, ServiceUnavailable
from engine.server import protocol as P
from engine.server.engine_thread import Served
from engine.server.relay import EventRelay
from engine.server.tools import CallDelta, ToolCallParser, detect_family


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: Any = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, kind, param, code), status_code=status, headers=headers)


def from_exception(e: BonsaiError) -> JSONResponse:
    if isinstance(e, P.RequestError):
        return error(e.status, str(e), e.kind, e.param, e.code, e.headers)
    if isinstance(e, ServiceUnavailable):
        return error(503, str(e), "unavailable_error", code=503)
    return error(400, str(e))


async def read_json(request: Request, limit: int) -> Any:
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


@dataclass
class ChatJob:
    """A chat as the front ends describe it, in OpenAI's message shape."""
    messages: list[dict[str, Any]]
    max_tokens: int | None
    sampling: list[SamplingParams]  # one per choice
    stop: tuple[str, ...] = ()
    tools: list[dict[str, Any]] | None = None  # rendered by the template; None: no tools
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = None
    top_logprobs: int | None = None
    grammar: GrammarSpec | None = None  # the output's constraint (response_format, tool_choice)
    prefix: str = "chatcmpl-"
    draft_tokens: int | None = None  # speculative.n_max: the request's cap on drafted tokens a step


def tool_family(served: Served, tools: list | None) -> str | None:
    """The family of the model's tool calls; a 400 when tools are given and it has none we parse."""
    if not tools:
        return None
    family = detect_family(served.engine.tokenizer.chat_template)
    if family is None:
        raise P.RequestError("this model's chat template has no tool-call format this server can parse "
                             "(hermes <tool_call> JSON, Qwen3 XML, Llama 3 JSON); send the request without tools",
                             "tools")
    return family


def make_chat_jobs(served: Served, chat: ChatJob) -> list[Job]:
    """The engine jobs of a chat, one per choice (runs off the event loop: template and tokenizer)."""
    cfg, engine = served.config, served.engine
    context = engine.slot_context
    prompt = chat_prompt(engine.tokenizer, chat.messages, context, cfg.context.compress_at, cfg.thinking.start_tag,
                         chat.tools, chat.template_kwargs)
    check_prompt_length(served, len(prompt.ids), "messages")
    budget = chat.thinking_budget if chat.thinking_budget is not None else cfg.thinking.budget
    max_tokens = chat.max_tokens or cfg.server.default_max_tokens
    rid = chat.prefix + uuid.uuid4().hex[:24]
    grammar = chat.grammar
    if grammar is not None and prompt.thinking_at_start:
        grammar = grammar.with_reasoning(opened=True)  # the thought the prompt opened runs free, then the constraint
    return [Job(prompt.ids, max_tokens=max_tokens, sampling=s, stop=chat.stop, thinking_budget=budget,
                thinking_at_start=prompt.thinking_at_start, split_reasoning=True, top_logprobs=chat.top_logprobs,
                grammar=grammar, draft_tokens=chat.draft_tokens, id=rid if i == 0 else f"{rid}-{i}")
            for i, s in enumerate(chat.sampling)]


async def start_chat(served: Served, relays: dict, chat: ChatJob, family: str | None, param: str) -> "Generation":
    """A chat of the Anthropic or Responses front end, checked against the server's caps, submitted."""
    limits = served.config.server
    if len(chat.messages) > limits.max_messages:
        raise P.RequestError(f"the conversation has {len(chat.messages)} messages, more than the "
                             f"{limits.max_messages} this server takes (server.max_messages); send fewer", param)
    chars = sum(len(str(m.get("content") or "")) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
                for m in chat.messages)
    if chars > limits.max_prompt_chars:
        raise P.RequestError(f"the request has {chars} characters of {param}, more than the "
                             f"{limits.max_prompt_chars} this server takes (server.max_prompt_chars); send less", param)
    jobs = await asyncio.get_running_loop().run_in_executor(None, make_chat_jobs, served, chat)  # template, tokenizer
    gen = Generation(served, jobs, relays, family, chat.tool_schemas)
    gen.submit()
    return gen


async def open_chat(state: Any, relays: dict, request: Request, model: type, build: Callable[[Any, Served], tuple],
                    shape: Callable[[JSONResponse], JSONResponse] = lambda r: r) -> tuple[Any, "Generation"] | JSONResponse:
    """Read and parse the body of a chat of the Anthropic or Responses front end as `model`, make its job
    with `build(req, served) -> (ChatJob, tool family, the request's input field)` and submit it:
    (req, generation), or the error response (busy: 503; a bad request: 400) in the front end's `shape`."""
    served = state.served
    try:
        req = P.parse(model, await read_json(request, state.config.server.max_body_bytes))
        chat, family, param = build(req, served)
        return req, await start_chat(served, relays, chat, family, param)
    except QueueFull as e:
        return shape(busy(state, e))
    except BonsaiError as e:
        return shape(from_exception(e))


def busy(state: Any, e: QueueFull) -> JSONResponse:
    """503 for a full queue, counted, with the Retry-After the scheduler suggests."""
    state.metrics.count_request("rejected_busy")
    return error(503, str(e), "unavailable_error", headers={"Retry-After": str(e.retry_after)})


def check_prompt_length(served: Served, n: int, param: str) -> None:
    context = served.engine.slot_context
    limit = served.config.server.max_prompt_tokens or context - 1
    if n > limit or n >= context:
        raise P.RequestError(f"the prompt has {n} tokens, more than the {min(limit, context - 1)} "
                             "this server accepts; shorten it", param, code="context_length_exceeded")


@dataclass
class Piece:
    """A step of choice `choice`'s output: thought, answer text, tool-call pieces, logprobs."""
    choice: int
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class End:
    choice: int
    reason: str  # stop | length | tool_calls
    usage: dict[str, Any]
    timings: dict[str, Any]
    stop_sequence: str | None = None


class Generation:
    """The running jobs of one request and their events, tool calls parsed."""

    def __init__(self, served: Served, jobs: list[Job], relays: dict, family: str | None = None,
                 tool_schemas: dict[str, dict[str, Any]] | None = None, fence_fallback: bool = True):
        self.served, self.jobs = served, jobs
        self.parsers = [ToolCallParser(family, tool_schemas or {}, fence_fallback) if family else None for _ in jobs]
        loop = asyncio.get_running_loop()
        relay = relays.get(loop) or relays.setdefault(loop, EventRelay(loop))
        self.queue: asyncio.Queue = asyncio.Queue()
        for i, job in enumerate(jobs):
            job.emit = functools.partial(_tagged, relay, self.queue, i)

    def submit(self) -> None:
        for job in self.jobs:
            self.served.engine.submit(job)

    def cancel(self) -> None:
        for job in self.jobs:
            self.served.engine.cancel(job)  # a no-op when it finished; frees the slot when the client left

    async def events(self, request: Request | None = None) -> AsyncIterator[Piece | End | Failed | None]:
        """Pieces and Ends until every choice ended (a Failed ends all); None: a quiet half second
        (the caller may check its client), and after a disconnect seen by `request`, the end."""
        open_choices = set(range(len(self.jobs)))
        while open_choices:
            item = await self._next()
            if item is None:
                if request is not None and await request.is_disconnected():
                    return
                yield None
                continue
            i, event = item
            if isinstance(event, Failed):
                yield event
                return
            parser = self.parsers[i]
            if isinstance(event, Delta):
                piece = Piece(i, event.reasoning, logprobs=event.logprobs)
                for out in parser.push(event.content) if parser else [event.content]:
                    if isinstance(out, str):
                        piece.content += out
                    else:
                        piece.calls.append(out)
                yield piece
            elif isinstance(event, Finished):
                if parser is not None:
                    tail = parser.flush()
                    yield Piece(i, content="".join(x for x in tail if isinstance(x, str)),
                                calls=[x for x in tail if isinstance(x, CallDelta)])
                reason = "tool_calls" if parser is not None and parser.calls and event.reason == "stop" else event.reason
                open_choices.discard(i)
                yield End(i, reason, event.usage, event.timings, event.stop_sequence)

    async def _next(self) -> tuple[int, Any] | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if not self.served.alive and self.queue.empty():
                return 0, Failed(self.served.engine.failure or "the server is shutting down", 503)
            return None


def _tagged(relay: EventRelay, queue: asyncio.Queue, choice: int, event: Any) -> None:
    relay.post(queue, (choice, event))


def total_usage(ends: list[End]) -> dict[str, Any]:
    """One request's usage over its choices: the prompt once, every choice's completion."""
    usage = dict(ends[0].usage)
    done = sum(e.usage.get("completion_tokens", 0) for e in ends)
    usage["completion_tokens"] = done
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + done
    return usage

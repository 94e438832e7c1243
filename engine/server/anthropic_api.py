"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens.

The request is turned into OpenAI-shaped messages (system, text, tool_use → an assistant's
tool_calls, tool_result → tool messages) and runs the same jobs as a chat completion; the answer
comes back as content blocks (thinking, text, tool_use), streamed as Anthropic's events in their
documented order: message_start, then per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage) and
message_stop; ping after message_start. Errors are {type: "error", error: {type, message}}.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from engine.decoding.prompts import chat_prompt
from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Failed
from engine.errors import BonsaiError
from engine.server import protocol as P
from engine.server.grammar_map import tools_grammar
from engine.server.openai_api import STREAM_HEADERS
from engine.server.protocol_body import STRICT, check_tool_schema
from engine.server.serving import (ChatJob, End, Generation, Piece, error, from_exception, open_chat, read_json,
                                   tool_family)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here
    citations: list[Any] | None = None  # sent back as the API returned them; not used


class ToolUseBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]


class AMessage(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ATool(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AThinking(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=0, le=P.MAX_COUNT)


class MessagesRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    max_tokens: int = Field(ge=1, le=P.MAX_COUNT)
    messages: list[AMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=P.MAX_COUNT)
    stream: bool = False
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinking | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def check(self) -> None:
        names = [t.name for t in self.tools or []]
        for i, tool in enumerate(self.tools or []):
            check_tool_schema(tool.name, tool.input_schema, f"tools[{i}]")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise P.RequestError(f"tool_choice names the tool '{choice.name}', which is not among the tools "
                                 f"({', '.join(names) or 'none given'})", "tool_choice")
        if choice is not None and choice.type == "any" and not names:
            raise P.RequestError("tool_choice any needs tools", "tool_choice")

    def stops(self) -> tuple[str, ...]:
        stops = tuple(s for s in self.stop_sequences or [] if s)
        if len(stops) > 16 or any(len(s) > P.MAX_STOP_CHARS for s in stops):
            raise P.RequestError(f"stop_sequences takes at most 16 strings of {P.MAX_STOP_CHARS} characters",
                                 "stop_sequences")
        return stops

    def openai_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        return [{"type": "function", "function": {"name": t.name, **({"description": t.description}
                                                                      if t.description else {}),
                                                  "parameters": t.input_schema}} for t in self.tools]

    def openai_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        if system:
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            if m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in m.content if isinstance(b, ToolUseBlock)]
                if calls:
                    msg["tool_calls"] = calls
                thought = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
                if thought:
                    msg["reasoning_content"] = thought
                out.append(msg)
                continue
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    result = b.content if isinstance(b.content, str) else "".join(t.text for t in b.content)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": ("Error: " if b.is_error else "") + result})
                elif isinstance(b, (ToolUseBlock, ThinkingBlock)):
                    raise P.RequestError(f"a user message may not hold a {b.type} block", "messages")
            if text:
                out.append({"role": "user", "content": text})
        return out

    def grammar(self, tokenizer: Any, family: str | None) -> Any:
        """tool_choice any / tool: a forced call; auto: the lazy grammar of the model's call syntax."""
        tools = self.openai_tools()
        if tools is None:
            return None
        choice = self.tool_choice or AToolChoice(type="auto")
        mode = {"auto": "auto", "any": "required", "tool": "named"}[choice.type]
        return tools_grammar(tools, mode, choice.name, not choice.disable_parallel_tool_use, tokenizer, family)


def anthropic_error(response: JSONResponse) -> JSONResponse:
    """An OpenAI-shaped error response in Anthropic's shape (same status and message)."""
    body = json.loads(response.body)
    message = body.get("error", {}).get("message", "error")
    kind = ERROR_TYPES.get(response.status_code, "api_error")
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=response.status_code, headers=headers)


def _chat_job(req: "MessagesRequest", served: Any) -> tuple[ChatJob, str | None, str]:
    tools = req.openai_tools()
    family = tool_family(served, tools)
    sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    budget = None
    if req.thinking is not None:
        budget = 0 if req.thinking.type == "disabled" else req.thinking.budget_tokens
    spec = ChatJob(req.openai_messages(), req.max_tokens, [sampling], req.stops(), tools,
                   {t["function"]["name"]: t["function"]["parameters"] for t in tools or []},
                   thinking_budget=budget, grammar=req.grammar(served.engine.tokenizer, family), prefix="msg_")
    return spec, family, "messages"


def add_routes(app: FastAPI, state: Any, relays: dict) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        opened = await open_chat(state, relays, request, MessagesRequest, _chat_job, anthropic_error)
        if isinstance(opened, JSONResponse):
            return opened
        req, gen = opened
        job = gen.jobs[0]
        meta = (job.id, state.served.model_id, len(job.prompt_ids), req.stops())
        if req.stream:
            return StreamingResponse(_stream(gen, meta), media_type="text/event-stream", headers=STREAM_HEADERS)
        return await _collect(gen, request, meta)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        served, cfg = state.served, state.config
        try:
            req = P.parse(MessagesRequest, {"max_tokens": 1, **(await read_json(request, cfg.server.max_body_bytes)
                                                                 or {})})
            engine = served.engine
            prompt = await asyncio.get_running_loop().run_in_executor(
                None, chat_prompt, engine.tokenizer, req.openai_messages(), 1 << 30, 1.0, cfg.thinking.start_tag,
                req.openai_tools())
        except BonsaiError as e:
            return anthropic_error(from_exception(e))
        return {"input_tokens": len(prompt.ids)}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(end: End, text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    reason = STOP_REASONS.get(end.reason, "end_turn")
    if reason == "end_turn" and end.stop_sequence is not None:
        return "stop_sequence", end.stop_sequence
    return reason, None


async def _collect(gen: Generation, request: Request, meta: tuple) -> Response:
    rid, model, prompt_n, stops = meta
    thought, text, calls, end = [], [], {}, None
    try:
        async for event in gen.events(request):
            if isinstance(event, Piece):
                thought.append(event.reasoning)
                text.append(event.content)
                for c in event.calls:
                    if c.name is not None:
                        calls[c.index] = {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "args": ""}
                    calls[c.index]["args"] += c.arguments
            elif isinstance(event, Failed):
                return anthropic_error(error(event.status, event.message, "server_error"))
            elif isinstance(event, End):
                end = event
    finally:
        gen.cancel()
    if end is None:
        return Response(status_code=499)
    content: list[dict[str, Any]] = []
    if "".join(thought):
        content.append({"type": "thinking", "thinking": "".join(thought), "signature": ""})
    answer = "".join(text)
    if answer.strip() or not calls:
        content.append({"type": "text", "text": answer.strip() if calls else answer})
    for k in sorted(calls):
        call = calls[k]
        content.append({"type": "tool_use", "id": call["id"], "name": call["name"], "input": _input(call["args"])})
    reason, sequence = _stop(end, answer, stops)
    return JSONResponse({"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
                         "stop_reason": reason, "stop_sequence": sequence,
                         "usage": {"input_tokens": prompt_n, "output_tokens": end.usage.get("completion_tokens", 0)}})


def _input(args: str) -> dict[str, Any]:
    try:
        value = json.loads(args or "{}")
    except ValueError:
        return {"_raw": args}  # the model wrote arguments that are not JSON: passed on, not lost
    return value if isinstance(value, dict) else {"_value": value}


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


async def _stream(gen: Generation, meta: tuple) -> AsyncIterator[str]:
    rid, model, prompt_n, stops = meta
    block: tuple[str, int] | None = None  # the open block: (its kind, its index)
    count = 0
    answer: list[str] = []

    def open_block(kind: str, start: dict[str, Any]) -> list[str]:
        nonlocal block, count
        out = [_event("content_block_stop", {"index": block[1]})] if block is not None else []
        block = (kind, count)
        count += 1
        return out + [_event("content_block_start", {"index": block[1], "content_block": start})]

    try:
        yield _event("message_start", {"message": {"id": rid, "type": "message", "role": "assistant", "content": [],
                                                   "model": model, "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": prompt_n, "output_tokens": 0}}})
        yield _event("ping", {})
        async for event in gen.events():
            if isinstance(event, Piece):
                out: list[str] = []
                if event.reasoning:
                    if block is None or block[0] != "thinking":
                        out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(_event("content_block_delta", {"index": block[1], "delta": {
                        "type": "thinking_delta", "thinking": event.reasoning}}))
                if event.content and (event.content.strip() or (block is not None and block[0] == "text")):
                    if block is None or block[0] != "text":
                        out += open_block("text", {"type": "text", "text": ""})
                    answer.append(event.content)
                    out.append(_event("content_block_delta", {"index": block[1], "delta": {
                        "type": "text_delta", "text": event.content}}))
                for c in event.calls:
                    if c.name is not None:
                        out += open_block(f"tool{c.index}", {"type": "tool_use", "id": _tool_id(c.id), "name": c.name,
                                                             "input": {}})
                    if c.arguments:
                        out.append(_event("content_block_delta", {"index": block[1], "delta": {
                            "type": "input_json_delta", "partial_json": c.arguments}}))
                for line in out:
                    yield line
            elif isinstance(event, End):
                if block is None:
                    for line in open_block("text", {"type": "text", "text": ""}):
                        yield line
                yield _event("content_block_stop", {"index": block[1]})
                reason, sequence = _stop(event, "".join(answer), stops)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": {"output_tokens": event.usage.get("completion_tokens", 0)}})
                yield _event("message_stop", {})
                return
            elif isinstance(event, Failed):
                kind = "overloaded_error" if event.status == 503 else "api_error"
                yield _event("error", {"error": {"type": kind, "message": event.message}})
                return
    finally:
        gen.cancel()


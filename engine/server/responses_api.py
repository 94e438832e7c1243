"""OpenAI's Responses API at /v1/responses, stateless: `input` as text or items (messages,
function_call, function_call_output), `instructions`, `max_output_tokens`, function tools. Nothing is
stored: `store: true` and `previous_response_id` are refused with a 400 that says so. Streaming sends
response.created, response.in_progress, then per output item response.output_item.added, its
content_part / output_text.delta or function_call_arguments.delta events and their .done, then
response.completed (or response.incomplete at max_output_tokens)."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Failed
from engine.server import protocol as P
from engine.server.grammar_map import chat_grammar
from engine.server.openai_api import STREAM_HEADERS
from engine.server.protocol_body import EFFORT_BUDGET, STRICT, ChatFields, FunctionDef, NamedFunction, ToolDef
from engine.server.serving import ChatJob, End, Generation, Piece, error, open_chat, tool_family


class InputText(BaseModel):
    model_config = STRICT
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputText]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class RTool(FunctionDef):
    type: Literal["function"]


class RToolChoice(NamedFunction):
    type: Literal["function"]


class TextFormat(BaseModel):
    model_config = STRICT
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class Reasoning(BaseModel):
    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    input: Union[str, list[Union[MessageItem, FunctionCallItem, FunctionOutputItem]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=P.MAX_COUNT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    tools: list[RTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], RToolChoice, None] = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    text: TextFormat | None = None
    reasoning: Reasoning | None = None

    def check(self) -> None:
        if self.store:
            raise P.RequestError("store: true is not offered: this server is stateless and keeps no responses; "
                                 "send store: false and the whole conversation in input", "store")
        if self.previous_response_id is not None:
            raise P.RequestError("previous_response_id is not offered: this server is stateless; send the whole "
                                 "conversation in input", "previous_response_id")
        fmt = (self.text.format or {}).get("type", "text") if self.text else "text"
        if fmt != "text":
            raise P.RequestError(f"text.format {ascii(fmt)} is not offered on /v1/responses; use response_format on "
                                 "/v1/chat/completions", "text")
        self.chat_fields().check_tools()

    def chat_fields(self) -> ChatFields:
        tools = [ToolDef(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                                parameters=t.parameters, strict=t.strict))
                 for t in self.tools or []] or None
        choice = self.tool_choice
        if isinstance(choice, RToolChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        return ChatFields.model_validate({"tools": tools, "tool_choice": choice,
                                          "parallel_tool_calls": self.parallel_tool_calls}, strict=False)

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out


def _chat_job(req: "ResponsesRequest", served: Any) -> tuple[ChatJob, str | None, str]:
    fields = req.chat_fields()
    tools = fields.template_tools()
    family = tool_family(served, tools)
    budget = EFFORT_BUDGET[req.reasoning.effort] if req.reasoning and req.reasoning.effort else None
    spec = ChatJob(req.messages(), req.max_output_tokens, [SamplingParams(temperature=req.temperature, top_p=req.top_p)],
                   (), tools, fields.tool_schemas(), thinking_budget=budget,
                   grammar=chat_grammar(fields, served.engine.tokenizer, family), prefix="resp_")
    return spec, family, "input"


def add_routes(app: FastAPI, state: Any, relays: dict) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        opened = await open_chat(state, relays, request, ResponsesRequest, _chat_job)
        if isinstance(opened, JSONResponse):
            return opened
        req, gen = opened
        served = state.served
        shell = {"id": gen.jobs[0].id, "object": "response", "created_at": P.now(), "model": served.model_id,
                 "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                 "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                 "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else
                 (req.tool_choice.model_dump() if req.tool_choice else "auto"),
                 "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "store": False,
                 "metadata": req.metadata or {}, "error": None, "incomplete_details": None}
        if req.stream:
            return StreamingResponse(_stream(gen, shell), media_type="text/event-stream", headers=STREAM_HEADERS)
        return await _collect(gen, request, shell)


class _Output:
    """The output items of a response as they are built."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}

    def text(self, piece: str) -> tuple[bool, dict[str, Any]]:
        """(whether the message item is new, the item)."""
        new = self.message is None
        if new:
            self.message = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                            "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self.items.append(self.message)
        self.message["content"][0]["text"] += piece
        return new, self.message

    def call(self, c) -> tuple[bool, dict[str, Any]]:
        new = c.name is not None
        if new:
            self.calls[c.index] = {"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id,
                                   "name": c.name, "arguments": "", "status": "in_progress"}
            self.items.append(self.calls[c.index])
        self.calls[c.index]["arguments"] += c.arguments
        return new, self.calls[c.index]

    def response(self, shell: dict[str, Any], end: End) -> dict[str, Any]:
        for item in self.items:
            item["status"] = "completed"
        if self.message is not None and self.calls:
            part = self.message["content"][0]
            part["text"] = part["text"].rstrip()
        done = end.reason != "length"
        usage = end.usage
        return {**shell, "status": "completed" if done else "incomplete", "output": self.items,
                "incomplete_details": None if done else {"reason": "max_output_tokens"},
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                          "total_tokens": usage["total_tokens"],
                          "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens_details": {"reasoning_tokens": 0}}}


async def _collect(gen: Generation, request: Request, shell: dict[str, Any]) -> Response:
    out, end = _Output(), None
    try:
        async for event in gen.events(request):
            if isinstance(event, Piece):
                if event.content and (out.message is not None or event.content.strip()):
                    out.text(event.content)
                for c in event.calls:
                    out.call(c)
            elif isinstance(event, Failed):
                return error(event.status, event.message, "server_error")
            elif isinstance(event, End):
                end = event
    finally:
        gen.cancel()
    if end is None:
        return Response(status_code=499)
    return JSONResponse(out.response(shell, end))


async def _stream(gen: Generation, shell: dict[str, Any]) -> AsyncIterator[str]:
    seq = 0
    out = _Output()

    def event(kind: str, **body: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **body})}\n\n"

    def close(item: dict[str, Any], index: int) -> list[str]:
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"]),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]
        return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=item["arguments"]), event("response.output_item.done", output_index=index, item=item)]

    try:
        start = {**shell, "status": "in_progress", "output": [], "usage": None}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        async for ev in gen.events():
            if isinstance(ev, Piece):
                lines: list[str] = []
                if ev.content and (out.message is not None or ev.content.strip()):
                    before = len(out.items)
                    new, item = out.text("")
                    index = out.items.index(item)
                    if new:
                        if before:
                            lines += close(out.items[before - 1], before - 1)
                        lines.append(event("response.output_item.added", output_index=index,
                                           item={**item, "content": []}))
                        lines.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                           content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
                    out.text(ev.content)
                    lines.append(event("response.output_text.delta", item_id=item["id"], output_index=index,
                                       content_index=0, delta=ev.content))
                for c in ev.calls:
                    before = len(out.items)
                    new, item = out.call(c)
                    index = out.items.index(item)
                    if new:
                        if before:
                            lines += close(out.items[before - 1], before - 1)
                        lines.append(event("response.output_item.added", output_index=index,
                                           item={**item, "arguments": ""}))
                    if c.arguments:
                        lines.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=index, delta=c.arguments))
                for line in lines:
                    yield line
            elif isinstance(ev, End):
                if out.items:
                    for line in close(out.items[-1], len(out.items) - 1):
                        yield line
                final = out.response(shell, ev)
                yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                            response=final)
                return
            elif isinstance(ev, Failed):
                yield event("error", code="server_error", message=ev.message, param=None)
                return
    finally:
        gen.cancel()

"""The OpenAI request bodies we accept (strict: unknown fields and wrong types are 400) and the
response objects we build, including llama.cpp's `timings`."""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import BonsaiError
from engine.decoding.sampling import SamplingParams

STRICT = ConfigDict(extra="forbid", strict=True)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    reasoning_content: str | None = None  # a thought sent back in the history (templates may show it)

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = STRICT
    model: str | None = None  # one model is served: any name reaches it
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, lt=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label, logged with the request

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, seed=self.seed)

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise RequestError("stop takes at most 16 strings", "stop")
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        if self.n != 1:
            raise RequestError(f"n={self.n} is not supported: this server returns one choice per request (n=1)", "n")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options needs stream: true", "stream_options")


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    thinking_budget: int | None = Field(None, ge=0)  # tokens of thought before the answer is forced

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = Field(None, ge=0, le=20)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise RequestError("several prompts in one request are not supported; send one prompt", "prompt")
            return p[0]
        if not p:
            raise RequestError("the prompt is empty", "prompt")
        return p


class RequestError(BonsaiError):
    """A request the server refuses: HTTP status, OpenAI error type and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code, self.headers = param, status, kind, code, headers or {}


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a RequestError naming the field."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union[")))
        if err["type"] == "extra_forbidden":
            raise RequestError(f"unknown field '{where}' (this server does not support it)", where) from None
        raise RequestError(f"invalid '{where}': {err['msg']}", where) from None
    request.check()
    return request


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               logprobs: list | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                         "finish_reason": finish}]}


def text_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
               logprobs: list | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": legacy_logprobs(logprobs) if logprobs else None,
                         "finish_reason": finish}]}


def legacy_logprobs(items: list[dict[str, Any]]) -> dict[str, Any]:
    """/v1/completions' logprobs layout from the chat layout."""
    return {"tokens": [i["token"] for i in items], "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [{t["token"]: t["logprob"] for t in i["top_logprobs"]} for i in items]}


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def now() -> int:
    return int(time.time())

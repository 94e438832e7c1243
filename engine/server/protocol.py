"""The OpenAI request bodies we accept (strict: unknown fields and wrong types are 400) and the
response objects we build, including llama.cpp's `timings`."""
from __future__ import annotations

import json
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.decoding.sampling import SamplingParams
from engine.server.protocol_body import MAX_CHOICES, ChatFields, ClientFields, ToolCallIn
from engine.server.request_error import RequestError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
__all__ = ["RequestError"]
# every number a request carries has both bounds (tests/test_engine_guard.py checks it): a value
# past them is a 400 here, never an error inside the engine
MAX_COUNT = 2**31 - 1  # token counts and limits (far above any context)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
PENALTY_MIN, PENALTY_MAX = 0.01, 100.0  # repetition_penalty: logits / p or * p stay finite in float32
MAX_DEPTH = 16  # nesting of a body: ours needs 4 ({"messages": [{"content": [{"text": ...}]}]})
MAX_STOP_CHARS = 256  # per stop string: the matcher's work per token grows with its square


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    reasoning_content: str | None = None  # a thought sent back in the history (templates may show it)
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, sent back in the history
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        content = self.content
        return "".join(p.text for p in content) if isinstance(content, list) else content or ""

    def as_dict(self) -> dict[str, Any]:
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(ClientFields):
    model_config = STRICT
    model: str | None = None  # one model is served: any name reaches it
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_COUNT)
    min_p: float = Field(0.0, ge=0, lt=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=PENALTY_MIN, le=PENALTY_MAX)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=MAX_COUNT)  # at most MAX_CHOICES (check)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label, logged with the request
    # llama.cpp's name: the most tokens drafted a step for this request (at most the server's
    # speculative.num_draft_tokens; 0: this request decodes plainly); ignored by a server without speculation
    draft_tokens: int | None = Field(None, alias="speculative.n_max", ge=0, le=MAX_COUNT)

    def sampling(self, vocab: int = MAX_COUNT, choice: int = 0) -> SamplingParams:
        """Choice `choice`'s sampling: its own seed (seed + choice) when a seed is given; logit_bias ids
        checked against `vocab`."""
        bias = self.token_bias(vocab)
        seed = self.seed if self.seed is None or not choice else (self.seed + choice) % (SEED_MAX + 1)
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, seed=seed,
                              **({"logit_bias": bias} if bias else {}))

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise RequestError("stop takes at most 16 strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise RequestError(f"a stop string has more than {MAX_STOP_CHARS} characters; shorten it", "stop")
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        if self.n > MAX_CHOICES:
            raise RequestError(f"n={self.n} asks for more than the {MAX_CHOICES} choices one request may have", "n")
        self.check_fields()
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options needs stream: true", "stream_options")


class ChatRequest(_Common, ChatFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    thinking_budget: int | None = Field(None, ge=0, le=MAX_COUNT)  # tokens of thought before the answer is forced

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        super().check()
        self.check_tools()

    def check_size(self, max_messages: int, max_chars: int) -> None:
        """The caps on one request's work, checked before any template or tokenizer runs."""
        if len(self.messages) > max_messages:
            raise RequestError(f"the conversation has {len(self.messages)} messages, more than the {max_messages} "
                               "this server takes (server.max_messages); send fewer", "messages")
        chars = sum(len(m.text()) + len(m.reasoning_content or "") + len(m.name or "")
                    + sum(len(c.function.arguments) for c in m.tool_calls or []) for m in self.messages)
        _check_chars(chars, max_chars, "messages")

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt's text before the completion

    def token_limit(self) -> int | None:
        return self.max_tokens

    def check_size(self, max_messages: int, max_chars: int) -> None:
        """The cap on one request's work (a prompt of token ids is bounded by the context instead)."""
        p = self.prompt
        _check_chars(len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str)), max_chars,
                     "prompt")

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise RequestError("several prompts in one request are not supported; send one prompt", "prompt")
            return p[0]
        if not p:
            raise RequestError("the prompt is empty", "prompt")
        return p


def _check_chars(chars: int, limit: int, param: str) -> None:
    if chars > limit:
        raise RequestError(f"the request has {chars} characters of {param}, more than the {limit} this server "
                           "takes (server.max_prompt_chars); send less", param)


def decode_body(raw: bytes) -> Any:
    """The one decoding of a request body: JSON (RFC 8259: no NaN or Infinity, no number beyond a
    double) nested at most MAX_DEPTH deep, every string valid Unicode (no lone surrogate, which no
    tokenizer, log or response encoder takes). Anything else is a RequestError (400) that says what."""
    try:
        data = json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)
    except RecursionError:
        raise RequestError(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({str(e).splitlines()[0]})") from None
    _check_tree(data)
    return data


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _check_tree(data: Any) -> None:
    """Depth and Unicode of a decoded body, walked without recursion; the path of the first problem."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path, "a key")
                stack.append((item, (*path, key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, (*path, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path, "a string")


def _check_text(text: str, path: tuple, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "the body"
        bad = ascii(text[e.start:e.end])
        field = where.split(".")[0].split("[")[0] or None
        raise RequestError(f"{what} in '{ascii(where)[1:-1]}' holds a lone surrogate ({bad[1:-1]}), which is not "
                           "valid Unicode; send UTF-8 text", field) from None


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
    check = getattr(request, "check", None)  # a model's own rules across fields, when it has some
    if check is not None:
        check()
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

"""The body-field policy for clients as they are: the fields with a meaning are implemented, the
harmless ones accepted, and a field we cannot honour is a 400 that says why.

Implemented: tools / tool_choice / parallel_tool_calls, response_format, logit_bias (token ids as
strings → SamplingParams.logit_bias), n (≤ MAX_CHOICES, a seed derived per choice), echo
(completions), chat_template_kwargs (passed to the chat template), reasoning_effort (the thinking
budget). Accepted and without effect here: store (false), metadata, service_tier, user (logged),
cache_prompt (the slots always reuse cached prefixes), stream_options.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.server.request_error import RequestError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_CHOICES = 16
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# reasoning_effort → thinking tokens before the answer is forced (None: the server's thinking.budget)
EFFORT_BUDGET = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": None}


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ClientFields(BaseModel):
    """Fields every OpenAI-style request may carry."""
    model_config = STRICT
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_prompt: bool | None = None  # llama.cpp's: prefixes are always reused here

    def check_fields(self) -> None:
        if self.store:
            raise RequestError("store: true is not offered: this server keeps no responses (stateless); "
                               "send store: false or leave it out", "store")

    def token_bias(self, vocab: int) -> dict[int, float]:
        """logit_bias as {token id: bias}; ids and bounds checked (-100..100, as OpenAI's)."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or not 0 <= int(key) < vocab:
                raise RequestError(f"logit_bias key {ascii(key[:20])} is not a token id in 0..{vocab - 1}",
                                   "logit_bias")
            if not -100 <= bias <= 100:
                raise RequestError(f"logit_bias for token {key} is {bias}, outside -100..100", "logit_bias")
            out[int(key)] = float(bias)
        return out


class ChatFields(ClientFields):
    """The chat-only fields of agents and UIs."""
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def check_tools(self) -> None:
        """Tool definitions and tool_choice are coherent (names, schemas, the named tool exists)."""
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise RequestError(f"{len(tools)} tools given, more than the {MAX_TOOLS} this server takes", "tools")
        seen: set[str] = set()
        for i, tool in enumerate(tools):
            check_tool_schema(tool.function.name, tool.function.parameters, f"tools[{i}]")
            if tool.function.name in seen:
                raise RequestError(f"tools[{i}]: the tool name '{tool.function.name}' is given twice", "tools")
            seen.add(tool.function.name)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
            raise RequestError(f"tool_choice names the function '{choice.function.name}', which is not among the "
                               f"tools ({', '.join(sorted(seen)) or 'none given'})", "tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice: required needs tools", "tool_choice")
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise RequestError("response_format json_schema needs its json_schema: {name, schema}", "response_format")

    def tool_mode(self) -> tuple[str, str | None]:
        """(none | auto | required | named, the named tool) with OpenAI's default: auto when tools are given."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return "none", None
        if isinstance(choice, NamedToolChoice):
            return "named", choice.function.name
        return choice or "auto", None

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        return {t.function.name: t.function.parameters or {"type": "object", "properties": {}}
                for t in self.tools or []}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (None: not rendered, e.g. tool_choice none)."""
        if self.tool_mode()[0] == "none":
            return None
        return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in self.tools]


def check_tool_schema(name: str, params: Any, where: str) -> None:
    """A tool's name and parameters schema are usable: a JSON-schema object describing an object."""
    if not TOOL_NAME.match(name):
        raise RequestError(f"{where}: the tool name {ascii(name[:70])} must be 1-64 letters, digits, _ . : or -",
                           "tools")
    if params is None:
        return
    if not isinstance(params, dict):
        raise RequestError(f"{where} ({name}): parameters must be a JSON schema object", "tools")
    kind = params.get("type", "object")
    if kind != "object":
        raise RequestError(f"{where} ({name}): the parameters schema must describe an object (type: object), "
                           f"not {ascii(kind)}", "tools")
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise RequestError(f"{where} ({name}): parameters.properties must map each argument to a schema", "tools")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise RequestError(f"{where} ({name}): parameters.required must be a list of argument names", "tools")

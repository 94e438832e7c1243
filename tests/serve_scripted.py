"""The real server (api.create_app and every route) over a scripted engine: each request's answer is
a fixed text, played back token by token (the tokenizer's own pieces) as the engine's events, so the
API's parsing and shaping are tested on exactly the outputs real models give."""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Callable

from engine.decoding.sequence import Delta, Finished
from engine.decoding.stop import StopStringMatcher
from engine.server.api import ServerState, create_app
from engine.server.config import ServeConfig
from engine.server.engine_thread import Served

# Qwen2.5's chat template, tools part included (hermes <tool_call> JSON), cut to what the tests use
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags."
    "<|im_end|>\\n' }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


class ScriptedEngine:
    """What the server needs of an Engine; `script(job) -> text` decides each answer."""

    def __init__(self, tokenizer, script: Callable, context: int = 4096):
        self.tokenizer, self.script, self.slot_context = tokenizer, script, context
        self.runner = SimpleNamespace(cache=SimpleNamespace(slots=[0, 1]))
        self.failure = None
        self.jobs: list = []

    def submit(self, job) -> None:
        self.jobs.append(job)
        ids = self.tokenizer.encode(self.script(job), add_special_tokens=False)
        matcher, out, reason = StopStringMatcher(job.stop), 0, "length"
        for i, token in enumerate(ids[:job.max_tokens]):
            text, stopped = matcher.push(self.tokenizer.decode(ids[:i + 1])[len(self.tokenizer.decode(ids[:i])):])
            out += 1
            logprobs = ([{"token": text, "logprob": -0.5, "bytes": list(text.encode()),
                          "top_logprobs": [{"token": text, "logprob": -0.5, "bytes": list(text.encode())}]
                          * (job.top_logprobs or 0)}] if job.top_logprobs is not None else [])
            job.emit(Delta([token], "", text, logprobs))
            if stopped:
                reason = "stop"
                break
        else:
            reason = "stop" if len(ids) <= job.max_tokens else "length"
            tail = matcher.flush()
            if tail:
                job.emit(Delta([], "", tail))
        n = len(job.prompt_ids)
        job.emit(Finished(reason, {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out,
                                   "prompt_tokens_details": {"cached_tokens": 0}}, {"predicted_n": out}, None,
                          matcher.matched))

    def cancel(self, job) -> None:
        pass

    def slots(self) -> list:
        return []


class _Thread:
    alive = True

    def stop(self) -> None:
        pass


def scripted_app(tokenizer, script: Callable, template: str | None = QWEN_TEMPLATE, **server):
    """(the app, its ScriptedEngine) over a copy of `tokenizer` whose chat template is `template`."""
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    config = ServeConfig.from_dict({"model": {"path": "scripted", "max_context": 4096},
                                    "server": {"default_max_tokens": 256, **server}})
    engine = ScriptedEngine(tok, script)
    state = ServerState(config, served=Served(engine, _Thread(), "scripted", config))
    return create_app(state), engine

"""Render a model's Hugging Face-style Jinja chat template into a prompt string.

Chat templates come with downloaded models, so they are untrusted code: they run in Jinja's
``ImmutableSandboxedEnvironment`` (no dunder access, no mutation of the messages). The environment
matches what transformers gives a template, so the same template renders the same text here:

- ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension (``break``/``continue``);
- ``{% generation %}...{% endgeneration %}`` accepted and rendered as its body;
- ``raise_exception(message)``, ``strftime_now(format)``, a limited ``dict`` and ``namespace``;
- the ``tojson`` filter as transformers defines it (``json.dumps``, no HTML escaping, non-ASCII kept);
- variables ``messages``, ``add_generation_prompt``, ``tools`` (None), ``documents`` (None), the
  special tokens the caller passes (``bos_token``, ``eos_token``, ...) and any extra keyword.

Message keys whose value is None are dropped first (OpenAI-style ``content=None``), as transformers
does, because templates handle a missing key better than a None.

A model without a template gets no made-up fallback: ``Tokenizer.apply_chat_template`` raises a
``BonsaiError`` saying so. Inventing a format (ChatML, "User:/Assistant:") for a model never trained
on it gives quietly bad answers; a base model is better used with a plain-text prompt.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import BonsaiError


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}`` marks the assistant's text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as Jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _DictFactory:
    """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise BonsaiError(
            f"chat template has a syntax error at line {err.lineno}: {_one_line(err.message or err)}; "
            "fix the template or use another one"
        ) from None


def render(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """The prompt text ``template`` makes of ``messages``.

    ``variables`` are passed to the template as they are: the model's special tokens
    (``bos_token="<s>"``, ``eos_token=...``) and anything a template reads, such as
    ``enable_thinking=False``. Raises ``BonsaiError`` (one line) when the template does not parse,
    calls ``raise_exception`` (e.g. roles out of order), breaks a sandbox rule, or fails on the
    messages it was given.
    """
    for message in messages:
        if not isinstance(message, dict):
            raise BonsaiError(f"chat message {message!r} is not a dict; pass {{'role': ..., 'content': ...}}")
    cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
    compiled = _compile(template)
    context = {"documents": None, **variables}
    try:
        return compiled.render(messages=cleaned, add_generation_prompt=add_generation_prompt, tools=tools, **context)
    except jinja2.exceptions.SecurityError as err:
        raise BonsaiError(
            f"chat template was stopped by the sandbox ({_one_line(err)}); the template is unsafe, use another one"
        ) from None
    except jinja2.TemplateSyntaxError as err:
        raise BonsaiError(f"chat template has a syntax error: {_one_line(err.message or err)}") from None
    except jinja2.UndefinedError as err:
        raise BonsaiError(
            f"chat template failed on these messages ({_one_line(err)}); check the roles and contents"
        ) from None
    except jinja2.TemplateError as err:
        raise BonsaiError(f"chat template rejected the messages: {_one_line(err)}") from None
    except Exception as err:  # the template is untrusted code: any failure is the template's
        raise BonsaiError(
            f"chat template failed on these messages ({type(err).__name__}: {_one_line(err)}); "
            "check the roles and contents"
        ) from None


def end_of_turn_token(template: str | None, special_tokens: list[str], variables: dict[str, Any]) -> str | None:
    """The special token ``template`` writes right after an assistant message (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``...), found by rendering a sample chat; None if there is none."""
    if not template:
        return None
    marker = "\x00bonsai-end-of-turn\x00"
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": marker}]
    try:
        text = render(template, messages, add_generation_prompt=False, **variables)
    except BonsaiError:
        return None
    _, found, rest = text.partition(marker)
    rest = rest.lstrip()
    if not found:
        return None
    return next((t for t in sorted(special_tokens, key=len, reverse=True) if t and rest.startswith(t)), None)

"""Chat templates render exactly as transformers renders them, inside a sandbox that holds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_tokenizer import smollm2_metadata

from engine.sources import chat_template
from engine.errors import BonsaiError
from engine.sources.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke about CPUs 🖥️."}],
    "system_multi": [SYSTEM, {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                     {"role": "user", "content": "Another, in 日本語?"}],
    "ends_with_assistant": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
    "whitespace": [{"role": "user", "content": "  padded\n\n  text  \n"}],
}

# A Llama-3-like template: bos_token, namespace, loop.last, trim, raise_exception, strftime_now
LLAMA3_LIKE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] | trim -%}
    {%- set messages = messages[1:] -%}
{%- endif -%}
<|start_header_id|>system<|end_header_id|>\n\nToday: {{ strftime_now('%Y') }}\n{{ ns.system }}<|eot_id|>
{%- for message in messages -%}
    {%- if message['role'] not in ['user', 'assistant'] -%}
        {{ raise_exception('unknown role ' + message['role']) }}
    {%- endif -%}
    <|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif -%}"""

# A tool-calling template: tojson (non-ASCII, HTML characters, indent), loop controls, dict(), generation block
TOOLS_LIKE = """{% for message in messages %}
  {% if message.role == 'system' %}{% continue %}{% endif %}
<turn role="{{ message.role }}">
  {% if tools and loop.first %}
Tools: {{ tools | tojson(indent=2) }}
  {% endif %}
  {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}
  {% else %}
{{ message.content }}
  {% endif %}
{{ dict(n=loop.index) | tojson }}
</turn>
  {% if loop.index >= 4 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<turn role="assistant">{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für <Ort> & Zeit",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_model_template_matches_transformers(smollm2_tok: Tokenizer, smollm2_hf_tok: Any, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = smollm2_hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm2_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_model_template_text(smollm2_tok: Tokenizer) -> None:
    text = smollm2_tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2_tok.encode(text)
    assert ids[0] == smollm2_tok.token_to_id("<|im_start|>")
    assert ids[-4:] == [smollm2_tok.token_to_id("<|im_start|>")] + smollm2_tok.encode("assistant\n")


@pytest.mark.parametrize("template", [LLAMA3_LIKE, TOOLS_LIKE], ids=["llama3_like", "tools_like"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_other_templates_match_transformers(smollm2_tok: Tokenizer, smollm2_hf_tok: Any, template: str, name: str,
                                            add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    tools = TOOLS if template is TOOLS_LIKE else None
    expected = smollm2_hf_tok.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    rendered = chat_template.render(template, messages, add_generation_prompt, tools=tools,
                                    **smollm2_tok.special_tokens_map)
    assert rendered == expected


def test_extra_variables_and_none_values() -> None:
    template = "{% for m in messages %}{{ m.role }}:{{ m.content if m.content is defined else '-' }};{% endfor %}" \
               "{{ enable_thinking }}"
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]
    assert chat_template.render(template, messages, enable_thinking=False) == "user:a;assistant:-;False"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{% set x = messages[0].update({'content': 'changed'}) %}",
])
def test_sandbox_blocks_escapes(template: str) -> None:
    with pytest.raises(BonsaiError) as caught:
        chat_template.render(template, [{"role": "user", "content": "hi"}])
    assert "sandbox" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content }", "syntax error"),
    ("{% if %}", "syntax error"),
    ("{% endfor %}", "syntax error"),
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),
    ("{{ messages[0]['content'] + 1 }}", "failed on these messages"),
    ("{{ messages[5]['content'].upper() }}", "failed on these messages"),
])
def test_template_errors_are_one_line(template: str, words: str) -> None:
    with pytest.raises(BonsaiError) as caught:
        chat_template.render(template, [{"role": "user", "content": "hi"}])
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_messages_must_be_dicts() -> None:
    with pytest.raises(BonsaiError):
        chat_template.render("{{ messages }}", ["just a string"])  # type: ignore[list-item]


def test_model_without_template_is_an_error(smollm2_gguf: Path) -> None:
    meta = {k: v for k, v in smollm2_metadata(smollm2_gguf).items() if k != "tokenizer.chat_template"}
    bare = Tokenizer.from_gguf_metadata(meta)
    assert bare.chat_template is None
    with pytest.raises(BonsaiError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    bare.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # a caller may supply one
    assert bare.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "<|im_end|>"),
    (LLAMA3_LIKE, "<|eot_id|>"),
    ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}",
     "<end_of_turn>"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("{{ raise_exception('no') }}", None),
])
def test_end_of_turn_token(template: str, expected: str | None) -> None:
    specials = ["<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<start_of_turn>", "<end_of_turn>", "<s>"]
    assert chat_template.end_of_turn_token(template, specials, {"bos_token": "<s>"}) == expected

"""Grammar-constrained decoding on the real SmolLM2: a json_schema answer parses and validates, a
forced tool call parses into the named tool with schema-valid arguments; n-gram speculation gives the
same greedy output."""
from __future__ import annotations

import json

import pytest

from engine.decoding.grammar import GrammarSpec
from engine.runtime.runner import ModelRunner
from engine.speculative.ngram import NgramDrafter
from tests.engine_runs import run_engine

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"name": "get_weather", "parameters": SCHEMA | {"properties": {"city": {"type": "string", "maxLength": 20}},
                                                       "required": ["city"]}}


def prompt(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_json_schema_and_forced_tool_call(smollm2_loaded, one_thread):
    tok = smollm2_loaded.tokenizer
    runner = ModelRunner(smollm2_loaded, 512, num_slots=1)
    ids = prompt(tok, "Give a person as JSON.")
    text, _, reason, _ = run_engine(runner, tok, ids, max_tokens=80, grammar=GrammarSpec.json_schema(SCHEMA))
    doc = json.loads(text)
    assert reason == "stop" and set(doc) == {"name", "age"} and isinstance(doc["age"], int)
    spec_text, *_ = run_engine(runner, tok, ids, NgramDrafter(1, 3), max_tokens=80,
                               grammar=GrammarSpec.json_schema(SCHEMA))
    assert spec_text == text
    call, _, reason, _ = run_engine(runner, tok, prompt(tok, "What is the weather in Paris?"), max_tokens=120,
                                    grammar=GrammarSpec.tool_calls([TOOL], "hermes", "named", "get_weather",
                                                                   parallel=False))
    assert reason == "stop", call
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>")
    body = json.loads(call[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert body["name"] == "get_weather" and isinstance(body["arguments"]["city"], str)
    assert set(body["arguments"]) == {"city"}

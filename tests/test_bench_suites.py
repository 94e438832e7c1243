"""Task suites: the shipped ones are complete, valid and render through a real chat template;
user files with mistakes fail with a one-line message that names the entry."""
from __future__ import annotations

import json
import os
from collections import Counter
from itertools import combinations
from pathlib import Path

import pytest

from engine.bench.records import SuitePrompt
from engine.bench.suites import CATEGORIES, available_suites, fresh_variant, load_suite
from engine.errors import BonsaiError
from engine.weights.loader import open_model_source
from engine.sources.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_model_source(smollm2_gguf).metadata)


def _good_entry(**overrides) -> dict:
    entry = {"id": "p1", "category": "qa", "max_tokens": 64,
             "messages": [{"role": "user", "content": "What is the capital of Peru?"}]}
    entry.update(overrides)
    return entry


def _write(tmp_path: Path, content: object, name: str = "suite.json") -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return str(path)


# --- shipped suites ---------------------------------------------------------------------------------

def test_shipped_suites_are_listed_and_load():
    names = available_suites()
    assert {"full", "short"} <= set(names)
    for name in names:
        prompts = load_suite(name)
        assert prompts and all(isinstance(p, SuitePrompt) for p in prompts)
        assert len({p.id for p in prompts}) == len(prompts), f"{name}: duplicate ids"
        assert all(p.messages[-1]["role"] == "user" for p in prompts)


def test_full_suite_covers_every_category_with_at_least_eight_prompts():
    counts = Counter(p.category for p in load_suite("full"))
    assert set(counts) == set(CATEGORIES)
    assert min(counts.values()) >= 8, counts
    for p in load_suite("full"):
        assert 64 <= p.max_tokens <= 256, p.id


def test_full_suite_shape_per_category():
    for p in load_suite("full", categories=["multi-turn"]):
        roles = [m["role"] for m in p.messages if m["role"] != "system"]
        assert roles.count("assistant") >= 2, f"{p.id}: multi-turn needs earlier turns with replies"
        assert roles == ["user", "assistant"] * roles.count("assistant") + ["user"], p.id
    for p in load_suite("full", categories=["summarization"]):
        words = len(p.messages[-1]["content"].split())
        assert 150 <= words <= 330, f"{p.id}: passage of {words} words"
    for p in load_suite("full", categories=["code-edit"]):
        assert "```" in p.messages[-1]["content"], f"{p.id}: code-edit must include the code to change"


def test_full_suite_prompts_are_fresh():
    """No two prompts share a long opening: a prompt cache must not carry one prompt over to another."""
    firsts = {p.id: p.messages[0]["content"] for p in load_suite("full")}
    for (a, ta), (b, tb) in combinations(firsts.items(), 2):
        shared = len(os.path.commonprefix([ta, tb]))
        assert shared < 60, f"{a} and {b} share their first {shared} characters"


def test_short_suite_has_one_small_prompt_per_category():
    prompts = load_suite("short")
    assert [p.category for p in prompts] == list(CATEGORIES)
    for p in prompts:
        assert 32 <= p.max_tokens <= 48, p.id
        assert sum(len(m["content"]) for m in p.messages) < 400, p.id


def test_every_prompt_renders_through_the_smollm2_template(smollm2_tokenizer: Tokenizer):
    for name in available_suites():
        for p in load_suite(name):
            text = smollm2_tokenizer.apply_chat_template(p.messages)
            assert p.messages[-1]["content"] in text
            assert text.endswith("<|im_start|>assistant\n")
            n_tokens = len(smollm2_tokenizer.encode(text))
            assert 0 < n_tokens <= 1500, f"{name}/{p.id}: {n_tokens} prompt tokens"
            if name == "short":
                assert n_tokens <= 160, f"short/{p.id}: {n_tokens} prompt tokens"


def test_categories_filter_and_limit_keep_file_order():
    prompts = load_suite("full", categories=["translation", "code"], limit_per_category=3)
    assert [p.category for p in prompts] == ["code"] * 3 + ["translation"] * 3
    full_ids = [p.id for p in load_suite("full")]
    assert [p.id for p in prompts] == [i for i in full_ids if i in {p.id for p in prompts}]


# --- fresh variants ---------------------------------------------------------------------------------

def test_fresh_variant_is_unique_per_repetition_and_keeps_the_task(smollm2_tokenizer: Tokenizer):
    for p in load_suite("short") + load_suite("full", categories=["multi-turn"], limit_per_category=2):
        assert fresh_variant(p, 0) is p
        variants = [fresh_variant(p, r) for r in range(6)]
        rendered = [smollm2_tokenizer.apply_chat_template(v.messages) for v in variants]
        assert len(set(rendered)) == len(rendered), p.id
        for v in variants:
            assert (v.id, v.category, v.max_tokens) == (p.id, p.category, p.max_tokens)
            assert [m["role"] for m in v.messages] == [m["role"] for m in p.messages]
            assert all(a["content"].endswith(b["content"]) for a, b in zip(v.messages, p.messages))
            assert v.messages[1:] == p.messages[1:]
        # The variants must part at the first message, not later: a cache would reuse everything before.
        first_at = rendered[0].index(p.messages[0]["content"])
        for a, b in combinations(rendered, 2):
            assert len(os.path.commonprefix([a, b])) <= first_at + len("(run "), p.id
    before = [dict(m) for m in p.messages]
    fresh_variant(p, 4)
    assert p.messages == before, "fresh_variant must not modify the original prompt"


# --- user files and bad input -----------------------------------------------------------------------

def test_user_json_and_jsonl_files_load(tmp_path: Path):
    entries = [_good_entry(id="a"), _good_entry(id="b", category="math", max_tokens=32)]
    from_json = load_suite(_write(tmp_path, entries))
    lines = "\n".join(json.dumps(e) for e in entries) + "\n\n"
    from_jsonl = load_suite(_write(tmp_path, lines, "suite.jsonl"))
    assert from_json == from_jsonl
    assert [(p.id, p.category, p.max_tokens) for p in from_json] == [("a", "qa", 64), ("b", "math", 32)]
    default = load_suite(_write(tmp_path, [{k: v for k, v in _good_entry().items() if k != "max_tokens"}]))
    assert default[0].max_tokens == SuitePrompt.max_tokens


BAD_FILES = {
    "not json": ("[{", "is not valid JSON"),
    "not a list": ({"prompts": []}, "must hold a JSON list"),
    "empty list": ([], "holds no prompts"),
    "entry not an object": (["hello"], "entry 0 is a str, not an object"),
    "missing key": ([{"id": "x", "category": "qa"}], "entry 0 (id 'x'): missing key(s) messages"),
    "unknown key": ([_good_entry(max_token=5)], "entry 0 (id 'p1'): unknown key(s) max_token"),
    "id not a string": ([_good_entry(id=7)], '"id" must be a non-empty string'),
    "unknown category": ([_good_entry(category="poetry")], "unknown category 'poetry' (use one of: code, code-edit"),
    "max_tokens string": ([_good_entry(max_tokens="64")], '"max_tokens" must be a positive integer'),
    "max_tokens zero": ([_good_entry(max_tokens=0)], '"max_tokens" must be a positive integer'),
    "messages not a list": ([_good_entry(messages="hi")], '"messages" must be a non-empty list'),
    "no messages": ([_good_entry(messages=[])], '"messages" must be a non-empty list'),
    "message missing content": ([_good_entry(messages=[{"role": "user"}])],
                                'message 0 must be an object with exactly the keys "role" and "content"'),
    "unknown role": ([_good_entry(messages=[{"role": "bot", "content": "hi"}])],
                     "message 0 has unknown role 'bot' (use one of: system, user, assistant)"),
    "empty content": ([_good_entry(messages=[{"role": "user", "content": "  "}])],
                      'message 0 has empty or non-string "content"'),
    "content not a string": ([_good_entry(messages=[{"role": "user", "content": ["hi"]}])],
                             'message 0 has empty or non-string "content"'),
    "ends with assistant": ([_good_entry(messages=[{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "hello"}])],
                            "must end with a user message"),
    "duplicate id": ([_good_entry(), _good_entry()], "entry 1: id 'p1' is already used by entry 0"),
}


@pytest.mark.parametrize("content, expected", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_suite_files_fail_with_one_line(tmp_path: Path, content: object, expected: str):
    path = _write(tmp_path, content)
    with pytest.raises(BonsaiError) as err:
        load_suite(path)
    message = str(err.value)
    assert expected in message
    assert path in message
    assert "\n" not in message


def test_bad_jsonl_line_is_named(tmp_path: Path):
    path = _write(tmp_path, json.dumps(_good_entry()) + "\n{oops\n", "suite.jsonl")
    with pytest.raises(BonsaiError, match=r"line 2 is not valid JSON"):
        load_suite(path)


def test_unknown_suite_lists_the_available_ones():
    with pytest.raises(BonsaiError) as err:
        load_suite("fulll")
    assert "unknown suite 'fulll'" in str(err.value)
    assert ", ".join(available_suites()) in str(err.value)


def test_missing_suite_file(tmp_path: Path):
    with pytest.raises(BonsaiError, match="suite file not found"):
        load_suite(str(tmp_path / "nope.json"))


def test_bad_filters():
    with pytest.raises(BonsaiError, match=r"unknown category 'poetry' \(use one of: code, code-edit"):
        load_suite("short", categories=["poetry"])
    with pytest.raises(BonsaiError, match="at least 1"):
        load_suite("short", limit_per_category=0)


def test_filter_that_matches_nothing(tmp_path: Path):
    with pytest.raises(BonsaiError, match="has no prompts in the categories math"):
        load_suite(_write(tmp_path, [_good_entry()]), categories=["math"])

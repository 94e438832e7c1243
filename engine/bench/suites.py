"""Task suites for `bonsai bench --suite`: prompt sets shipped with the package or given as a file.

A suite is a JSON list (or a JSONL file, one object a line) of entries like
``{"id": "code-edit-03", "category": "code-edit", "max_tokens": 160, "messages": [{"role": "user", ...}]}``.
"""
from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from engine.bench.records import SuitePrompt
from engine.errors import BonsaiError

# Spec-Bench style categories plus code and code editing, in the order reports list them.
CATEGORIES: tuple[str, ...] = (
    "code", "code-edit", "math", "reasoning", "summarization", "translation", "qa", "multi-turn",
)
ROLES = ("system", "user", "assistant")
_REQUIRED_KEYS = ("id", "category", "messages")
_ALLOWED_KEYS = (*_REQUIRED_KEYS, "max_tokens")
_SCHEMA_HINT = ('each entry is {"id": str, "category": str, "max_tokens": int, '
                '"messages": [{"role": ..., "content": ...}]}')


def _shipped_dir() -> Any:
    """The folder of shipped suites (a Traversable: works from a wheel or an editable install)."""
    return resources.files("engine") / "data" / "suites"


def available_suites() -> list[str]:
    """Names of the suites shipped with bonsai (``full``, ``short``, ...), sorted."""
    folder = _shipped_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def _read_source(name_or_path: str) -> tuple[str, str]:
    """(label for messages, text) of a shipped suite name or a user's suite file."""
    looks_like_path = any(sep in name_or_path for sep in ("/", "\\")) or name_or_path.endswith((".json", ".jsonl"))
    if not looks_like_path and name_or_path in available_suites():
        return f"suite {name_or_path!r}", (_shipped_dir() / f"{name_or_path}.json").read_text(encoding="utf-8")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        try:
            return str(path), path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BonsaiError(f"cannot read suite file {path}: {e}; give a readable UTF-8 JSON or JSONL file") from None
    if looks_like_path:
        raise BonsaiError(f"suite file not found: {path}")
    shipped = ", ".join(available_suites()) or "none"
    raise BonsaiError(f"unknown suite {name_or_path!r} (available: {shipped}); "
                      "or give the path of a .json/.jsonl file with the same schema")


def _parse(label: str, text: str, jsonl: bool) -> list[tuple[str, Any]]:
    """(where, raw entry) pairs; ``where`` names the entry's position for error messages."""
    if jsonl:
        raw = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                raw.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise BonsaiError(f"{label} line {lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                                  "a JSONL suite holds one JSON object per line") from None
        return raw
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BonsaiError(f"{label} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                          "fix the file or save it as .jsonl with one entry per line") from None
    if not isinstance(data, list):
        raise BonsaiError(f"{label} must hold a JSON list of prompt entries, not a {type(data).__name__}; "
                          + _SCHEMA_HINT)
    return [(f"entry {i}", entry) for i, entry in enumerate(data)]


def _validate_entry(label: str, where: str, entry: Any) -> SuitePrompt:
    """The SuitePrompt of one raw entry, or a one-line BonsaiError naming the entry and the fix."""
    if not isinstance(entry, dict):
        raise BonsaiError(f"{label} {where} is a {type(entry).__name__}, not an object; " + _SCHEMA_HINT)
    if isinstance(entry.get("id"), str) and entry["id"]:
        where = f"{where} (id {entry['id']!r})"

    def fail(problem: str) -> BonsaiError:
        return BonsaiError(f"{label} {where}: {problem}")

    missing = [k for k in _REQUIRED_KEYS if k not in entry]
    if missing:
        raise fail(f"missing key(s) {', '.join(missing)}; " + _SCHEMA_HINT)
    unknown = sorted(set(entry) - set(_ALLOWED_KEYS))
    if unknown:
        raise fail(f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(_ALLOWED_KEYS)})")
    if not isinstance(entry["id"], str) or not entry["id"].strip():
        raise fail('"id" must be a non-empty string')
    category = entry["category"]
    if category not in CATEGORIES:
        raise fail(f"unknown category {category!r} (use one of: {', '.join(CATEGORIES)})")
    max_tokens = entry.get("max_tokens", SuitePrompt.max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise fail(f'"max_tokens" must be a positive integer, not {max_tokens!r}')
    messages = entry["messages"]
    if not isinstance(messages, list) or not messages:
        raise fail('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise fail(f'message {i} must be an object with exactly the keys "role" and "content"')
        if message["role"] not in ROLES:
            raise fail(f"message {i} has unknown role {message['role']!r} (use one of: {', '.join(ROLES)})")
        if not isinstance(message["content"], str) or not message["content"].strip():
            raise fail(f'message {i} has empty or non-string "content"; give the text of the message')
    if messages[-1]["role"] != "user":
        raise fail(f"the last message is from {messages[-1]['role']!r}; a prompt must end with a user message")
    return SuitePrompt(id=entry["id"], category=category, max_tokens=max_tokens,
                       messages=[{"role": m["role"], "content": m["content"]} for m in messages])


def load_suite(name_or_path: str, categories: list[str] | None = None,
               limit_per_category: int | None = None) -> list[SuitePrompt]:
    """The prompts of a shipped suite (by name) or of a user's JSON/JSONL file, in file order.

    ``categories`` keeps only those categories; ``limit_per_category`` keeps the first N of each.
    Raises ``BonsaiError`` with a one-line message for an unknown suite or any malformed entry.
    """
    if categories is not None:
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown:
            raise BonsaiError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))} "
                              f"(use one of: {', '.join(CATEGORIES)})")
    if limit_per_category is not None and (isinstance(limit_per_category, bool) or limit_per_category < 1):
        raise BonsaiError(f"the limit per category must be at least 1, not {limit_per_category!r}")
    label, text = _read_source(name_or_path)
    raw = _parse(label, text, jsonl=name_or_path.endswith(".jsonl"))
    if not raw:
        raise BonsaiError(f"{label} holds no prompts; " + _SCHEMA_HINT)
    prompts: list[SuitePrompt] = []
    seen: dict[str, str] = {}
    for where, entry in raw:
        prompt = _validate_entry(label, where, entry)
        if prompt.id in seen:
            raise BonsaiError(f"{label} {where}: id {prompt.id!r} is already used by {seen[prompt.id]}; "
                              "give every prompt a unique id")
        seen[prompt.id] = where
        prompts.append(prompt)
    if categories is not None:
        prompts = [p for p in prompts if p.category in categories]
    if limit_per_category is not None:
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            taken[p.category] = taken.get(p.category, 0) + 1
            if taken[p.category] <= limit_per_category:
                kept.append(p)
        prompts = kept
    if not prompts:
        raise BonsaiError(f"{label} has no prompts in the categories {', '.join(categories or [])}; "
                          "choose categories the suite contains")
    return prompts


def fresh_variant(prompt: SuitePrompt, repetition: int) -> SuitePrompt:
    """``prompt`` made unique for one repetition, so repeated runs never hit a prompt cache.

    Repetition 0 is the prompt itself. Otherwise the first message (the start of the rendered
    prompt, so no cached prefix beyond the template's header survives) gets a short line such as
    ``(run 3)`` in front; the task and the category stay the same.
    """
    assert repetition >= 0, repetition
    if repetition == 0:
        return prompt
    first, *rest = prompt.messages
    marked = {**first, "content": f"(run {repetition})\n{first['content']}"}
    return replace(prompt, messages=[marked, *[dict(m) for m in rest]])

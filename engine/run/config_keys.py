"""The run config's key checking (engine.run.config): a dataclass from a mapping with one-line errors for
unknown keys (with the nearest valid one), missing keys and wrong types, and sizes such as 6GB."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from engine.errors import BonsaiError


def fail(path: str, message: str) -> None:
    """The one-line error of a key with a wrong value."""
    raise BonsaiError(f"config {path}: {message}")


def parse_bytes(text: str, path: str) -> int:
    """'6GB', '512MiB', '1.5G' → bytes."""
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
             "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        fail(path, f"'{text}' is not a size like 6GB or 512MiB")
    return int(value * units[unit])


def build(cls: type, data: Any, path: str) -> Any:
    """A dataclass from a mapping: unknown keys, missing keys and wrong types are one-line errors."""
    where = path or "top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        fail(where, f"must be a mapping of keys, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
            fail(f"{path + '.' if path else ''}{key}", f"unknown key{hint}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key_path = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if dataclasses.is_dataclass(hints[name]):
                    build(hints[name], {}, key_path)  # names the first required key inside
                fail(key_path, "is required")
            continue
        kwargs[name] = _convert(hints[name], data[name], key_path)
    return cls(**kwargs)


def _convert(hint: Any, value: Any, path: str) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            fail(path, f"must be true or false, got {value!r}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, f"must be an integer, got {value!r}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(path, f"must be a number, got {value!r}")
        value = float(value)
    elif hint is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            fail(path, f"must be a string, got {value!r}")
        value = str(value)
    return value

"""The numbers a model file gives its architecture, read with the file's own key names and checked
against limits no supported model comes near: a value past them is a corrupt or hostile file,
refused in one line (the key, its value, what it must be) before anything is allocated.

The limits are far above today's largest models (Llama-3.1-405B: hidden 16384, FFN 53248, 126
layers, 128 heads; Gemma-3: a 262144-token vocabulary; contexts of 10M positions)."""
from __future__ import annotations

import math
from typing import Any, Mapping

from engine.errors import ModelFileError

LIMITS = {"vocab_size": 1 << 21, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_layers": 1024,
          "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 26}
_REQUIRED = object()


class Fields:
    """Typed, bounded reads of one file's architecture keys (config.json, or a GGUF's metadata with
    the architecture's prefix); every error names the key as the file spells it."""

    def __init__(self, data: Mapping[str, Any], prefix: str = ""):
        self.data, self.prefix = data, prefix

    def has(self, key: str) -> bool:
        return self.data.get(self.prefix + key) is not None

    def count(self, key: str, field: str, default: Any = _REQUIRED) -> int:
        """A positive whole number at most LIMITS[field] (ModelConfig's name of it)."""
        name = self.prefix + key
        value = self.data.get(name)
        if value is None:
            if default is _REQUIRED:
                raise ModelFileError(f"{name} is missing; the architecture needs it")
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(f"{name} is {_show(value)}; it must be a whole number")
        limit = LIMITS[field]
        if not 1 <= value <= limit:
            raise ModelFileError(f"{name} is {value}; it must be in 1..{limit}"
                                 + (" (the file is corrupt or not a model bonsai runs)" if value > limit else ""))
        return value

    def number(self, key: str, default: Any = _REQUIRED, low: float = 0.0, high: float = math.inf) -> float:
        """A finite number in (low, high)."""
        name = self.prefix + key
        value = self.data.get(name)
        if value is None:
            if default is _REQUIRED:
                raise ModelFileError(f"{name} is missing; the architecture needs it")
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high \
                or not math.isfinite(value):
            bounds = f"above {low}" + (f" and below {high}" if high != math.inf else "")
            raise ModelFileError(f"{name} is {_show(value)}; it must be a finite number {bounds}")
        return float(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.data.get(self.prefix + key)
        if value is None or isinstance(value, dict):
            return value
        raise ModelFileError(f"{self.prefix + key} is {_show(value)}; it must be an object (or absent)")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

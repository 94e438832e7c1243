"""Which format each tensor gets: a default, ordered pattern rules, embedding/head settings, `auto`.

Names are Hugging Face names (`model.layers.3.self_attn.q_proj.weight`). A rule's pattern is a
regular expression searched in the name, so a plain word (`q_proj`, `mlp.down_proj`) matches as a
substring. For a block matrix the first matching rule wins, then the `auto` rule, then the
default. The embedding and the output layer take `embed` / `head` (bfloat16 unless set). Vectors
(norms, biases) are never quantized. This module imports nothing else of bonsai.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from quant.formats import CODE_BITS, QuantSpec

EMBED_NAME = "model.embed_tokens.weight"
HEAD_NAME = "lm_head.weight"
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RecipeError(ValueError):
    """A recipe that does not fit the model (its message is one line for the user)."""


@dataclass(frozen=True)
class Rule:
    pattern: str
    spec: QuantSpec

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise RecipeError(f"pattern {self.pattern!r} is not a valid regular expression ({e})") from None

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


@dataclass(frozen=True)
class Recipe:
    default: QuantSpec = QuantSpec("tri", 128)
    rules: tuple[Rule, ...] = ()
    embed: QuantSpec = QuantSpec("bf16")
    head: QuantSpec = QuantSpec("bf16")
    auto: bool = False  # llama.cpp's rule: v_proj, and down_proj of some layers, to int4

    def __post_init__(self) -> None:
        if not isinstance(self.rules, tuple):
            object.__setattr__(self, "rules", tuple(self.rules))


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    n8 = num_layers // 8
    return layer < n8 or layer >= 7 * num_layers // 8 or (layer - n8) % 3 == 2


def is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D weight a format applies to (not a norm or bias)."""
    return len(shape) == 2 and name.endswith(".weight") and "norm" not in name.rsplit(".", 2)[-2]


def layer_kind(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` → `self_attn.q_proj` (what error messages list)."""
    stem = name[:-len(".weight")] if name.endswith(".weight") else name
    m = _LAYER_RE.search(stem)
    return stem[m.end():] if m else stem.removeprefix("model.")


def _auto_spec(recipe: Recipe, name: str, num_layers: int) -> QuantSpec | None:
    m = _LAYER_RE.search(name)
    if not recipe.auto or m is None:
        return None
    promoted = name.endswith("v_proj.weight") or (name.endswith("down_proj.weight")
                                                  and more_bits(int(m.group(1)), num_layers))
    if not promoted:
        return None
    return QuantSpec("int4", recipe.default.group_size)


def plan(recipe: Recipe, shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict[str, QuantSpec]:
    """The spec of every matrix in `shapes` (vectors are left out: they stay float).

    Raises RecipeError if a rule matches no block matrix or a group size does not divide a matrix's
    input dimension.
    """
    block = [n for n, s in shapes.items() if is_matrix(n, s) and n not in (EMBED_NAME, HEAD_NAME)]
    for rule in recipe.rules:
        if not any(rule.matches(n) for n in block):
            kinds = ", ".join(dict.fromkeys(layer_kind(n) for n in block))
            raise RecipeError(f"pattern {rule.pattern!r} matches no layer; the layers are: {kinds}")
    out: dict[str, QuantSpec] = {}
    for name, shape in shapes.items():
        if not is_matrix(name, shape):
            continue
        if name == EMBED_NAME:
            spec = recipe.embed
        elif name == HEAD_NAME:
            spec = recipe.head
        else:
            spec = next((r.spec for r in recipe.rules if r.matches(name)), None)
            if spec is None:
                spec = recipe.default
                auto = _auto_spec(recipe, name, num_layers)
                if auto is not None and CODE_BITS[auto.quant_type] > CODE_BITS[spec.quant_type]:
                    spec = auto
        out[name] = spec
    _check_groups(out, shapes)
    return out


def _check_groups(specs: dict[str, QuantSpec], shapes: dict[str, tuple[int, ...]]) -> None:
    bad = [(n, s) for n, s in specs.items() if not s.is_float and shapes[n][1] % s.group_size]
    if not bad:
        return
    name, spec = bad[0]
    k = shapes[name][1]
    fits = [g for g in (256, 128, 64, 32, 16, 8) if all(shapes[n][1] % g == 0 for n, _ in bad) and g < spec.group_size]
    hint = f"a group size of {fits[0]} fits" if fits else "choose a group size that divides it"
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    raise RecipeError(f"group size {spec.group_size} does not divide the input dimension {k} of {name}{more}: {hint}")


def calibration_plan(specs: dict[str, QuantSpec]) -> Callable[[str], QuantSpec | None]:
    """The plan the calibration methods take: the spec of every matrix to quantize, else None."""
    return lambda name: (s if (s := specs.get(name)) is not None and not s.is_float else None)

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


# GGUF block of the type each grid exports to losslessly (engine.quantization.gguf_export): a fallback group that is a
# multiple of it keeps the export exact at the fewest bits
EXPORT_BLOCK = {"tri": 64, "tri-dense": 64, "bin": 128, "int4": 32, "int8": 32}


def fallback_group(spec: QuantSpec, k: int) -> int:
    """The group size a tensor of input dimension k gets when spec's does not divide it: the largest
    divisor of k below spec's that packs whole bytes, among the multiples of the type's GGUF block
    first (K = 576, tri g128 → 64)."""
    per_byte = {"tri": 4, "bin": 8, "int4": 2}.get(spec.quant_type, 1)
    fits = [g for g in range(spec.group_size, 0, -1) if k % g == 0 and g % per_byte == 0]
    exportable = [g for g in fits if g % EXPORT_BLOCK.get(spec.quant_type, 1) == 0]
    return (exportable or fits)[0]


def plan(recipe: Recipe, shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict[str, QuantSpec]:
    """`plan_with_fallback`'s specs."""
    return plan_with_fallback(recipe, shapes, num_layers)[0]


def plan_with_fallback(recipe: Recipe, shapes: dict[str, tuple[int, ...]], num_layers: int
                       ) -> tuple[dict[str, QuantSpec], dict[int, list[str]]]:
    """The spec of every matrix in `shapes` (vectors are left out: they stay float), and the group
    fallbacks: {group used: the tensor classes that use it} where a spec's group size does not divide a
    matrix's input dimension (`fallback_group`; the model is never refused for it).

    Raises RecipeError if a rule matches no block matrix.
    """
    block = [n for n, s in shapes.items() if is_matrix(n, s) and n not in (EMBED_NAME, HEAD_NAME)]
    for rule in recipe.rules:
        if not any(rule.matches(n) for n in block):
            kinds = ", ".join(dict.fromkeys(layer_kind(n) for n in block))
            raise RecipeError(f"pattern {rule.pattern!r} matches no layer; the layers are: {kinds}")
    out: dict[str, QuantSpec] = {}
    fallbacks: dict[int, list[str]] = {}
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
        if not spec.is_float and shape[1] % spec.group_size:
            spec = QuantSpec(spec.quant_type, fallback_group(spec, shape[1]))
            kinds = fallbacks.setdefault(spec.group_size, [])
            if layer_kind(name) not in kinds:
                kinds.append(layer_kind(name))
        out[name] = spec
    return out, fallbacks


def calibration_plan(specs: dict[str, QuantSpec]) -> Callable[[str], QuantSpec | None]:
    """The plan the calibration methods take: the spec of every matrix to quantize, else None."""
    return lambda name: (s if (s := specs.get(name)) is not None and not s.is_float else None)

"""Quantization recipes: command-line options and the YAML file (`--recipe`) → quant.recipe.Recipe.

```yaml
quant_type: tri          # default format of block matrices
group_size: 64
embed_bits: 16           # 16 (bf16), 8, 4, 2 (tri) or 1 (bin)
head_bits: 16
auto: false              # llama.cpp's rule: v_proj and some down_proj to int4
rules:                   # ordered; the first matching pattern wins
  - pattern: "self_attn\\.(q|k|v|o)_proj"    # a regex searched in HF names; a plain word is a substring
    bits: 4              # or quant_type: int4
    group_size: 64       # optional: the recipe's group size
```
Unknown keys are errors that name the nearest valid key.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from engine.errors import BonsaiError
from quant.formats import QuantSpec
from quant.recipe import Recipe, Rule

TOP_KEYS = ("quant_type", "group_size", "embed_bits", "head_bits", "auto", "rules")
RULE_KEYS = ("pattern", "quant_type", "bits", "group_size")


def _check_keys(mapping: Any, valid: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(mapping, dict):
        raise BonsaiError(f"{where} must be a mapping of keys to values")
    for key in mapping:
        if key not in valid:
            near = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(valid)}"
            raise BonsaiError(f"unknown key '{key}' in {where}: {hint}")
    return mapping


def _spec(quant_type: Any, bits: Any, group_size: int, where: str) -> QuantSpec:
    try:
        if bits is not None:
            return QuantSpec.from_bits(int(bits), group_size)
        return QuantSpec(str(quant_type), group_size)
    except (ValueError, TypeError) as e:
        raise BonsaiError(f"{where}: {e}") from None


def read_recipe_file(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BonsaiError(f"recipe file not found: {path}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = " ".join(str(e).split())
        raise BonsaiError(f"{path} is not valid YAML ({first})") from None
    return _check_keys(data if data is not None else {}, TOP_KEYS, str(path))


def build_recipe(file_data: dict[str, Any] | None, *, quant_type: str | None, group_size: int | None,
                 sensitive_layers: str | None, sensitive_bits: int, embed_bits: int | None,
                 head_bits: int | None, auto: bool, where: str = "the recipe") -> Recipe:
    """Command-line options over the recipe file's values over the defaults (tri, group 128, bf16)."""
    data = file_data or {}
    group = group_size if group_size is not None else data.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise BonsaiError(f"group size must be a positive integer, not {group!r}")
    default = _spec(quant_type if quant_type is not None else data.get("quant_type", "tri"), None, group,
                    "--quant-type")
    rules = []
    for pattern in (p.strip() for p in (sensitive_layers or "").split(",")):
        if pattern:
            rules.append(_rule(pattern, _spec(None, sensitive_bits, group, "--sensitive-bits")))
    raw_rules = data.get("rules") or []
    if not isinstance(raw_rules, list):
        raise BonsaiError(f"'rules' in {where} must be a list of {{pattern, quant_type or bits, group_size}}")
    for i, raw in enumerate(raw_rules):
        rule = _check_keys(raw, RULE_KEYS, f"rule {i + 1} of {where}")
        if "pattern" not in rule or ("quant_type" in rule) == ("bits" in rule):
            raise BonsaiError(f"rule {i + 1} of {where} needs a pattern and one of quant_type or bits")
        spec = _spec(rule.get("quant_type"), rule.get("bits"), int(rule.get("group_size", group)),
                     f"rule {i + 1} of {where}")
        rules.append(_rule(str(rule["pattern"]), spec))
    embed = embed_bits if embed_bits is not None else data.get("embed_bits", 16)
    head = head_bits if head_bits is not None else data.get("head_bits", 16)
    return Recipe(default=default, rules=tuple(rules), embed=_spec(None, embed, group, "--embed-bits"),
                  head=_spec(None, head, group, "--head-bits"), auto=bool(auto or data.get("auto", False)))


def _rule(pattern: str, spec: QuantSpec) -> Rule:
    try:
        return Rule(pattern, spec)
    except ValueError as e:
        raise BonsaiError(str(e)) from None

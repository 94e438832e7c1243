"""Which tool-call syntax a chat template teaches its model, read from the template text itself
(a renamed file, or a fine-tune that kept its base's template, is still recognised)."""
from __future__ import annotations

HERMES = "hermes"  # Qwen2.5 / Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
QWEN3_XML = "qwen3_xml"  # Qwen3.5 / 3.6 / Qwen3-Coder: <tool_call><function=NAME><parameter=K>V</parameter>...
LLAMA3_JSON = "llama3_json"  # Llama 3.1+: [<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]
FAMILIES = (HERMES, QWEN3_XML, LLAMA3_JSON)


def detect_family(template: str | None) -> str | None:
    """The family of `template`'s tool calls, or None when it renders no tools we can parse."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template and "<function=" in template and "<parameter=" in template:
        return QWEN3_XML
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return LLAMA3_JSON
    return None

"""GGUF metadata for exports: copied from a source GGUF, or built from the architecture and a HF tokenizer.

Tokenizers built from tokenizer.json: byte-level BPE ('gpt2' in llama.cpp's terms), the kind of
Llama-3, Qwen and SmolLM. The pre-tokenizer regexes are matched against the ones llama.cpp knows
(engine.sources.tokenizer.PRE_TOKENIZER_SPLITS) to name `tokenizer.ggml.pre`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFValueType, GGUFWriter, RopeScalingType

from engine.errors import BonsaiError
from engine.sources.gguf_file import GGUFFile
from engine.sources.model_config import ModelConfig
from engine.sources.tokenizer import (GPT2_SPLIT, PRE_TOKENIZER_SPLITS, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED,
                              TOKEN_USER_DEFINED)

# keys the writer sets itself, or that describe the source file's own tensor types
_NOT_COPIED = {"general.architecture", "general.file_type", "general.quantization_version", "general.alignment"}


def copy_metadata(writer: GGUFWriter, source: GGUFFile, skip: frozenset[str] = frozenset()) -> None:
    """Every key of the source GGUF (architecture, tokenizer, chat template...) with its exact type, but
    those in `skip` (the caller writes them anew)."""
    for name, value in source.metadata.items():
        vtype, item = source.metadata_types[name]
        if name.startswith("GGUF.") or name in _NOT_COPIED or name in skip or item == GGUFValueType.ARRAY:
            continue
        writer.add_key_value(name, value, GGUFValueType(vtype), sub_type=GGUFValueType(item) if item is not None else None)


def add_architecture(writer: GGUFWriter, cfg: ModelConfig) -> None:
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling.factor)


def _split_patterns(pre: dict[str, Any] | None) -> tuple[str, ...] | None:
    """The regexes a tokenizer.json pre-tokenizer splits with, in order (None if not byte-level)."""
    steps = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" else [pre]
    patterns: list[str] = []
    byte_level = False
    for step in steps:
        kind = (step or {}).get("type")
        if kind == "Split" and "Regex" in step.get("pattern", {}):
            patterns.append(step["pattern"]["Regex"])
        elif kind == "Digits" and step.get("individual_digits"):
            patterns.append(r"\p{N}")
        elif kind == "ByteLevel":
            byte_level = True
            if step.get("use_regex", True):
                patterns.append(GPT2_SPLIT)
        else:
            return None
    return tuple(patterns) if byte_level else None


def _special_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def add_tokenizer_from_hf(writer: GGUFWriter, directory: Path, vocab_size: int) -> None:
    """tokenizer.ggml.* keys from tokenizer.json / tokenizer_config.json (byte-level BPE only)."""
    try:
        spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (OSError, ValueError) as e:
        raise BonsaiError(f"cannot read the tokenizer files of {directory} ({e})") from None
    model = spec.get("model") or {}
    patterns = _split_patterns(spec.get("pre_tokenizer"))
    pre = next((name for name, splits in PRE_TOKENIZER_SPLITS.items() if splits == patterns), None)
    if model.get("type") != "BPE" or patterns is None or pre is None:
        raise BonsaiError("--gguf: only byte-level BPE tokenizers with a pre-tokenizer llama.cpp knows are "
                          "written from a Hugging Face source; quantize from the model's GGUF to export this one")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    types: dict[int, int] = {}
    for added in spec.get("added_tokens") or []:
        vocab[added["content"]] = int(added["id"])
        types[int(added["id"])] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    size = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    token_types = [TOKEN_UNUSED] * size
    for token, index in vocab.items():
        tokens[index] = token
        token_types[index] = types.get(index, TOKEN_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        text = _special_text(config.get(key))
        if text is not None and text in vocab:
            add(vocab[text])
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str) and template:
        writer.add_chat_template(template)

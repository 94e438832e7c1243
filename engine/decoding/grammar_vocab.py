"""Our tokenizer as xgrammar sees it: every token's bytes, the vocabulary padded to the logits width,
the stop ids; and one grammar compiler per (tokenizer, width), cached (compiled grammars are cached
inside it, so a schema is compiled once per tokenizer).

A token's bytes: byte-level BPE (GPT-2 style, Qwen, SmolLM2, Llama 3) spells bytes with GPT-2's
alphabet, read back through its inverse; SentencePiece spells a space "▁" and byte-fallback tokens
`<0xNN>`; any other tokenizer (the tests' tiny ones) is asked for its text. Special (control)
tokens get no bytes: the grammar never allows them except the stop ids at its end.
"""
from __future__ import annotations

import re
import weakref
from typing import Any


from engine.sources.tokenizer import byte_alphabet

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → {vocab: compiler}


def token_bytes(tokenizer: Any, size: int) -> list[bytes]:
    """The bytes of token ids 0..size-1 (b"" for special tokens and ids the tokenizer lacks)."""
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    specials = getattr(tokenizer, "special_ids", frozenset())
    inverse = {c: b for b, c in byte_alphabet().items()}
    words = [t for t in tokens if t]
    byte_level = 50 * sum(t.startswith("\u0120") for t in words) > len(words)  # "Ġ" (a spelled space) opens 2%+
    sentencepiece = not byte_level and any(t.startswith("\u2581") for t in words)
    out = []
    for i, t in enumerate(tokens):
        if t is None or i in specials:
            out.append(b"")
        elif byte_level:
            out.append(bytes(inverse[c] for c in t) if all(c in inverse for c in t) else t.encode())
        elif sentencepiece:
            m = _BYTE_TOKEN.fullmatch(t)
            out.append(bytes([int(m.group(1), 16)]) if m else t.replace("\u2581", " ").encode())
        else:
            out.append(tokenizer.decode([i]).encode())
    return out


def tokenizer_info(tokenizer: Any, vocab: int | None = None) -> xgrammar.TokenizerInfo:
    """vocab: the width of the logits rows masked (default the tokenizer's vocabulary)."""
    import xgrammar  # here, not at module import: it imports transformers (~1.7 s a start)
    size = tokenizer.vocab_size if vocab is None else min(vocab, tokenizer.vocab_size)
    stops = sorted(i for i in getattr(tokenizer, "eos_ids", ()) if i < size)
    return xgrammar.TokenizerInfo(token_bytes(tokenizer, size), xgrammar.VocabType.RAW,
                                  vocab_size=vocab or size, stop_token_ids=stops or None)


def compiler(tokenizer: Any, vocab: int | None = None) -> xgrammar.GrammarCompiler:
    """The grammar compiler for `tokenizer` at logits width `vocab`, built once."""
    import xgrammar  # here, not at module import: it imports transformers (~1.7 s a start)
    per = _compilers.setdefault(tokenizer, {})
    if vocab not in per:
        per[vocab] = xgrammar.GrammarCompiler(tokenizer_info(tokenizer, vocab), max_threads=1)
    return per[vocab]

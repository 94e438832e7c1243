"""A tiny tokenizer for grammar tests: JSON's characters, letters, a few words, the tool-call tags."""
from __future__ import annotations

PIECES = (list('{}[]:,"\\ \n0123456789.-+eE_=<>/') + list("abcdefghijklmnopqrstuvwxyz")
          + ["true", "false", "null", '"name"', "<tool_call>", "</tool_call>", "<think>", "</think>", "<eos>"])


class GrammarTokenizer:
    """Token i reads PIECES[i]; the last one ends generation. vocab: pad the id space (a model's
    wider vocabulary: ids past the pieces read as nothing)."""

    def __init__(self, vocab: int = len(PIECES)):
        self.vocab_size = vocab
        self.special_ids = frozenset()
        self.eos_ids = frozenset({len(PIECES) - 1})

    def id_to_token(self, i: int) -> str | None:
        return PIECES[i] if i < len(PIECES) else None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] if i < len(PIECES) - 1 else "" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            n = next(n for n in range(12, 0, -1) if text[i:i + n] in PIECES[:-1])
            out.append(PIECES.index(text[i:i + n]))
            i += n
        return out

    def is_byte_token(self, i: int) -> bool:
        return False

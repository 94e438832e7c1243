"""Incremental detokenization: token ids arrive one at a time, text leaves in whole characters.

Decoding one token alone is wrong in two ways: a character may be split over several tokens (an
emoji is 4 bytes, often 2-4 byte-level tokens), and SentencePiece drops the space before the first
word of a text, so "▁world" decoded alone reads "world". ``StreamDecoder`` keeps two offsets into
the ids seen so far:

    ids:  [ ... emitted ... | prefix_offset ... read_offset | new ids ]

and on each token decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``. The text
the new ids add is the difference, released only when it does not end in U+FFFD (an incomplete
UTF-8 sequence, waiting for its next bytes). Both decodes start at the same token, so whatever the
decoder does at the start of a text (dropping SentencePiece's first space) it does to both, and
the difference keeps the space; only the window at the very start of the stream loses it, as
``decode`` of the whole does. ``ids[prefix_offset:read_offset]`` always produced text, so it
is never empty in the decoder's eyes. SentencePiece byte-fallback tokens
(``<0x..>``) are held back until a non-byte token follows, because the decoder reads a run of them
as one group and turns the whole group into U+FFFD if any byte is invalid (with
``skip_special_tokens`` a run goes on across the special tokens it skips).

The pieces, joined, with ``flush()`` at the end, equal ``tokenizer.decode(all_ids)``.
"""
from __future__ import annotations


from engine.sources.tokenizer import Tokenizer


class StreamDecoder:
    """Turns token ids, pushed one by one, into text pieces that never split a character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded as context
        self._read_offset = 0  # ids before this are already out as text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self._ids.append(int(token_id))
        if self._in_byte_run():
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """End the stream: the text still held back (an incomplete character at the end comes out
        as U+FFFD, as in ``decode``). The decoder is then empty, ready for a new stream."""
        text = self._emit(final=True)
        self._ids.clear()
        self._prefix_offset = self._read_offset = 0
        return text

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset:]
        held = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:held])
        text = self._decode(window)
        if not final and (len(text) <= len(prefix_text) or text.endswith("\ufffd")):
            return ""
        assert text.startswith(prefix_text), (prefix_text, text)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _in_byte_run(self) -> bool:
        """Whether the last token the decoder sees is a byte-fallback token (skipped special
        tokens are invisible to it, so a byte run goes on across them)."""
        ids = self._ids
        for k in range(len(ids) - 1, self._read_offset - 1, -1):
            token_id = ids[k]
            if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
                continue
            return self.tokenizer.is_byte_token(token_id)
        return False


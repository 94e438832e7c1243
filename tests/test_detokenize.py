"""StreamDecoder: pieces joined equal decode(all ids), and no piece shows a half-finished character."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_tokenizer import SPM_TEXTS, TEXTS, smollm2_metadata, spm_metadata

from engine.decoding.detokenize import StreamDecoder
from engine.sources.tokenizer import Tokenizer

STREAM_TEXTS = TEXTS + [
    "🎉🎊🎈 party " * 3,
    "混合 mixed テキスト with émojis 🇯🇵🇫🇷 and ZWJ 🧑‍💻",
    "Ⓐ Ⓑ Ⓒ ① ② ③ ½ ¾",
    "a😀b😀c😀",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_metadata(smollm2_gguf))


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_metadata())


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = StreamDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_pieces_join_to_decode(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text)
    pieces = stream(smollm2, ids)
    assert "".join(pieces) == smollm2.decode(ids)
    if "\ufffd" not in smollm2.decode(ids):
        assert not any("\ufffd" in piece for piece in pieces)


def test_partial_characters_wait(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🍕")
    assert len(ids) > 1  # a 4-byte emoji is several byte-level tokens here
    pieces = stream(smollm2, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[len(ids) - 1] == "🍕" and pieces[-1] == ""


def test_random_ids_join_to_decode(smollm2: Tokenizer) -> None:
    """Ids a model might sample, invalid UTF-8 included: still exactly decode(ids)."""
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randrange(1, 60))]
        assert "".join(stream(smollm2, ids)) == smollm2.decode(ids)
        assert "".join(stream(smollm2, ids, True)) == smollm2.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>assistant\nHi there 👋<|im_end|>")
    assert "".join(stream(smollm2, ids, skip_special_tokens=True)) == "assistant\nHi there 👋"


def test_flush_starts_a_new_stream(smollm2: Tokenizer) -> None:
    decoder = StreamDecoder(smollm2)
    first = smollm2.encode("one 😀")
    assert "".join(decoder.push(t) for t in first[:-1]) + decoder.flush() == smollm2.decode(first[:-1])
    second = smollm2.encode("two")
    assert "".join(decoder.push(t) for t in second) + decoder.flush() == "two"


# --- SentencePiece: the leading space and byte-fallback tokens ---

@pytest.mark.parametrize("text", SPM_TEXTS + ["hello world hello world", "日本 😀 café 😀", "hello 😀"])
def test_sentencepiece_pieces_join_to_decode(spm: Tokenizer, text: str) -> None:
    ids = spm.encode(text, add_special_tokens=True)
    pieces = stream(spm, ids)
    assert "".join(pieces) == spm.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_sentencepiece_keeps_spaces_between_words(spm: Tokenizer) -> None:
    ids = spm.encode("hello world hello")
    assert stream(spm, ids) == ["hello", " world", " hello", ""]


def test_sentencepiece_lone_space_token(spm: Tokenizer) -> None:
    """A "▁" on its own decodes to nothing at the start, but it is a space once text came before."""
    space, hello, world = spm.token_to_id("▁"), spm.token_to_id("▁hello"), spm.token_to_id("▁world")
    letter_h = spm.token_to_id("h")
    for ids in ([hello, space, letter_h], [space, letter_h], [hello, space, space, world], [space, space, world]):
        assert "".join(stream(spm, ids)) == spm.decode(ids)


def test_sentencepiece_invalid_bytes_match_decode(spm: Tokenizer) -> None:
    """A run of byte tokens is one group for the decoder: '€' then a stray byte makes the whole run U+FFFD."""
    euro = [spm.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    stray = spm.token_to_id("<0xFF>")
    ids = [spm.token_to_id("▁hello")] + euro + [stray, spm.token_to_id("▁world")]
    assert "".join(stream(spm, ids)) == spm.decode(ids) == "hello\ufffd\ufffd\ufffd\ufffd world"
    assert "".join(stream(spm, ids[:-2])) == spm.decode(ids[:-2]) == "hello€"


def test_sentencepiece_skipped_special_tokens(spm: Tokenizer) -> None:
    """A skipped </s> produces no text; the word after it still gets its space."""
    ids = [1, spm.token_to_id("▁hello"), 2, spm.token_to_id("▁world"), 2, 2, spm.token_to_id("!")]
    assert "".join(stream(spm, ids, skip_special_tokens=True)) == spm.decode(ids, True) == "hello world!"


def test_sentencepiece_random_ids(spm: Tokenizer) -> None:
    rng = random.Random(2)
    specials = [0, 1, 2, spm.token_to_id("▁"), spm.token_to_id("▁▁")]
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.3 else rng.randrange(spm.vocab_size)
               for _ in range(rng.randrange(1, 12))]
        assert "".join(stream(spm, ids)) == spm.decode(ids)
        assert "".join(stream(spm, ids, skip_special_tokens=True)) == spm.decode(ids, skip_special_tokens=True)

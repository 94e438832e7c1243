"""Tokenizer parity with transformers on SmolLM2's GGUF, plus a small synthetic SentencePiece vocabulary."""
from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ModelFileError, UnsupportedModelError
from engine.sources.gguf_file import GGUFFile
from engine.sources.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; we'd've known.",
    "DON'T SHOUT, IT'S RUDE",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "  both  ",
    " ",
    "    ",
    "\n",
    "\n\n\n",
    "line one\nline two\n\nline four\n",
    "\t",
    "\ttab\t\ttabs\t",
    "mixed \t \n whitespace \r\n windows",
    "a  b   c    d",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
    "class Foo:\n    def __init__(self):\n        self.x = [1, 2, 3]  # comment\n",
    "function f(x) {\n  if (x > 0) {\n    return x * 2;\n  }\n  return -x;\n}\n",
    "const xs = items.map((it) => it.id).filter(Boolean);",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42;",
    '{"key": "value", "list": [1, 2.5, null, true]}',
    "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "https://example.com/path?query=1&b=2#frag",
    "user@example.com",
    "😀",
    "I love pizza 🍕🍕!",
    "👨‍👩‍👧‍👦 family",
    "👍🏽 thumbs, 🏳️‍🌈 flag",
    "日本語のテキストです。",
    "中文字符测试，标点符号！",
    "한국어 텍스트",
    "Café naïve résumé façade Ångström",
    "Ünïcödé ÿ ß æ ø å",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "Ελληνικά γράμματα",
    "नमस्ते दुनिया",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "Order #12345 costs $1,234.56 (or €999,99).",
    "2024-01-15T10:30:00Z",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "<|im_start |> not special",
    "math: ∑ x² ≤ ∞, ∀ε>0 ∃δ",
    "zero\u200bwidth and non\u00a0breaking",
    "control \x00 \x07 \x1b chars",
    "ﬁ ligature and ① circled",
    "MiXeD CaSe WoRdS and camelCaseIdentifiers",
    "!!!???...---___===",
    "a" * 300,
]
# texts where transformers' GGUF tokenizer splits numbers unlike SmolLM2's own tokenizer (see hf_original_split)
NUMBER_SPLIT_TEXTS = {"ﬁ ligature and ① circled"}


@lru_cache(maxsize=None)
def smollm2_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's metadata as the loader hands it to Tokenizer (read once per test session)."""
    return GGUFFile(path).metadata


@pytest.fixture(scope="module")
def hf_original_split(smollm2_hf_tok: Any) -> Any:
    """transformers' GGUF tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json.

    transformers ignores tokenizer.ggml.pre == "smollm" and splits like GPT-2; SmolLM2 (and
    llama.cpp) first cut every numeric character off on its own. The two differ only on text with
    a number that has a merge with the space before it, such as " ①".
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(smollm2_hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def test_enough_texts() -> None:
    assert len(TEXTS) >= 50


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(smollm2_tok: Tokenizer, smollm2_hf_tok: Any, hf_original_split: Any, text: str) -> None:
    expected = smollm2_hf_tok.encode(text, add_special_tokens=False)
    if text in NUMBER_SPLIT_TEXTS:
        assert expected != hf_original_split.encode(text, add_special_tokens=False).ids  # still a divergence
        expected = hf_original_split.encode(text, add_special_tokens=False).ids
    assert smollm2_tok.encode(text) == expected
    assert smollm2_tok.encode(text, add_special_tokens=True) == expected  # this GGUF says add_bos_token = False
    assert smollm2_hf_tok.encode(text, add_special_tokens=True) == smollm2_hf_tok.encode(text, add_special_tokens=False)


def test_number_split_texts_follow_smollm2s_own_pre_tokenizer(smollm2_tok: Tokenizer, hf_original_split: Any) -> None:
    for text in TEXTS:
        assert smollm2_tok.encode(text) == hf_original_split.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(smollm2_tok: Tokenizer, smollm2_hf_tok: Any, text: str) -> None:
    ids = smollm2_hf_tok.encode(text, add_special_tokens=False)
    assert smollm2_tok.decode(ids) == smollm2_hf_tok.decode(ids)
    assert smollm2_tok.decode(ids, skip_special_tokens=True) == smollm2_hf_tok.decode(ids, skip_special_tokens=True)
    if smollm2_hf_tok.decode(ids) == text:
        assert smollm2_tok.decode(smollm2_tok.encode(text)) == text


def test_special_tokens(smollm2_tok: Tokenizer, smollm2_hf_tok: Any) -> None:
    assert smollm2_tok.vocab_size == len(smollm2_hf_tok) == 49152
    assert (smollm2_tok.bos_id, smollm2_tok.bos_token) == (smollm2_hf_tok.bos_token_id, smollm2_hf_tok.bos_token) == (1, "<|im_start|>")
    assert (smollm2_tok.eos_id, smollm2_tok.eos_token) == (smollm2_hf_tok.eos_token_id, smollm2_hf_tok.eos_token) == (2, "<|im_end|>")
    assert smollm2_tok.add_bos is False
    # <|im_end|> ends a turn (eos and the chat template), <|endoftext|> ends a document
    assert smollm2_tok.eos_ids == frozenset({2, 0})
    assert smollm2_tok.encode("<|im_start|>") == [1]
    for token_id in (0, 1, 2, 17, 28120, 49151):
        token = smollm2_tok.id_to_token(token_id)
        assert token == smollm2_hf_tok.convert_ids_to_tokens(token_id)
        assert smollm2_tok.token_to_id(token) == token_id
    assert smollm2_tok.token_to_id("no such token here") is None


def test_random_ids_decode_like_transformers(smollm2_tok: Tokenizer, smollm2_hf_tok: Any) -> None:
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(smollm2_tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert smollm2_tok.decode(ids) == smollm2_hf_tok.decode(ids)


def test_add_bos_from_metadata(smollm2_gguf: Path) -> None:
    meta = dict(smollm2_metadata(smollm2_gguf), **{"tokenizer.ggml.add_bos_token": True})
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert tokenizer.encode("hi", add_special_tokens=True) == [1] + tokenizer.encode("hi")


def test_hf_dir_matches_transformers(smollm2_tok: Tokenizer, smollm2_hf_tok: Any, tmp_path: Path) -> None:
    smollm2_hf_tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:  # the saved tokenizer.json has transformers' pre-tokenizer, so compare with it
        assert from_dir.encode(text) == smollm2_hf_tok.encode(text, add_special_tokens=False)
        assert from_dir.encode(text, add_special_tokens=True) == smollm2_hf_tok.encode(text, add_special_tokens=True)
        assert from_dir.decode(smollm2_hf_tok.encode(text)) == smollm2_hf_tok.decode(smollm2_hf_tok.encode(text))
    assert from_dir.chat_template == smollm2_tok.chat_template
    assert (from_dir.bos_id, from_dir.eos_id) == (1, 2)
    assert from_dir.eos_ids == frozenset({0, 2, 5})


def test_end_of_turn_token_from_chat_template(smollm2_gguf: Path) -> None:
    """A control token the template closes assistant turns with stops generation, named or not."""
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<jupyter_output>\n{% endfor %}"
    meta = dict(smollm2_metadata(smollm2_gguf), **{"tokenizer.chat_template": template})
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert tokenizer.eos_ids == frozenset({0, 2, tokenizer.token_to_id("<jupyter_output>")})


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# --- pre-tokenizers: the regex llama.cpp picks for tokenizer.ggml.pre ---

def _byte_level_meta(pre: str, merges: list[str], extra: list[str]) -> dict[str, Any]:
    from engine.sources.tokenizer import byte_alphabet

    tokens = list(byte_alphabet().values()) + extra
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(tokens), "tokenizer.ggml.merges": merges}


def test_smollm_splits_digits_but_gpt2_does_not() -> None:
    meta = _byte_level_meta("gpt2", ["1 2", "12 3"], ["12", "123"])
    assert Tokenizer.from_gguf_metadata(meta).encode("123") == [len(meta["tokenizer.ggml.tokens"]) - 1]
    meta["tokenizer.ggml.pre"] = "smollm"
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("123")] == ["1", "2", "3"]


def test_llama3_matches_whole_words_before_merging() -> None:
    """llama.cpp (and Llama 3's tokenizer.json) look a whole pre-token up before applying merges."""
    meta = _byte_level_meta("gpt2", ["a b"], ["ab", "abc"])
    assert Tokenizer.from_gguf_metadata(meta).encode("abc") == [256, ord("c") - ord("!")]
    meta.update({"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.bos_token_id": 256})
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert tokenizer.encode("abc") == [257]
    assert tokenizer.encode("abc", add_special_tokens=True) == [256, 257]  # llama.cpp's default for llama3


def test_byte_level_tokens_stored_as_text_are_respelled() -> None:
    """A normal token written with a real space (" hello") is the byte-level "Ġhello" its merges make."""
    meta = _byte_level_meta("gpt2", ["h e", "he l", "hel l", "hell o", "Ġ hello"],
                            ["he", "hel", "hell", "hello", " hello"])
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert tokenizer.encode(" hello") == [len(meta["tokenizer.ggml.tokens"]) - 1]
    assert tokenizer.decode(tokenizer.encode(" hello hello")) == " hello hello"


def test_merges_that_do_not_fit_the_tokens() -> None:
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer.from_gguf_metadata(_byte_level_meta("gpt2", ["x y"], []))  # "xy" is no token


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_split_regex_matches_transformers(pre: str) -> None:
    reference = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from tokenizers import Regex, pre_tokenizers

    from engine.sources.tokenizer import PRE_TOKENIZER_SPLITS

    theirs = pre_tokenizers.Split(Regex(reference.GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
    smollm2_tok = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                    for r in PRE_TOKENIZER_SPLITS[pre]])
    for text in TEXTS:
        assert smollm2_tok.pre_tokenize_str(text) == theirs.pre_tokenize_str(text)
    assert [p for p, _ in smollm2_tok.pre_tokenize_str("1234567")] == (
        ["123", "456", "7"] if pre == "llama-bpe" else list("1234567"))


def test_deepseek_llm_pre_tokenizer_builds() -> None:
    meta = _byte_level_meta("deepseek-llm", [], [])
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    assert tokenizer.decode(tokenizer.encode("Hello 世界 123\n")) == "Hello 世界 123\n"


def test_unknown_pre_tokenizer_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.sources.tokenizer"):
        tokenizer = Tokenizer.from_gguf_metadata(_byte_level_meta("no-such-pre", [], []))
    assert "no-such-pre" in caplog.text
    assert tokenizer.decode(tokenizer.encode("still works")) == "still works"


@pytest.mark.parametrize("meta, error", [
    ({}, ModelFileError),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": []}, ModelFileError),
    ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, UnsupportedModelError),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}, ModelFileError),  # no merges
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}, ModelFileError),  # no scores
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0],
      "tokenizer.ggml.token_type": [1, 1]}, ModelFileError),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0],
      "tokenizer.ggml.bos_token_id": 7}, ModelFileError),
])
def test_bad_metadata_is_a_one_line_error(meta: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error) as caught:
        Tokenizer.from_gguf_metadata(meta)
    assert "\n" not in str(caught.value)


# --- SentencePiece ("llama") vocabulary built from tokens and scores ---

SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "s", "i", "a", "n", ",", ".", "!", "é", "日", "本",
              "▁h", "el", "ll", "lo", "▁he", "▁hel", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁t",
              "he", "▁the", "is", "▁is", "in", "▁a", "an", "▁an", "▁▁", "▁▁▁▁"]


def spm_metadata(add_space_prefix: bool = True) -> dict[str, Any]:
    """A tiny Llama-style vocabulary: <unk> <s> </s>, 256 byte tokens, pieces, a user-defined <tool>."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    # longer pieces first; single characters last
    scores = [0.0] * 259 + [-float(i) - (100.0 if len(p) == 1 else 0.0) for i, p in enumerate(SPM_PIECES)] + [0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_space_prefix}


SPM_TEXTS = ["hello world", "hello  world!", "the world is an island.\n\nhello", "日本 café", "xyz 😀 ok",
             "", "  ", "<s>hello</s>", "a<tool>b", "hello<tool> world", "tab\there", "  two leading"]


def test_merges_from_scores_match_transformers() -> None:
    """Ties in score (common: byte and control tokens all score 0) order by longer left, longer right."""
    from transformers.tokenization_utils_base import generate_merges

    from engine.sources.tokenizer import merges_from_scores

    tokens = ["a", "b", "c", "d", "ab", "bc", "cd", "abc", "bcd", "abcd", "da", "dab", "cda"]
    scores = [0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -2.0, -1.0, -3.0, -1.0, -2.0, -2.0, -2.0]
    vocab = {token: index for index, token in enumerate(tokens)}
    assert merges_from_scores(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores)))


def test_sentencepiece_pieces_and_bos() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata())
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode("hello world")]
    assert pieces == ["▁hello", "▁world"]
    assert tokenizer.add_bos and tokenizer.encode("hello", add_special_tokens=True)[0] == 1
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    # characters outside the vocabulary fall back to their UTF-8 bytes
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("😀")][-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tokenizer.encode("a<tool>b")[1] == tokenizer.token_to_id("<tool>")
    assert tokenizer.encode("<s>") == [1]
    assert tokenizer.eos_ids == frozenset({2})


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_round_trip(text: str) -> None:
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata())
    expected = text[1:] if text.startswith(" ") else text  # the prefix space is merged into the first "▁"
    assert tokenizer.decode(tokenizer.encode(text)) == expected


def test_sentencepiece_without_space_prefix() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata(add_space_prefix=False))
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("hello world")][0] == "h"
    assert tokenizer.decode(tokenizer.encode(" hello world")) == " hello world"


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_matches_transformers_converter(text: str) -> None:
    reference = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    meta = spm_metadata()
    names = {"tokens": "tokens", "scores": "scores", "token_type": "token_type", "bos_token_id": "bos_token_id",
             "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id"}
    spec = {new: meta[f"tokenizer.ggml.{old}"] for old, new in names.items()}
    theirs, _ = reference.convert_gguf_tokenizer("llama", dict(spec, tokenizer_type="llama"))
    smollm2_tok = Tokenizer.from_gguf_metadata(meta)
    ids = theirs.encode(text, add_special_tokens=False).ids
    assert smollm2_tok.encode(text) == ids
    assert smollm2_tok.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


def test_sentencepiece_hf_dir_keeps_prefix_space_rules(tmp_path: Path) -> None:
    reference = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    meta = spm_metadata()
    spec = {"tokens": meta["tokenizer.ggml.tokens"], "scores": meta["tokenizer.ggml.scores"],
            "token_type": meta["tokenizer.ggml.token_type"], "tokenizer_type": "llama"}
    theirs, _ = reference.convert_gguf_tokenizer("llama", spec)
    theirs.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    for text in SPM_TEXTS:
        ids = theirs.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=False)
    assert tokenizer.encode("hi", add_special_tokens=True)[0] == 1

"""Text <-> token ids, built on the ``tokenizers`` library from a GGUF's metadata or a HF directory.

A GGUF stores no ``tokenizer.json``, only llama.cpp's keys: the token strings, their types, the
merges (byte-level BPE) or scores (SentencePiece), the special token ids and the chat template.
We rebuild the same tokenizer the model was trained with:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. Text is split by the regexes llama.cpp picks
  for ``tokenizer.ggml.pre``, then each byte is spelled with GPT-2's byte alphabet and merged.
- ``tokenizer.ggml.model == "llama"``: SentencePiece BPE. Spaces become "▁", a "▁" is put in front
  of the text (``add_space_prefix``, only at the very start, as transformers does), merges are
  ranked by the score of the token they make, characters outside the vocabulary fall back to the
  ``<0xNN>`` byte tokens.

Control tokens (type 3) become special tokens and user-defined ones (type 4) added tokens, so both
are matched whole when they appear in the text.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from engine.sources import chat_template as chat_template_module
from engine.errors import BonsaiError, ModelFileError, UnsupportedModelError

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's letters with case (Lu, Ll, Lt), as code point ranges; written as numbers because
# several (U+1F7D, U+2126, U+212A...) turn into other characters if the source is ever NFC-normalized
_DEEPSEEK_LETTERS = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F),
    (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481),
    (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126),
    (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)
DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?[" + "".join(f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LETTERS) + "]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + "]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
# tokenizer.ggml.pre -> the regexes applied one after the other, each splitting the pieces of the last
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2"), (GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (r"\p{N}", GPT2_SPLIT)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (QWEN2_SPLIT,)),
    "deepseek-llm": DEEPSEEK_LLM_SPLITS,
}
# llama.cpp matches a whole pre-token against the vocabulary before merging for these, and adds BOS
LLAMA3_FAMILY = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"))
# end-of-generation tokens llama.cpp recognises by name (when the vocabulary marks them control)
END_OF_GENERATION_NAMES = frozenset((
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
    "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|return|>", "<|call|>",
))


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes are themselves, the others
    (controls, space, soft hyphen...) are U+0100, U+0101, ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in table):
        table[byte] = chr(0x100 + offset)
    return table


def _spell_bytes(text: str, alphabet: dict[int, str]) -> str:
    return "".join(alphabet[byte] for byte in text.encode("utf-8"))


def _add_vocabulary_tokens(backend: Backend, tokens: list[str], types: list[int], vocab: dict[str, int]) -> None:
    """Control tokens as special tokens, user-defined ones as plain added tokens: both matched whole."""
    control = [t for i, (t, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_CONTROL and vocab.get(t) == i]
    user = [t for i, (t, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_USER_DEFINED and vocab.get(t) == i]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control if t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user if t])


def _byte_level_backend(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Backend:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelFileError("GGUF byte-level (gpt2) tokenizer has no tokenizer.ggml.merges; re-convert the model")
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        # control / user-defined tokens are stored as raw text and matched as such
        plain = kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or set(token) <= letters
        vocab[token if plain else _spell_bytes(token, alphabet)] = index
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise ModelFileError("GGUF tokenizer.ggml.merges has an entry without a space; the file is corrupt")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning("unknown tokenizer.ggml.pre %r: splitting text like GPT-2; tokens may differ from llama.cpp", pre)
        splits = (GPT2_SPLIT,)
    try:
        backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=pre in LLAMA3_FAMILY))
    except Exception as err:  # the tokenizers library raises a bare Exception
        raise ModelFileError(f"GGUF tokenizer merges do not fit its tokens ({_one_line(err)}); "
                             "the file is corrupt") from None
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_vocabulary_tokens(backend, tokens, types, vocab)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every way to cut a token into two tokens is a merge, and a merge
    ranks by the score of the token it makes (best first; ties: longer left part, then longer right
    part, then vocabulary order)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for index, (token, score) in enumerate(zip(tokens, scores)):
        if vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), index, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Backend:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelFileError("GGUF SentencePiece (llama) tokenizer lacks one tokenizer.ggml.scores per token; "
                             "re-convert the model")
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = Backend(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, [float(s) for s in scores]),
                                 unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_vocabulary_tokens(backend, tokens, types, vocab)
    return backend


def _special_token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelFileError(f"cannot read {path}: {_one_line(err)}; download the file again") from None


class Tokenizer:
    """A model's tokenizer: encode, decode, special tokens and chat template.

    Attributes: ``bos_id``/``eos_id`` and ``bos_token``/``eos_token`` (None if the model has none);
    ``eos_ids``, every id that ends generation (EOS, EOT/EOM, the chat template's end-of-turn token,
    llama.cpp's known end-of-generation tokens); ``special_ids``; ``add_bos``/``add_eos``, what
    ``encode(..., add_special_tokens=True)`` adds; ``chat_template`` (a caller may replace it);
    ``special_tokens_map``, the special token strings a chat template sees.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        extra_eos_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
    ) -> None:
        self._backend = backend
        self._byte_tokens: dict[int, bool] = {}  # id → is a byte-fallback token (is_byte_token)
        self.bos_id, self.eos_id = bos_id, eos_id
        # a tokenizer.json post-processor may add BOS/EOS itself; then it decides, not the flags
        probe = backend.encode("", add_special_tokens=True).ids
        self._backend_adds_specials = bool(probe)
        if self._backend_adds_specials:
            add_bos = bos_id is not None and probe[:1] == [bos_id]
            add_eos = eos_id is not None and probe[-1:] == [eos_id]
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.bos_token = self.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = self.id_to_token(eos_id) if eos_id is not None else None
        self.special_tokens_map = {
            name: self.id_to_token(token_id)
            for name, token_id in (("bos_token", bos_id), ("eos_token", eos_id), ("unk_token", unk_id),
                                   ("pad_token", pad_id))
            if token_id is not None and self.id_to_token(token_id) is not None
        }
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        specials = [added[token_id].content for token_id in self.special_ids]
        stops = {token_id for token_id in (eos_id, *extra_eos_ids) if token_id is not None}
        stops |= {self.token_to_id(name) for name in END_OF_GENERATION_NAMES.intersection(specials)}
        end_of_turn = chat_template_module.end_of_turn_token(chat_template, specials, self.special_tokens_map)
        if end_of_turn is not None:
            stops.add(self.token_to_id(end_of_turn))
        self.eos_ids: frozenset[int] = frozenset(token_id for token_id in stops if token_id is not None)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """The tokenizer described by a GGUF's metadata (``{key: field.contents()}``)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise ModelFileError("GGUF has no tokenizer metadata (tokenizer.ggml.model/tokens); "
                                 "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"GGUF tokenizer type {kind!r} is not supported (supported: gpt2, llama); "
                                        "use the model's Hugging Face directory instead")
        tokens = [str(token) for token in tokens]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)]
        if len(types) != len(tokens):
            raise ModelFileError(f"GGUF has {len(tokens)} tokens but {len(types)} token types; the file is corrupt")
        if kind == "gpt2":
            backend = _byte_level_backend(meta, tokens, types)
        else:
            backend = _sentencepiece_backend(meta, tokens, types)

        def token_id(key: str, required_valid: bool = False) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is None or 0 <= int(value) < len(tokens):
                return None if value is None else int(value)
            if required_valid:
                raise ModelFileError(f"GGUF tokenizer.ggml.{key} = {value} is outside the {len(tokens)}-token "
                                     "vocabulary; the file is corrupt")
            log.warning("ignoring tokenizer.ggml.%s = %s: outside the vocabulary", key, value)
            return None

        default_bos = kind == "llama" or meta.get("tokenizer.ggml.pre") in LLAMA3_FAMILY
        return cls(
            backend,
            bos_id=token_id("bos_token_id", required_valid=True),
            eos_id=token_id("eos_token_id", required_valid=True),
            extra_eos_ids=[i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None],
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template") or None,
            unk_id=token_id("unknown_token_id"),
            pad_id=token_id("padding_token_id"),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory (tokenizer.json and its config files)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelFileError(f"no tokenizer.json in {path}; download the model's tokenizer files too")
        spec = _read_json(path / "tokenizer.json")
        config = _read_json(path / "tokenizer_config.json", missing_ok=True)
        special_map = _read_json(path / "special_tokens_map.json", missing_ok=True)
        if "add_bos_token" in config or "add_eos_token" in config:
            spec["post_processor"] = None  # as transformers: the config's flags replace the post-processor
        try:
            backend = Backend.from_str(json.dumps(spec))
        except Exception as err:  # the tokenizers library raises a bare Exception on bad files
            raise ModelFileError(f"cannot load {path / 'tokenizer.json'}: {_one_line(err)}; "
                                 "download it again") from None

        def special_id(name: str) -> int | None:
            text = _special_token_text(config.get(name)) or _special_token_text(special_map.get(name))
            return backend.token_to_id(text) if text is not None else None

        value = _read_json(path / "generation_config.json", missing_ok=True).get("eos_token_id")
        extra_eos = [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, bos_id=special_id("bos_token"), eos_id=special_id("eos_token"), extra_eos_ids=extra_eos,
                   add_bos=bool(config.get("add_bos_token", False)), add_eos=bool(config.get("add_eos_token", False)),
                   chat_template=template if isinstance(template, str) else None,
                   unk_id=special_id("unk_token"), pad_id=special_id("pad_token"))

    def hf_files(self) -> dict[str, str]:
        """tokenizer.json, tokenizer_config.json and generation_config.json (contents) that
        ``from_hf_dir`` reads back as this tokenizer: for checkpoints made from a GGUF."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
                                  "add_eos_token": self.add_eos, "clean_up_tokenization_spaces": False,
                                  **self.special_tokens_map}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        generation = {"bos_token_id": self.bos_id,
                      "eos_token_id": [self.eos_id] * (self.eos_id is not None) + sorted(self.eos_ids - {self.eos_id})}
        return {"tokenizer.json": self._backend.to_str(pretty=True),
                "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
                "generation_config.json": json.dumps(generation, indent=2)}

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token (added tokens included) → its id."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def is_byte_token(self, token_id: int) -> bool:
        """Whether the id is a SentencePiece byte-fallback token (``<0x..>``); looked up once per id
        (streaming asks it for every token)."""
        answer = self._byte_tokens.get(token_id)
        if answer is None:
            token = self.id_to_token(token_id)
            answer = self._byte_tokens[token_id] = token is not None and _BYTE_TOKEN.fullmatch(token) is not None
        return answer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are matched
        as such. ``add_special_tokens`` adds BOS/EOS where the model's files ask for them."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self._backend_adds_specials:
            return ids
        if self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (a SentencePiece model drops the space it put before the first word)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The prompt for ``messages``, rendered with the model's chat template.

        The text already holds the template's BOS (if any): encode it with ``add_special_tokens=False``.
        Raises ``BonsaiError`` if the model has no chat template.
        """
        if not self.chat_template:
            raise BonsaiError("this model has no chat template; give it a plain-text prompt instead of chat "
                              "messages, or set a chat template for it")
        variables = {**self.special_tokens_map, **extra}
        return chat_template_module.render(self.chat_template, messages, add_generation_prompt, **variables)


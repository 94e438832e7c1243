"""The grammar maths without a model: specs, their grammars over a tiny tokenizer, the masks."""
from __future__ import annotations

import pytest
import torch

from engine.decoding.grammar import GrammarError, GrammarSpec, check
from engine.decoding.grammar_match import GrammarMatch, apply_mask, apply_mask_torch, bitmask, mask_rows
from engine.decoding.grammar_vocab import token_bytes
from tests.grammar_tokenizer import PIECES, GrammarTokenizer

TOK = GrammarTokenizer()
V = 80  # the logits width: wider than the pieces, as a model's padded vocabulary
EOS = len(PIECES) - 1
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
CLOCK = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}


def complete(spec: GrammarSpec, text: str) -> bool:
    """Whether `text` then the end-of-sequence token is a whole output of the grammar."""
    m = GrammarMatch(spec, TOK, V)
    ids = TOK.encode(text)
    if m.accept_prefix(ids) < len(ids):
        return False
    assert all(m.accept(t) for t in ids)
    return m.accept(EOS) and m.is_terminated()


PERSON = GrammarSpec.json_schema({"type": "object", "properties": {"age": {"type": "integer"},
                                                                   "tag": {"enum": ["a", "b"]}},
                                  "required": ["age", "tag"], "additionalProperties": False})


@pytest.mark.parametrize("text, ok", [
    ('{"age": 3, "tag": "a"}', True), ('{"age": -12, "tag": "b"}', True),
    ('{"age": 3}', False), ('{"age": "3", "tag": "a"}', False), ('{"age": 3, "tag": "c"}', False),
    ('{"age": 3, "tag": "a", "x": 1}', False), ('{"age": 3, "tag": "a"', False), ("[1]", False),
])
def test_json_schema_accepts_valid_and_refuses_invalid(text, ok):
    assert complete(PERSON, text) is ok


@pytest.mark.parametrize("text, ok", [('{"a": [1, true, null]}', True), ("{}", True), ("[1, 2]", False),
                                      ('"text"', False), ("{", False)])
def test_json_object(text, ok):
    assert complete(GrammarSpec.json_object(), text) is ok


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("mode, name, parallel, text, ok", [
    ("required", None, True, CALL, True), ("required", None, True, CALL + "\n" + CALL2, True),
    ("required", None, False, CALL + "\n" + CALL2, False), ("required", None, True, "hi", False),
    ("required", None, True, CALL.replace('"paris"', "3"), False), ("required", None, True, "", False),
    ("named", "time", True, CALL2, True), ("named", "time", True, CALL, False),
    ("auto", None, True, "just text", True), ("auto", None, True, "ok " + CALL + " done", True),
    ("auto", None, True, "ok <tool_call>\n{\"name\": \"nope\"", False),
])
def test_hermes_tool_calls(mode, name, parallel, text, ok):
    spec = GrammarSpec.tool_calls([WEATHER, CLOCK], "hermes", mode, name, parallel)
    assert complete(spec, text) is ok


def test_llama3_and_qwen_xml_formats():
    llama = GrammarSpec.tool_calls([WEATHER], "llama3_json", "required")
    assert complete(llama, '{"name": "get_weather", "parameters": {"city": "x", "days": 2}}')
    assert not complete(llama, '{"name": "get_weather", "arguments": {"city": "x"}}')
    xml = GrammarSpec.tool_calls([WEATHER], "qwen3_xml", "required")
    assert complete(xml, "<tool_call>\n<function=get_weather>\n<parameter=city>rome</parameter>\n</function>\n"
                         "</tool_call>")
    assert not complete(xml, CALL)


def test_reasoning_prefix_comes_before_the_constraint():
    spec = GrammarSpec.json_object().with_reasoning()
    assert complete(spec, '<think>hmm, {x</think>\n\n{"a": 1}')
    assert not complete(spec, '{"a": 1}')
    assert complete(GrammarSpec.json_object().with_reasoning(opened=True), 'so</think> {}')


@pytest.mark.parametrize("make, words", [
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "cannot be compiled"),
    (lambda: GrammarSpec.json_schema([1]), "must be a JSON object"),
    (lambda: GrammarSpec.tool_calls([{"parameters": {}}]), "has no name"),
    (lambda: GrammarSpec.tool_calls([{"name": "f", "parameters": "x"}]), "must be a JSON object"),
    (lambda: GrammarSpec.tool_calls([WEATHER], mode="named", name="nope"), "not among the tools"),
    (lambda: GrammarSpec.tool_calls([WEATHER, WEATHER]), "share a name"),
    (lambda: GrammarSpec.tool_calls([], mode="required"), "no tools"),
    (lambda: GrammarSpec.tool_calls([WEATHER], fmt="xml"), "unknown tool-call format"),
    (lambda: GrammarSpec.tool_calls([{"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}]), "cannot be compiled"),
])
def test_bad_specs_raise_one_line_grammar_errors(make, words):
    with pytest.raises(GrammarError) as e:
        check(make(), TOK, V)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_masks_allow_exactly_the_grammar_tokens_and_leave_other_rows():
    m = GrammarMatch(PERSON, TOK, V)
    logits = torch.randn(3, V)
    out = mask_rows(logits, [m], [1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [PIECES.index("{")]
    assert torch.equal(logits, logits.clone())  # the input is not written
    mask = bitmask(2, V)
    m.allowed(mask, 0)
    m.accept(PIECES.index("{"))
    m.allowed(mask, 1)
    a, b = torch.randn(2, V), None
    b = a.clone()
    assert torch.equal(apply_mask(a, mask), apply_mask_torch(b, mask))


def test_rows_of_several_grammars_filled_together_equal_each_alone():
    object_only = GrammarSpec.json_object()
    ahead = GrammarMatch(PERSON, TOK, V)
    assert ahead.accept_prefix(TOK.encode('{"age": 1')) == len(TOK.encode('{"age": 1'))
    for t in TOK.encode('{"age": 1'):
        assert ahead.accept(t)
    matches = [GrammarMatch(PERSON, TOK, V), ahead, GrammarMatch(object_only, TOK, V)]
    logits = torch.randn(4, V)
    out = mask_rows(logits, matches, [0, 2, 3])  # three rows: the batch filler
    for row, m in zip([0, 2, 3], matches):
        assert torch.equal(out[row], m.masked(logits[row]))  # one row: the matcher's own fill
    assert torch.equal(out[1], logits[1])


def test_drafts_cut_at_the_first_refused_token_and_state_kept():
    m = GrammarMatch(PERSON, TOK, V)
    ids = TOK.encode('{"age": x')
    assert m.accept_prefix(ids) == len(ids) - 1
    masks = m.draft_masks(ids[:-1])
    assert masks.shape[0] == len(ids)
    assert m.accept(ids[0])  # nothing was consumed by the look-ahead


def test_token_bytes_of_the_tokenizer_kinds():
    class Spelled(GrammarTokenizer):
        def __init__(self, pieces):
            super().__init__(len(pieces))
            self.pieces = pieces

        def id_to_token(self, i):
            return self.pieces[i]

    byte_level = Spelled(["\u0120hi", "a", "\u010a"] + ["\u0120x"] * 60)
    assert token_bytes(byte_level, 3) == [b" hi", b"a", b"\n"]
    piece = Spelled(["\u2581hi", "<0x0A>", "b"])
    assert token_bytes(piece, 3) == [b" hi", b"\n", b"b"]

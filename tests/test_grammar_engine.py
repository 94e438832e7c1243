"""Grammar-constrained decoding in the engine, on a tiny random model: outputs match their schema,
constrained and free rows batched together, speculation and lookahead change nothing, logit_bias,
logprobs after the mask."""
from __future__ import annotations

import json
import math

import pytest

from engine.decoding.engine import Engine
from engine.decoding.grammar import GrammarSpec
from engine.decoding.lookahead import Lookahead
from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Delta, Failed, Finished, Request
from engine.runtime.runner import ModelRunner
from engine.speculative.draft_model import DraftModelDrafter
from engine.speculative.ngram import NgramDrafter
from tests.grammar_tokenizer import PIECES, GrammarTokenizer
from tests.test_spec_generate import perturbed, tiny_loaded

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["ab", "c", "dd"]},
                                           "n": {"type": "integer", "minimum": -5, "maximum": 99}},
          "required": ["ok", "tag"], "additionalProperties": False}


def valid(doc) -> bool:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    return (isinstance(doc, dict) and set(doc) <= {"ok", "tag", "n"} and {"ok", "tag"} <= set(doc)
            and isinstance(doc["ok"], bool) and doc["tag"] in ("ab", "c", "dd")
            and type(doc.get("n", 0)) is int and -5 <= doc.get("n", 0) <= 99)


SEEN: dict[str, int] = {}  # what the last run's engine counted (drafts accepted)


def run(requests: list[dict], drafters=None, lookahead: bool = False, slots: int = 3, scale: float = 0.6):
    loaded = tiny_loaded(scale=scale)
    runner = ModelRunner(loaded, 128, num_slots=slots)
    tok = GrammarTokenizer(loaded.config.vocab_size)
    engine = Engine(runner, tok, drafters=drafters(loaded, slots) if drafters else None, lookahead=lookahead,
                    spec_gate=False)
    outs = []
    for i, kw in enumerate(requests):
        events: list = []
        outs.append(events)
        engine.submit(Request([3 + i, 9, 12, 5], id=str(i), emit=events.append, **kw))
    for _ in range(2000):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work
    SEEN["accepted"] = engine.metrics.spec_accepted
    result = []
    for events in outs:
        assert not any(isinstance(e, Failed) for e in events), events
        ids = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
        text = "".join(e.content + e.reasoning for e in events if isinstance(e, Delta))
        end = next(e for e in events if isinstance(e, Finished))
        result.append((ids, text, end.reason, [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]))
    return result


# a random model loves blanks, which JSON allows between tokens: biased away (logit_bias under a grammar)
BLANKS = {PIECES.index(" "): -100.0, PIECES.index("\n"): -100.0}


def constrained(seed: int | None = None, **kw) -> dict:
    sampling = (SamplingParams(logit_bias=BLANKS) if seed is None
                else SamplingParams(temperature=1.0, seed=seed, logit_bias=BLANKS))
    return dict(max_tokens=100, grammar=GrammarSpec.json_schema(SCHEMA), sampling=sampling, **kw)


def test_every_constrained_output_parses_and_validates_beside_free_rows(one_thread):
    reqs = [constrained(), dict(max_tokens=30), constrained(seed=1), constrained(seed=2), dict(max_tokens=12),
            constrained(seed=3)]
    out = run(reqs)
    for kw, (ids, text, reason, _) in zip(reqs, out):
        if "grammar" not in kw:
            assert reason == "length"  # free rows: untouched by the others' masks
            continue
        assert reason == "stop", text  # the grammar ended it
        assert valid(json.loads(text)), text


def test_free_rows_are_the_same_beside_constrained_ones(one_thread):
    alone = run([dict(max_tokens=30)], slots=3)
    beside = run([dict(max_tokens=30), constrained(), constrained(seed=4)], slots=3)
    assert beside[0][0] == alone[0][0]


def ngram(loaded, slots):
    return [NgramDrafter(1, 3) for _ in range(slots)]


def draft_model(loaded, slots):
    return [DraftModelDrafter(perturbed(loaded, 0.05), loaded.config.vocab_size, 128) for _ in range(slots)]


@pytest.mark.parametrize("drafters", [ngram, draft_model])
def test_greedy_output_is_the_same_with_speculation(one_thread, drafters):
    reqs = [constrained(), constrained(top_logprobs=2),
            dict(max_tokens=60, grammar=GrammarSpec.tool_calls([{"name": "f", "parameters": SCHEMA}]))]
    plain = run(reqs)
    spec = run(reqs, drafters)
    # n-gram drafts copy the output's own JSON, and are accepted; a draft model drafts without the mask
    # (its drafts are cut at the first refused token), so on a random model none survive
    assert SEEN["accepted"] > 0 or drafters is draft_model
    assert [o[:3] for o in spec] == [o[:3] for o in plain]
    for (_, _, _, a), (_, _, _, b) in zip(spec, plain):
        assert [x["token"] for x in a] == [x["token"] for x in b]
        assert all(math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4) for x, y in zip(a, b))


def test_lookahead_changes_nothing_under_a_grammar(one_thread, monkeypatch):
    """A launched step feeds the tokens already chosen under the mask; the mask of the next one is made
    when its logits are taken, from the matcher past those tokens: safe, and used."""
    used = []
    real_take = Lookahead.take
    monkeypatch.setattr(Lookahead, "take", lambda self, rows, tokens: used.append(
        (out := real_take(self, rows, tokens)) is not None) or out)
    reqs = [constrained(), dict(max_tokens=25), constrained(seed=5)]
    assert run(reqs, lookahead=True) == run(reqs, lookahead=False)
    assert any(used)


def test_logprobs_are_of_the_masked_distribution(one_thread):
    (_, text, _, lps), = run([constrained(top_logprobs=5)])
    assert text.startswith("{") and lps[0]["token"] == "{"
    assert lps[0]["logprob"] == pytest.approx(0.0, abs=1e-5)  # the only token allowed first: all the mass
    assert [t["token"] for t in lps[0]["top_logprobs"]] == ["{"]  # refused ids never listed
    for lp in lps:
        mass = sum(math.exp(t["logprob"]) for t in lp["top_logprobs"])
        assert mass <= 1 + 1e-4 and all(math.isfinite(t["logprob"]) for t in lp["top_logprobs"])


def test_logit_bias_bans_and_forces(one_thread):
    (free, *_), = run([dict(max_tokens=10)])
    banned = free[0]
    (ids, *_), = run([dict(max_tokens=10, sampling=SamplingParams(logit_bias={banned: -100}))])
    assert banned not in ids
    z = PIECES.index("z")
    (ids, *_), = run([dict(max_tokens=6, sampling=SamplingParams(logit_bias={z: 100}))])
    assert ids == [z] * 6


def test_bad_logit_bias_and_grammar_without_tokenizer_fail_alone(one_thread):
    loaded = tiny_loaded()
    engine = Engine(ModelRunner(loaded, 64, num_slots=2), None)
    events: list = []
    engine.submit(Request([1, 2], grammar=GrammarSpec.json_object(), emit=events.append))
    engine.submit(Request([1, 2], sampling=SamplingParams(logit_bias={10_000: 1.0}), emit=events.append))
    engine.step()
    fails = [e for e in events if isinstance(e, Failed)]
    assert [f.status for f in fails] == [400, 400]
    assert "tokenizer" in fails[0].message and "10000" in fails[1].message

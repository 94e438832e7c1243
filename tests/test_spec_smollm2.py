"""Speculative decoding on the real SmolLM2: at temperature 0 every drafter and the mix give
token for token what plain decoding gives (10 prompts x 80 tokens, past EOS so every answer is
full length), and bad input fails in one line. One plain reference run per prompt is shared by
the tests of this file."""
from __future__ import annotations

import pytest
import torch

from engine.weights.loader import load_model
from engine.runtime.runner import ModelRunner
from engine.speculative.config import SpeculativeConfig, build_drafter
from engine.speculative.draft_model import DraftModelDrafter
from engine.speculative.mix import MixDrafter
from engine.speculative.ngram import NgramDrafter
from tests.engine_runs import run_engine
from tests.test_cli_errors import assert_one_line_error, bonsai_in_process

pytestmark = pytest.mark.slow

PROMPTS = [
    "Rename the variable `x` to `total` in this code and show the whole code:\n\n"
    "def add(values):\n    x = 0\n    for v in values:\n        x += v\n    return x\n",
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape.",
    "Summarize: The committee met on Monday. The committee approved the budget. The committee will meet again "
    "next Monday to discuss the budget for the new library.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Translate to French: The cat is on the table. The dog is under the table.",
    "What is the capital of France? Answer in one sentence, then repeat the answer.",
    "Fix the bug in this function and show the corrected code:\n\ndef mean(xs):\n    return sum(xs) / len(x)\n",
    "List the first ten even numbers separated by commas.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea, then write it again in capital letters.",
]
MAX_TOKENS = 80
SEQ = 512


@pytest.fixture(scope="module")
def target(smollm2_loaded):
    return smollm2_loaded


@pytest.fixture(scope="module")
def prompts(target):
    tok = target.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(target, prompts):
    runner = ModelRunner(target, SEQ)
    request = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [run_engine(runner, target.tokenizer, ids, **request)[1] for ids in prompts]


def _spec_outputs(target, prompts, drafter, k, max_tokens=MAX_TOKENS):
    runner = ModelRunner(target, SEQ)
    request = dict(max_tokens=max_tokens, ignore_eos=True)
    out, total = [], None
    for ids in prompts:
        _, got, _, stats = run_engine(runner, target.tokenizer, ids, **request, drafter=drafter, k=k)
        out.append(got)
        if total is None:
            total = stats.speculative
        else:
            total.merge(stats.speculative)
    return out, total


def _first_difference(got, want) -> int:
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def test_ngram_output_equals_plain_decoding(target, prompts, plain):
    """`--spec ngram` as users run it (adaptive length) on every prompt; then always verifying
    k = 4 n-gram tokens (not adaptive) on two prompts, so verification does all the work."""
    assert sum(len(o) for o in plain) == 10 * MAX_TOKENS
    outputs, stats = _spec_outputs(target, prompts, MixDrafter([NgramDrafter(1, 4)]), k=4)
    for i, (got, want) in enumerate(zip(outputs, plain)):
        assert got == want, f"prompt {i}: differs from token {_first_difference(got, want)}"
    # how much the adaptive planner drafts depends on measured pass times (machine load: under load it may
    # draft nothing), so only its output is asserted; drafting and acceptance are asserted on the fixed-k run
    outputs, stats = _spec_outputs(target, prompts[:2], NgramDrafter(1, 4), k=4)
    assert outputs == plain[:2]
    print(f"fixed k = 4: {stats.accepted} of {stats.drafted} drafts accepted")
    assert stats.accepted > 20 and stats.drafted > stats.accepted  # drafts were accepted and rejected


def test_draft_model_and_mix_outputs_equal_plain_decoding(smollm2_gguf, target, prompts, plain):
    """The draft model is SmolLM2 itself with bfloat16 weights (a near copy that sometimes
    disagrees); the mix puts the n-gram drafter in front of it (adaptive)."""
    draft = load_model(smollm2_gguf, weight_dtype=torch.bfloat16)
    vocab = target.config.vocab_size
    n, short = 3, 48
    outputs, stats = _spec_outputs(target, prompts[:n], DraftModelDrafter(draft, vocab, SEQ + 8), 3, short)
    assert outputs == [p[:short] for p in plain[:n]]
    assert stats.accepted > 0.7 * stats.drafted
    mix = MixDrafter([NgramDrafter(1, 4), DraftModelDrafter(draft, vocab, SEQ + 8)])
    outputs, stats = _spec_outputs(target, prompts[:n], mix, 4, short)
    assert outputs == [p[:short] for p in plain[:n]]
    assert stats.steps > 0


def test_the_factory_builds_a_draft_model_and_refuses_another_tokenizer(smollm2_gguf, target, tmp_path):
    from tests.gguf_tiny import write_tiny_gguf
    drafter = build_drafter(SpeculativeConfig.from_spec(f"mix:ngram,draft:{smollm2_gguf}"), target, SEQ)
    assert [m.drafter.name for m in drafter.members] == ["ngram", "draft"]
    from engine.sources import store
    if store.find_pulled("smollm2-135m") is not None:  # a pulled name drafts as its path does
        by_name = build_drafter(SpeculativeConfig.from_spec("draft:smollm2-135m", adaptive=False), target, SEQ)
        assert by_name.loaded.path == store.find_pulled("smollm2-135m")
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, smollm2_gguf)
    from engine.errors import BonsaiError
    with pytest.raises(BonsaiError, match="another tokenizer"):
        build_drafter(SpeculativeConfig.from_spec(f"draft:{other}"), target, SEQ)


def test_cli_bad_spec_input_is_one_line(smollm2_gguf, tmp_path, capsys):
    from tests.gguf_tiny import write_tiny_gguf
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, smollm2_gguf)
    base = ("generate", str(smollm2_gguf), "-p", "hi", "-n", "2")

    def run(*args: str):
        return bonsai_in_process(capsys, *base, *args)
    assert_one_line_error(run("--spec", f"draft:{other}"), "another tokenizer")
    assert_one_line_error(run("--spec", f"draft:{tmp_path / 'missing.gguf'}"), "not found")
    assert_one_line_error(run("--spec", "ngarm"), "did you mean ngram")
    assert_one_line_error(run("--spec", "ngram", "--draft-tokens", "0"), "1..64")


def test_cli_generate_and_bench_report_draft_statistics(smollm2_gguf, tmp_path, capsys):
    import json
    proc = bonsai_in_process(capsys, "generate", str(smollm2_gguf), "--chat", "-p", PROMPTS[1], "-n", "24", "--spec",
                             "ngram", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    spec = out["timings"]["speculative"]
    assert spec["method"] == "ngram" and spec["steps"] >= 1 and spec["accepted"] <= spec["drafted"]
    # each pass gives accepted + 1 tokens; the rest came from steps the gate kept plain
    assert spec["steps"] + spec["accepted"] <= len(out["token_ids"])
    out = tmp_path / "b.json"
    proc = bonsai_in_process(capsys, "bench", str(smollm2_gguf), "--suite", "short", "--categories", "code-edit", "-r",
                             "1", "--spec", "mix:ngram", "--draft-tokens", "3", "--vs-plain", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["speculative"]["active"] and report["speculative"]["num_draft_tokens"] == 3
    suite = report["suite"]
    assert suite["outputs_compared"] == 1 and suite["output_mismatches"] == []
    assert set(suite["speedup"]) == {"code-edit", "overall"}
    overall = suite["by_category"]["overall"]["speculative"]
    # whether it drafts at all on one short prompt depends on measured times (the adaptive planner, and the gate
    # that keeps plain decoding where speculating measured slower): the counts are reported either way
    assert {"steps", "drafted", "accepted"} <= set(overall) and report["speculative"]["drafters"] == ["ngram"]
    assert "identical to plain decoding" in proc.stdout

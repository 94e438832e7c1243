"""A hybrid (DeltaNet) model through the generation core: speculative greedy output equal to plain
decoding (verify keeps every position's state, the rollback copies one back), prefix reuse only where
a slot's state is the prompt's prefix or a saved prefix point lies inside it (cache_n honest), no lookahead."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")

from engine.decoding.engine import Engine  # noqa: E402
from engine.decoding.generate import generate_text  # noqa: E402
from engine.decoding.sequence import Request  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.speculative.ngram import NgramDrafter  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from tests.engine_runs import run_engine  # noqa: E402
from tests.hybrid_tiny import engine_hybrid_config, make_hybrid_model  # noqa: E402
from tests.test_spec_generate import TinyTokenizer  # noqa: E402

PROMPT = [3, 17, 42, 9, 3, 17, 42, 9, 3, 17, 42, 9, 5]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, smollm2_gguf):
    import transformers
    tok_dir = tmp_path_factory.mktemp("tok")
    transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(tok_dir)
    path = tmp_path_factory.mktemp("qwen35-small-vocab")
    model = make_hybrid_model(path, tok_dir, vocab_size=64)
    with torch.no_grad():  # a peaked head: greedy loops soon, so n-gram drafts get accepted and rejected
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    return load_model(path, dtype=torch.float32, weight_dtype=torch.float32)


def test_greedy_with_ngram_equals_plain_decoding(loaded, one_thread):
    tok, request = TinyTokenizer(), dict(max_tokens=40, ignore_eos=True)
    plain = ModelRunner(loaded, 96)
    assert plain.rewinds_for_free is False and plain.decoder is None and plain.short_prefill_rows == 0
    _, plain_ids, _, _ = run_engine(plain, tok, PROMPT, **request)
    runner = ModelRunner(loaded, 96)
    _, ids, _, stats = run_engine(runner, tok, PROMPT, **request, drafter=NgramDrafter(1, 3), k=4)
    spec = stats.speculative
    assert ids == plain_ids and spec.drafted > 0 and 0 < spec.accepted < spec.drafted  # both ways exercised
    assert runner.slot(0).tokens == PROMPT + ids[:-1]


def test_prefix_reuse_only_where_the_state_was_saved(loaded, one_thread):
    tok = TinyTokenizer()
    runner = ModelRunner(loaded, 96)
    engine = Engine(runner, tok)
    first = generate_text(engine, Request(list(PROMPT), max_tokens=6, ignore_eos=True))
    follow = PROMPT + first[1][:-1] + [7, 8]  # the slot's tokens, then more: its state is that prefix's
    second = generate_text(engine, Request(list(follow), max_tokens=6, ignore_eos=True))
    assert second[3].cached_tokens == len(PROMPT) + len(first[1]) - 1
    fresh = generate_text(Engine(ModelRunner(loaded, 96), tok), Request(list(follow), max_tokens=6, ignore_eos=True))
    assert second[1] == fresh[1]
    branch = PROMPT[:6] + [11, 12]  # shares 6 tokens with the slot, whose state is past them: not reused
    third = generate_text(engine, Request(list(branch), max_tokens=6, ignore_eos=True))
    fresh = generate_text(Engine(ModelRunner(loaded, 96), tok), Request(list(branch), max_tokens=6, ignore_eos=True))
    assert third[3].cached_tokens == 0 and third[1] == fresh[1]


def test_the_memory_plan_counts_the_states_a_verify_pass_keeps(loaded):
    """With speculation every slot keeps the state after each position of its last verify pass (k + 2 of
    them: the rollback points): the plan counts them; a dense model and plain decoding have no such line."""
    from engine.memory.budget import run_settings
    from engine.memory.plan import _kv_lines
    cfg = loaded.config
    per_slot = cfg.hybrid.state_bytes_per_slot(2)
    spec = _kv_lines(cfg, run_settings(cfg, "cuda", 256, slots=3, verify_positions=6))[0]
    assert [(line.name.split(" (")[0], line.bytes) for line in spec[1:]] == [
        ("DeltaNet states", 3 * per_slot), ("DeltaNet verify states", 3 * 6 * per_slot)]
    plain, host = _kv_lines(cfg, run_settings(cfg, "cuda", 256, slots=3))
    assert [line.name.split(" (")[0] for line in plain] == ["KV cache bf16", "DeltaNet states"]
    from engine.runtime.hybrid_state import POINTS  # the prefix points: in host memory
    assert [(line.name.split(" (")[0], line.bytes) for line in host] == [("DeltaNet prefix points", 3 * POINTS * per_slot)]


def test_a_prefix_restarts_from_the_longest_point_saved_inside_it(loaded, one_thread):
    """Prefix points (the DeltaNet state after each prompt pass of several tokens, the newest two per slot): the
    same prompt again restarts from the last chunk boundary before its final token, a prompt that keeps the first
    one and changes what followed (a re-rendered earlier answer) from the first prompt's end; a point whose tokens
    the slot no longer begins with is never used; each answer equals a fresh engine's."""
    tok, request = TinyTokenizer(), dict(max_tokens=6, ignore_eos=True)
    engine = Engine(ModelRunner(loaded, 96, prefill_chunk_size=5), tok)

    def fresh(prompt):
        return generate_text(Engine(ModelRunner(loaded, 96, prefill_chunk_size=5), tok), Request(list(prompt), **request))
    first = generate_text(engine, Request(list(PROMPT), **request))  # 13 tokens: passes of 5, 5, 3 (points 10, 13)
    again = generate_text(engine, Request(list(PROMPT), **request))
    assert again[3].cached_tokens == 10 and again[1] == first[1]
    changed = PROMPT + [first[1][0] + 1, 7, 8]  # the first prompt, then not the slot's answer
    out = generate_text(engine, Request(list(changed), **request))
    assert out[3].cached_tokens == len(PROMPT) and out[1] == fresh(changed)[1]
    other = [5] + PROMPT[1:]  # differs at the first token: every point's tokens mismatch
    out = generate_text(engine, Request(list(other), **request))
    assert out[3].cached_tokens == 0 and out[1] == fresh(other)[1]


def test_the_scheduler_rewinds_a_slot_to_its_point_with_the_state_it_saved(loaded, one_thread):
    """A slot given a request from a prefix point holds that point's DeltaNet state (the scheduler rewinds it; a bare
    cut of its tokens would leave the state of everything it had seen): the prompt's logits equal a fresh run's."""
    from engine.decoding.scheduler import Scheduler
    prompt = PROMPT + [7, 8, 9, 10]  # 17 tokens: passes of 5, 5, 5, 2 (points 15 and 17)
    runner = ModelRunner(loaded, 96, prefill_chunk_size=5)
    slot = runner.slot(0)
    runner.prefill(slot, prompt)
    for token in (4, 5, 6):  # an answer after it: the slot's state moves past the prompt
        runner.forward(slot, [token])
    scheduler = Scheduler([slot])
    scheduler.submit("again", prompt)
    [a] = scheduler.assign()
    assert a.reused == 15 == slot.length
    got = runner.prefill(slot, prompt[a.reused:])
    fresh = ModelRunner(loaded, 96, prefill_chunk_size=5)
    assert torch.equal(got, fresh.prefill(fresh.slot(0), prompt))


def test_prefix_points_keep_the_newest_and_check_their_tokens():
    from engine.runtime.hybrid_state import POINTS, HybridStates
    states = HybridStates(engine_hybrid_config(("linear_attention", "full_attention"), 64), 2, torch.float32, "cpu")
    for n in range(1, POINTS + 2):  # one more than it keeps: the oldest goes
        states.recurrent[:, 1].fill_(n)
        states.conv[:, 1].fill_(-n)
        states.save_point(1, list(range(10 * n)))
    tokens = list(range(100))
    assert states.best_point(1, 100, tokens) == 10 * (POINTS + 1) and states.best_point(1, 15, tokens) == 0  # 10 went
    assert states.best_point(0, 100, tokens) == 0 and states.best_point(1, 100, [9] + tokens[1:]) == 0
    assert states.restore_point(1, 20, tokens) is not None and states.restore_point(1, 10, tokens) is None
    assert float(states.recurrent[:, 1].max()) == 2 and float(states.conv[:, 1].min()) == -2
    assert float(states.recurrent[:, 0].abs().max()) == 0  # another slot's state untouched


"""A hybrid (DeltaNet) model through the generation core: speculative greedy output equal to plain
decoding (verify keeps every position's state, the rollback copies one back), prefix reuse only where
a slot's state is the prompt's prefix (cache_n honest), no lookahead, run options it lacks refused."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")

from engine.decoding.engine import Engine  # noqa: E402
from engine.decoding.generate import generate_text  # noqa: E402
from engine.decoding.sequence import Request  # noqa: E402
from engine.errors import BonsaiError  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.speculative.ngram import NgramDrafter  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from tests.engine_runs import run_engine  # noqa: E402
from tests.hybrid_tiny import make_hybrid_model  # noqa: E402
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


@pytest.mark.parametrize("options, message", [
    (dict(kv_type="int8"), "KV type int8"), (dict(kv_offload=True), "KV offload")])
def test_unsupported_run_options_are_refused(loaded, options, message):
    with pytest.raises(BonsaiError, match=message):
        ModelRunner(loaded, 96, **options)


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
    plain = _kv_lines(cfg, run_settings(cfg, "cuda", 256, slots=3))[0]
    assert [line.name.split(" (")[0] for line in plain] == ["KV cache bf16", "DeltaNet states"]

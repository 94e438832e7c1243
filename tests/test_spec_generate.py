"""Speculative decoding through the generation core on tiny random models: greedy output equal to
plain decoding, the sampled distribution unchanged (exact enumeration vs chi-square), the cache
after accept/reject equal to one built from the accepted tokens, end rules inside accepted runs."""
from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.weights.loader import LoadedModel, TensorSummary
from engine.runtime.linear import Linear, cpu_bf16_gemm, linear
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams, apply_penalties, probabilities
from engine.speculative.draft_model import DraftModelDrafter
from engine.speculative.mix import MixDrafter
from engine.speculative.ngram import NgramDrafter
from tests.engine_runs import run_engine
from tests.test_kv_cache import TINY, tiny_model
from tests.test_spec_verify import chi_square_ok


class TinyTokenizer:
    """Token i reads 't{i} '; `eos` ends generation."""

    def __init__(self, eos: int | None = None):
        self.eos_ids = frozenset() if eos is None else frozenset({eos})
        self.special_ids = frozenset()
        self.vocab_size = 1 << 30  # every id reads as text

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"t{i} " for i in ids)

    def id_to_token(self, i: int) -> str:
        return f"t{i}"

    def is_byte_token(self, i: int) -> bool:  # engine.sources.tokenizer.Tokenizer's: no byte-fallback tokens here
        return False


def tiny_loaded(vocab: int = TINY.vocab_size, seed: int = 0, scale: float = 0.3, layers: int = 2) -> LoadedModel:
    cfg = replace(TINY, vocab_size=vocab, num_layers=layers)
    model = tiny_model(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, scale)
    return LoadedModel(model=model, tokenizer=None, config=cfg, path=Path("tiny"),
                       summary=TensorSummary("test", 0, 0, 0), device=torch.device("cpu"),
                       dtype=torch.float32, weight_dtype=torch.float32)


def perturbed(target: LoadedModel, noise: float, seed: int = 1) -> LoadedModel:
    """A draft model: the target's weights plus noise (agrees often, not always)."""
    out = tiny_loaded(target.config.vocab_size, layers=target.config.num_layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mine, theirs in zip(out.model.parameters(), target.model.parameters()):
            mine.copy_(theirs + noise * torch.randn(theirs.shape, generator=gen))
    return out


PROMPT = [5, 17, 3, 5, 17, 3, 42, 8, 5, 17]


def drafters(target: LoadedModel, noise: float = 0.02):
    vocab = target.config.vocab_size
    return {"ngram": NgramDrafter(1, 3), "draft": DraftModelDrafter(perturbed(target, noise), vocab, 96),
            "mix": MixDrafter([NgramDrafter(1, 3), DraftModelDrafter(perturbed(target, noise), vocab, 96)])}


@pytest.mark.parametrize("name", ["ngram", "draft", "mix", "draft-self"])
def test_greedy_output_equals_plain_decoding(one_thread, name):
    loaded = tiny_loaded()
    tok = TinyTokenizer()
    request = dict(max_tokens=40, ignore_eos=True)
    plain_text, plain_ids, _, _ = run_engine(ModelRunner(loaded, 96), tok, PROMPT, **request)
    if name == "draft-self":  # the target drafting for itself: every draft accepted
        drafter = DraftModelDrafter(loaded, loaded.config.vocab_size, 96)
    else:
        drafter = drafters(loaded)[name]
    runner = ModelRunner(loaded, 96)
    text, ids, finish, stats = run_engine(runner, tok, PROMPT, **request, drafter=drafter, k=4)
    assert ids == plain_ids and text == plain_text and finish == "length"
    spec = stats.speculative
    assert spec.steps > 0 and spec.drafted > 0 and stats.generated_tokens == 40
    assert 1 + spec.accepted + spec.steps == 40  # the first token, then accepted + bonus per step
    if name == "draft-self":
        assert spec.accepted == spec.drafted
        assert spec.mean_accepted_length > 3
    assert runner.slot(0).tokens == PROMPT + ids[:-1]  # as after plain decoding


needs_bf16_gemm = pytest.mark.skipif(not cpu_bf16_gemm(), reason="this CPU has no native bfloat16 GEMM")


@needs_bf16_gemm
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_bf16_matrices_give_every_row_the_same_result_at_any_width(threads):
    """The CPU bfloat16 path: 1..9 rows in one call, each row bit-identical to the same row in a call
    of 16 (a verify pass of k + 1 rows vs the decode step's one), within bf16 rounding of float32."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((17920, 1536), (896, 4864), (64, 32)):  # 17920 x 1536: a lone row takes another kernel
            w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / 30).bfloat16()  # [N, K]
            x = torch.randn(16, k, generator=torch.Generator().manual_seed(k))  # [16, K]
            every = linear(x, w)  # [16, N]
            assert every.dtype == torch.float32
            for rows in range(1, 10):  # k + 1 verified rows for k <= 8
                assert torch.equal(linear(x[:rows], w), every[:rows]), (n, k, rows)
            want = x @ w.float().T
            assert (every - want).abs().max() < 0.02 * want.abs().max()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_float16_matrices_give_a_verified_row_the_decode_steps_result(threads):
    """The CPU float16 path (the default matrices under float32 activations): each of 2..8 rows (a verify
    pass of k + 1 rows) is bit-identical to the same row run alone (the decode step), within float16
    rounding of float32; more rows go through one float32 GEMM."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((8960, 1536), (896, 4864), (64, 32)):
            w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / 30).half()  # [N, K]
            x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))  # [9, K]
            alone = torch.cat([linear(x[i:i + 1], w) for i in range(9)])  # [9, N]
            assert alone.dtype == torch.float32
            for rows in range(2, 9):
                assert torch.equal(linear(x[:rows], w), alone[:rows]), (n, k, rows)
            want = x @ w.float().T  # [9, N]
            assert (alone - want).abs().max() < 2e-3 * want.abs().max()
            assert (linear(x, w) - want).abs().max() < 1e-4 * want.abs().max()  # 9 rows: float32
    finally:
        torch.set_num_threads(previous)


@needs_bf16_gemm
def test_greedy_output_with_cpu_bf16_matrices_equals_plain_decoding(one_thread):
    loaded = tiny_loaded()
    for module in loaded.model.modules():
        if isinstance(module, Linear) and module is not loaded.model.lm_head:
            module.weight.data = module.weight.data.bfloat16()
    tok = TinyTokenizer()
    request = dict(max_tokens=40, ignore_eos=True)
    _, plain_ids, _, _ = run_engine(ModelRunner(loaded, 96), tok, PROMPT, **request)
    drafter = DraftModelDrafter(perturbed(loaded, 0.02), loaded.config.vocab_size, 96)
    _, ids, _, stats = run_engine(ModelRunner(loaded, 96), tok, PROMPT, **request, drafter=drafter, k=4)
    assert ids == plain_ids
    assert stats.speculative.accepted > 0 and stats.speculative.drafted > stats.speculative.accepted


def test_a_cpu_draft_model_runs_its_output_layer_narrow_and_still_drafts(one_thread):
    from engine.speculative.draft_model import narrow_output_layer
    target = tiny_loaded()
    assert not target.config.tie_word_embeddings
    draft = replace(perturbed(target, 0.02), weight_dtype=torch.float16)
    narrow_output_layer(draft)
    from engine.runtime.narrow_head import int8_head_usable
    assert draft.model.lm_head.weight.dtype == (torch.int8 if int8_head_usable() else torch.float16)
    exact = perturbed(target, 0.02)  # float32 matrices: the output layer is left as it is
    narrow_output_layer(exact)
    assert exact.model.lm_head.weight.dtype == torch.float32
    request = dict(max_tokens=24, ignore_eos=True)
    _, plain_ids, _, _ = run_engine(ModelRunner(target, 96), TinyTokenizer(), PROMPT, **request)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 96)
    _, ids, _, stats = run_engine(ModelRunner(target, 96), TinyTokenizer(), PROMPT, **request, drafter=drafter, k=4)
    assert ids == plain_ids and stats.speculative.accepted > 0
    fresh = DraftModelDrafter(draft, target.config.vocab_size, 96)
    first = fresh.propose(PROMPT, 3).tokens
    assert fresh.catch_up_seconds > 0  # the whole prompt was fed: not a cost of these 3 tokens
    fresh.propose(PROMPT + first[:2], 3)  # as after a step that kept 1 draft + the bonus
    assert fresh.catch_up_seconds == 0.0


def test_cache_after_accept_and_reject_equals_a_cache_of_the_accepted_tokens(one_thread):
    loaded = tiny_loaded()
    runner = ModelRunner(loaded, 96)
    drafter = drafters(loaded, noise=0.01)["draft"]  # another model: some drafts rejected
    _, ids, _, stats = run_engine(runner, TinyTokenizer(), PROMPT, max_tokens=30, ignore_eos=True, drafter=drafter, k=3)
    assert 0 < stats.speculative.accepted < stats.speculative.drafted
    slot = runner.slot(0)
    assert slot.tokens == PROMPT + ids[:-1]
    fresh = ModelRunner(loaded, 96)
    fresh.prefill(fresh.slot(0), slot.tokens)
    n = slot.length
    torch.testing.assert_close(runner.cache.k[:, 0, :, :n], fresh.cache.k[:, 0, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(runner.cache.v[:, 0, :, :n], fresh.cache.v[:, 0, :, :n], atol=1e-5, rtol=1e-4)
    draft_slot = drafter.runner.slot(0)  # the drafter's own cache holds a prefix of the context
    assert draft_slot.tokens == (PROMPT + ids)[:draft_slot.length]


@pytest.mark.parametrize("end", ["eos", "stop", "max_tokens", "capacity"])
def test_ends_inside_an_accepted_run_as_plain_decoding_does(one_thread, end):
    loaded = tiny_loaded()
    plain_runner = ModelRunner(loaded, 96)
    _, reference, _, _ = run_engine(plain_runner, TinyTokenizer(), PROMPT, max_tokens=30, ignore_eos=True)
    cut = reference[7]
    tok = TinyTokenizer(eos=cut if end == "eos" else None)
    request = dict(max_tokens=9 if end == "max_tokens" else 30, ignore_eos=end != "eos",
                   stop=(f"t{cut} ",) if end == "stop" else ())
    capacity = len(PROMPT) + 12 if end == "capacity" else 96
    plain = ModelRunner(loaded, capacity)
    want = run_engine(plain, tok, PROMPT, **request)
    spec = ModelRunner(loaded, capacity)
    got = run_engine(spec, tok, PROMPT, **request, drafter=DraftModelDrafter(loaded, loaded.config.vocab_size, 96), k=5)
    assert got[:3] == want[:3]
    assert spec.slot(0).tokens == plain.slot(0).tokens


def _exact_distribution(loaded: LoadedModel, prompt: list[int], params: SamplingParams, n: int) -> torch.Tensor:
    """P(first n tokens) by enumeration with plain decoding's maths: [V] * n → flat [V^n]."""
    vocab = loaded.config.vocab_size
    runner = ModelRunner(loaded, 64)
    out = torch.zeros(vocab ** n, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=n):
        prob = 1.0
        seen = torch.bincount(torch.tensor(prompt), minlength=vocab).float()
        output = torch.zeros(vocab)
        slot = runner.slot(0)
        slot.reset()
        logits = runner.prefill(slot, prompt)
        for i, t in enumerate(seq):
            prob *= probabilities(apply_penalties(logits, seen, output, params), params)[t].item()
            if prob == 0:
                break
            seen[t] += 1
            output[t] += 1
            if i + 1 < n:
                logits = runner.forward(slot, [t])[-1]
        out[sum(t * vocab ** (n - 1 - i) for i, t in enumerate(seq))] = prob
    return out


def test_sampling_distribution_is_unchanged(one_thread):
    """Three tokens, vocab 4, with top-k and a presence penalty: the joint distribution of the
    speculative output equals the enumerated one (the draft model's q differs from p; a one-hot
    q, as from n-gram drafts, is covered by tests/test_spec_verify.py)."""
    vocab, n_tokens, runs = 4, 3, 1500
    target = tiny_loaded(vocab, seed=0, scale=0.6, layers=1)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=0.9, top_k=3, presence_penalty=0.7, seed=11)
    exact = _exact_distribution(target, prompt, params, n_tokens)
    drafter = DraftModelDrafter(perturbed(target, 0.3), vocab, 64)
    runner = ModelRunner(target, 64)
    request = dict(max_tokens=n_tokens, sampling=params, ignore_eos=True, reuse_prefix=False)
    counts = torch.zeros(vocab ** n_tokens, dtype=torch.float64)
    accepted = 0
    for i in range(runs):
        request = {**request, "sampling": replace(params, seed=i)}
        _, ids, _, stats = run_engine(runner, TinyTokenizer(), prompt, **request, drafter=drafter, k=2)
        counts[sum(t * vocab ** (n_tokens - 1 - j) for j, t in enumerate(ids))] += 1
        accepted += stats.speculative.accepted
    assert accepted > runs // 10  # drafts were in play, not only plain steps
    stat, critical = chi_square_ok(counts, exact)
    assert stat < critical, (stat, critical)


def test_verify_runs_the_fused_decode_step_and_matches_plain_fused_decoding(one_thread):
    """Where decoding runs the fused step (a GPU; asked for here on the CPU), verify runs the same
    step over several rows: the greedy output equals plain fused decoding's, and making a step
    for a new row count leaves the cache as it was."""
    from engine.weights.loader import load_dummy
    from engine.weights.formats import WeightFormat
    from tests.test_decode_step import CFG
    loaded = load_dummy(CFG, "tiny", weight_format=WeightFormat("tri", 64, "int4"))
    tok = TinyTokenizer()
    request = dict(max_tokens=24, ignore_eos=True)
    plain = ModelRunner(loaded, 96, fast_decode=True)
    _, want, _, _ = run_engine(plain, tok, PROMPT, **request)
    runner = ModelRunner(loaded, 96, fast_decode=True)
    runner.prefill(runner.slot(0), PROMPT)
    before = runner.cache.k[:, 0, :, :len(PROMPT)].clone()
    logits, hidden = runner.verify(runner.slot(0), [want[0], want[1], 7])
    assert hidden == {} and logits.shape == (3, CFG.vocab_size) and set(runner._row_steps) == {3}
    torch.testing.assert_close(runner.cache.k[:, 0, :, :len(PROMPT)], before)
    runner.slot(0).reset()
    _, got, _, stats = run_engine(runner, tok, PROMPT, **request, drafter=NgramDrafter(1, 3), k=4)
    assert got == want and stats.speculative.drafted > 0


def test_model_bench_decodes_speculatively_with_a_drafter(one_thread):
    from engine.bench.model_bench import BenchTest, run_model_bench, run_test
    from engine.speculative.stats import SpecStats
    from tests.engine_runs import engine_over
    loaded = tiny_loaded()
    [m] = run_model_bench(engine_over(ModelRunner(loaded, 96), None, NgramDrafter(1, 3)), [BenchTest(8, 24)], 2,
                          frozenset())
    spec = m.summary()["speculative"]
    assert spec["steps"] + spec["accepted"] == 2 * 24 and spec["drafted"] > 0  # n_gen tokens per repetition
    runner, stats = ModelRunner(loaded, 96), SpecStats()
    run_test(engine_over(runner, None, MixDrafter([NgramDrafter(1, 3)])), BenchTest(8, 24), 1, frozenset(), stats)
    plain = ModelRunner(loaded, 96)
    run_test(engine_over(plain, None), BenchTest(8, 24), 1, frozenset())
    assert runner.slot(0).tokens[:33] == plain.slot(0).tokens  # the same greedy tokens

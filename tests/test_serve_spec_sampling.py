"""Speculative decoding inside the server's engine loop, what changes the target's distribution or reads its
states: penalties and the thinking budget with speculation, drafters that read hidden states (MTP, DFlash),
graphed speculative steps of several slots on the GPU, and sampling through the speculative step keeping the
distribution. The tiny model, its engines and plain decoding are test_serve_spec's."""
from __future__ import annotations

import pytest
import torch

from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Finished, ThinkingRules
from engine.runtime.runner import ModelRunner
from engine.speculative.config import SpeculativeConfig
from engine.speculative.drafter import Draft
from tests.engine_runs import Threaded, run_engine, spec_engine
from tests.test_serve_engine import collect, submit
from tests.test_serve_spec import NGRAM, PROMPTS, kv_matches_tokens, loaded, make_engine, plain  # noqa: F401


def test_penalties_and_thinking_budget_with_speculation(loaded, smollm2_tok, one_thread):
    greedy_penalized = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3)
    want = plain(loaded, smollm2_tok, PROMPTS[0], 20, sampling=greedy_penalized)[0]
    rules = ThinkingRules("<think>", "</think>", "Time is up.")
    think = smollm2_tok.encode("<|im_start|>assistant\n<think>\n")
    engines = [make_engine(loaded, smollm2_tok, rules=rules, spec=spec) for spec in (NGRAM, None)]
    try:
        spec_engine, plain_engine = engines
        text, _, _ = collect(submit(spec_engine, PROMPTS[0], max_tokens=20, sampling=greedy_penalized)[1])
        assert text == want
        # logprobs of tokens that arrived as accepted drafts are their rows' (as plain decoding's)
        events = [[], []]
        for e, out in zip(engines, events):
            _, q = submit(e, PROMPTS[1], max_tokens=12, top_logprobs=2)
            while not isinstance(event := q.get(timeout=60), Finished):
                out += event.logprobs
        assert [x["token"] for x in events[0]] == [x["token"] for x in events[1]] and len(events[0]) == 12
        assert [x["logprob"] for x in events[0]] == pytest.approx([x["logprob"] for x in events[1]], abs=1e-4)
        assert [t["token"] for x in events[0] for t in x["top_logprobs"]] == \
            [t["token"] for x in events[1] for t in x["top_logprobs"]]
        results = [collect(submit(e, think, max_tokens=20, thinking_budget=4, thinking_at_start=True)[1])
                   for e in engines]
        assert results[0][:2] == results[1][:2] and results[0][1].rstrip().endswith("Time is up.")
        # sampling at T > 0 runs through the rejection rule, reproducibly with a seed
        sampled = SamplingParams(temperature=0.8, top_k=40, seed=7)
        runs = [collect(submit(spec_engine, PROMPTS[1], max_tokens=16, sampling=sampled)[1]) for _ in range(2)]
        assert runs[0][0] == runs[1][0] and runs[0][2].usage["completion_tokens"] == 16
    finally:
        for e in engines:
            e.stop()


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_drafters_reading_hidden_states_verify_per_slot_and_keep_greedy_output(loaded, smollm2_tok, one_thread, kind):
    from engine.speculative.drafter_train import TrainConfig, make_drafter, new_module
    cfg = TrainConfig(kind=kind, steps=1, block_size=3, batch=1, seq_len=24).drafter_config(loaded.config)
    engine = make_engine(loaded, smollm2_tok, slots=2, fused=True,
                         spec=SpeculativeConfig.from_spec("ngram", num_draft_tokens=3, adaptive=False))
    try:
        for s in engine.spec.slots:  # untrained: drafts are mostly rejected, but every path runs
            s.drafter = make_drafter(new_module(cfg, loaded.config.vocab_size), loaded)
        jobs = [submit(engine, p, max_tokens=12, id=f"r{i}") for i, p in enumerate(PROMPTS[:2])]
        for p, (_, q) in zip(PROMPTS[:2], jobs):
            text, _, fin = collect(q)
            assert text == plain(loaded, smollm2_tok, p, 12)[0] and fin.timings["draft_n"] > 0
        kv_matches_tokens(engine, 0)
    finally:
        engine.stop()


@pytest.mark.gpu
def test_graphed_speculative_steps_of_several_slots_match_plain_graphed_decoding(smollm2_gguf, monkeypatch):
    """On a GPU: 4 slots' [token + drafts] rows in one graphed step give plain graphed decoding's
    greedy tokens, with drafts accepted, and the widest step stays within 16 rows."""
    from engine.weights.loader import load_model
    loaded = load_model(smollm2_gguf, "cuda")
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in ("1, 2, 3, 4, 5, 6,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
                                         "The cat sat on the mat. The cat sat on the", "Once upon a time")]
    single = ModelRunner(loaded, max_seq_len=256)
    want = [run_engine(single, tok, p, max_tokens=48, ignore_eos=True)[1] for p in prompts]
    runner = ModelRunner(loaded, max_seq_len=256, num_slots=4)
    core = spec_engine(runner, tok, NGRAM, slot_context=256)
    runner.prepare_rows(core.spec.max_rows())
    widths: list[int] = []
    step_rows = runner.step_rows
    monkeypatch.setattr(runner, "step_rows", lambda t, p, s: widths.append(len(t)) or step_rows(t, p, s))
    engine = Threaded(core)
    try:
        jobs = [submit(engine, p, max_tokens=48, id=f"g{i}") for i, p in enumerate(prompts)]
        results = [collect(q) for _, q in jobs]
        for w, (text, _, fin) in zip(want, results):
            assert text == tok.decode(w) or fin.reason == "stop"  # an EOS ends it early: the text then is a prefix
            assert tok.decode(w).startswith(text)
        assert sum(fin.timings["draft_n_accepted"] for _, _, fin in results) > 0
        assert runner.decoder.graph is not None and 4 < max(widths) <= 16  # slots' drafts shared steps
    finally:
        engine.stop()


class Fixed:
    """Always drafts one given token (q one-hot): accepted with probability p(token), else the
    target's token comes from the residual."""
    name, hidden_layers = "fixed", ()

    def __init__(self, token: int):
        self.token = token

    def begin(self, prompt):
        pass

    def propose(self, context, k):
        return Draft([self.token][:k], source=self.name)

    def observe(self, feedback):
        pass


def test_sampling_through_the_speculative_step_keeps_the_distribution(loaded, smollm2_tok, one_thread):
    """The first two tokens' joint distribution at T > 0 (top-k 3: 9 outcomes) equals plain
    sampling's when the second comes through verification of a one-hot draft (chi-square)."""
    from engine.decoding.sampling import probabilities
    params = SamplingParams(temperature=1.5, top_k=3)
    prompt = PROMPTS[2]
    runner = ModelRunner(loaded, max_seq_len=32)
    p1 = probabilities(runner.prefill(runner.slot(0), prompt)[:smollm2_tok.vocab_size], params)  # [V]
    exact: dict[tuple[int, int], float] = {}
    for t1 in torch.topk(p1, 3).indices.tolist():
        runner.slot(0).rewind(runner.slot(0).length - len(prompt))
        p2 = probabilities(runner.forward(runner.slot(0), [t1])[-1][:smollm2_tok.vocab_size], params)  # [V]
        for t2 in torch.topk(p2, 3).indices.tolist():
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
    likely = max(exact, key=exact.get)
    engine = make_engine(loaded, smollm2_tok, slots=8, context=32, fused=True)
    counts = dict.fromkeys(exact, 0)
    try:
        for s in engine.spec.slots:
            s.drafter = Fixed(likely[1])  # the likeliest second token: accepted often, rejected often
        n, drafted = 240, 0
        text = {pair: (smollm2_tok.decode([pair[0]]), smollm2_tok.decode([pair[1]])) for pair in exact}
        assert len(set(text.values())) == len(text)  # the outcomes are told apart by their text
        by_text = {v: k for k, v in text.items()}
        for group in range(0, n, 8):  # 8 slots sample together
            jobs = [submit(engine, prompt, max_tokens=3, top_logprobs=0,
                           sampling=SamplingParams(temperature=1.5, top_k=3, seed=i))[1] for i in range(group, group + 8)]
            for q in jobs:
                tokens: list[str] = []
                while not isinstance(event := q.get(timeout=60), Finished):
                    tokens += [x["token"] for x in event.logprobs]
                counts[by_text[tuple(tokens[:2])]] += 1
                drafted += event.timings["draft_n"]
        assert drafted > n // 2
    finally:
        engine.stop()
    stat = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert stat < 26.12, (stat, counts, exact)  # chi-square, 8 degrees of freedom, p = 0.001

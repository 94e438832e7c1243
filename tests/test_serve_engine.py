"""The engine loop on a tiny random model (real SmolLM2 tokenizer): concurrent requests decoded in
one batched step give what plain single-request generation gives; prefix reuse; cancellation;
thinking budget; a failing request leaves the others running."""
from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
import torch

from engine.decoding.engine import Engine
from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Delta, Failed, Finished, Request, ThinkingRules
from engine.runtime.model import Transformer
from engine.runtime.runner import ModelRunner
from engine.sources.model_config import ModelConfig
from engine.weights.loader import LoadedModel, TensorSummary
from tests.engine_runs import Threaded, run_engine


def tiny_loaded(vocab: int) -> LoadedModel:
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return LoadedModel(model=model.eval(), tokenizer=None, config=cfg, path=Path("tiny"),
                       summary=TensorSummary("test", 0, 0, 0), device=torch.device("cpu"),
                       dtype=torch.float32, weight_dtype=torch.float32)


@pytest.fixture(scope="module")
def loaded(smollm2_tok):
    return tiny_loaded(smollm2_tok.vocab_size)


def make_engine(loaded, tok, slots=4, chunk=8, context=128, rules=None, budget=None) -> Threaded:
    runner = ModelRunner(loaded, max_seq_len=context, num_slots=slots, prefill_chunk_size=chunk)
    return Threaded(Engine(runner, tok, context, max_queue=8, rules=rules, prefill_budget=budget))


def submit(engine, prompt, max_tokens=12, id="r", **kw) -> tuple[Request, queue.Queue]:
    q: queue.Queue = queue.Queue()
    req = Request(id=id, prompt_ids=list(prompt), max_tokens=max_tokens, emit=q.put, **kw)
    engine.submit(req)
    return req, q


def collect(q: queue.Queue, timeout=60.0):
    text, reasoning = "", ""
    while True:
        event = q.get(timeout=timeout)
        if isinstance(event, Delta):
            text += event.content
            reasoning += event.reasoning
        elif isinstance(event, Finished):
            return text, reasoning, event
        else:
            return event


def plain(loaded, tok, prompt, max_tokens=12, sampling=None) -> str:
    runner = ModelRunner(loaded, max_seq_len=128)
    text, _, _, _ = run_engine(runner, tok, list(prompt), max_tokens=max_tokens, sampling=sampling or SamplingParams())
    return text


PROMPTS = [[1, 504, 3259, 28, 2], [1, 1203, 284, 253, 1542, 2930, 30], [1, 77, 88, 99], [1, 504, 3259, 28, 9]]


def test_decode_batch_rows_equal_single_forwards(loaded, one_thread):
    runner = ModelRunner(loaded, max_seq_len=64, num_slots=3)
    single = ModelRunner(loaded, max_seq_len=64, num_slots=3)
    for i, p in enumerate(PROMPTS[:3]):
        runner.prefill(runner.slot(i), p)
        single.prefill(single.slot(i), p)
    batched = runner.decode_batch([runner.slot(2), runner.slot(0), runner.slot(1)], [5, 6, 7])  # [3, V]
    rows = [single.forward(single.slot(i), [t])[-1] for i, t in ((2, 5), (0, 6), (1, 7))]
    torch.testing.assert_close(batched, torch.stack(rows), atol=1e-4, rtol=1e-4)
    assert runner.slot(0).tokens == PROMPTS[0] + [6]


def test_concurrent_requests_match_plain_generation_and_share_steps(loaded, smollm2_tok, one_thread):
    engine = make_engine(loaded, smollm2_tok)
    try:
        jobs = [submit(engine, p) for p in PROMPTS]
        results = [collect(q) for _, q in jobs]
        for p, (text, _, fin) in zip(PROMPTS, results):
            assert text == plain(loaded, smollm2_tok, p)
            assert fin.usage["prompt_tokens"] == len(p) and fin.timings["predicted_n"] == fin.usage["completion_tokens"]
        m = engine.metrics
        assert m.decode_rows > m.decode_steps  # several requests shared decode steps
        # the second turn of a conversation reuses the slot holding its prefix
        again = PROMPTS[1] + [42, 43]
        text, _, fin = collect(submit(engine, again)[1])
        assert fin.usage["prompt_tokens_details"]["cached_tokens"] == len(PROMPTS[1]) == fin.timings["cache_n"]
        assert text == plain(loaded, smollm2_tok, again)
    finally:
        engine.stop()


def test_prefill_runs_in_budgeted_chunks_between_decode_steps(loaded, smollm2_tok, one_thread):
    """While a request decodes, new prompts are prefilled at most `budget` tokens between two of its
    steps (whole chunks, oldest first), and every output is still plain generation's."""
    engine = make_engine(loaded, smollm2_tok, slots=3, chunk=8, budget=10)
    calls: list[tuple[str, int]] = []  # ("prefill", tokens) | ("decode", rows), in the order they ran
    forward, decode_batch = engine.runner.forward, engine.runner.decode_batch

    def logged_forward(slot, tokens, num_logits=1):
        if len(tokens) > 1:
            calls.append(("prefill", len(tokens)))
        return forward(slot, tokens, num_logits)

    def logged_decode(slots, tokens):
        calls.append(("decode", len(slots)))
        return decode_batch(slots, tokens)

    engine.runner.forward, engine.runner.decode_batch = logged_forward, logged_decode
    long_a, long_b = list(range(300, 330)), list(range(400, 421))  # 30 and 21 tokens: 8 + 8 + 8 + 6, 8 + 8 + 5
    try:
        _, q0 = submit(engine, PROMPTS[0], max_tokens=40, id="running")
        first = q0.get(timeout=30)  # decoding now
        jobs = [submit(engine, p, max_tokens=6, id=str(i)) for i, p in enumerate((long_a, long_b))]
        results = [collect(q) for q in (q0, jobs[0][1], jobs[1][1])]
        assert first.content + results[0][0] == plain(loaded, smollm2_tok, PROMPTS[0], 40)
        for p, (text, _, fin) in zip((long_a, long_b), results[1:]):
            assert text == plain(loaded, smollm2_tok, p, 6) and fin.usage["prompt_tokens"] == len(p)
    finally:
        engine.stop()
    prefills = [n for kind, n in calls if kind == "prefill"]
    # the running request's own prompt, then first come, first served in the same cuts as alone
    assert prefills == [5] + [8, 8, 8, 6] + [8, 8, 5], calls
    first_decode = next(i for i, (kind, _) in enumerate(calls) if kind == "decode")
    between = 0
    for kind, n in calls[first_decode:]:
        between = between + n if kind == "prefill" else 0
        assert between <= 10, calls  # a decoding request never waits for more than the budget
    assert engine.metrics.prefill_chunks == 1 + 7


def test_sampled_rows_drawn_together_give_each_request_its_own_seeded_sample(loaded, smollm2_tok, one_thread):
    """Greedy, sampled and penalized requests decoded in one batch: every row's token chosen in one
    call, each sampled request with its own generator, so each output is what it gives alone."""
    kinds = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=3),
             SamplingParams(temperature=0.9, top_p=0.9, seed=4),
             SamplingParams(temperature=1.2, top_k=30, presence_penalty=1.0, seed=5)]
    engine = make_engine(loaded, smollm2_tok)
    try:
        jobs = [submit(engine, p, max_tokens=10, sampling=k) for p, k in zip(PROMPTS, kinds)]
        texts = [collect(q)[0] for _, q in jobs]
    finally:
        engine.stop()
    assert texts == [plain(loaded, smollm2_tok, p, 10, k) for p, k in zip(PROMPTS, kinds)]
    assert engine.metrics.decode_rows > engine.metrics.decode_steps


def test_cancel_frees_the_slot_and_others_finish(loaded, smollm2_tok, one_thread):
    engine = make_engine(loaded, smollm2_tok, slots=2)
    try:
        a, qa = submit(engine, PROMPTS[0], max_tokens=200)
        b, qb = submit(engine, PROMPTS[1], max_tokens=6)
        qa.get(timeout=30)
        engine.cancel(a)
        deadline = time.time() + 30
        while engine.active.get(0) is not None and time.time() < deadline:
            time.sleep(0.01)
        assert 0 not in engine.active and engine.metrics.requests["cancelled"] == 1
        assert isinstance(collect(qb)[2], Finished)
        c, qc = submit(engine, PROMPTS[2], max_tokens=3)
        assert isinstance(collect(qc)[2], Finished)
    finally:
        engine.stop()


def test_failing_request_is_reported_and_the_engine_goes_on(loaded, smollm2_tok, one_thread, monkeypatch):
    from engine.decoding import sequence
    original = sequence.Sequence.take

    def flaky(self, token, logits, room):
        if self.request.id == "bad" and self.generated >= 2:
            raise RuntimeError("planted failure")
        return original(self, token, logits, room)

    monkeypatch.setattr(sequence.Sequence, "take", flaky)
    engine = make_engine(loaded, smollm2_tok, slots=2, context=32)
    try:
        _, qbad = submit(engine, PROMPTS[0], max_tokens=20, id="bad")
        _, qgood = submit(engine, PROMPTS[1], max_tokens=8)
        failed = collect(qbad)
        assert isinstance(failed, Failed) and "planted failure" in failed.message
        assert collect(qgood)[0] == plain(loaded, smollm2_tok, PROMPTS[1], 8)
        _, q = submit(engine, [1, 2, 3], max_tokens=40)  # runs into the 32-token context
        text, _, fin = collect(q)
        # every position holds a token; the last sampled one needs none
        assert fin.reason == "length" and fin.usage["prompt_tokens"] + fin.usage["completion_tokens"] == 33
        assert max(s.length for s in engine.runner.cache.slots) == 32 and engine.metrics.requests["error"] == 1
    finally:
        engine.stop()


def test_thinking_budget_inserts_the_end_tag_and_the_answer_follows(loaded, smollm2_tok, one_thread):
    rules = ThinkingRules("<think>", "</think>", "Time is up.")
    engine = make_engine(loaded, smollm2_tok, rules=rules)
    try:
        prompt = smollm2_tok.encode("<|im_start|>assistant\n<think>\n")
        _, q = submit(engine, prompt, max_tokens=20, thinking_budget=4, thinking_at_start=True)
        text, reasoning, fin = collect(q)
        assert reasoning.rstrip().endswith("Time is up.") and "</think>" not in text + reasoning
        assert fin.reason == "length" and text  # the answer went on after the inserted end tag
    finally:
        engine.stop()


def test_a_model_that_ends_inside_its_thought_is_led_into_the_answer(smollm2_tok, one_thread):
    from engine.decoding.sequence import Sequence
    events: list = []
    tok = smollm2_tok
    req = Request(id="t", prompt_ids=[1, 2], max_tokens=50, emit=events.append, thinking_at_start=True)
    seq = Sequence(req, tok, ThinkingRules(), tok.vocab_size, torch.device("cpu"), reused=0)

    def choose(token: int) -> torch.Tensor:
        logits = torch.full((tok.vocab_size,), -1e9)
        logits[token] = 0.0
        return logits

    eos = min(tok.eos_ids)
    for t in tok.encode("hmm"):
        seq.on_logits(choose(t), room=100)
    seq.on_logits(choose(eos), room=100)  # ends inside the thought
    assert not seq.done and tok.decode(seq.pending) == "</think>\n\n"
    answer = tok.encode("Paris")
    for t in answer:
        seq.on_logits(choose(t), room=100)
    seq.on_logits(choose(eos), room=100)
    assert seq.done and seq.finish_reason == "stop"
    reasoning = "".join(e.reasoning for e in events if isinstance(e, Delta))
    content = "".join(e.content for e in events if isinstance(e, Delta))
    assert (reasoning, content) == ("hmm", "Paris")
    inserted = len(tok.encode("</think>\n\n"))
    assert events[-1].usage["completion_tokens"] == len(tok.encode("hmm")) + inserted + len(answer)


def test_a_model_that_stops_right_after_its_thought_is_led_once(smollm2_tok, one_thread):
    from engine.decoding.sequence import Sequence
    events: list = []
    tok = smollm2_tok
    req = Request(id="t", prompt_ids=[1, 2], max_tokens=50, emit=events.append)
    seq = Sequence(req, tok, ThinkingRules(), tok.vocab_size, torch.device("cpu"), reused=0)
    logits = torch.full((tok.vocab_size,), -1e9)
    for t in tok.encode("<think>ok</think>"):
        seq.on_logits(logits.index_fill(0, torch.tensor([t]), 0.0), room=100)
    eos = logits.index_fill(0, torch.tensor([min(tok.eos_ids)]), 0.0)
    seq.on_logits(eos, room=100)
    assert not seq.done and tok.decode(seq.pending) == "\n\n"  # led into the answer
    seq.on_logits(eos, room=100)
    assert seq.done  # only once: an empty answer after that is the model's own


@pytest.mark.gpu
def test_graphed_batched_decode_matches_the_graphed_single_row_step(smollm2_gguf):
    from engine.weights.loader import load_model
    loaded = load_model(smollm2_gguf, "cuda")
    runner = ModelRunner(loaded, max_seq_len=128, num_slots=4)
    assert runner.decoder is not None and runner.decoder.graph is not None
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time",
                                                     "1, 2, 3, 4,", "def main():")]
    single = ModelRunner(loaded, max_seq_len=128, num_slots=4)
    for i, p in enumerate(prompts):
        runner.prefill(runner.slot(i), p)
        single.prefill(single.slot(i), p)
    order = [3, 0, 2]  # rows from different slots at different positions
    batched = runner.decode_batch([runner.slot(i) for i in order], [prompts[i][-1] for i in order]).float().cpu()
    rows = torch.stack([single.forward(single.slot(i), [prompts[i][-1]])[-1].float().cpu() for i in order])
    assert 3 in runner._row_steps and runner._row_steps[3].graph is not None  # the graphed 3-row step ran
    assert torch.equal(batched.argmax(-1), rows.argmax(-1))
    torch.testing.assert_close(batched, rows, atol=0.1, rtol=0.05)


def test_ids_beyond_the_tokenizer_are_never_sampled(smollm2_tok, one_thread):
    from engine.decoding.sequence import Sequence
    tok = smollm2_tok
    events: list = []
    req = Request(id="v", prompt_ids=[1, 2], max_tokens=5, emit=events.append)
    seq = Sequence(req, tok, ThinkingRules(), tok.vocab_size, torch.device("cpu"), reused=0)
    logits = torch.zeros(tok.vocab_size + 64)  # a padded output layer (or a dummy model's larger vocabulary)
    logits[tok.vocab_size + 3] = 50.0
    logits[42] = 10.0
    seq.on_logits(logits, room=100)
    assert seq.pending == [42]


def test_token_ids_only_still_end_at_the_end_of_sequence_token(smollm2_tok, one_thread):
    from engine.decoding.sequence import Sequence
    tok, events = smollm2_tok, []
    for ignore in (False, True):
        events.clear()
        seq = Sequence(Request([1, 2], max_tokens=5, text=False, ignore_eos=ignore, emit=events.append), tok,
                       ThinkingRules(), tok.vocab_size, torch.device("cpu"), reused=0)
        for token in (42, min(tok.eos_ids)):
            seq.take(token, None, room=100)
        assert seq.done != ignore and [d.token_ids for d in events if isinstance(d, Delta)] == \
            [[42]] + ([[min(tok.eos_ids)]] if ignore else [])
        assert all(d.content == "" for d in events if isinstance(d, Delta))

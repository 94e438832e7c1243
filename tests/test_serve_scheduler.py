"""Server bookkeeping without a model: slots and queue, context policy, reasoning split, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.errors import BonsaiError
from engine.decoding.context_policy import fit_conversation
from engine.decoding.metrics import Metrics
from engine.decoding.reasoning import ReasoningSplitter
from engine.decoding.scheduler import PrefillChunk, QueueFull, Scheduler, plan_prefill, plan_riders


@dataclass
class Slot:
    index: int
    capacity: int = 100
    tokens: list[int] = field(default_factory=list)

    def rewind(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:]


def make(n: int = 3, max_queue: int = 2) -> Scheduler:
    return Scheduler([Slot(i) for i in range(n)], max_queue=max_queue)


def test_longest_cached_prefix_wins_and_is_kept():
    s = make()
    s.slots[0].tokens[:] = [1, 2, 3]
    s.slots[1].tokens[:] = [1, 2, 3, 4, 5, 6]
    s.slots[2].tokens[:] = [9]
    s.submit("a", [1, 2, 3, 4, 5, 7])
    (a,) = s.assign()
    assert (a.request, a.slot.index, a.reused) == ("a", 1, 5)
    assert s.slots[1].tokens == [1, 2, 3, 4, 5]  # rewound to the shared prefix
    s.submit("b", [1, 2, 3, 4, 5, 6])
    (b,) = s.assign()
    assert (b.slot.index, b.reused) == (0, 3)  # slot 1 is busy: the next best


def test_at_least_one_prompt_token_is_left_to_compute():
    s = make(1)
    s.slots[0].tokens[:] = [1, 2, 3, 4]
    s.submit("a", [1, 2, 3])
    (a,) = s.assign()
    assert a.reused == 2 and s.slots[0].tokens == [1, 2]


def test_ties_go_to_the_slot_idle_longest_and_release_keeps_the_cache():
    s = make(2)
    s.submit("a", [5])
    s.submit("b", [6])
    a, b = s.assign()
    a.slot.tokens[:] = [5, 50]
    b.slot.tokens[:] = [6, 60]
    s.release(b.slot)
    s.release(a.slot)  # a's slot was used last
    s.submit("c", [7, 8])
    (c,) = s.assign()
    assert c.slot is b.slot and c.reused == 0
    assert a.slot.tokens == [5, 50]  # the other cache survives
    assert s.info(a.slot.index).requests_served == 1 and s.busy == 1


def test_bounded_queue_refuses_with_retry_after_and_fifo_order():
    s = make(n=1, max_queue=2)
    s.submit("a", [1])
    assert [x.request for x in s.assign()] == ["a"]
    s.submit("b", [1])
    s.submit("c", [1])
    with pytest.raises(QueueFull) as e:
        s.submit("d", [1])
    assert e.value.retry_after >= 1 and "busy" in str(e.value)
    assert s.assign() == []  # no free slot
    s.release(s.slots[0])
    assert [x.request for x in s.assign()] == ["b"]
    assert s.drop_waiting(lambda r: r == "c") == ["c"] and s.waiting == 0


def test_queue_counts_free_slots_as_room():
    s = make(n=3, max_queue=0)
    for r in "abc":
        s.submit(r, [1])  # three free slots take three requests even with no queue
    with pytest.raises(QueueFull):
        s.submit("d", [1])
    assert len(s.assign()) == 3 and s.drain() == []


def chunks(plan: list[PrefillChunk]) -> list[tuple[int, int]]:
    return [(c.slot, c.size) for c in plan]


def test_prefill_plan_gives_whole_chunks_first_come_first_served_within_the_budget():
    # the oldest request (slot 3) first, as many whole chunks as fit; the next chunk (188) would pass 512
    assert chunks(plan_prefill([(3, 700, 256), (1, 100, 256), (0, 40, 256)], budget=512)) == [(3, 256), (3, 256)]
    # short prompts share a budget; the third's chunk does not fit, and nobody is skipped over (FCFS)
    assert chunks(plan_prefill([(1, 100, 256), (0, 40, 256), (2, 300, 256), (4, 10, 256)], budget=256)) == [(1, 100), (0, 40)]
    # one chunk always runs, even past a small budget, so prefill never starves
    assert chunks(plan_prefill([(0, 300, 256)], budget=64)) == [(0, 256)]
    # the last prompt token is left to the batched decode step (its logits start the answer)
    assert chunks(plan_prefill([(0, 257, 256)], budget=1000)) == [(0, 256)]
    # nobody decodes (budget None): one chunk for every waiting request
    assert chunks(plan_prefill([(0, 600, 256), (1, 30, 256)], budget=None)) == [(0, 256), (1, 30)]
    assert plan_prefill([], budget=512) == []
    # each request its own chunk: a short prompt's passes (16) next to a long prompt's chunk
    assert chunks(plan_prefill([(2, 40, 16), (0, 700, 512)], budget=32)) == [(2, 16), (2, 16)]
    assert chunks(plan_prefill([(2, 9, 16), (0, 700, 512)], budget=32)) == [(2, 9)]
    assert chunks(plan_prefill([(0, 700, 512), (2, 40, 16)], budget=32)) == [(0, 512)]


def test_riders_fill_the_rows_a_decode_pass_leaves_free_oldest_first():
    # 3 slots decode in a 16-row pass: 13 rows free, the oldest prompt first, the next one gets the rest
    assert chunks(plan_riders(3, [(5, 10), (1, 40), (2, 7)], rows=16, min_free=4)) == [(5, 10), (1, 3)]
    assert chunks(plan_riders(1, [(0, 40)], rows=16, min_free=4)) == [(0, 15)]
    # a prompt's last token rides too: its logits start the answer
    assert chunks(plan_riders(2, [(4, 2)], rows=16, min_free=4)) == [(4, 2)]
    # nobody decodes: a lone prompt runs its own passes; two or more share the pass, oldest first
    assert plan_riders(0, [(0, 40)], rows=16, min_free=4) == []
    assert chunks(plan_riders(0, [(3, 10), (1, 40)], rows=16, min_free=4)) == [(3, 10), (1, 6)]
    assert chunks(plan_riders(0, [(1, 40), (3, 10)], rows=16, min_free=4)) == [(1, 16)]
    # too few rows free (the prompt would crawl)
    assert plan_riders(13, [(0, 40)], rows=16, min_free=4) == []
    assert chunks(plan_riders(12, [(0, 40)], rows=16, min_free=4)) == [(0, 4)]
    assert plan_riders(16, [(0, 40)], rows=16, min_free=0) == []  # no row free at all


def test_prefill_cuts_of_a_prompt_do_not_depend_on_the_other_requests():
    def cuts(waiting: dict[int, int], budget: int | None) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {slot: [] for slot in waiting}
        while any(left > 1 for left in waiting.values()):
            for c in plan_prefill([(s, n, 7) for s, n in waiting.items() if n > 1], budget=budget):
                out[c.slot].append(c.size)
                waiting[c.slot] -= c.size
        return out
    alone = cuts({5: 29}, 10)[5]
    assert alone == [7, 7, 7, 7] and cuts({5: 29}, None)[5] == alone  # the 29th token decodes
    for budget in (1, 9, 14, 50, None):
        together = cuts({2: 12, 5: 29, 0: 3}, budget)
        assert together[5] == alone and together[2] == [7, 5] and together[0] == [3], budget


def count_words(messages):
    return sum(len(m["content"].split()) for m in messages)


def conversation(turns: int):
    msgs = [{"role": "system", "content": "brief " * 5}]  # 5 "tokens" per message
    for i in range(turns):
        msgs += [{"role": "user", "content": f"q{i} " * 5}, {"role": "assistant", "content": f"a{i} " * 5}]
    return msgs + [{"role": "user", "content": "now " * 5}]


def test_context_policy_does_nothing_below_the_threshold():
    msgs = conversation(3)  # 5 + 30 + 5 = 40 words
    fitted = fit_conversation(msgs, count_words, context=45, compress_at=0.9)
    assert fitted.messages is msgs and fitted.dropped == 0 and fitted.prompt_tokens == 40


def test_context_policy_drops_whole_oldest_turns_and_keeps_system_and_current(caplog):
    msgs = conversation(3)
    with caplog.at_level("INFO"):
        fitted = fit_conversation(msgs, count_words, context=40, compress_at=0.9)  # threshold 36
    assert fitted.messages[0] == msgs[0] and fitted.messages[-1] == msgs[-1]
    assert fitted.dropped == 2 and fitted.prompt_tokens == 30
    assert [m["role"] for m in fitted.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "dropped the 2 oldest messages" in caplog.text


def test_context_policy_refuses_what_cannot_fit():
    msgs = [{"role": "system", "content": "x " * 30}, {"role": "user", "content": "y " * 30}]
    with pytest.raises(BonsaiError, match="context holds 50"):
        fit_conversation(msgs, count_words, context=50)


def split_all(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    r, c = "", ""
    for p in pieces:
        a, b = splitter.push(p)
        r, c = r + a, c + b
    a, b = splitter.flush()
    return r + a, c + b


@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_reasoning_split_on_tags_in_any_piece_sizes(cut):
    text = "<think>\nlet me see</think>\n\nParis."
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    assert split_all(ReasoningSplitter("<think>", "</think>"), pieces) == ("let me see", "Paris.")


def test_reasoning_opened_by_the_prompt_and_text_without_thought():
    s = ReasoningSplitter("<think>", "</think>", thinking=True)
    assert split_all(s, ["hmm </th", "ink> ok"]) == ("hmm ", "ok")
    assert split_all(ReasoningSplitter("<think>", "</think>"), ["<th", "e answer"]) == ("", "<the answer")
    assert split_all(ReasoningSplitter("<think>", "</think>"), ["a <think> b"]) == ("", "a <think> b")
    off = ReasoningSplitter("<think>", "</think>", enabled=False)
    assert split_all(off, ["<think>x</think>y"]) == ("", "<think>x</think>y")
    unfinished = ReasoningSplitter("<think>", "</think>")
    assert split_all(unfinished, ["<think>still going </thi"]) == ("still going </thi", "")
    assert unfinished.thinking


def test_metrics_prometheus_text_parses():
    m = Metrics(slots_total=2)
    m.count_request("stop")
    m.count_request("length", queued=0.5, first_token=0.25)
    m.count_request("cancelled", queued=0.125, first_token=0.0)  # ended before its first token
    m.count_prompt(10, 4)
    m.count_step(rows=2, tokens=2)
    m.count_step(rows=1, tokens=1, waited=0.375)  # the engine waited for the device's tokens
    m.count_prefill()
    m.count_spec(drafted=3, accepted=2)
    m.count_spec(drafted=1, accepted=1)
    m.count_spec(drafted=0, accepted=0)  # a step without drafts counts nothing
    samples = {}
    for line in m.prometheus().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['bonsai_requests_total{outcome="stop"}'] == 1
    assert samples["bonsai_request_timed_total"] == 2 and samples["bonsai_request_queue_seconds_total"] == 0.625
    assert samples["bonsai_request_first_token_seconds_total"] == 0.25
    assert samples["bonsai_prompt_cache_tokens_total"] == 4 and samples["bonsai_prompt_tokens_computed_total"] == 6
    assert samples["bonsai_decode_rows_total"] == 3 and samples["bonsai_slots_total"] == 2
    assert samples["bonsai_decode_wait_seconds_total"] == 0.375 and samples["bonsai_decode_steps_total"] == 2
    assert samples["bonsai_prefill_chunks_total"] == 1
    assert samples["bonsai_spec_decode_num_draft_tokens_total"] == 4
    assert samples["bonsai_spec_decode_num_accepted_tokens_total"] == 3 and samples["bonsai_spec_decode_num_drafts_total"] == 2
    assert [samples[f'bonsai_spec_decode_num_draft_tokens_per_pos_total{{position="{p}"}}'] for p in range(3)] == [2, 1, 1]
    assert [samples[f'bonsai_spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(3)] == [2, 1, 0]


def test_event_relay_delivers_in_order_with_one_wakeup_per_burst():
    import asyncio
    import threading

    from engine.server.relay import EventRelay

    async def main():
        relay = EventRelay(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(3)]
        # the engine thread posts a whole step's events while the loop is busy elsewhere
        poster = threading.Thread(target=lambda: [relay.post(queues[i % 3], i) for i in range(30)])
        poster.start()
        poster.join()
        got = [[await q.get() for _ in range(10)] for q in queues]
        assert got == [list(range(k, 30, 3)) for k in range(3)]
        assert relay.wakeups == 1 and all(q.empty() for q in queues)
        relay.post(queues[0], "next")  # a later burst wakes the loop again
        assert await asyncio.wait_for(queues[0].get(), 5) == "next" and relay.wakeups == 2

    asyncio.run(main())


@pytest.mark.parametrize("text", ["Paris", "", 'quote " back\\slash\nnew line\ttab', "é 🙂 \u2028 </think>", "\x00\x1f"])
def test_chunk_lines_equal_the_generic_sse_encoding(text):
    from engine.server import protocol as P
    from engine.server.sse import ChunkLines, sse
    for rid, model, created in (("chatcmpl-abc", "smollm2", 1764000000), ('id"odd', "m/ö", 0)):
        for delta in ({"content": text}, {"reasoning_content": text}, {"reasoning_content": "a", "content": text}):
            assert ChunkLines(rid, model, created, True).delta(delta) == sse(P.chat_chunk(rid, model, created, delta))
        assert ChunkLines(rid, model, created, False).text(text) == sse(P.text_chunk(rid, model, created, text))

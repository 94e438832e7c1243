"""The real `bonsai serve` process with speculative decoding on a tiny random GGUF (SmolLM2's
tokenizer cut to 1024 tokens): greedy answers over HTTP equal plain decoding of the same model,
alone and as concurrent streams; a second turn reuses its prefix (cache_n) with 3 slots; stop
strings; draft counters in timings, /metrics and /slots."""
from __future__ import annotations

import json
import threading

import pytest
import torch

httpx = pytest.importorskip("httpx")

from tests.serve_process import start_server  # noqa: E402

PROMPTS = ["one two three four one two three four one two", "the cat sat on the mat and the cat sat",
           "a b c d e f a b c d", "red green blue red green blue red"]


@pytest.fixture(scope="module")
def tiny_gguf(smollm2_gguf, tmp_path_factory):
    from tests.gguf_tiny import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_gguf, seed=3)


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-spec")
    (tmp / "serve.yaml").write_text(
        f"model:\n  path: {tiny_gguf}\n  max_context: 192\n"
        "runtime:\n  device: cpu\n  max_batch_size: 3\n  prefill_chunk_size: 64\n"
        "  decode_algorithm: speculative\n  draft_model: none\n"
        "speculative:\n  method: ngram\n  num_draft_tokens: 4\n  adaptive: false\n"
        "server:\n  max_queue: 8\n")
    proc = start_server(tmp / "serve.yaml", tmp / "server.log", threads=1)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """Plain decoding of the same model in this process (float32, as the server's several slots)."""
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_model
    from tests.engine_runs import run_engine
    loaded = load_model(tiny_gguf, "cpu", weight_dtype=torch.float32)
    runner = ModelRunner(loaded, max_seq_len=192)

    def run(ids: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> str:
        return run_engine(runner, loaded.tokenizer, ids, max_tokens=max_tokens, stop=stop)[0]

    run.tokenizer = loaded.tokenizer
    return run


def complete(server, prompt, max_tokens=24, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("bonsai_spec"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_greedy_answers_equal_plain_decoding_and_drafts_are_counted(server, reference, one_thread):
    before = metrics(server)
    tok = reference.tokenizer
    drafted = accepted = 0
    for prompt in PROMPTS[:2]:
        body = complete(server, prompt, 32)
        assert body["choices"][0]["text"] == reference(tok.encode(prompt, add_special_tokens=True), 32)
        t = body["timings"]
        assert 0 <= t["draft_n_accepted"] <= t["draft_n"] and t["predicted_n"] == body["usage"]["completion_tokens"]
        drafted, accepted = drafted + t["draft_n"], accepted + t["draft_n_accepted"]
    after = metrics(server)
    assert drafted > 0 and accepted > 0
    assert after["bonsai_spec_decode_num_draft_tokens_total"] - before.get("bonsai_spec_decode_num_draft_tokens_total", 0) == drafted
    assert after["bonsai_spec_decode_num_accepted_tokens_total"] - before.get(
        "bonsai_spec_decode_num_accepted_tokens_total", 0) == accepted
    assert after['bonsai_spec_decode_num_draft_tokens_per_pos_total{position="0"}'] > 0
    slots = httpx.get(server.url + "/slots").json()
    assert len(slots) == 3 and all(s["drafter"]["method"] == "ngram" for s in slots)
    assert sum(s["drafter"]["drafted"] for s in slots) >= drafted


def test_a_request_turns_its_drafts_off_with_llama_cpps_field(server, reference, one_thread):
    """"speculative.n_max": 0 (llama.cpp's name) decodes that request plainly in the speculating server; a wrong
    value is a 400 naming the field."""
    tok = reference.tokenizer
    for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}]})):
        r = httpx.post(server.url + path, timeout=120, json={**body, "max_tokens": 24, "temperature": 0,
                                                             "speculative.n_max": 0})
        assert r.status_code == 200, r.text
        assert r.json()["timings"]["draft_n"] == 0 and r.json()["usage"]["completion_tokens"] > 0
    assert r.json()["choices"][0]["message"]["content"] is not None
    plain = complete(server, PROMPTS[0], 24, **{"speculative.n_max": 0})
    assert plain["choices"][0]["text"] == reference(tok.encode(PROMPTS[0], add_special_tokens=True), 24)
    assert complete(server, PROMPTS[0], 24)["timings"]["draft_n"] > 0  # the same prompt drafts by default
    bad = httpx.post(server.url + "/v1/completions", timeout=30, json={"prompt": "x", "speculative.n_max": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.n_max"


def test_concurrent_streams_equal_plain_decoding(server, reference, one_thread):
    tok = reference.tokenizer
    texts: dict[int, str] = {}
    finals: dict[int, dict] = {}

    def stream(i: int) -> None:
        body = {"prompt": PROMPTS[i % 4] + f" {i}", "max_tokens": 24, "temperature": 0, "stream": True}
        pieces = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    pieces += [c["text"] for c in chunk["choices"]]
                    if "timings" in chunk:
                        finals[i] = chunk["timings"]
        texts[i] = "".join(pieces)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)]  # 3 slots + 2 waiting
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(5):
        assert texts[i] == reference(tok.encode(PROMPTS[i % 4] + f" {i}", add_special_tokens=True), 24)
    assert sum(t["draft_n"] for t in finals.values()) > 0


def test_second_turn_reuses_the_prefix_and_stop_strings_cut_exactly(server, reference, one_thread):
    tok = reference.tokenizer
    first = complete(server, PROMPTS[2], 16)
    turn2 = PROMPTS[2] + first["choices"][0]["text"] + " and again"
    second = complete(server, turn2, 16)
    assert second["timings"]["cache_n"] > len(tok.encode(PROMPTS[2], add_special_tokens=True))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["timings"]["cache_n"]
    assert second["choices"][0]["text"] == reference(tok.encode(turn2, add_special_tokens=True), 16)
    # a stop string from the middle of the answer: the text ends right before it, as in plain decoding
    ids = tok.encode(PROMPTS[3], add_special_tokens=True)
    full = reference(ids, 24)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    body = complete(server, PROMPTS[3], 24, stop=[stop])
    assert body["choices"][0]["text"] == reference(ids, 24, (stop,)) and body["choices"][0]["finish_reason"] == "stop"


def test_a_draft_model_is_loaded_once_for_all_slots(tiny_gguf, reference, one_thread):
    """draft:PATH in the server's engine (the target drafting for itself, its weights as stored: every draft is
    accepted): one copy of the draft model's weights, a KV cache per slot, greedy output unchanged."""
    import queue

    from engine.decoding.sequence import Finished, Request
    from engine.runtime.runner import ModelRunner
    from engine.speculative.config import SpeculativeConfig
    from engine.weights.loader import load_model
    from tests.engine_runs import Threaded, spec_engine
    loaded = load_model(tiny_gguf, "cpu", weight_dtype=torch.float32)
    spec = SpeculativeConfig.from_spec(f"draft:{tiny_gguf}", num_draft_tokens=3, adaptive=False, draft_weights="stored")
    engine = Threaded(spec_engine(ModelRunner(loaded, max_seq_len=96, num_slots=2), loaded.tokenizer, spec,
                                  slot_context=96))
    try:
        drafters = [s.drafter for s in engine.spec.slots]
        assert drafters[0].loaded is drafters[1].loaded and drafters[0].runner is not drafters[1].runner
        queues = []
        for prompt in PROMPTS[:2]:
            q: queue.Queue = queue.Queue()
            engine.submit(Request(loaded.tokenizer.encode(prompt, add_special_tokens=True), 12, id=prompt, emit=q.put))
            queues.append(q)
        for prompt, q in zip(PROMPTS[:2], queues):
            text = ""
            while not isinstance(event := q.get(timeout=120), Finished):
                text += event.content
            assert text == reference(loaded.tokenizer.encode(prompt, add_special_tokens=True), 12)
            assert event.timings["draft_n_accepted"] == event.timings["draft_n"] > 0
    finally:
        engine.stop()

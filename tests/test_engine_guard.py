"""Issue 24, class 1: no request can kill or freeze the engine thread. A per-request failure anywhere
in the engine (admission, drafter, prefill, sampling, the event callback) ends that request with an
error and the others go on; if the thread ends anyway, every waiting request is failed at once,
new ones are refused with 503 and /health says 503. Numeric request fields are range-checked at
the edge (protocol.py), and the sampling maths stays finite for any value the edge accepts."""
from __future__ import annotations

import asyncio
import typing

import pytest
import torch

from engine.decoding.sampling import SamplingParams, probabilities, sample
from engine.server import protocol as P
from engine.decoding.sequence import Failed, Finished
from tests.test_serve_engine import PROMPTS, collect, make_engine, submit

QUESTION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def loaded(tiny_engine_model):
    return tiny_engine_model


def test_a_request_failing_at_admission_ends_alone_and_the_engine_serves_on(loaded, smollm2_tok, one_thread,
                                                                             monkeypatch):
    """The issue's case: Sequence() raised in _admit (a seed torch refuses), outside the loop's
    error handling, and the thread died: every later request waited forever."""
    from engine.decoding import sequence
    original = sequence.Sequence.__init__

    def refuse(self, request, *args, **kwargs):
        if request.id.startswith("bad"):
            raise ValueError("Overflow when unpacking long long")
        original(self, request, *args, **kwargs)

    monkeypatch.setattr(sequence.Sequence, "__init__", refuse)
    engine = make_engine(loaded, smollm2_tok, slots=2)
    try:
        # admitted in one iteration: the bad ones between good ones
        jobs = [submit(engine, p, max_tokens=4, id=i) for p, i in zip(PROMPTS, ("good0", "bad1", "good2", "bad3"))]
        results = {req.id: collect(q, timeout=20) for req, q in jobs}
        for rid in ("bad1", "bad3"):
            assert isinstance(results[rid], Failed) and results[rid].status == 500
            assert "Overflow" in results[rid].message
        for rid in ("good0", "good2"):
            assert isinstance(results[rid][2], Finished)
        assert engine.alive and engine.metrics.requests["error"] == 2
        assert isinstance(collect(submit(engine, PROMPTS[1], max_tokens=3)[1], timeout=20)[2], Finished)
    finally:
        engine.stop()
    assert engine.scheduler.busy == 0  # the refused requests gave their slots back


def test_an_event_callback_that_raises_fails_only_its_request(loaded, smollm2_tok, one_thread):
    """A request whose emit raises (its event loop closed) must not take its batch down with it."""
    engine = make_engine(loaded, smollm2_tok, slots=3)
    try:
        good = [submit(engine, p, max_tokens=6, id=f"g{i}") for i, p in enumerate(PROMPTS[:2])]

        def broken(event):
            raise RuntimeError("Event loop is closed")

        bad, _ = submit(engine, PROMPTS[2], max_tokens=6, id="bad")
        bad.emit = broken
        for _, q in good:
            assert isinstance(collect(q, timeout=20)[2], Finished)
        assert engine.alive
        assert isinstance(collect(submit(engine, PROMPTS[3], max_tokens=2)[1], timeout=20)[2], Finished)
    finally:
        engine.stop()


def test_a_dead_engine_fails_waiting_requests_at_once_and_refuses_new_ones(loaded, smollm2_tok, one_thread,
                                                                            monkeypatch):
    """If the thread ends anyway (here: a BaseException no handler takes), nothing waits forever."""
    from engine.errors import BonsaiError
    engine = make_engine(loaded, smollm2_tok, slots=1)
    try:
        running, q_running = submit(engine, PROMPTS[0], max_tokens=200, id="running")
        q_running.get(timeout=20)  # it decodes
        step = engine._step

        def die():
            raise SystemExit("planted: the loop itself broke")

        _, q_waiting = submit(engine, PROMPTS[1], max_tokens=4, id="waiting")  # queued behind the one slot
        monkeypatch.setattr(engine, "_step", die)
        for q in (q_running, q_waiting):
            event = q.get(timeout=20)
            while not isinstance(event, (Failed, Finished)):
                event = q.get(timeout=20)
            assert isinstance(event, Failed) and event.status == 503 and "engine" in event.message
        engine._thread.join(20)
        assert not engine.alive and "SystemExit" in engine.failure
        with pytest.raises(BonsaiError, match="engine"):
            submit(engine, PROMPTS[2])
        monkeypatch.setattr(engine, "_step", step)
    finally:
        engine.stop()


def test_health_turns_503_and_requests_are_refused_when_the_engine_is_dead(loaded, smollm2_tok, one_thread,
                                                                            monkeypatch):
    httpx = pytest.importorskip("httpx")
    from engine.server.api import ServerState, create_app
    from engine.server.config import ServeConfig
    from engine.server.engine_thread import Served
    engine = make_engine(loaded, smollm2_tok, slots=1)
    config = ServeConfig.from_dict({"model": {"path": "tiny"}})
    state = ServerState(config, served=Served(engine.engine, engine.thread, "tiny", config))
    app = create_app(state)

    async def ask() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            out = [await client.get("/health")]
            monkeypatch.setattr(engine, "_step", lambda: (_ for _ in ()).throw(SystemExit("planted")))
            out.append(await client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2}))
            engine._thread.join(20)
            out.append(await client.get("/health"))
            out.append(await client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2}))
            return out

    try:
        ok, during, health, after = asyncio.run(asyncio.wait_for(ask(), 60))
    finally:
        engine.stop()
    assert ok.status_code == 200
    assert during.status_code == 503 and during.json()["error"]["type"] == "unavailable_error"
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    assert after.status_code == 503 and "engine" in after.json()["error"]["message"]


# -- the edge: every numeric field is range-checked --------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 10**30),
    ("max_tokens", 10**30), ("max_tokens", 0), ("max_completion_tokens", 2**63),
    ("top_k", 10**30), ("top_k", -1), ("thinking_budget", 10**30), ("top_logprobs", 21),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("repetition_penalty", 0.0),
    ("temperature", 2.5), ("top_p", 0.0), ("min_p", 1.0), ("presence_penalty", 1e308),
    ("frequency_penalty", -3.0), ("speculative.n_max", -1), ("speculative.n_max", 10**30),
])
def test_out_of_range_numbers_are_400_naming_the_field(field, value):
    with pytest.raises(P.RequestError) as e:
        P.parse(P.ChatRequest, {"messages": QUESTION, field: value, **({"logprobs": True} if "logprobs" in field
                                                                        else {})})
    assert e.value.status == 400 and e.value.param == field and field in str(e.value)


@pytest.mark.parametrize("field, value", [("max_tokens", 2**40), ("logprobs", 21), ("seed", 2**64), ("top_k", 2**40)])
def test_completion_numbers_are_range_checked_too(field, value):
    with pytest.raises(P.RequestError) as e:
        P.parse(P.CompletionRequest, {"prompt": "hi", field: value})
    assert e.value.param == field


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63), -1])
def test_every_seed_the_edge_accepts_seeds_a_generator(seed):
    req = P.parse(P.ChatRequest, {"messages": QUESTION, "seed": seed, "temperature": 0.7})
    from engine.decoding.sampling import make_generator
    make_generator(req.sampling(), torch.device("cpu"))


def _bounds(model) -> dict[str, tuple[bool, bool]]:
    """field → (has a lower bound, has an upper bound), for every int/float field of a request model."""
    out = {}
    for name, info in model.model_fields.items():
        kinds = set(typing.get_args(info.annotation)) | {info.annotation}
        if not kinds & {int, float}:
            continue
        lower = any(getattr(m, "ge", None) is not None or getattr(m, "gt", None) is not None for m in info.metadata)
        upper = any(getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None for m in info.metadata)
        out[name] = (lower, upper)
    return out


@pytest.mark.parametrize("model", [P.ChatRequest, P.CompletionRequest])
def test_every_numeric_request_field_has_both_bounds(model):
    """A numeric field added later without a range fails here, before a client finds it."""
    bounds = _bounds(model)
    assert {"seed", "max_tokens", "top_k", "repetition_penalty"} <= set(bounds)
    assert all(lower and upper for lower, upper in bounds.values()), bounds


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 5e-324])
def test_a_tiny_temperature_samples_the_top_token_without_nan(temperature):
    """What the edge accepts (temperature in (0, 2]) the maths must survive: before, logits / 1e-300
    overflowed to inf and softmax gave NaN, so the request failed inside the engine."""
    logits = torch.tensor([1.0, 3.0, -2.0, 2.9, float("-inf")])
    params = SamplingParams(temperature=temperature, top_p=0.9, min_p=0.05)
    probs = probabilities(logits, params)
    assert torch.isfinite(probs).all() and probs[1] == 1
    assert sample(logits, params, torch.Generator().manual_seed(0)) == 1


def test_the_penalty_the_edge_accepts_at_its_bounds_keeps_sampling_finite():
    from engine.decoding.sampling import apply_penalties
    bound = P.ChatRequest.model_fields["repetition_penalty"].metadata
    low = next(m.ge for m in bound if getattr(m, "ge", None) is not None)
    high = next(m.le for m in bound if getattr(m, "le", None) is not None)
    logits = torch.randn(64) * 30  # [V]
    seen = torch.ones(64)
    for rp in (low, high):
        params = SamplingParams(temperature=1e-30, repetition_penalty=rp)
        out = apply_penalties(logits, seen, torch.zeros(64), params)
        assert torch.isfinite(out).all() and torch.isfinite(probabilities(out, params)).all()

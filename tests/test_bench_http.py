"""`bonsai bench --url`: measuring an OpenAI-compatible server, against a stub on 127.0.0.1."""
from __future__ import annotations

import time

import pytest

from engine.bench.http_client import aggregate_summary, probe_server, run_concurrency, stream_chat
from engine.bench.records import PromptResult, SuitePrompt, percentile
from engine.errors import BonsaiError
from tests.stub_openai_server import SERVER_ERROR, STREAM_ERROR, closed_port_url, running_stub

TIMEOUT = 5.0


def prompt(i: int = 0, max_tokens: int = 64) -> SuitePrompt:
    return SuitePrompt(id=f"p{i}", category="qa", messages=[{"role": "user", "content": f"question {i}"}],
                       max_tokens=max_tokens)


def run_one(url: str, **kwargs) -> PromptResult:
    return stream_chat(url, "stub-model", prompt(), None, TIMEOUT, **kwargs)


def test_probe_returns_the_first_model_id():
    with running_stub(model="smollm2-135m") as url:
        assert probe_server(url, None, TIMEOUT) == "smollm2-135m"
        assert probe_server(url + "/v1/", None, TIMEOUT) == "smollm2-135m"  # a /v1 suffix is accepted


def test_request_is_a_streaming_chat_completion_with_usage():
    seen: list[dict] = []
    with running_stub(requests_seen=seen, api_key="secret") as url:
        stream_chat(url, "stub-model", prompt(3, max_tokens=32), "secret", TIMEOUT, temperature=0.0, seed=7)
    body = seen[-1]["body"]
    assert seen[-1]["path"] == "/v1/chat/completions"
    assert seen[-1]["headers"]["Authorization"] == "Bearer secret"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"]) == ("stub-model", 32, 0.0, 7)
    assert body["messages"] == [{"role": "user", "content": "question 3"}]


def test_ttft_and_inter_token_latency_are_measured():
    with running_stub(tokens=10, first_token_delay=0.1, token_delay=0.02) as url:
        r = run_one(url)
    assert 0.1 <= r.ttft_seconds < 0.25
    assert len(r.inter_token_seconds) == 9
    assert 0.015 <= percentile(r.inter_token_seconds, 50) <= 0.035
    assert 30 < r.decode_tokens_per_second <= 55  # 9 tokens after the first in 9 x 20 ms: 50 tok/s
    assert r.total_seconds >= 0.1 + 9 * 0.02


def test_usage_text_and_finish_reason_are_parsed():
    with running_stub(tokens=8, prompt_tokens=12) as url:
        r = run_one(url)
        capped = stream_chat(url, "stub-model", prompt(max_tokens=5), None, TIMEOUT)
    assert (r.prompt_tokens, r.generated_tokens, r.finish_reason) == (12, 8, "stop")
    assert r.output_text == "".join(f"tok{i} " for i in range(8))
    assert r.server_timings is None and r.drafted is None and r.accepted is None and r.cached_tokens == 0
    assert (capped.generated_tokens, capped.finish_reason) == (5, "length")


def test_tokens_are_counted_from_chunks_when_the_server_sends_no_usage():
    with running_stub(tokens=6, usage=False) as url:
        r = run_one(url)
    assert (r.generated_tokens, r.prompt_tokens) == (6, 0)


def test_a_chunk_may_carry_several_tokens():
    with running_stub(tokens=8, tokens_per_chunk=2, token_delay=0.01) as url:
        r = run_one(url)
    assert r.generated_tokens == 8  # from usage, not the 4 chunks
    assert len(r.inter_token_seconds) == 3
    span = sum(r.inter_token_seconds)
    assert r.decode_tokens_per_second == pytest.approx(7 / span)


def test_reasoning_content_counts_as_output():
    with running_stub(tokens=6, reasoning_tokens=3, first_token_delay=0.05) as url:
        r = run_one(url)
    assert r.ttft_seconds >= 0.05
    assert r.output_text == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert r.generated_tokens == 6


@pytest.mark.parametrize("usage", [True, False])
def test_llama_cpp_timings_fill_cache_and_draft_counts(usage):
    timings = {"cache_n": 5, "draft_n": 10, "draft_n_accepted": 7}
    with running_stub(tokens=8, prompt_tokens=12, timings=timings, usage=usage) as url:
        r = run_one(url)
    assert (r.cached_tokens, r.drafted, r.accepted) == (5, 10, 7)
    assert r.server_timings is not None and r.server_timings["predicted_n"] == 8
    assert (r.prompt_tokens, r.generated_tokens) == (12, 8)  # without usage: prompt_n + cache_n, predicted_n


def test_more_requests_in_flight_give_more_throughput():
    prompts = [prompt(i) for i in range(8)]
    with running_stub(tokens=10, token_delay=0.02) as url:
        serial, wall_1 = run_concurrency(url, "stub-model", prompts, 1, None, TIMEOUT)
        parallel, wall_4 = run_concurrency(url, "stub-model", prompts, 4, None, TIMEOUT)
    one, four = aggregate_summary(serial, wall_1), aggregate_summary(parallel, wall_4)
    assert [r.prompt_id for r in parallel] == [p.id for p in prompts]
    assert one["requests"] == four["requests"] == 8
    assert one["generated_tokens"] == four["generated_tokens"] == 80
    assert four["aggregate_tokens_per_second"] > 2 * one["aggregate_tokens_per_second"]
    assert 15 <= four["itl_ms_p50"] <= 35


def test_aggregate_summary_of_known_results():
    def result(ttft: float, gaps: list[float], tps: float, drafted: int | None = None,
               accepted: int | None = None) -> PromptResult:
        return PromptResult("p", "qa", prompt_tokens=10, generated_tokens=len(gaps) + 1, ttft_seconds=ttft,
                            decode_tokens_per_second=tps, total_seconds=ttft + sum(gaps), finish_reason="stop",
                            inter_token_seconds=gaps, drafted=drafted, accepted=accepted)
    results = [result(0.1, [0.01, 0.01, 0.01], 100.0, 8, 6), result(0.3, [0.03, 0.03, 0.03], 50.0)]
    s = aggregate_summary(results, wall_seconds=2.0)
    assert (s["requests"], s["generated_tokens"], s["prompt_tokens"]) == (2, 8, 20)
    assert s["aggregate_tokens_per_second"] == pytest.approx(4.0)
    assert s["ttft_ms_mean"] == pytest.approx(200) and s["ttft_ms_p50"] == pytest.approx(200)
    assert s["ttft_ms_p90"] == pytest.approx(280) and s["ttft_ms_p99"] == pytest.approx(298)
    assert s["itl_ms_p50"] == pytest.approx(20) and s["itl_ms_p99"] == pytest.approx(30)
    assert s["tpot_ms_mean"] == pytest.approx(20)
    assert s["decode_tps_mean"] == pytest.approx(75)
    assert s["decode_tps_std"] == pytest.approx(35.355, rel=1e-3)
    assert (s["draft_tokens"], s["draft_tokens_accepted"], s["draft_acceptance"]) == (8, 6, 0.75)


def one_line_error(call) -> str:
    with pytest.raises(BonsaiError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message
    return message


@pytest.mark.parametrize("mode, expected", [
    ("html_models", ["not an OpenAI-compatible server", "GET /v1/models returned text/html", "not JSON"]),
    ("empty_models", ["lists no models", "load a model"]),
])
def test_probe_failures_say_what_is_wrong(mode, expected):
    with running_stub(mode=mode) as url:
        message = one_line_error(lambda: probe_server(url, None, TIMEOUT))
    assert all(part in message for part in expected), message


def test_probe_of_a_server_that_wants_a_key():
    with running_stub(api_key="secret") as url:
        message = one_line_error(lambda: probe_server(url, None, TIMEOUT))
        assert probe_server(url, "secret", TIMEOUT) == "stub-model"
    assert "HTTP 401" in message and "Invalid API Key" in message and "API key" in message


def test_probe_of_something_that_is_not_an_openai_server():
    with running_stub() as url:
        message = one_line_error(lambda: probe_server(url + "/nothing-here", None, TIMEOUT))
    assert "not an OpenAI-compatible server" in message and "HTTP 404" in message


@pytest.mark.parametrize("mode, expected", [
    ("error_500", ["HTTP 500", SERVER_ERROR, "prompt p0"]),
    ("error_in_stream", ["reported an error mid-stream", STREAM_ERROR]),
    ("malformed", ["malformed stream event", "not JSON"]),
    ("cut", ["ended before [DONE]", "after 4 chunks"]),
    ("drop", ["ended before [DONE]"]),
    ("zero_tokens", ["generated no tokens for prompt p0"]),
])
def test_stream_failures_say_what_is_wrong(mode, expected):
    with running_stub(mode=mode, tokens=8) as url:
        message = one_line_error(lambda: run_one(url))
    assert all(part in message for part in expected), message


def test_a_failing_request_fails_the_concurrent_run():
    with running_stub(mode="error_500") as url:
        message = one_line_error(lambda: run_concurrency(url, "m", [prompt(i) for i in range(4)], 2, None, TIMEOUT))
    assert SERVER_ERROR in message


def test_unreachable_server_fails_fast():
    url = closed_port_url()
    start = time.perf_counter()
    probe = one_line_error(lambda: probe_server(url, None, TIMEOUT))
    chat = one_line_error(lambda: run_one(url))
    assert time.perf_counter() - start < 2
    for message in (probe, chat):
        assert f"cannot reach the server at {url}" in message and "is it running?" in message


def test_a_slow_server_hits_the_timeout_instead_of_hanging():
    with running_stub(tokens=4, first_token_delay=3.0) as url:
        start = time.perf_counter()
        message = one_line_error(lambda: stream_chat(url, "stub-model", prompt(), None, 0.3))
        assert time.perf_counter() - start < 1.5
    assert "did not finish within 0.3 s" in message


def test_the_timeout_bounds_the_whole_request_not_each_read():
    with running_stub(tokens=4, token_delay=0.4) as url:  # each read is under the timeout, the stream is not
        start = time.perf_counter()
        message = one_line_error(lambda: stream_chat(url, "stub-model", prompt(), None, 0.5))
        assert time.perf_counter() - start < 0.75
    assert "did not finish within 0.5 s" in message


@pytest.mark.parametrize("bad", ["localhost:8080", "ftp://127.0.0.1:21", "http://127.0.0.1:notaport"])
def test_a_bad_url_is_refused(bad):
    message = one_line_error(lambda: probe_server(bad, None, TIMEOUT))
    assert "http://127.0.0.1:8080" in message


def test_bad_concurrency_is_refused():
    message = one_line_error(lambda: run_concurrency("http://127.0.0.1:1", "m", [prompt()], 0, None, TIMEOUT))
    assert "at least 1" in message

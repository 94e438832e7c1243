"""Task suites on the local engine, and per-category summaries shared with server runs."""
from __future__ import annotations

import time
from typing import Callable

from engine.bench.records import PromptResult, SuitePrompt, mean_std, percentile
from engine.bench.suites import fresh_variant
from engine.decoding.engine import Engine
from engine.decoding.generate import generate
from engine.decoding.sampling import SamplingParams
from engine.decoding.sequence import Request
from engine.errors import BonsaiError
from engine.speculative.stats import SpecStats


def run_prompt(engine: Engine, prompt: SuitePrompt, sampling: SamplingParams) -> PromptResult:
    """Answer one suite prompt through the engine (no prefix reuse: every run is fresh)."""
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True))
    request = Request(ids, max_tokens=prompt.max_tokens, sampling=sampling, reuse_prefix=False, split_reasoning=False)
    out_ids: list[int] = []
    pieces: list[str] = []
    token_times: list[float] = []
    finish, stats = "length", None
    start = time.perf_counter()
    for event in generate(engine, request):
        if event.token_ids:
            token_times.append(time.perf_counter())
        out_ids.extend(event.token_ids)
        pieces.append(event.text)
        stats = event.stats
        finish = event.finish_reason or finish
    total = time.perf_counter() - start
    spec = stats.speculative
    if not out_ids:
        raise BonsaiError(f"the model generated no tokens for prompt {prompt.id} (it ended its answer at once): "
                          "a zero-length run has no speed to measure; check the chat template or the prompt")
    return PromptResult(
        prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(ids),
        generated_tokens=stats.generated_tokens, ttft_seconds=stats.ttft_seconds,
        decode_tokens_per_second=stats.decode_tokens_per_second, total_seconds=total,
        finish_reason=finish, cached_tokens=stats.cached_tokens,
        inter_token_seconds=[b - a for a, b in zip(token_times, token_times[1:])],
        output_token_ids=out_ids, output_text="".join(pieces),
        drafted=spec.drafted if spec else None, accepted=spec.accepted if spec else None,
        steps=spec.steps if spec else None, speculative=spec.as_dict() if spec else None)


def run_suite(engine: Engine, prompts: list[SuitePrompt], repetitions: int, sampling: SamplingParams | None = None,
              on_result: Callable[[PromptResult], None] = lambda r: None, plain: Engine | None = None,
              on_plain_result: Callable[[PromptResult], None] | None = None) -> list[PromptResult]:
    """Warm up on a variant no timed run uses, then every prompt `repetitions` times, fresh each time.
    With `plain` (an engine without drafters over the same runner) and `on_plain_result`, each prompt
    also runs plain just before (interleaved, so a drift of the machine's speed hits both alike);
    those results go to `on_plain_result`."""
    sampling = sampling or SamplingParams()
    pair = plain is not None and on_plain_result is not None
    if prompts:
        warm = fresh_variant(prompts[0], 10_000)
        warm = SuitePrompt(warm.id, warm.category, warm.messages, 4)
        if pair:
            run_prompt(plain, warm, sampling)
        run_prompt(engine, warm, sampling)
    results = []
    for rep in range(repetitions):
        for prompt in prompts:
            variant = fresh_variant(prompt, rep)
            if pair:
                on_plain_result(run_prompt(plain, variant, sampling))
            result = run_prompt(engine, variant, sampling)
            results.append(result)
            on_result(result)
    return results


def summarize_by_category(results: list[PromptResult]) -> dict[str, dict[str, float]]:
    """Per category and 'overall': runs, tokens, decode tok/s mean ± std, TTFT mean and p90, ITL p50/p90."""
    groups: dict[str, list[PromptResult]] = {}
    for r in results:
        groups.setdefault(r.category, []).append(r)
    if results:
        groups["overall"] = list(results)
    out = {}
    for name, rs in groups.items():
        tps_mean, tps_std = mean_std([r.decode_tokens_per_second for r in rs if r.generated_tokens > 1])
        itl = [x for r in rs for x in r.inter_token_seconds]
        ttft = [r.ttft_seconds for r in rs]
        out[name] = {"runs": len(rs), "generated_tokens": sum(r.generated_tokens for r in rs),
                     "prompt_tokens": sum(r.prompt_tokens for r in rs),
                     "decode_tokens_per_second": tps_mean, "decode_stddev": tps_std,
                     "ttft_ms_mean": 1000 * mean_std(ttft)[0], "ttft_ms_p90": 1000 * percentile(ttft, 90),
                     "itl_ms_p50": 1000 * percentile(itl, 50), "itl_ms_p90": 1000 * percentile(itl, 90)}
        spec = [r.speculative for r in rs if r.speculative]
        if spec:
            total = SpecStats.from_dict(spec[0])
            for d in spec[1:]:
                total.merge(SpecStats.from_dict(d))
            out[name]["speculative"] = total.as_dict()
    return out

"""`bonsai bench --url`: task suites through any OpenAI-compatible server, at several concurrencies."""
from __future__ import annotations

from typing import Any, Callable, Optional

from bonsai_cli.common import err_console


def run_server_bench(report: dict[str, Any], url: str, suite: str, categories: Optional[str], limit: Optional[int],
                     levels: list[int], repetitions: int, api_key: Optional[str], timeout: float,
                     save: Callable[[], None], vs_plain: bool = False) -> None:
    """vs_plain: every level also runs its requests with drafting off ("speculative.n_max": 0, llama.cpp's field,
    which our server honours per request), in the same server: plain and speculative side by side, the order
    alternating from level to level, the speedup and how many greedy outputs are identical."""
    from engine.bench import http_client
    from engine.bench.environment import describe_environment
    from engine.bench.suite_runner import summarize_by_category
    from engine.bench.suites import fresh_variant, load_suite
    from engine.errors import BonsaiError

    if not levels or any(c < 1 for c in levels):
        raise BonsaiError("--concurrency takes positive integers like 1,2,4,8")
    url = url.rstrip("/")
    prompts = load_suite(suite, categories.split(",") if categories else None, limit)
    model_id = http_client.probe_server(url, api_key, min(timeout, 10.0))
    report["environment"] = {**describe_environment(None), "device": f"server {url}"}
    report["model"] = {"name": model_id, "server": url, "architecture": "?", "parameters": 0,
                       "bits_per_weight": 0.0, "weight_dtype": "?", "kv_dtype": "?"}
    report["settings"] = {"repetitions": repetitions, "concurrency": levels, "suite": suite, "temperature": 0.0,
                          "vs_plain": vs_plain}
    report["suite"] = {"name": suite, "prompts": len(prompts), "results": [], "by_category": {}}
    report["concurrency"] = []
    http_client.stream_chat(url, model_id, fresh_variant(prompts[0], 10_000), api_key, timeout)  # warm-up
    all_results = []
    seen_cache = 0
    for index, level in enumerate(levels):
        batch = [fresh_variant(p, 1000 * level + rep) for rep in range(repetitions) for p in prompts]
        err_console.print(f"[dim]concurrency {level}: {len(batch)} requests{', plain and as served' * vs_plain}[/dim]")
        runs: dict[str, tuple[list, float]] = {}
        for way in (["plain", "served"] if index % 2 == 0 else ["served", "plain"]) if vs_plain else ["served"]:
            extra = {"speculative.n_max": 0} if way == "plain" else None
            runs[way] = http_client.run_concurrency(url, model_id, batch, level, api_key, timeout, extra=extra)
            seen_cache += sum(r.cached_tokens for r in runs[way][0])
        results, wall = runs["served"]
        all_results += results
        entry = {"concurrency": level, "wall_seconds": wall, "summary": http_client.aggregate_summary(results, wall)}
        if vs_plain:
            plain = http_client.aggregate_summary(*runs["plain"])
            entry["plain"] = {"wall_seconds": runs["plain"][1], "summary": plain}
            entry["speedup"] = entry["summary"]["aggregate_tokens_per_second"] / max(
                plain["aggregate_tokens_per_second"], 1e-9)
            entry["identical_outputs"] = sum(a.output_text == b.output_text for a, b in zip(runs["plain"][0], results))
            err_console.print(f"concurrency {level}: as served / plain {entry['speedup']:.2f}x, "
                              f"{entry['identical_outputs']} of {len(batch)} greedy outputs identical")
        report["concurrency"].append(entry)
        if level == levels[0]:
            report["suite"]["results"] += [r.as_dict() for r in results]
            report["suite"]["by_category"] = summarize_by_category(results)
        save()
    report["caches"]["server_reported_cache_n_total"] = seen_cache
    if seen_cache:
        err_console.print(f"[yellow]the server reused {seen_cache} cached prompt tokens (cache_n): "
                          "TTFT may be lower than for unseen prompts[/yellow]")

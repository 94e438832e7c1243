"""TTFT of a conversation's second turn on a running server: with the first turn's prefix reused
from the slot (cache_n) vs the same turn made fresh (a different first line, so nothing is reused).

    python tests/perf/serve_prefix_reuse.py --url http://127.0.0.1:8080 [-r 3] [--context-words 300]
"""
from __future__ import annotations

import argparse
import json
import statistics

from engine.bench import http_client
from engine.bench.records import SuitePrompt
from engine.bench.suites import fresh_variant

STORY = ("The lighthouse keeper wrote in his log every evening: the wind, the ships that passed, the colour "
         "of the sea, and the birds that rested on the rail. ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--context-words", type=int, default=300, help="length of the first turn's document")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    model = http_client.probe_server(args.url, args.api_key, 10)
    words = STORY.split()
    document = " ".join((words * (args.context_words // len(words) + 1))[:args.context_words])
    reuse, fresh, cached = [], [], []
    for rep in range(args.repetitions):
        first = [{"role": "user", "content": f"(session {rep})\nRead this log:\n{document}\nWhat is it about?"}]
        turn1 = http_client.stream_chat(args.url, model, SuitePrompt(f"t1-{rep}", "chat", first, 8), args.api_key, 300)
        second = first + [{"role": "assistant", "content": turn1.output_text},
                          {"role": "user", "content": "Name one thing he wrote down."}]
        turn2 = http_client.stream_chat(args.url, model, SuitePrompt(f"t2-{rep}", "chat", second, 8), args.api_key, 300)
        other = fresh_variant(SuitePrompt(f"t2f-{rep}", "chat", second, 8), 100 + rep)
        turn2_fresh = http_client.stream_chat(args.url, model, other, args.api_key, 300)
        reuse.append(turn2.ttft_seconds * 1000)
        fresh.append(turn2_fresh.ttft_seconds * 1000)
        cached.append((turn2.cached_tokens, turn2.prompt_tokens, turn2_fresh.cached_tokens))
    print(json.dumps({"ttft_ms_with_reuse": statistics.mean(reuse), "ttft_ms_without_reuse": statistics.mean(fresh),
                      "samples_with": reuse, "samples_without": fresh,
                      "cache_n_prompt_tokens_fresh_cache_n": cached}, indent=1))


if __name__ == "__main__":
    main()

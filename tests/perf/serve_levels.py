"""Where a concurrency level's throughput goes (issue 20): `bonsai bench --url` one level at a time, the server's
/metrics read before and after each, so a level's tok/s splits into decode steps a second × tokens a step (mean
batch) and the prompt chunks between them.

    python3 tests/perf/serve_levels.py --url http://127.0.0.1:18080 --suites short,tests/perf/repetitive_suite.json \
        --levels 1,8 [-r 1] [--json $OUT/levels.json]

Per level: aggregate tok/s, wall, decode steps, rows a step (the mean batch), ms a step (the level's wall over its
steps: everything the loop did, prefill and host work included), prompt chunks, and what the level would give at
that batch if every step cost only its share of the wall spent decoding (not measured here: the steps' own GPU time
comes from tests/perf/gpu_issue20.py --sections step).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

COUNTERS = ("decode_steps_total", "decode_rows_total", "generation_tokens_total", "prefill_chunks_total",
            "prompt_tokens_computed_total", "request_timed_total", "request_queue_seconds_total",
            "request_first_token_seconds_total", "decode_wait_seconds_total")


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("bonsai_") and name[len("bonsai_"):] in COUNTERS:
            values[name[len("bonsai_"):]] = float(value)
    return values


def level(url: str, suite: str, c: int, reps: int, timeout: float, limit: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        before = scrape(url)
        proc = subprocess.run([sys.executable, "-m", "bonsai_cli", "bench", "--url", url, "--suite", suite,
                               "--concurrency", str(c), "-r", str(reps), "--json", str(out)]
                              + (["--limit", str(limit)] if limit else []),
                              capture_output=True, text=True, timeout=timeout)
        after = scrape(url)
        if proc.returncode != 0:
            raise RuntimeError(f"bench failed: {proc.stderr.strip().splitlines()[-1:]}")
        report = json.loads(out.read_text())
    summary = report["concurrency"][0]["summary"]  # bonsai_cli/bench_server.py: one level
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    steps = max(delta["decode_steps_total"], 1)
    wall = summary["wall_seconds"]
    return {"suite": suite, "concurrency": c, "tok_s": summary["aggregate_tokens_per_second"], "wall_s": wall,
            "steps": delta["decode_steps_total"], "rows_per_step": delta["decode_rows_total"] / steps,
            "tokens_per_step": delta["generation_tokens_total"] / steps, "ms_per_step": wall / steps * 1e3,
            "prefill_chunks": delta["prefill_chunks_total"], "prompt_tokens": delta["prompt_tokens_computed_total"],
            "itl_p50": summary.get("itl_ms_p50"), "itl_p99": summary.get("itl_ms_p99"),
            "ttft_p50": summary.get("ttft_ms_p50"),
            "queue_ms": delta["request_queue_seconds_total"] / max(delta["request_timed_total"], 1) * 1e3,
            "first_token_ms": delta["request_first_token_seconds_total"] / max(delta["request_timed_total"], 1) * 1e3,
            # the engine's wait for a plain step's tokens, a step: ~a step's time when the device is the limit, ~0 when
            # the host (the engine's Python, the HTTP loop sharing its interpreter lock) is
            "wait_ms_per_step": delta["decode_wait_seconds_total"] / steps * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--suites", default="short")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=200)
    ap.add_argument("--limit", type=int, help="only the first N prompts of each suite")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for suite in args.suites.split(","):
        for c in (int(x) for x in args.levels.split(",")):
            row = level(args.url, suite, c, args.reps, args.timeout, args.limit)
            rows.append(row)
            print(f"{Path(suite).stem:10} c={c}: {row['tok_s']:7.1f} tok/s, {row['steps']:5.0f} steps of "
                  f"{row['rows_per_step']:.2f} rows ({row['tokens_per_step']:.2f} tokens), {row['ms_per_step']:.2f} ms "
                  f"a step of wall ({row['wait_ms_per_step']:.2f} waiting for the device), "
                  f"{row['prefill_chunks']:.0f} prompt chunks ({row['prompt_tokens']:.0f} tokens), "
                  f"ITL p50/p99 {row['itl_p50']:.1f}/{row['itl_p99']:.1f} ms, TTFT p50 {row['ttft_p50']:.0f} ms (server: "
                  f"queue {row['queue_ms']:.1f} + admission to first token {row['first_token_ms']:.1f} ms, means)",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

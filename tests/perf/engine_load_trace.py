"""The engine under a closed-loop load, in one process, iteration by iteration (issue 20): where a request's time
from admission to its first token goes when C clients keep a request each in flight (the server measured 24 ms of it
at one client and 77-92 ms at eight, 2026-12-06, H100, 8B ternary: the mean batch at c=8 was then 5 of 8 rows).

    python3 tests/perf/engine_load_trace.py [--clients 1,8] [--requests 64] [--prompt 12-40] [--tokens 32]
    python3 tests/perf/engine_load_trace.py --cpu-smoke          # a tiny dummy model on the CPU
    python3 tests/perf/engine_load_trace.py --spec ngram --clients 1,2,4,8   # against --spec none, the same prompts

No HTTP, no tokenizer (token-id requests): what is left is the engine loop. Each client resubmits as soon as its
request finishes. Per iteration: its wall time, rows decoding, riders (prompt rows in the decode pass) and own prompt
passes (engine._prefill_chunk calls); per request: admission → first token in iterations and ms. Prints the level's
tok/s, mean batch, and the iterations a first token waited, split by kind.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bonsai_cli.run_options import dummy_architecture  # noqa: E402
from engine.decoding.engine import Engine  # noqa: E402
from engine.decoding.sequence import Finished, Request  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402
from tests.perf.gpu_core_overhead import TINY  # noqa: E402


class Trace:
    """Wraps the engine's per-iteration parts (this process only) and records what each iteration did."""

    def __init__(self, engine: Engine):
        self.engine, self.iterations, self.current = engine, [], None
        riders, chunk = engine._riders, engine._prefill_chunk

        def traced_riders():
            out = riders()  # (pieces, the longest prompt that may ride)
            self.current["riders"] += sum(p.size for p in out[0])
            return out

        def traced_chunk(index, size):
            self.current["own_passes"] += 1
            self.current["own_tokens"] += size
            return chunk(index, size)

        engine._riders, engine._prefill_chunk = traced_riders, traced_chunk

    def step(self) -> None:
        e = self.engine
        decoding = sum(1 for s in e.active.values() if len(s.pending) == 1 and not s.done)
        self.current = {"decoding": decoding, "active": len(e.active), "waiting": e.scheduler.waiting,
                        "riders": 0, "own_passes": 0, "own_tokens": 0}
        t0 = time.perf_counter()
        e.step()
        self.current["ms"] = (time.perf_counter() - t0) * 1e3
        self.iterations.append(self.current)


def level(engine: Engine, trace: Trace, clients: int, requests: int, prompt: tuple[int, int], tokens: int,
          vocab: int, seed: int, pattern: int = 0) -> dict:
    """pattern > 0: each prompt is a random run of that many tokens repeated (n-gram drafts find matches)."""
    rng = random.Random(seed)
    drafted0, accepted0 = engine.metrics.spec_drafted, engine.metrics.spec_accepted
    done: list[dict] = []
    to_submit = clients
    submitted = 0

    def make() -> Request:
        n = rng.randint(*prompt)
        record = {"submitted": time.perf_counter(), "iteration": len(trace.iterations)}

        def emit(event, record=record):
            if isinstance(event, Finished):
                record["first_token_ms"] = event.stats.prefill_seconds * 1e3
                record["finished"] = time.perf_counter()
                record["tokens"] = event.stats.generated_tokens
                done.append(record)
            elif "first_iteration" not in record:
                record["first_iteration"] = len(trace.iterations)
        run = [rng.randrange(10, vocab) for _ in range(pattern or n)]
        return Request((run * (n // len(run) + 1))[:n], max_tokens=tokens, ignore_eos=True, text=False,
                       reuse_prefix=False, emit=emit)

    start_iteration, t0 = len(trace.iterations), time.perf_counter()
    while len(done) < requests:
        finished_before = len(done)
        while to_submit and submitted < requests:
            engine.submit(make())
            submitted += 1
            to_submit -= 1
        trace.step()
        to_submit += len(done) - finished_before
    wall = time.perf_counter() - t0
    its = trace.iterations[start_iteration:]
    waited = [r["first_iteration"] - r["iteration"] for r in done if "first_iteration" in r]
    kinds = {"decode only": [i for i in its if not i["riders"] and not i["own_passes"]],
             "with riders": [i for i in its if i["riders"] and not i["own_passes"]],
             "own prompt passes": [i for i in its if i["own_passes"]]}
    return {"clients": clients, "tok_s": sum(r["tokens"] for r in done) / wall, "wall_s": wall,
            "drafted": engine.metrics.spec_drafted - drafted0, "accepted": engine.metrics.spec_accepted - accepted0,
            "iterations": len(its), "mean_decoding": statistics.mean(i["decoding"] for i in its),
            "first_token_ms_mean": statistics.mean(r["first_token_ms"] for r in done),
            "first_token_iterations_mean": statistics.mean(waited) if waited else 0.0,
            "kinds": {k: {"count": len(v), "ms_mean": statistics.mean(i["ms"] for i in v) if v else 0.0,
                          "riders_mean": statistics.mean(i["riders"] for i in v) if v else 0.0,
                          "own_tokens_mean": statistics.mean(i["own_tokens"] for i in v) if v else 0.0,
                          "decoding_mean": statistics.mean(i["decoding"] for i in v) if v else 0.0}
                      for k, v in kinds.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--weights", default="tri")
    ap.add_argument("--head", default="int4")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", default="12-40", help="prompt lengths, uniform in this range")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--spec", default="none", help="ngram: an n-gram drafter on every slot, k = 4 (with the gate)")
    ap.add_argument("--pattern", type=int, default=0, help="prompts of a random run of this many tokens, repeated")
    ap.add_argument("--no-ride", action="store_true",
                    help="prompts longer than the short prefill never ride (the engine before session 26)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    device = "cuda"
    if args.cpu_smoke:
        path = Path("/tmp/engine_load_trace_tiny.yaml")
        path.write_text(TINY)
        args.model, device, args.requests, args.tokens = str(path), "cpu", 6, 6
    config, _ = dummy_architecture(args.model)
    loaded = load_dummy(config, Path(args.model).stem, device=device,
                        weight_format=WeightFormat(args.weights, 64 if args.cpu_smoke else 128, args.head))
    runner = ModelRunner(loaded, max_seq_len=512, num_slots=args.slots)
    runner.prepare_rows(16)
    drafters = None
    if args.spec == "ngram":
        from engine.speculative.ngram import NgramDrafter
        drafters = [NgramDrafter(1, 4) for _ in range(args.slots)]
    engine = Engine(runner, None, drafters=drafters, num_draft_tokens=4)
    if args.no_ride:
        engine.ride_tokens = engine.short_tokens
    trace = Trace(engine)
    lo, hi = (int(x) for x in args.prompt.split("-"))
    results = []
    level(engine, trace, args.slots, args.slots, (lo, hi), 4, config.vocab_size, seed=99)  # warm-up
    for c in (int(x) for x in args.clients.split(",")):
        r = level(engine, trace, c, args.requests, (lo, hi), args.tokens, config.vocab_size, seed=c,
                  pattern=args.pattern)
        results.append(r)
        print(f"c={c}: {r['tok_s']:8.1f} tok/s, {r['iterations']} iterations, mean decoding {r['mean_decoding']:.2f} "
              f"rows, admission→first token {r['first_token_ms_mean']:.1f} ms = "
              f"{r['first_token_iterations_mean']:.1f} iterations; drafts accepted {r['accepted']} / {r['drafted']}",
              flush=True)
        for kind, k in r["kinds"].items():
            print(f"    {kind:18}: {k['count']:5} iterations of {k['ms_mean']:6.2f} ms, decoding {k['decoding_mean']:.2f}, "
                  f"riders {k['riders_mean']:.1f} rows, own prompt tokens {k['own_tokens_mean']:.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

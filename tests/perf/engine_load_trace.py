"""The engine under a closed-loop load, in one process, iteration by iteration (issue 20): where a request's time
from admission to its first token goes when C clients keep a request each in flight (the server measured 24 ms of it
at one client and 77-92 ms at eight, 2026-12-06, H100, 8B ternary: the mean batch at c=8 was then 5 of 8 rows).

    python3 tests/perf/engine_load_trace.py [--clients 1,8] [--requests 64] [--prompt 12-40] [--tokens 32]
    python3 tests/perf/engine_load_trace.py --cpu-smoke          # a tiny dummy model on the CPU
    python3 tests/perf/engine_load_trace.py --spec ngram --clients 1,2,4,8   # against --spec none, the same prompts
    python3 tests/perf/engine_load_trace.py --spec none,ngram --pattern 8 --repeat 2   # engines side by side, levels
                                                     # interleaved (ngram:always: drafters without the gate)

No HTTP, no tokenizer (token-id requests): what is left is the engine loop. Each client resubmits as soon as its
request finishes. Per iteration: its wall time, rows decoding, riders (prompt rows in the decode pass) and own prompt
passes (engine._prefill_chunk calls), whether it speculated (a try of the gate's slower way or not), took a step
launched ahead, launched one; per request: admission → first token in iterations and ms. Prints the level's tok/s,
mean batch, and the iterations a first token waited, split by kind.
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
        if engine.spec is not None:
            spec_step = engine.spec.step

            def traced_spec(*args):
                drafted = engine.metrics.spec_drafted
                out = spec_step(*args)
                self.current["spec"], self.current["drafted"] = 1, engine.metrics.spec_drafted - drafted
                return out
            engine.spec.step = traced_spec
        if engine.gate is not None:
            speculate = engine.gate.speculate

            def traced_speculate(batch):
                out = speculate(batch)
                self.current["trial"] = int(engine.gate._trial)
                return out
            engine.gate.speculate = traced_speculate
        if engine.ahead is not None:
            take, launch = engine.ahead.take, engine.ahead.launch

            def traced_take(rows, tokens):
                out = take(rows, tokens)
                self.current["ahead_taken"] = int(out is not None)
                return out

            def traced_launch(rows, tokens):
                self.current["launched"] = 1
                return launch(rows, tokens)
            engine.ahead.take, engine.ahead.launch = traced_take, traced_launch

    def step(self) -> None:
        e = self.engine
        decoding = sum(1 for s in e.active.values() if len(s.pending) == 1 and not s.done)
        self.current = {"decoding": decoding, "active": len(e.active), "waiting": e.scheduler.waiting,
                        "riders": 0, "own_passes": 0, "own_tokens": 0, "spec": 0, "drafted": 0, "trial": 0,
                        "ahead_taken": 0, "launched": 0}
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
    outputs: list[list[int]] = []  # each request's token ids, in the order submitted
    to_submit = clients
    submitted = 0

    def make() -> Request:
        n = rng.randint(*prompt)
        record = {"submitted": time.perf_counter(), "iteration": len(trace.iterations), "ids": []}
        outputs.append(record["ids"])

        def emit(event, record=record):
            record["ids"].extend(getattr(event, "token_ids", ()))
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
    decode = [i for i in its if i["decoding"] and not i["riders"] and not i["own_passes"]]
    kinds.update({"  speculated": [i for i in decode if i["spec"]],
                  "  (gate tries)": [i for i in decode if i["trial"]],
                  "  plain, ahead taken": [i for i in decode if not i["spec"] and i["ahead_taken"]],
                  "  plain, not ahead": [i for i in decode if not i["spec"] and not i["ahead_taken"]]})
    return {"clients": clients, "tok_s": sum(r["tokens"] for r in done) / wall, "wall_s": wall,
            "drafted": engine.metrics.spec_drafted - drafted0, "accepted": engine.metrics.spec_accepted - accepted0,
            "iterations": len(its), "launched": sum(i["launched"] for i in its),
            "spec_steps": sum(i["spec"] for i in its), "outputs": outputs, "timeline": "".join(map(_code, its)), "mean_decoding": statistics.mean(i["decoding"] for i in its),
            "first_token_ms_mean": statistics.mean(r["first_token_ms"] for r in done),
            "first_token_iterations_mean": statistics.mean(waited) if waited else 0.0,
            "kinds": {k: {"count": len(v), "ms_mean": statistics.mean(i["ms"] for i in v) if v else 0.0,
                          "riders_mean": statistics.mean(i["riders"] for i in v) if v else 0.0,
                          "own_tokens_mean": statistics.mean(i["own_tokens"] for i in v) if v else 0.0,
                          "decoding_mean": statistics.mean(i["decoding"] for i in v) if v else 0.0,
                          "drafted_mean": statistics.mean(i["drafted"] for i in v) if v else 0.0}
                      for k, v in kinds.items()}}


def base_engine(base: Path) -> type:
    """The Engine of the files engine/decoding/{spec_gate,spec_step,engine}.py under `base` (an earlier commit's, e.g.
    `git archive HEAD engine/decoding engine/speculative | tar -x -C DIR`), loaded beside the current modules: both
    measured in one process. With engine/speculative/planner.py under `base`, the base's fused step plans with it."""
    import importlib.util
    modules = {}
    for name in ("spec_gate", "spec_step", "engine"):
        spec = importlib.util.spec_from_file_location(f"base_{name}", base / "engine" / "decoding" / f"{name}.py")
        modules[name] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    modules["engine"].SpecGate = modules["spec_gate"].SpecGate
    modules["engine"].SpeculativeStep = modules["spec_step"].SpeculativeStep
    planner = base / "engine" / "speculative" / "planner.py"
    if planner.exists():
        spec = importlib.util.spec_from_file_location("base_planner", planner)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in ("Acceptance", "TargetCost", "joint_draft_lengths"):
            setattr(modules["spec_step"], name, getattr(module, name))
    return modules["engine"].Engine


def build(args, config, loaded, spec: str) -> tuple[Engine, Trace]:
    """An engine of its own runner (slots, graphs) for `spec`: none, ngram (the gate on a CUDA device) or ngram:always;
    NAME@base: the engine of --base."""
    runner = ModelRunner(loaded, max_seq_len=512, num_slots=args.slots)
    runner.prepare_rows(16)
    drafters = None
    if spec.startswith("ngram"):
        from engine.speculative.ngram import NgramDrafter
        drafters = [NgramDrafter(1, 4) for _ in range(args.slots)]
    engine_class = base_engine(args.base) if spec.endswith("@base") else Engine
    engine = engine_class(runner, None, drafters=drafters, num_draft_tokens=4,
                          spec_gate=False if spec.startswith("ngram:always") else None)
    if args.no_ride:
        engine.ride_tokens = engine.short_tokens
    trace = Trace(engine)
    lo, hi = (int(x) for x in args.prompt.split("-"))
    level(engine, trace, args.slots, args.slots, (lo, hi), 4, config.vocab_size, seed=99)  # warm-up
    return engine, trace


def report(spec: str, r: dict, engine: Engine) -> None:
    print(f"[{spec}] c={r['clients']}: {r['tok_s']:8.1f} tok/s, {r['iterations']} iterations, mean decoding "
          f"{r['mean_decoding']:.2f} rows, admission→first token {r['first_token_ms_mean']:.1f} ms = "
          f"{r['first_token_iterations_mean']:.1f} iterations; drafts accepted {r['accepted']} / {r['drafted']} in "
          f"{r['spec_steps']} speculative steps; {r['launched']} steps launched ahead", flush=True)
    for kind, k in r["kinds"].items():
        print(f"    {kind:20}: {k['count']:5} iterations of {k['ms_mean']:6.2f} ms, decoding {k['decoding_mean']:.2f}, "
              f"riders {k['riders_mean']:.1f} rows, own prompt tokens {k['own_tokens_mean']:.1f}, drafted "
              f"{k['drafted_mean']:.2f}", flush=True)
    if engine.gate is not None:
        rates = {f"{'spec' if s else 'plain'}@{c}": round(v) for (s, c), v in sorted(engine.gate.rates.items())}
        print(f"    gate: tok/s by (way, class) {rates}; periods {engine.gate.period}", flush=True)
    if engine.spec is not None:
        costs = {rows: round(s * 1e3, 2) for rows, s in sorted(engine.spec.pass_cost.seconds.items())}
        print(f"    verify pass ms by rows {costs}", flush=True)


def _code(it: dict) -> str:
    """One letter an iteration: p own prompt passes, r riders, T a gate's try, S speculated, a plain taking the step
    launched ahead, . plain not; upper-case p/r/a/.: it launched the next step ahead; - nothing decoding."""
    if it["own_passes"] or it["riders"]:
        c = "p" if it["own_passes"] else "r"
    elif not it["decoding"]:
        return "-"
    elif it["spec"]:
        return "T" if it["trial"] else "S"
    else:
        c = "a" if it["ahead_taken"] else "."
    return c.upper() if it["launched"] else c


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
    ap.add_argument("--spec", default="none", help="comma-separated engines, each on its own runner, levels interleaved: "
                    "none | ngram (an n-gram drafter on every slot, k = 4, with the gate) | ngram:always (no gate)")
    ap.add_argument("--base", type=Path, help="engines named NAME@base run the engine/decoding files (and engine/speculative/planner.py, if there) under this folder")
    ap.add_argument("--repeat", type=int, default=1, help="each level this many times (interleaved across engines)")
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
    specs = args.spec.split(",")
    engines = {spec: build(args, config, loaded, spec) for spec in specs}
    lo, hi = (int(x) for x in args.prompt.split("-"))
    results = []
    for c in (int(x) for x in args.clients.split(",")):
        for rep in range(args.repeat):
            for spec, (engine, trace) in engines.items():
                r = level(engine, trace, c, args.requests, (lo, hi), args.tokens, config.vocab_size, seed=c + 1000 * rep,
                          pattern=args.pattern)
                results.append({"spec": spec, "repeat": rep, **r})
                report(spec, r, engine)
        for rep in range(args.repeat):
            outs = [r["outputs"] for r in results if r["clients"] == c and r["repeat"] == rep]
            print(f"c={c} repeat {rep}: greedy outputs of the {len(outs)} engines "
                  f"{'identical' if all(o == outs[0] for o in outs) else 'DIFFER'}", flush=True)
        by = {spec: [r["tok_s"] for r in results if r["clients"] == c and r["spec"] == spec] for spec in specs}
        print(f"c={c}: " + ", ".join(f"{spec} {statistics.mean(v):.1f} tok/s ({v[0] / by[specs[0]][0]:.2f}x "
                                     f"{specs[0]} first run)" for spec, v in by.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

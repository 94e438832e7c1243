"""Why one request through `bonsai serve` decodes slower than `bonsai bench` (issue 20): the same generated model
driven through the engine (generate_text, as the bench does) with the server's runner shape and without it.

    python3 tests/perf/serve_step_gap.py --tokenizer .tok/smollm2.gguf        # qwen3-8b ternary, int4 head, cuda
    python3 tests/perf/serve_step_gap.py --cpu-smoke                           # a tiny model on the CPU

Variants (one model, one runner each, interleaved repetitions): the bench's shape (1 slot, a 640-key context),
the server's (configs/serve-dummy-bench.yaml: 8 slots of 4,096 keys, every row count captured), and either with
the borrowed tokenizer (the engine cuts the logits to its vocabulary; +text: detokenized as it goes) or with
token ids only. Per variant: ms a
token through the engine (one request of --tokens after a --prompt prefill; best and median), the engine's wait
for the device a step (metrics.decode_wait_seconds), the one-row decode step alone (--steps back to back,
fed on the device, timed from the host after a sync), and with --profile the kernels of 20 engine steps by total time.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bonsai_cli.run_options import dummy_architecture  # noqa: E402
from engine.bench.model_bench import fresh_tokens  # noqa: E402
from engine.decoding.engine import Engine  # noqa: E402
from engine.decoding.generate import generate_text  # noqa: E402
from engine.decoding.sequence import Request  # noqa: E402
from engine.run.builder import tokenizer_of  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402
from tests.perf.gpu_core_overhead import TINY  # noqa: E402  (the tiny model of --cpu-smoke)

SHAPES = {"bench": (1, 640), "serve": (8, 4096)}  # (slots, keys a slot)


def one_request(engine: Engine, prompt: list[int], n: int, text: bool = False) -> tuple[float, float, int]:
    """(decode seconds, seconds waited for the device, plain steps) of one request (text: detokenized as it goes,
    as the server's are)."""
    engine.runner.slot(0).reset()
    waited, steps = engine.metrics.decode_wait_seconds, engine.metrics.decode_steps
    stats = generate_text(engine, Request(prompt, max_tokens=n + 1, ignore_eos=True, text=text,
                                          reuse_prefix=False))[3]
    return (stats.decode_seconds, engine.metrics.decode_wait_seconds - waited,
            engine.metrics.decode_steps - steps)


def step_alone(runner: ModelRunner, steps: int, prompt: list[int]) -> float:
    """ms a one-row decode step run back to back (the graphed one on CUDA), its token fed on the device."""
    slot = runner.slot(0)
    slot.reset()
    token = runner.prefill(slot, prompt).argmax(-1, keepdim=True)  # [1]
    for _ in range(3):
        token = runner.decode_batch([slot], token).argmax(-1)  # [1]
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        token = runner.decode_batch([slot], token).argmax(-1)
    sync()
    slot.reset()
    return (time.perf_counter() - t0) * 1e3 / steps


def kernels(engine: Engine, prompt: list[int], top: int = 12) -> list[str]:
    """The kernels of 20 decode steps through the engine, by total device time (µs a step)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        one_request(engine, prompt, 20)
    spent = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = sorted(prof.key_averages(), key=lambda e: -spent(e))[:top]
    return [f"{spent(e) / 20:8.1f} µs  {e.count / 20:6.1f}x  {e.key[:90]}" for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--weights", default="tri")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer (GGUF) whose vocabulary the engine cuts to")
    ap.add_argument("--prompt", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default="bench,serve,bench+tok,serve+tok,serve+tok+text")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        path = Path("/tmp/serve_step_gap_tiny.yaml")
        path.write_text(TINY)
        args.model, args.tokens, args.reps, args.steps = str(path), 8, 1, 4

    device = "cpu" if args.cpu_smoke else "cuda"
    shapes = {"bench": (1, 128), "serve": (2, 256)} if args.cpu_smoke else SHAPES
    config, _ = dummy_architecture(args.model)
    loaded = load_dummy(config, Path(args.model).stem, device=device,
                        weight_format=WeightFormat(args.weights, 64 if args.cpu_smoke else 128, "int4"))
    tok = tokenizer_of(args.tokenizer) if args.tokenizer else None
    prompt = fresh_tokens(min(config.vocab_size, tok.vocab_size if tok else config.vocab_size), frozenset(),
                          args.prompt, 1)
    out = {"model": Path(args.model).stem, "weights": args.weights, "device": device, "variants": {}}
    for name in args.variants.split(","):
        shape, *extra = name.split("+")
        with_tok, text = "tok" in extra, "text" in extra
        if with_tok and tok is None:
            continue
        slots, keys = shapes[shape]
        runner = ModelRunner(loaded, max_seq_len=keys, num_slots=slots)
        engine = Engine(runner, tok if with_tok else None)
        runner.prepare_rows(slots)
        one_request(engine, prompt, 4, text)  # captures, allocations
        runs = [one_request(engine, prompt, args.tokens, text) for _ in range(args.reps)]
        ms = [d * 1e3 / args.tokens for d, _, _ in runs]
        wait = [w * 1e3 / max(s, 1) for _, w, s in runs]
        alone = step_alone(runner, args.steps, prompt)
        row = {"slots": slots, "keys": keys, "vocab": engine.vocab, "ms_token_best": min(ms),
               "ms_token_median": statistics.median(ms), "wait_ms_step": statistics.median(wait),
               "step_alone_ms": alone}
        print(f"{name:10s} {slots} slots x {keys:5d} keys, vocab {engine.vocab:6d}: {min(ms):.3f} ms a token "
              f"(median {statistics.median(ms):.3f}), waiting {row['wait_ms_step']:.3f} ms a step; "
              f"the step alone {alone:.3f} ms", flush=True)
        if args.profile:
            row["kernels"] = kernels(engine, prompt)
            print("\n".join("    " + line for line in row["kernels"]), flush=True)
        out["variants"][name] = row
        del engine, runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

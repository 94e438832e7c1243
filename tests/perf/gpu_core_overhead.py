"""The decoding core's cost on the GPU: the same graphed decode step and prefill, driven directly
(runner.forward + argmax, what `bonsai bench` did before issue 22) and through the engine
(engine.decoding: one request, submit + step), side by side in one process.

    python3 tests/perf/gpu_core_overhead.py                 # qwen3-8b ternary, int4 head, on cuda
    python3 tests/perf/gpu_core_overhead.py --cpu-smoke     # a tiny dummy model on the CPU

Prints pp (prefill of --prompt tokens) and tg (--tokens decode steps) tok/s, best and median of
--reps interleaved repetitions, for both drivers, and their ratio; one JSON line at the end.
"""
from __future__ import annotations

import argparse
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
from engine.decoding.sampling import greedy_tokens  # noqa: E402
from engine.decoding.sequence import Request  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402

TINY = ("architectures: [Qwen3ForCausalLM]\nvocab_size: 4096\nhidden_size: 256\nintermediate_size: 512\n"
        "num_hidden_layers: 2\nnum_attention_heads: 4\nnum_key_value_heads: 2\nhead_dim: 64\n")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def direct(runner, prompt: list[int], n: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds of n tokens): the runner driven by hand."""
    slot = runner.slot(0)
    slot.reset()
    sync(runner.device)
    t0 = time.perf_counter()
    logits = runner.prefill(slot, prompt)
    token = greedy_tokens(logits[None])[0]
    t1 = time.perf_counter()
    for _ in range(n):
        token = greedy_tokens(runner.forward(slot, [token]))[0]
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def through_engine(engine, prompt: list[int], n: int) -> tuple[float, float]:
    """The same through the engine: the request's own prefill and decode times."""
    engine.runner.slot(0).reset()
    sync(engine.runner.device)
    stats = generate_text(engine, Request(prompt, max_tokens=n + 1, ignore_eos=True, text=False,
                                          reuse_prefix=False))[3]
    return stats.prefill_seconds, stats.decode_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--weights", default="tri")
    ap.add_argument("--head", default="int4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        path = Path("/tmp/gpu_core_overhead_tiny.yaml")
        path.write_text(TINY)
        args.model, args.prompt, args.tokens, args.reps = str(path), 32, 16, 2
    device = "cpu" if args.cpu_smoke else "cuda"
    config, _ = dummy_architecture(args.model)
    loaded = load_dummy(config, Path(args.model).stem, device=device,
                        weight_format=WeightFormat(args.weights, 64 if args.cpu_smoke else 128, args.head))
    runner = ModelRunner(loaded, max_seq_len=args.prompt + args.tokens + 8)
    engine = Engine(runner, None)
    prompt = fresh_tokens(config.vocab_size, frozenset(), args.prompt, 1)
    for run in (direct, lambda r, p, n: through_engine(engine, p, n)):
        run(runner, prompt, 4)  # warm-up: captures, allocations
    results = {"direct": [], "engine": []}
    for rep in range(args.reps):  # interleaved: a drift of the machine hits both alike
        results["direct"].append(direct(runner, prompt, args.tokens))
        results["engine"].append(through_engine(engine, prompt, args.tokens))
    out = {"model": Path(args.model).stem, "weights": args.weights, "head": args.head, "device": device,
           "graphed": getattr(runner.decoder, "graph", None) is not None,
           "prefill_graphs": runner.prefill_graphs is not None}
    for name, runs in results.items():
        pp = [args.prompt / p for p, _ in runs]
        tg = [args.tokens / d for _, d in runs]
        out[name] = {"pp_best": max(pp), "pp_median": statistics.median(pp), "tg_best": max(tg),
                     "tg_median": statistics.median(tg)}
        print(f"{name:7s} pp{args.prompt}: {max(pp):10.1f} tok/s best, {statistics.median(pp):10.1f} median; "
              f"tg{args.tokens}: {max(tg):8.1f} best, {statistics.median(tg):8.1f} median")
    out["engine_over_direct"] = {k: out["engine"][k] / out["direct"][k] for k in out["engine"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

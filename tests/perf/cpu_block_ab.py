"""Issue 23: the native CPU decode step with each block's host work in one C call (engine.runtime.cpu_step,
kq_block) against the torch path between the same C products, in one process on the same loaded model, interleaved.

    python3 tests/perf/cpu_block_ab.py qwen2.5-coder-1.5b [--steps 32] [--rounds 8] [--context 64] [--threads 2]

MODEL: a pulled built-in name (`bonsai pull`) or a GGUF path. The model is loaded once with the native kernels
(cpu_int4, cpu_kernels native, int8 narrow head); each round decodes `--steps` one-token steps with the C block path
on and then off (the order alternating between rounds), the slot rewound after each run so both see the same context
lengths. Prints ms a step, mean ± stdev over rounds, and the ratio. Greedy agreement is tests/test_cpu_step.py's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def model_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    from engine.sources import store
    found = store.find_pulled(name)
    if found is None:
        raise SystemExit(f"{name}: not pulled; run `bonsai pull {name}` first")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--context", type=int, default=64, help="prompt tokens before the timed steps")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_model
    loaded = load_model(model_path(args.model), cpu_int4=True, cpu_kernels="native", narrow_head="int8")
    natives = [block.native for block in loaded.model.layers]
    if not any(natives):
        raise SystemExit("the C block path does not take this model's blocks (see engine.runtime.cpu_step)")
    runner = ModelRunner(loaded, max(512, args.context + 2 * args.steps + 8))
    slot = runner.slot(0)
    runner.prefill(slot, [100 + i % 5000 for i in range(args.context)])
    times: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(args.rounds):
        for on in (True, False) if rnd % 2 == 0 else (False, True):
            for block, native in zip(loaded.model.layers, natives):
                block.native = native if on else None
            runner.forward(slot, [5], num_logits=1)  # warm
            slot.rewind(1)
            t0 = time.perf_counter()
            for i in range(args.steps):
                runner.forward(slot, [5 + i], num_logits=1)
            times[on].append((time.perf_counter() - t0) / args.steps * 1e3)
            slot.rewind(args.steps)
    for on, label in ((True, "C block"), (False, "torch")):
        v = times[on]
        print(f"{args.model} context {slot.length}: {label:8} {statistics.mean(v):7.2f} ± {statistics.stdev(v):5.2f} "
              f"ms a step ({1e3 / statistics.mean(v):6.1f} tok/s), min {min(v):.2f}")
    print(f"ratio (torch / C block): {statistics.mean(times[False]) / statistics.mean(times[True]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

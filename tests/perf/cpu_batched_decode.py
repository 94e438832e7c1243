"""Batched decode on the CPU: one step for B slots (runner.decode_batch) at B = 1, 2, 4, 8, with
float16 and float32 matrices — what `runtime.weight_dtype: auto` chooses from.

    python tests/perf/cpu_batched_decode.py [--reps 8] [--context 100]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.sources import store
from engine.weights.loader import load_model
from engine.runtime.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--context", type=int, default=100, help="tokens already in each slot")
    args = ap.parse_args()
    path = store.find_pulled(store.DEFAULT_MODEL) or store.pull(store.DEFAULT_MODEL)
    for dtype in (torch.float16, torch.float32):
        runner = ModelRunner(load_model(path, "cpu", weight_dtype=dtype), max_seq_len=args.context + 16, num_slots=8)
        for slot in runner.cache.slots:
            runner.prefill(slot, list(range(10, 10 + args.context)))
        for b in (1, 2, 4, 8):
            slots = runner.cache.slots[:b]
            times = []
            for _ in range(args.reps + 1):
                start = time.perf_counter()
                runner.decode_batch(slots, [100] * b)
                times.append(time.perf_counter() - start)
                for slot in slots:
                    slot.rewind(1)
            ms = statistics.median(times[1:]) * 1000
            print(f"{str(dtype).split('.')[1]:8s} B={b}: {ms:7.1f} ms/step  {1000 * b / ms:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()

"""Packed prefill on the GPU: a packed matrix is unpacked to bf16 Wᵀ for cuBLAS whole or in column slices
(engine.weights.packed_linear; the memory plan picks slices only under max_gpu_memory). Hypothesis first tested: a
slice that fits the L2 cache (50 MB) might be read back by the GEMM before its lines reach HBM (it was not: larger
slices won at every size, 2026-12-04). This script measures, one run side by side (slice 0 = whole):
  matmul  packed_matmul of T rows for the 27B-class and 8B shapes at each slice size, against cuBLAS on a bf16
          weight of the same shape (the floor: no unpacking);
  model   the runner's graphed prefill of T tokens (generated weights) at each slice size.
    python -m tests.perf.prefill_slices --slices 32,64,256,0 --models qwen3.6-27b:tri:int4,qwen3-8b:tri:int4
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.weights import packed_linear

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"27b qkv+z": (16384, 5120), "27b gate_up": (34816, 5120), "27b down": (5120, 17408),
          "8b qkv": (6144, 4096), "8b gate_up": (24576, 4096), "8b down": (4096, 12288)}


def _bench(fn) -> float:
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def matmul_section(slices: list[int], t: int, kind: str) -> None:
    from quant.packed_layout import random_packed
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        pw = random_packed(kind, n, k, 128, device="cuda", generator=gen)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        dense = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        floor = _bench(lambda: torch.matmul(x, dense))
        want = packed_linear.packed_matmul(x, pw).float()
        cells = []
        for mb in slices:
            got = packed_linear.packed_matmul(x, pw, mb << 20).float()
            assert (got - want).abs().max() <= 1e-2 * want.abs().max(), f"{name} at {mb} MB differs"
            s = _bench(lambda: packed_linear.packed_matmul(x, pw, mb << 20))
            cells.append(f"{f'{mb} MB' if mb else 'whole'} {s * 1e6:.0f}")
        print(f"matmul {name} [{t}x{k}]·[{k}x{n}] {kind}: cuBLAS bf16 {floor * 1e6:.0f} us | " + " | ".join(cells)
              + " us", flush=True)


def model_section(slices: list[int], t: int, specs: list[str], reps: int) -> None:
    import yaml

    from engine.runtime.runner import ModelRunner
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    for spec in specs:
        name, weights, head = spec.split(":")
        cfg = ModelConfig.from_hf_config(yaml.safe_load((ROOT / "configs" / "models" / f"{name}.yaml").read_text()))
        loaded = load_dummy(cfg, name, "cuda", WeightFormat(weights, 128, head))
        tokens = [(i * 7919) % cfg.vocab_size for i in range(t)]
        cells = []
        for mb in slices:
            packed_linear.set_unpack_slice(loaded.model, mb << 20)
            runner = ModelRunner(loaded, max_seq_len=2 * t, num_slots=1, prefill_chunk_size=t)
            slot = runner.slot(0)
            times = []
            for _ in range(reps + 2):  # the first two capture and warm up
                slot.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.forward(slot, tokens)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ms = [x * 1e3 for x in times[2:]]
            cells.append(f"{f'{mb} MB' if mb else 'whole'} {statistics.mean(ms):.1f} ± {statistics.pstdev(ms):.1f} ms "
                         f"({t / statistics.mean(times[2:]):,.0f} tok/s)")
            del runner, slot
            torch.cuda.empty_cache()
        print(f"prefill {spec} {t} tokens: " + " | ".join(cells), flush=True)
        del loaded
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", default="32,64,128,256,0")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--kind", default="tri")
    ap.add_argument("--models", default="qwen3.6-27b:tri:int4,qwen3-8b:tri:int4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="matmul,model")
    a = ap.parse_args()
    slices = [int(s) for s in a.slices.split(",")]
    print(torch.cuda.get_device_name(), flush=True)
    if "matmul" in a.parts:
        matmul_section(slices, a.tokens, a.kind)
    if "model" in a.parts:
        model_section(slices, a.tokens, a.models.split(","), a.reps)


if __name__ == "__main__":
    main()

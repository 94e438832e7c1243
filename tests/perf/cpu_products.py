"""One product of each GGUF block type on the native CPU kernels (quant/kernels/cpu_kquant.c), timed alone: a
matrix kept in cache (the kernel's arithmetic) and 24 copies cycled (streamed from memory, as a decode step reads a
model), at 1 and N threads, one decode row (M=1) and a verify-sized tile; GB/s of the packed bytes and billions of
weights a second. Not a test: `python tests/perf/cpu_products.py [--threads 2] [--rows 1,5]`.
Prints the body the library was built with (avx512-vnni, avx2, or the portable loops)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from quant import kquant_pack  # noqa: E402
from quant.kernels import cpu_rt  # noqa: E402
from tests.gguf_tiny import random_k_quant_bytes  # noqa: E402

# (type, N, K): the shapes of Qwen2.5-Coder-0.5B's gate/up (A formats) and the 1.5B's q/k/v-sized K-quants
CASES = [(T.Q4_0, 9728, 896), (T.Q5_0, 9728, 896), (T.Q8_0, 9728, 896), (T.Q4_K, 3072, 1536), (T.Q6_K, 3072, 1536)]


def _layer(qtype: T, n: int, k: int, rng: np.random.Generator) -> tuple[cpu_rt.Layer, int]:
    if qtype in (T.Q4_K, T.Q6_K):
        raw = random_k_quant_bytes(rng, qtype, n, k)
    else:
        raw = gguf_quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    p = kquant_pack.pack(raw, int(qtype), k)
    planes = [torch.from_numpy(np.ascontiguousarray(a)).clone() for a in (p.qs, p.qh, p.meta)]
    return cpu_rt.Layer([(p.fmt, *planes, n, p.kp)], k), p.nbytes


def _time(layers: list, x: torch.Tensor, threads: int, reps: int) -> float:
    """median seconds a product over 5 rounds of `reps` calls cycling through `layers`"""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(reps):
            layers[i % len(layers)].run(x, threads=threads)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,5")
    args = ap.parse_args()
    lib = cpu_rt.library()
    if lib is None:
        sys.exit(f"no native kernels: {cpu_rt.build_error()}")
    print(f"body {cpu_rt.body(lib) or 'portable loops'}, {os.cpu_count()} CPUs, threads 1 and {args.threads}")
    rng = np.random.default_rng(0)
    for qtype, n, k in CASES:
        first, nbytes = _layer(qtype, n, k, rng)
        copies = [first] + [_layer(qtype, n, k, rng)[0] for _ in range(23)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            for threads in sorted({1, args.threads}):
                for where, layers in (("cache", [first]), ("stream", copies)):
                    t = _time(layers, x, threads, 48)
                    print(f"{qtype.name:5s} {n}x{k} rows {rows} threads {threads} {where:6s}: {t * 1e3:7.3f} ms "
                          f"{nbytes / t / 1e9:5.1f} GB/s {n * k / t / 1e9:5.1f} Gw/s")


if __name__ == "__main__":
    main()

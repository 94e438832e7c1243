"""What tests/perf/gpu_kernels.py's sections share: the results they fill (written as JSON at the end), the
timer (median of CUDA-graph replays) and the check line."""
from __future__ import annotations

import torch

RESULTS: dict = {"checks": [], "gemv": [], "gemm": [], "step": []}


def bench(fn, graph: bool = True) -> float:
    """Seconds per call (median), from CUDA-graph replays when possible."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
    return triton.testing.do_bench(fn, rep=50, return_mode="median") * 1e-3


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)

"""One GPU run that checks every kernel at real shapes, then times them (and a whole decode step).

    python tests/perf/gpu_kernels.py --json gpu.json [--sections check,gemv,gemm,step] [--quick]

Checks: activation quantization, packed GEMV (all layouts, M = 1/4/16), packed GEMM, decode attention
and rope/KV write against their references at Qwen3-8B shapes. Timings (CUDA-graph replays, so
launch overhead is excluded as it is in the graphed decode step): GEMV configurations swept per
shape with achieved bandwidth vs the measured copy bandwidth and vs bf16 cuBLAS; GEMM vs bf16
cuBLAS; the graphed decode step of whole dummy models.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.bench.model_bench import measure_copy_bandwidth  # noqa: E402
from quant.kernels.act_quant import quantize_activations, quantize_activations_reference  # noqa: E402
from quant.kernels.packed_gemm import packed_gemm  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv, packed_gemv_reference  # noqa: E402
from quant.packed_layout import KINDS, dequantize, random_packed  # noqa: E402
from tests.perf.gpu_common import RESULTS, bench, check  # noqa: E402
from tests.perf.gpu_steps import section_prefill, section_step, step_rows_timing  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
             "head": (151936, 4096)}


def section_check(dev) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    for mode in ("norm", "gated"):
        x = torch.randn(4, 8192 if mode == "gated" else 4096, device=dev)
        w = torch.rand(4096, device=dev) + 0.5 if mode == "norm" else None
        a, b = quantize_activations(x, 128, w, gated=mode == "gated"), quantize_activations_reference(
            x, 128, w, gated=mode == "gated")
        check(f"act_quant {mode}", torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]), "int8 identical")
    for kind in KINDS:
        for name, (n, k) in SHAPES_8B.items():
            if name == "head" and kind != "int4":
                continue
            pw = random_packed(kind, n, k, 128, device=dev, generator=g)
            for m in (1, 4, 16):
                xq = quantize_activations(torch.randn(m, k, device=dev), 128)
                got, want = packed_gemv(*xq, pw), packed_gemv_reference(*xq, pw)
                err = ((got - want).abs().max() / want.abs().max()).item()
                check(f"gemv {kind} {name} M={m}", err < 1e-5, f"max rel err {err:.2e}")
        pw = random_packed(kind, 4096, 4096, 128, device=dev, generator=g)
        x = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16)
        want = (x.float() @ dequantize(pw).t())
        err = ((packed_gemm(x, pw).float() - want).abs().max() / want.abs().max()).item()
        check(f"gemm {kind} 512x4096x4096", err < 2e-2, f"max rel err {err:.2e} (bf16 output)")


def section_gemv(dev, copy_bw: float, quick: bool, kinds: list[str]) -> None:
    g = torch.Generator(device=dev).manual_seed(1)
    configs = [(128 * w, s, w) for w in (1, 2, 4) for s in (1, 2, 4, 8, 16, 32)]
    if quick:
        configs = [(128 * w, s, w) for w in (2, 4) for s in (4, 8, 16)]
    for kind in kinds:
        for name, (n, k) in SHAPES_8B.items():
            if name == "head" and kind not in ("int4", "tri"):
                continue
            pw = random_packed(kind, n, k, 128, device=dev, generator=g)
            dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            for m in ((1, 4, 8) if name != "head" else (1,)):
                xq = quantize_activations(torch.randn(m, k, device=dev), 128)
                out = torch.zeros(m, n, device=dev)
                best = None
                t_default = bench(lambda: packed_gemv(*xq, pw, out=out))
                for cfg in configs:
                    try:
                        t = bench(lambda: packed_gemv(*xq, pw, out=out, config=cfg))
                    except Exception as e:  # a config a shape cannot take
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if m > 1:  # the M > 1 variants at the best launch shape
                    t2d = bench(lambda: packed_gemv(*xq, pw, out=out, config=best[1], variant="2d"))
                    t3d = bench(lambda: packed_gemv(*xq, pw, out=out, config=best[1], variant="3d"))
                    print(f"gemv {kind:4} {name:8} M={m:2} rows as 2-D tiles {t2d * 1e6:6.1f} us, 3-D {t3d * 1e6:6.1f} us",
                          flush=True)
                    RESULTS.setdefault("gemv_rows", []).append({"kind": kind, "shape": name, "m": m,
                                                                "rows_2d_us": t2d * 1e6, "rows_3d_us": t3d * 1e6})
                xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_bf16 = bench(lambda: torch.nn.functional.linear(xb, dense))
                t, cfg = best
                row = {"kind": kind, "shape": name, "n": n, "k": k, "m": m, "us": t * 1e6, "config": cfg,
                       "default_us": t_default * 1e6,
                       "bytes": pw.nbytes, "gb_per_s": pw.nbytes / t / 1e9, "fraction_of_copy": pw.nbytes / t / copy_bw,
                       "bf16_us": t_bf16 * 1e6, "speedup_vs_bf16": t_bf16 / t}
                RESULTS["gemv"].append(row)
                print(f"gemv {kind:4} {name:8} M={m:2} {t * 1e6:7.1f} us {row['gb_per_s']:6.0f} GB/s "
                      f"({row['fraction_of_copy']:.0%} of copy) cfg={cfg} bf16 {t_bf16 * 1e6:7.1f} us "
                      f"x{row['speedup_vs_bf16']:.1f} (default cfg {t_default * 1e6:.1f} us)", flush=True)


def section_small(dev) -> None:
    """The small kernels of a decode step alone: activation quantization by groups per program."""
    for mode, k in (("norm", 4096), ("plain", 4096), ("gated", 12288)):
        x = torch.randn(1, 2 * k if mode == "gated" else k, device=dev)
        w = torch.rand(k, device=dev) + 0.5 if mode == "norm" else None
        for per in (1, 2, 4, 8, 32):
            t = bench(lambda: quantize_activations(x, 128, w, gated=mode == "gated", groups_per_program=per))
            print(f"act_quant {mode:5} K={k:5} groups/program {per:2}: {t * 1e6:6.2f} us", flush=True)
            RESULTS.setdefault("small", []).append({"kernel": f"act_quant {mode}", "k": k, "per": per, "us": t * 1e6})


def bench_quick(fn, calls: int = 20, reps: int = 5) -> float:
    """Seconds per call: one CUDA graph of `calls` calls, replayed `reps` times (median)."""
    fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / calls)
    return sorted(times)[len(times) // 2]


def section_rows(dev, kinds: list[str]) -> None:
    """GEMV at M = 2..16 (verify widths, batched slots): the dp4a variants (2-D tiles per row, 3-D
    broadcast, word-row loop with launch shapes swept) vs M = 1; then
    the graphed decode step of the 8B ternary model per row count."""
    g = torch.Generator(device=dev).manual_seed(2)
    for kind in kinds:
        for name, (n, k) in SHAPES_8B.items():
            pw = random_packed(kind, n, k, 128, device=dev, generator=g)
            x1 = quantize_activations(torch.randn(1, k, device=dev), 128)
            out1 = torch.zeros(1, n, device=dev)
            t1 = bench_quick(lambda: packed_gemv(*x1, pw, out=out1))
            for m in (2, 3, 4, 8, 16):
                xq = quantize_activations(torch.randn(m, k, device=dev), 128)
                out = torch.zeros(m, n, device=dev)
                want = packed_gemv_reference(*xq, pw)
                err = ((packed_gemv(*xq, pw, variant="rows") - want).abs().max() / want.abs().max()).item()
                check(f"gemv rows {kind} {name} M={m}", err < 1e-5, f"max rel err {err:.1e}")
                res = {"kind": kind, "shape": name, "m": m, "m1_us": t1 * 1e6}
                for variant in ("2d", "3d"):
                    if m <= (4 if variant == "2d" else 8):
                        res[variant] = bench_quick(lambda: packed_gemv(*xq, pw, out=out, variant=variant)) * 1e6
                res["rows"] = bench_quick(lambda: packed_gemv(*xq, pw, out=out, variant="rows")) * 1e6
                if kind == "tri" and name != "head" and m in (4, 8, 16) and os.environ.get("ROWS_SWEEP"):
                    best = (float("inf"), None)
                    for bn, warps in ((64, 1), (128, 1), (128, 2), (256, 2), (256, 4)):
                        for split in (1, 2, 4, 8, 16, 32):
                            if split * 2 <= k // 128:
                                cfg = (bn, split, warps)
                                best = min(best, (bench_quick(lambda: packed_gemv(*xq, pw, out=out, config=cfg, variant="rows")), cfg))
                    res["rows_best"], res["rows_best_config"] = best[0] * 1e6, best[1]
                print("rows " + " ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in res.items()),
                      flush=True)
                RESULTS.setdefault("rows", []).append(res)
    step_rows_timing(dev)


def section_dequant(dev) -> None:
    from quant.kernels.packed_dequant import dequantize_t
    g = torch.Generator(device=dev).manual_seed(3)
    for kind in ("tri", "int4"):
        pw = random_packed(kind, 24576, 4096, 128, device=dev, generator=g)
        out = torch.empty(4096, 24576, device=dev, dtype=torch.bfloat16)
        for cfg in ((128, 4), (256, 4), (256, 8), (512, 8), (64, 2), (128, 2)):
            t = bench(lambda: dequantize_t(pw, out=out, config=cfg))
            moved = out.numel() * 2 + pw.nbytes
            RESULTS.setdefault("dequant", []).append({"kind": kind, "config": cfg, "us": t * 1e6,
                                                      "gb_per_s": moved / t / 1e9})
            print(f"dequant {kind} gate_up cfg={cfg}: {t * 1e6:.0f} us, {moved / t / 1e9:.0f} GB/s", flush=True)


def section_gemm(dev) -> None:
    g = torch.Generator(device=dev).manual_seed(2)
    configs = [(128, 256, 64, 8, 3), (64, 256, 64, 4, 4)]
    for kind in ("tri", "bin", "int4"):
        for name, (n, k) in SHAPES_8B.items():
            if name == "head":
                continue
            pw = random_packed(kind, n, k, 128, device=dev, generator=g)
            x = torch.randn(512, k, device=dev, dtype=torch.bfloat16)
            dense = dequantize(pw, torch.bfloat16)
            out = torch.empty(512, n, device=dev, dtype=torch.bfloat16)
            best = None
            for cfg in configs:
                try:
                    t = bench(lambda: packed_gemm(x, pw, out=out, config=cfg), graph=False)
                except Exception as e:
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            t_cublas = bench(lambda: torch.nn.functional.linear(x, dense), graph=False)
            from quant.kernels.packed_dequant import dequantize_t
            t_deq = bench(lambda: torch.matmul(x, dequantize_t(pw)), graph=False)
            flops = 2 * 512 * n * k
            t, cfg = best
            RESULTS["gemm"].append({"kind": kind, "shape": name, "m": 512, "us": t * 1e6, "config": cfg,
                                    "tflops": flops / t / 1e12, "cublas_bf16_tflops": flops / t_cublas / 1e12,
                                    "dequant_then_cublas_tflops": flops / t_deq / 1e12})
            print(f"gemm {kind:4} {name:8} M=512 {flops / t / 1e12:6.1f} TFLOP/s cfg={cfg} | cuBLAS bf16 "
                  f"{flops / t_cublas / 1e12:6.1f} | dequant+cuBLAS {flops / t_deq / 1e12:6.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sections", default="check,gemv,gemm,step")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kinds", default="tri,bin,int4,int8", help="layouts the gemv section sweeps")
    ap.add_argument("--models", default="qwen3-8b:tri:int4,qwen3-8b:bin:int4,qwen3-8b:bf16:bf16,dense-27b:tri:int4")
    ap.add_argument("--step-models", default="qwen3-8b:tri:int4", help="steprows: name:weights:head list, e.g. "
                    "qwen2.5-coder-1.5b:bf16:bf16,qwen2.5-coder-0.5b:bf16:bf16 (verify widths of the draft pair)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    RESULTS["device"] = torch.cuda.get_device_name(0)
    copy_bw = measure_copy_bandwidth(dev)
    RESULTS["copy_bytes_per_second"] = copy_bw
    print(f"{RESULTS['device']}: copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    sections = {"check": lambda: section_check(dev), "gemv": lambda: section_gemv(dev, copy_bw, args.quick, args.kinds.split(",")),
                "gemm": lambda: section_gemm(dev), "dequant": lambda: section_dequant(dev), "small": lambda: section_small(dev), "rows": lambda: section_rows(dev, args.kinds.split(",")),
                "steprows": lambda: step_rows_timing(dev, tuple(args.step_models.split(","))),
                "prefill": lambda: section_prefill(dev, args.models.split(",")), "step": lambda: section_step(dev, args.models.split(","))}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            sections[name]()
        except Exception:
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(name)
        print(f"== section {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()

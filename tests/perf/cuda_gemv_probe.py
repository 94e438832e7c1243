"""Probe for issue 19: can a one-row packed GEMV written in CUDA C++ stream the small products faster than Triton?

Session 29 measured the one-row Triton products at 96-99% of copy bandwidth on the 8B / 27B-class gate/up
matrices but 43-70% on q/k/v, o and down (4-12 MB each), and a persistent Triton kernel could not keep even the
large ones' bandwidth. Before building CUDA C++ into the engine (NVRTC at run time, a CI compile check), this
probe answers the question that decides it: with every weight word of the product requested in one go (each
thread loads all of its words as 16-byte vectors before it computes; no software pipeline, no registers held
across steps), how close to the bytes' time does a small product get, against Triton's kernels in the same run?

    python3 tests/perf/cuda_gemv_probe.py --json $OUT/cuda_probe.json [--kinds tri,bin] [--reps 30]

Needs a CUDA GPU. The kernel is compiled by NVRTC and launched through quant.kernels.cuda_rt (ctypes; with PDL
as the engine's Triton kernels launch, and without), and once through CuPy where it is installed (a second,
independent launcher: if ours is wrong, CuPy's number still answers). The kernel (quant.kernels.cuda_gemv, the engine's) reads
the layout packed_gemv reads (words [K·BITS/32, N] int32, scales [K/G, N] float16, int8
activations with per-group scale and code sum) and computes the same sums; each config is checked against
packed_gemv_reference before it is timed as tests/perf/gpu_kern.py times (graph replays over rotated copies).
Configs: WARPS warps a block, each warp GPW whole groups of 128 columns (a thread: 4 neighbouring columns,
GW·GPW 16-byte loads); the block sums its warps in shared memory and adds one float a column (atomics when the
grid splits K). FLOOR=1 compiles the same loads with the arithmetic replaced by an xor: what the loads alone cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quant.kernels.cuda_gemv import SOURCE, defines  # noqa: E402  (the engine's kernel)
from quant.kernels.packed_gemv import packed_gemv, packed_gemv_reference  # noqa: E402
from tests.perf.gpu_kern import SHAPES, Run, relative_error, rotated, section_copy, time_calls  # noqa: E402

CONFIGS = ((4, 1), (8, 1), (4, 2), (8, 2))  # (WARPS, GPW)


class CudaGemv:
    """The CUDA C++ one-row product for one config: compiled by NVRTC and launched through quant.kernels.cuda_rt
    (ctypes, PDL when asked), or through CuPy (`cupy=True`: CuPy's own NVRTC and launch, without PDL)."""

    def __init__(self, kind: str, warps: int, gpw: int, floor: bool = False, pdl: bool = False, cupy: bool = False):
        self.warps, self.gpw, self.pdl, self.cupy = warps, gpw, pdl, cupy
        flags = defines(kind, warps, gpw, pdl and not cupy, floor)
        if cupy:
            import cupy as cp
            options = ("-std=c++17",) + tuple(f"-D{k}={v}" for k, v in flags.items())
            self.fn = cp.RawModule(code=SOURCE, options=options).get_function("gemv_row")
        else:
            from quant.kernels.cuda_rt import CudaKernel, compile_cubin
            major, minor = torch.cuda.get_device_capability()
            self.kernel = CudaKernel(compile_cubin(SOURCE, 10 * major + minor, flags), "gemv_row")

    def bind(self, xq, pw, out):
        """A closure launching y += x Wᵀ into out on torch's current stream (capturable)."""
        ng = pw.in_features // 128
        grid = ((pw.out_features + 127) // 128, -(-ng // (self.warps * self.gpw)))
        x8, sx, sumx = xq
        tensors = (x8.view(torch.int32), sx, sumx, pw.words, pw.scales, out.view(-1))
        if not self.cupy:
            from quant.kernels.cuda_rt import i32, ptr
            args = [ptr(t) for t in tensors] + [i32(pw.out_features), i32(ng), i32(1)]
            return lambda: self.kernel.launch(grid, (self.warps * 32,), args, pdl=self.pdl)
        import cupy as cp
        import numpy as np
        cargs = tuple(cp.asarray(t) for t in tensors) + (np.int32(pw.out_features), np.int32(ng), np.int32(1))

        def call():
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                self.fn(grid, (self.warps * 32,), cargs)
        return call


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--kinds", default="tri,bin")
    p.add_argument("--shapes", default=",".join(s for s in SHAPES if "21504" not in s))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    a = p.parse_args(argv)
    a.tiny, a.sections = False, ["copy"]
    return a


def triton_call(xq, pw, out, pdl: bool):
    def call():
        os.environ["BONSAI_PDL"] = "1" if pdl else "0"
        os.environ["BONSAI_CUDA_GEMV"] = "0"  # Triton's kernel, as the engine ran it before
        packed_gemv(*xq, pw, out=out, accumulate=True)
    return call


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    run.section("copy", section_copy)
    copy = run.results["copy_gb_per_s"]
    rows, checks = [], []
    compiled: dict = {}
    for kind in args.kinds.split(","):
        for i, shape in enumerate(args.shapes.split(",")):
            if run.out_of_time(f"{kind} {shape}"):
                break
            pw = run.weights(kind, shape, seed=i)
            xq = run.activations(1, pw.in_features, seed=i)
            want = packed_gemv_reference(*xq, pw)
            mats = rotated(run, pw)
            out = torch.zeros(1, pw.out_features, device=run.dev)
            variants = [("triton pdl", None), ("triton", None)] + [
                (f"cuda{' pdl' * pdl} w{w} g{g}", (w, g, False, pdl, False)) for w, g in CONFIGS for pdl in (True, False)
            ] + [("cuda floor pdl w8 g1", (8, 1, True, True, False)), ("cupy w8 g1", (8, 1, False, False, True))]
            for name, cfg in variants:
                try:
                    if cfg is None:
                        calls = [triton_call(xq, m, out, name.endswith("pdl")) for m in mats]
                    else:
                        key = (kind,) + cfg
                        if key not in compiled:
                            compiled[key] = CudaGemv(kind, *cfg)
                        calls = [compiled[key].bind(xq, m, out) for m in mats]
                    if " floor" not in name:
                        out.zero_()
                        calls[0]()
                        torch.cuda.synchronize()
                        err = relative_error(out, want)
                        checks.append({"name": f"{kind} {shape} {name}", "ok": err < 1e-5, "err": err})
                        if err >= 1e-5:
                            print(f"[FAIL] {kind} {shape} {name}: {err:.1e}", flush=True)
                            continue
                    t = time_calls(run, calls)
                except Exception as error:  # noqa: BLE001 - recorded, the next variant runs
                    run.results["errors"][f"{kind} {shape} {name}"] = f"{type(error).__name__}: {error}"[:300]
                    print(f"ERROR {kind} {shape} {name}: {error}", flush=True)
                    continue
                gbs = pw.nbytes / (t["us"] * 1e-6) / 1e9
                rows.append({"kind": kind, "shape": shape, "variant": name, "mb": pw.nbytes / 1e6,
                             "share_of_copy": gbs / copy if copy else None, **t})
                print(f"{kind:4} {shape:14} {name:18} {t['us']:7.2f} us ({t['us_min']:.2f}-{t['us_max']:.2f})  "
                      f"{pw.nbytes / 1e6:6.1f} MB  {gbs / copy if copy else 0:5.0%} of copy", flush=True)
            os.environ["BONSAI_PDL"] = "1"
            del mats
    run.results.update(gemv=rows, checks=checks, seconds=time.perf_counter() - run.start)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(run.results, indent=1))
    failed = [c for c in checks if not c["ok"]]
    print(f"copy {copy or 0:.0f} GB/s; {len(checks)} checks, {len(failed)} failed; errors: {run.results['errors'] or 'none'}")
    return 1 if failed or run.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

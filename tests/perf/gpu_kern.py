"""Base-3 ternary (tri5) vs 2-bit ternary GEMV at batch 1, and the batched-row kernels (dp4a vs tensor cores).

    python3 tests/perf/gpu_kern.py --json $OUT/kern.json [--sections copy,check,gemv,rows] [--reps 30]
    TRITON_INTERPRET=1 python3 tests/perf/gpu_kern.py --tiny --json /tmp/kern.json   # the code paths, on a CPU

Self-contained (torch, triton and this repository's quant package). On one GPU it first checks every
kernel variant it times against the plain-torch reference at the full shapes (`check`), then times
with CUDA events: each sample is one CUDA-graph replay of consecutive calls on rotated copies of the
matrix (at least ROTATE_BYTES of them, four times an H200's 50 MB L2, so the weights come from HBM;
with PDL consecutive calls overlap as they do in the decode step), `--reps` samples after a warm-up,
median and spread. The outputs are accumulated into (no memset between calls).
  copy: device-to-device copy bandwidth (read + write), the ruler for the GEMV's share.
  gemv: batch-1 GEMV, 2-bit `tri` vs base-3 `tri5`, group 128, at the Qwen3-8B projections (q/k/v fused,
        o, gate/up fused, down) and the 27B-class ones (ffn 21504 and 17408): µs, GB/s, share of copy.
  rows: 1, 2, 4, 8, 16 rows of `tri` and `int4` at the 8B gate/up and down shapes: the dp4a kernels
        (packed_gemv's default variant per row count) vs the int8 tensor-core kernel (packed_mma),
        each as time relative to its own 1-row time and to the dp4a 1-row time.
Each section records its error in the JSON and the script goes on; a deadline (--budget-s) skips what
is left rather than overrun.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quant.kernels.act_quant import quantize_activations  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv, packed_gemv_reference  # noqa: E402
from quant.packed_layout import PackedWeight, random_packed  # noqa: E402

# (out, in) features of the projections: Qwen3-8B (hidden 4096, ffn 12288, 32 + 2·8 heads of 128) and the
# 27B-class dense model (hidden 5120, 40 + 2·8 heads of 128, ffn 17408 or 21504 as in configs/models/dense-27b.yaml).
SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
          "27b qkv": (7168, 5120), "27b o": (5120, 5120), "27b gate_up": (34816, 5120), "27b down": (5120, 17408),
          "27b gate_up 21504": (43008, 5120), "27b down 21504": (5120, 21504)}
ROWS_SHAPES = ("8b gate_up", "8b down")
TINY_SHAPES = {"8b qkv": (96, 512), "8b gate_up": (160, 512), "8b down": (64, 768)}
ROWS = (1, 2, 4, 8, 16)
TINY_ROWS = (1, 4, 16)
ROTATE_BYTES = 200 << 20  # weights touched between two uses of one copy: 4x the H200's L2
GROUP = 128
SECTIONS = ("copy", "check", "gemv", "rows")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--reps", type=int, default=30, help="timed samples per kernel (at least 20 on a GPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed replays first")
    parser.add_argument("--budget-s", type=float, default=210.0, help="skip what is left after this many seconds")
    parser.add_argument("--tiny", action="store_true",
                        help="miniature shapes, 1 sample, no rotation bytes: the code paths on a CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.tiny:
        args.reps, args.warmup = min(args.reps, 1), 0
    elif args.reps < 20:
        parser.error("--reps must be at least 20 (medians of fewer samples move between runs)")
    return args


class Run:
    """Device, shapes and the results being gathered; `section` runs one part, recording its error."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.shapes = TINY_SHAPES if args.tiny else SHAPES
        self.rows = TINY_ROWS if args.tiny else ROWS
        self.rotate_bytes = 1 if args.tiny else ROTATE_BYTES
        self.start = time.perf_counter()
        import triton
        self.results: dict = {"device": torch.cuda.get_device_name() if self.dev.type == "cuda" else "cpu",
                              "torch": torch.__version__, "triton": triton.__version__, "tiny": args.tiny,
                              "group_size": GROUP, "reps": args.reps, "copy_gb_per_s": None,
                              "checks": [], "gemv": [], "rows": [], "errors": {}, "skipped": []}

    def finish(self, path: Path | None) -> int:
        """Write the results (path), print the checks' count; the exit code (1: a check failed or a section broke)."""
        if path:
            path.write_text(json.dumps(self.results, indent=1))
        failed = [c for c in self.results["checks"] if not c["ok"]]
        print(f"{len(self.results['checks'])} checks, {len(failed)} failed; errors: {self.results['errors'] or 'none'}")
        return 1 if failed or self.results["errors"] else 0

    def out_of_time(self, what: str) -> bool:
        if time.perf_counter() - self.start < self.args.budget_s:
            return False
        self.results["skipped"].append(what)
        return True

    def section(self, name: str, fn) -> None:
        try:
            fn(self)
        except Exception as error:  # noqa: BLE001 - recorded, and the next section runs
            self.results["errors"][name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            traceback.print_exc()

    def weights(self, kind: str, shape: str, seed: int) -> PackedWeight:
        n, k = self.shapes[shape]
        pw = random_packed(kind, n, k, GROUP, device=self.dev, generator=torch.Generator(self.dev).manual_seed(seed))
        pw.scales.uniform_(0.5, 1.5, generator=torch.Generator(self.dev).manual_seed(seed + 1))
        return pw

    def activations(self, rows: int, k: int, seed: int):
        x = torch.randn(rows, k, generator=torch.Generator(self.dev).manual_seed(seed), device=self.dev)
        return quantize_activations(x, GROUP)


def product(xq, pw: PackedWeight, path: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel a (kind, path) runs: `dp4a` packed_gemv's default for the row count (tri5: its own GEMV),
    `mma` the tensor-core kernel; with out, added into it."""
    return packed_gemv(*xq, pw, out=out, accumulate=out is not None, variant="mma" if path == "mma" else None)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def time_calls(run: Run, calls: list) -> dict:
    """Per-call seconds of `calls` (closures over distinct weight copies) run back to back: on a GPU each
    sample is one CUDA-graph replay of all of them between two events; on a CPU, wall clock."""
    samples = []
    if run.dev.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:  # compiles and settles everything outside the capture
                call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        for i in range(run.args.warmup + run.args.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            if i >= run.args.warmup:
                samples.append(start.elapsed_time(stop) * 1e-3 / len(calls))
        del graph
    else:
        for i in range(run.args.warmup + run.args.reps):
            t0 = time.perf_counter()
            for call in calls:
                call()
            if i >= run.args.warmup:
                samples.append((time.perf_counter() - t0) / len(calls))
    return {"us": statistics.median(samples) * 1e6, "us_min": min(samples) * 1e6, "us_max": max(samples) * 1e6,
            "us_std": (statistics.stdev(samples) if len(samples) > 1 else 0.0) * 1e6, "samples": len(samples)}


def rotated(run: Run, pw: PackedWeight) -> list[PackedWeight]:
    """pw and copies of it, enough that ROTATE_BYTES lie between two uses of one (each timed call reads HBM)."""
    copies = max(2, math.ceil(run.rotate_bytes / pw.nbytes))
    return [pw] + [PackedWeight(pw.kind, pw.words.clone(), pw.scales.clone(), pw.out_features, pw.in_features,
                                pw.group_size) for _ in range(copies - 1)]


def time_product(run: Run, pw: PackedWeight, xq, path: str) -> dict:
    """Timing of one kernel on rotated copies of pw."""
    mats = rotated(run, pw)
    out = torch.zeros(xq[0].shape[0], pw.out_features, device=run.dev)
    timing = time_calls(run, [lambda w=w: product(xq, w, path, out) for w in mats])
    return {"copies": len(mats), **timing}


def step_model(spec: str, dev: torch.device):
    """"NAME:KIND:HEAD" (configs/models/NAME.yaml, packed layout, head layout) → (generated-weights model, a one-slot
    640-key bfloat16 cache): what the graphed one-row step timings of the perf scripts run."""
    import yaml

    from engine.runtime.kv_cache import KVCache
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    name, kind, head = spec.split(":")
    root = Path(__file__).resolve().parents[2]
    cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs/models" / f"{name}.yaml").read_text()))
    loaded = load_dummy(cfg, name, dev, WeightFormat(kind, 128, head))
    return loaded, KVCache(cfg, 640, 1, dtype=torch.bfloat16, device=dev)


def replay_us(graph, replays: int = 200) -> float:
    """Mean µs of a captured graph's replays, back to back."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays * 1e6


def section_copy(run: Run) -> None:
    """Device-to-device copy bandwidth, read + write counted: median of --reps copies of 1 GiB."""
    size = (16 << 20) if run.args.tiny else (1 << 30)
    src = torch.empty(size // 4, dtype=torch.float32, device=run.dev).uniform_()
    dst = torch.empty_like(src)
    timing = time_calls(run, [lambda: dst.copy_(src)])
    run.results["copy_gb_per_s"] = 2 * size / (timing["us"] * 1e-6) / 1e9
    run.results["copy"] = {"bytes": 2 * size, **timing}


def _check(run: Run, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = relative_error(got, want)
    run.results["checks"].append({"name": name, "ok": err < 1e-5, "max_rel_err": err})
    print(f"[{'ok' if err < 1e-5 else 'FAIL'}] {name}: max rel err {err:.1e}", flush=True)


def gemv_cases(run: Run):
    """(label, shape, kind, weights, activations) of the batch-1 comparison: one matrix alive at a time."""
    for i, shape in enumerate(run.shapes):
        for kind in ("tri", "tri5"):
            pw = run.weights(kind, shape, seed=i)
            yield f"gemv {kind} {shape} M=1", shape, kind, pw, run.activations(1, pw.in_features, seed=i)


def rows_cases(run: Run):
    """(label, shape, kind, weights, rows, path, activations) of the batched-rows comparison."""
    for kind in ("tri", "int4"):
        for shape in ROWS_SHAPES:
            pw = run.weights(kind, shape, seed=7)
            for rows in run.rows:
                xq = run.activations(rows, pw.in_features, seed=rows)
                for path in ("dp4a", "mma"):
                    yield f"rows {path} {kind} {shape} M={rows}", shape, kind, pw, rows, path, xq


def section_check(run: Run) -> None:
    """Every variant the timing sections run (the same cases), at full width, against packed_gemv_reference."""
    for label, _, _, pw, xq in gemv_cases(run):
        if run.out_of_time(f"check {label}"):
            return
        _check(run, label, product(xq, pw, "dp4a"), packed_gemv_reference(*xq, pw))
    for label, _, _, pw, _, path, xq in rows_cases(run):
        if run.out_of_time(f"check {label}"):
            return
        _check(run, label, product(xq, pw, path), packed_gemv_reference(*xq, pw))


def _passed(run: Run, name: str) -> bool | None:
    return next((c["ok"] for c in run.results["checks"] if c["name"] == name), None)


def section_gemv(run: Run) -> None:
    copy = run.results["copy_gb_per_s"]
    for label, shape, kind, pw, xq in gemv_cases(run):
        if run.out_of_time(label):
            return
        timing = time_product(run, pw, xq, "dp4a")
        gbs = pw.nbytes / (timing["us"] * 1e-6) / 1e9
        run.results["gemv"].append({"shape": shape, "n": pw.out_features, "k": pw.in_features, "kind": kind,
                                    "bytes": pw.nbytes, "gb_per_s": gbs, "share_of_copy": gbs / copy if copy else None,
                                    "checked": _passed(run, label), **timing})


def section_rows(run: Run) -> None:
    one: dict[tuple, float] = {}  # (kind, shape, path) → its 1-row time
    for label, shape, kind, pw, rows, path, xq in rows_cases(run):
        if run.out_of_time(label):
            return
        timing = time_product(run, pw, xq, path)
        first = one.setdefault((kind, shape, path), timing["us"])
        dp4a_first = one.get((kind, shape, "dp4a"))
        run.results["rows"].append({
            "kind": kind, "shape": shape, "n": pw.out_features, "k": pw.in_features, "rows": rows, "path": path,
            "rel_to_1_row": timing["us"] / first, "rel_to_dp4a_1_row": timing["us"] / dp4a_first if dp4a_first else None,
            "checked": _passed(run, label), **timing})


def table(results: dict) -> str:
    """The results as a compact text table."""
    lines = [f"{results['device']}, torch {results['torch']}, triton {results['triton']}; "
             f"copy {results['copy_gb_per_s'] or 0:.0f} GB/s; checks "
             f"{sum(c['ok'] for c in results['checks'])}/{len(results['checks'])} ok"]
    by_shape: dict[str, dict] = {}
    for r in results["gemv"]:
        by_shape.setdefault(r["shape"], {})[r["kind"]] = r
    if by_shape:
        lines.append(f"{'batch-1 GEMV':18} {'tri us':>8} {'GB/s':>6} {'share':>6} {'tri5 us':>8} {'GB/s':>6} "
                     f"{'share':>6} {'tri/tri5':>8}")
    for shape, kinds in by_shape.items():
        cells = []
        for kind in ("tri", "tri5"):
            r = kinds.get(kind)
            cells.append(f"{r['us']:8.1f} {r['gb_per_s']:6.0f} {r['share_of_copy'] or 0:6.0%}" if r else f"{'-':>22}")
        ratio = kinds["tri"]["us"] / kinds["tri5"]["us"] if len(kinds) == 2 else float("nan")
        lines.append(f"{shape:18} {cells[0]} {cells[1]} {ratio:8.2f}")
    rows_by: dict[tuple, dict] = {}
    for r in results["rows"]:
        rows_by.setdefault((r["kind"], r["shape"], r["path"]), {})[r["rows"]] = r
    if rows_by:
        counts = sorted({r["rows"] for r in results["rows"]})
        lines.append(f"{'rows: us (x 1 row)':30} " + " ".join(f"{'M=' + str(m):>14}" for m in counts))
    for (kind, shape, path), per in rows_by.items():
        lines.append(f"{kind + ' ' + shape + ' ' + path:30} "
                     + " ".join(f"{per[m]['us']:7.1f} ({per[m]['rel_to_1_row']:4.2f})" if m in per else f"{'-':>14}"
                                for m in counts))
    for name, error in results["errors"].items():
        lines.append(f"ERROR in {name}: {error}")
    if results["skipped"]:
        lines.append(f"skipped (out of time): {len(results['skipped'])}, first: {results['skipped'][0]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    for name in SECTIONS:
        if name in args.sections:
            run.section(name, globals()[f"section_{name}"])
    run.results["seconds"] = time.perf_counter() - run.start
    print(table(run.results), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(run.results, indent=1))
    return 1 if run.results["errors"] or not all(c["ok"] for c in run.results["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())

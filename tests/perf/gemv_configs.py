"""One-row packed GEMV launch configs against occupancy (issue 19), and the graphed step with the fastest ones.

Nsight Compute (session 25) put the one-row ternary GEMVs at 125 ("kwarps") and 165 ("2d") registers a thread: 16
and 12 warps a SM, the 8B gate/up grid at 0.73 of a wave, DRAM 51% busy. Narrower programs hold fewer words a
thread (ptxas for sm_90a, Triton 3.6: kwarps 128 columns 125 registers, 64 columns 79, 32 columns 48; 2d 128 columns
165, 64 columns 96) and more of them fit a SM; whether that keeps more bytes in flight is what this measures.

    python3 tests/perf/gemv_configs.py --json $OUT/configs.json [--kinds tri,bin] [--steps qwen3-8b:tri:int4,…]
    TRITON_INTERPRET=1 python3 tests/perf/gemv_configs.py --tiny      # the code paths on a CPU (no step)

sweep: every (variant, BLOCK_N, split-K, warps) around the shipped rules, at the 8B and 27B-class shapes; each is
       checked against the exact reference first, then timed as tests/perf/gpu_kern.py times (graph replays over
       rotated weight copies, medians of --reps).
step:  the graphed one-row decode step (512 keys) with the shipped rules, with each shape's fastest config from the
       sweep, and with the "2d" products at 128 columns (the rule before NARROW_COLUMNS) — packed_gemv's rule
       functions replaced in this process only — interleaved over --rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import quant.kernels.packed_gemv as pg  # noqa: E402
from quant.kernels.gemv_parts import split_k  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv, packed_gemv_reference  # noqa: E402
from tests.perf.gpu_kern import (SHAPES, TINY_SHAPES, Run, replay_us, rotated, section_copy, step_model,  # noqa: E402
                                 time_calls)


def candidates(kind: str, n: int, ng: int) -> list[tuple[str, tuple[int, int, int]]]:
    """(variant, (BLOCK_N, split_k, warps)) around the shipped rules: 2d at 32/64/128 columns, kwarps (≤ 2-bit)
    at 64/128 columns and 2/4 warps; each at its rule's split, half and double."""
    out = []
    for bn in (32, 64, 128):
        rule = split_k(triton.cdiv(n, bn), ng, 4096)
        out += [("2d", (bn, s, 1)) for s in sorted({max(1, rule // 2), rule, min(32, 2 * rule)}) if 2 * s <= ng]
    if kind in ("tri", "bin"):
        for bn in (64, 128):
            for warps in (2, 4):
                rule = pg.kwarps_launch_config(n, ng, warps)[1]
                out += [("kwarps", (bn, s, warps)) for s in sorted({max(1, rule // 2), rule, 2 * rule})
                        if s <= 32 and pg._kwarps_per_split(ng, s, warps) >= warps]
    return out


def shipped(kind: str, n: int, k: int) -> tuple[str, tuple[int, int, int]]:
    ng = k // 128
    variant = pg.default_variant(kind, 128, 1, k, n)
    config = pg.kwarps_launch_config(n, ng) if variant == "kwarps" else pg.gemv_launch_config(n, ng, kind)
    return variant, config


def section_sweep(run: Run) -> None:
    res, best = run.results.setdefault("sweep", []), run.results.setdefault("best", {})
    for kind in run.args.kinds.split(","):
        for i, (shape, (n, k)) in enumerate(run.shapes.items()):
            if run.out_of_time(f"sweep {kind} {shape}"):
                return
            pw = run.weights(kind, shape, seed=i)
            xq = run.activations(1, k, seed=i)
            want = packed_gemv_reference(*xq, pw)
            mats, out = rotated(run, pw), torch.zeros(1, n, device=run.dev)
            ship = shipped(kind, n, k)
            rows = []
            for variant, config in candidates(kind, n, k // 128):
                got = packed_gemv(*xq, pw, config=config, variant=variant)
                err = ((got - want).abs().max() / want.abs().max()).item()
                name = f"{kind} {shape} {variant} {config}"
                run.results["checks"].append({"name": name, "ok": err < 1e-5, "detail": f"{err:.1e}"})
                if err >= 1e-5:
                    print(f"[FAIL] {name}: max rel err {err:.1e}", flush=True)
                    continue
                t = time_calls(run, [lambda w=w, v=variant, c=config: packed_gemv(
                    *xq, w, out=out, accumulate=True, config=c, variant=v) for w in mats])
                rows.append({"kind": kind, "shape": shape, "n": n, "k": k, "variant": variant, "config": list(config),
                             "shipped": (variant, config) == ship, **t})
            res.extend(rows)
            fastest = min(rows, key=lambda r: r["us"])
            base = next((r for r in rows if r["shipped"]), None)
            best[f"{kind} {n} {k}"] = [fastest["variant"], fastest["config"]]
            print(f"{kind} {shape} ({pw.nbytes / 1e6:.1f} MB): shipped {ship[0]} {ship[1]} "
                  f"{base['us'] if base else float('nan'):.2f} us, fastest {fastest['variant']} "
                  f"{tuple(fastest['config'])} {fastest['us']:.2f} us | " + " ".join(
                      f"{r['variant'][0]}{r['config'][0]}/{r['config'][1]}/{r['config'][2]}:{r['us']:.2f}"
                      for r in rows), flush=True)
            del mats, pw


@contextlib.contextmanager
def rules(table: dict[tuple[int, int], tuple[str, tuple[int, int, int]]], kind: str):
    """packed_gemv's one-row rules for `kind` replaced by table[(N, groups)] → (variant, config) in this process."""
    saved = pg.default_variant, pg.gemv_launch_config, pg.kwarps_launch_config

    def variant(k_: str, group_size: int, rows: int, in_features: int, out_features: int = 0) -> str:
        hit = table.get((out_features, in_features // 128)) if rows == 1 and k_ == kind else None
        return hit[0] if hit else saved[0](k_, group_size, rows, in_features, out_features)

    def gemv_config(n: int, ng: int, k_: str, num_sms: int = 132, rows: int = 1):
        hit = table.get((n, ng)) if k_ == kind and rows == 1 else None
        return tuple(hit[1]) if hit and hit[0] == "2d" else saved[1](n, ng, k_, num_sms, rows)

    def kwarps_config(n: int, ng: int, warps: int = 2):
        hit = table.get((n, ng))
        return tuple(hit[1]) if hit and hit[0] == "kwarps" else saved[2](n, ng, warps)

    pg.default_variant, pg.gemv_launch_config, pg.kwarps_launch_config = variant, gemv_config, kwarps_config
    try:
        yield
    finally:
        pg.default_variant, pg.gemv_launch_config, pg.kwarps_launch_config = saved


def section_step(run: Run) -> None:
    from engine.runtime.cuda_graphs import DecodeStepRunner
    if run.dev.type != "cuda" or not run.args.steps:
        return
    res = run.results.setdefault("step", [])
    for spec in run.args.steps.split(","):
        if run.out_of_time(f"step {spec}"):
            return
        kind = spec.split(":")[1]
        table = {(int(key.split()[1]), int(key.split()[2]) // 128): (v, tuple(c))
                 for key, (v, c) in run.results.get("best", {}).items() if key.split()[0] == kind}
        loaded, cache = step_model(spec, run.dev)
        wide = {(n, k // 128): ("2d", (128, split_k(triton.cdiv(n, 128), k // 128, 4096), 1))
                for n, k in run.shapes.values() if shipped(kind, n, k)[0] == "2d"}  # the rule before NARROW_COLUMNS
        tables = {"shipped": {}, "fastest": table, "wide": wide}
        times: dict[str, list[float]] = {p: [] for p in run.args.policies.split(",")}
        for _ in range(run.args.rounds):
            for policy in times:
                with rules(tables[policy], kind):
                    step = DecodeStepRunner(loaded.model, cache, 1, 4)
                    step.run([1], [512], [0])
                times[policy].append(replay_us(step.graph))
                del step
        row = {"model": spec, **{p: {"us": statistics.mean(t), "spread": (max(t) - min(t)) / 2, "samples": t}
                                 for p, t in times.items()}}
        res.append(row)
        first = next(iter(times))
        print(f"step {spec}: " + ", ".join(f"{p} {row[p]['us']:.1f} ± {row[p]['spread']:.1f} us "
                                           f"({row[first]['us'] / row[p]['us']:.3f}x {first})" for p in times), flush=True)
        del loaded, cache
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--kinds", default="tri,bin")
    parser.add_argument("--steps", default="qwen3-8b:tri:int4,dense-27b:tri:int4,qwen3-8b:bin:int4")
    parser.add_argument("--policies", default="shipped,fastest,wide",
                        help="step: shipped (the rules as they are), fastest (the sweep's), wide (2d at 128 columns)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sections", default="sweep,step")
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps, args.warmup = 1, 0
    run = Run(args)
    run.shapes = TINY_SHAPES if args.tiny else {k: v for k, v in SHAPES.items() if "21504" not in k}
    run.section("copy", section_copy)
    for name, fn in (("sweep", section_sweep), ("step", section_step)):
        if name in args.sections.split(","):
            run.section(name, fn)
    return run.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

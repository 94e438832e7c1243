"""Issue 20 on one GPU: the tensor-core rows kernel's launch configs swept, the rows dispatch measured per
path, and the graphed decode step at 1-16 rows under several dispatch rules, in one process.

    python3 tests/perf/gpu_issue20.py --json $OUT/issue20.json [--sections sweep,paths,step] [--budget-s 420]
    TRITON_INTERPRET=1 python3 tests/perf/gpu_issue20.py --tiny --json /tmp/i20.json   # the code paths, on a CPU

sweep: packed_mma at 8 rows on the 8B gate/up and down shapes (tri, int4, g128) over BLOCK_N x warps x
       stages x split-K programs x how a tile is loaded; every config checked against the exact
       reference first.
paths: per layout and shape (8B and 27B-class q/k/v, o, gate/up, down) and rows 1-16: the dp4a kernels as
       dispatched, packed_mma with the sweep's best config, and (from 5 rows) what PackedLinear does above
       GEMV_MAX_ROWS (unpack to bf16 + cuBLAS): µs each, the fastest marked; the rule it implies.
step:  the graphed decode step of the 8B ternary model (int4 head) at 1/2/4/8/16 rows, under the shipped
       dispatch and (--policies) with mma from 2, 3, 4, 5 or 8 rows (the sweep's best config): µs, x one row.
prefill: a prompt of 16-200 tokens into an empty slot of the same model, through the 16-row graphed step
       (ModelRunner._short_prefill) and the eager chunk (short_prefill_tokens = 0): median ms of 7.
Timing as tests/perf/gpu_kern.py (CUDA-graph replays over rotated weight copies, medians of --reps).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import quant.kernels.packed_gemv as gemv_mod  # noqa: E402
import quant.kernels.packed_mma as mma_mod  # noqa: E402
from quant.kernels.act_quant import quantize_activations  # noqa: E402
from quant.kernels.gemv_parts import split_k  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv, packed_gemv_reference  # noqa: E402
from quant.kernels.packed_mma import groups_per_tile, packed_mma  # noqa: E402
from quant.packed_layout import PackedWeight  # noqa: E402
from tests.perf.gpu_kern import SHAPES, TINY_SHAPES, Run, relative_error, rotated, time_calls  # noqa: E402

SWEEP_SHAPES = ("8b gate_up", "8b down")
PATH_SHAPES = ("8b qkv", "8b o", "8b gate_up", "8b down", "27b qkv", "27b o", "27b gate_up", "27b down")
KINDS = ("tri", "int4")
ROWS = (1, 2, 3, 4, 5, 8, 12, 16)
# (BLOCK_N, warps, stages, programs, activations ahead: packed_mma's x_ahead, bytes read by word rows); joined planes
# lost every sweep (session 9), tiles held in registers ahead lost in session 25's: not swept.
GRIDS = {"wide": [(bn, w, st, prog, xa, False) for bn, w in ((128, 4), (256, 8)) for prog in (256, 512)
                  for st, xa in ((2, 0), (2, 1), (3, 1), (2, 2))],
         # programs of one or two warps: a program's barriers (the activations' trips through shared memory)
         # stall fewer warps, and more programs are in flight
         "narrow": [(bn, w, st, prog, xa, False) for bn, w in ((32, 1), (64, 1), (64, 2), (128, 2))
                    for prog in (512, 1024, 2048) for st, xa in ((2, 0), (2, 1), (3, 1), (2, 2))],
         # the packed bytes read a whole word row a warp (16-byte copies) instead of 16-byte pieces of 8 rows
         "rows": [(bn, w, st, prog, xa, True) for bn, w in ((64, 2), (128, 2), (128, 4), (256, 4), (256, 8))
                  for prog in (512, 1024) for st, xa in ((2, 0), (2, 1), (3, 1), (2, 2))],
         # the shipped tri config, and it with the activations loaded together
         "ref": [(128, 4, 2, 512, 0, False), (128, 4, 2, 512, 1, False)]}

SECTIONS = ("sweep", "paths", "step", "prefill")


def mma_config(pw: PackedWeight, bn: int, warps: int, stages: int, programs: int) -> tuple[int, int, int, int]:
    tiles = pw.in_features // pw.group_size // groups_per_tile(pw.kind, pw.group_size)
    return bn, split_k(-(-pw.out_features // bn), tiles, programs), warps, stages


def section_sweep(run: Run) -> None:
    res = run.results.setdefault("sweep", [])
    grid = [g for name in run.args.grid.split(",") for g in GRIDS[name]]
    grid = grid if not run.args.tiny else grid[:5]
    mats = {kind: {shape: run.weights(kind, shape, seed=3) for shape in SWEEP_SHAPES} for kind in KINDS}
    xqs = {shape: run.activations(8, mats[KINDS[0]][shape].in_features, seed=8) for shape in SWEEP_SHAPES}
    copies = {kind: {shape: rotated(run, pw) for shape, pw in m.items()} for kind, m in mats.items()}
    for bn, warps, stages, programs, xa, wr in grid:  # each config on both layouts: a short budget sees both
        if run.out_of_time(f"sweep {bn} {warps} {stages} {programs} {xa} {wr}"):
            break
        for kind in KINDS:
            row = {"kind": kind, "block_n": bn, "warps": warps, "stages": stages, "programs": programs,
                   "x_ahead": xa, "word_rows": wr, "join": False}
            try:
                total = 0.0
                for shape, pw in mats[kind].items():
                    cfg = mma_config(pw, bn, warps, stages, programs)
                    got = packed_mma(*xqs[shape], pw, config=cfg, join=False, x_ahead=xa, word_rows=wr)
                    err = relative_error(got, packed_gemv_reference(*xqs[shape], pw))
                    if err > 1e-5:
                        raise AssertionError(f"{shape}: max rel err {err:.1e}")
                    out = torch.zeros(8, pw.out_features, device=run.dev)
                    t = time_calls(run, [lambda w=w, c=cfg: packed_mma(*xqs[shape], w, out, True, c, False, xa, wr)
                                         for w in copies[kind][shape]])
                    row[shape] = t["us"]
                    total += t["us"]
                row["total_us"] = total
            except Exception as error:  # noqa: BLE001 - a config that does not compile or is wrong: recorded
                text = str(error).strip()
                row["error"] = f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}"
            res.append(row)
            print(f"sweep {kind} bn={bn} w={warps} st={stages} prog={programs} x_ahead={xa} rows={wr}: "
                  f"{row.get('total_us', float('nan')):.1f} us "
                  + " ".join(f"{sh} {row[sh]:.1f}" for sh in SWEEP_SHAPES if sh in row) + f" {row.get('error', '')}",
                  flush=True)
    del mats, copies
    torch.cuda.empty_cache() if run.dev.type == "cuda" else None
    best = {}
    for kind in KINDS:
        ok = [r for r in res if r["kind"] == kind and "total_us" in r]
        if ok:
            b = min(ok, key=lambda r: r["total_us"])
            best[kind] = b
            print(f"best {kind}: {b}", flush=True)
    run.results["best"] = best


def best_launch(run: Run, kind: str) -> tuple[tuple[int, int, int, int], bool, int, bool]:
    """(BLOCK_N, warps, stages, programs), joined planes, activations ahead, bytes by word rows:
    the sweep's best, else the shipped."""
    b = run.results.get("best", {}).get(kind)
    if b is None:
        return (mma_mod.MMA_LAUNCH[kind], mma_mod.JOIN_PLANES.get(kind, False), mma_mod.X_AHEAD.get(kind, 0),
                mma_mod.WORD_ROWS.get(kind, False))
    return ((b["block_n"], b["warps"], b["stages"], b["programs"]), b["join"], b.get("x_ahead", 0),
            b.get("word_rows", False))


def section_paths(run: Run) -> None:
    from quant.kernels.packed_dequant import dequantize_t
    res = run.results.setdefault("paths", [])
    shapes = [s for s in PATH_SHAPES if s in run.shapes]
    rows_list = ROWS if not run.args.tiny else (1, 4, 5, 16)
    for kind in KINDS:
        (bn, warps, stages, programs), join, xa, wr = best_launch(run, kind)
        for shape in shapes:
            pw = run.weights(kind, shape, seed=5)
            copies = rotated(run, pw)
            for rows in rows_list:
                if run.out_of_time(f"paths {kind} {shape} {rows}"):
                    return
                xq = run.activations(rows, pw.in_features, seed=rows)
                x = torch.randn(rows, pw.in_features, device=run.dev, dtype=torch.bfloat16)
                out = torch.zeros(rows, pw.out_features, device=run.dev)
                cfg = mma_config(pw, bn, warps, stages, programs)
                calls = {"dp4a": lambda w: packed_gemv(*xq, w, out=out, accumulate=True,
                                                       variant=gemv_mod.default_variant(kind, 128, rows, w.in_features)
                                                       if rows == 1 else None)}
                if rows >= 2:
                    calls["mma"] = lambda w: packed_mma(*xq, w, out, True, cfg, join, xa, wr)
                if rows >= 5:
                    calls["cublas"] = lambda w: torch.matmul(x, dequantize_t(w, torch.bfloat16))
                row = {"kind": kind, "shape": shape, "rows": rows}
                for name, fn in calls.items():
                    if name == "mma":
                        err = relative_error(packed_mma(*xq, pw, config=cfg, join=join, x_ahead=xa,
                                                        word_rows=wr),
                                             packed_gemv_reference(*xq, pw))
                        row["mma_err"] = err
                    row[name] = time_calls(run, [lambda w=w, fn=fn: fn(w) for w in copies])["us"]
                row["fastest"] = min((k for k in calls), key=lambda k: row[k])
                res.append(row)
                print(f"paths {kind} {shape:12} M={rows:2}: " + " ".join(f"{k} {row[k]:6.1f}" for k in calls)
                      + f" -> {row['fastest']}", flush=True)
            del copies, pw
    summary = {}
    for kind in KINDS:
        for rows in rows_list:
            rs = [r for r in res if r["kind"] == kind and r["rows"] == rows]
            if rs:
                summary[f"{kind} M={rows}"] = {p: sum(r[p] for r in rs) for p in ("dp4a", "mma", "cublas") if p in rs[0]}
    run.results["paths_summary"] = summary
    for key, sums in summary.items():
        print(f"sum over shapes {key}: " + " ".join(f"{p} {v:7.1f}" for p, v in sums.items()), flush=True)


def section_step(run: Run) -> None:
    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.kv_cache import KVCache
    if run.dev.type != "cuda":
        return
    loaded, cfg = model_8b(run)
    cache = KVCache(cfg, 1024, 16, dtype=torch.bfloat16, device=run.dev)
    shipped = (dict(gemv_mod.MMA_FROM_ROWS), dict(mma_mod.MMA_LAUNCH), dict(mma_mod.JOIN_PLANES),
               dict(mma_mod.X_AHEAD), dict(mma_mod.WORD_ROWS))
    # shipped: today's thresholds and launch configs; best: today's thresholds, the sweep's best configs
    policies = {"shipped": None, "best": 0, **{f"mma>={n}": n for n in run.args.policies}}
    res = run.results.setdefault("step", [])
    for name, start in policies.items():
        gemv_mod.MMA_FROM_ROWS.clear()
        gemv_mod.MMA_FROM_ROWS.update(shipped[0] if not start else {k: start for k in shipped[0]})
        if start is not None:
            for kind in KINDS:
                launch, join, xa, wr = best_launch(run, kind)
                mma_mod.MMA_LAUNCH[kind], mma_mod.JOIN_PLANES[kind] = launch, join
                mma_mod.X_AHEAD[kind], mma_mod.WORD_ROWS[kind] = xa, wr
        base = None
        for rows in (1, 2, 4, 8, 16):
            if run.out_of_time(f"step {name} {rows}"):
                break
            step = DecodeStepRunner(loaded.model, cache, rows, 4)
            step.run([1] * rows, [512] * rows, list(range(rows)))
            torch.cuda.synchronize()
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(20):
                    step.graph.replay()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - t0) / 20)
            t = sorted(samples)[len(samples) // 2]
            base = base or t
            res.append({"policy": name, "rows": rows, "us": t * 1e6, "x_one_row": t / base})
            print(f"step {name:8} rows={rows:2}: {t * 1e6:7.1f} us ({t / base:.2f}x one row)", flush=True)
            del step
        gemv_mod.MMA_FROM_ROWS.clear()
        gemv_mod.MMA_FROM_ROWS.update(shipped[0])
        mma_mod.MMA_LAUNCH.update(shipped[1])
        mma_mod.JOIN_PLANES.update(shipped[2])
        mma_mod.X_AHEAD.update(shipped[3])
        mma_mod.WORD_ROWS.update(shipped[4])


def model_8b(run: Run):
    """The 8B ternary model (int4 head) on generated weights, loaded once per run."""
    if "model" not in run.__dict__:
        import yaml

        from engine.sources.model_config import ModelConfig
        from engine.weights.formats import WeightFormat
        from engine.weights.loader import load_dummy
        root = Path(__file__).resolve().parents[2]
        cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs/models/qwen3-8b.yaml").read_text()))
        run.model = load_dummy(cfg, "qwen3-8b", run.dev, WeightFormat("tri", 128, "int4")), cfg
    return run.model


def section_prefill(run: Run) -> None:
    from engine.runtime.runner import ModelRunner
    if run.dev.type != "cuda":
        return
    loaded, cfg = model_8b(run)
    runner = ModelRunner(loaded, max_seq_len=1024)
    runner.prepare_rows(16)
    res = run.results.setdefault("prefill", [])
    for n in (16, 40, 64, 96, 128, 200):
        prompt = [(7 * i + 3) % 4000 + 10 for i in range(n)]
        row = {"tokens": n}
        for path, limit in (("short", 10 ** 6), ("eager", 0)):
            runner.short_prefill_tokens = limit
            samples = []
            for _ in range(8):
                runner.slot(0).reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.forward(runner.slot(0), prompt)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            row[path] = sorted(samples[1:])[3] * 1e3
        res.append(row)
        print(f"prefill {n:3} tokens: short {row['short']:6.2f} ms, eager {row['eager']:6.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--grid", default="wide", help="sweep: configs swept, comma-separated names of GRIDS")
    ap.add_argument("--policies", default="2,3,4,5,8", help="step: mma from these row counts, besides the shipped rule")
    args = ap.parse_args(argv)
    args.policies = [int(p) for p in args.policies.split(",") if p]
    if args.tiny:
        args.reps, args.warmup = 1, 0
    run = Run(args)
    if args.tiny:
        run.shapes = {**TINY_SHAPES, "8b down": (64, 768)}
    else:
        run.shapes = SHAPES
    for name in args.sections.split(","):
        try:
            globals()[f"section_{name}"](run)
        except Exception as error:  # noqa: BLE001 - recorded, the next section runs
            run.results["errors"][name] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    run.results["seconds"] = time.perf_counter() - run.start
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(run.results, indent=1, default=str))
    print(json.dumps({"errors": run.results["errors"], "skipped": run.results["skipped"][:3],
                      "best": run.results.get("best")}, default=str))
    return 1 if run.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

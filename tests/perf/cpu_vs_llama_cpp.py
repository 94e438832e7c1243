"""CPU prefill and decode, bonsai vs llama.cpp's llama-bench on the same GGUF, in one run, interleaved.

Usage: python tests/perf/cpu_vs_llama_cpp.py [--models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
           [--rounds 5] [--threads 2] [--weight-dtype auto] [--json OUT]
Builds llama-bench once (tests/perf/llama_cpp_build.py, outside the repo). For each pulled model, ours
is loaded once in this process; each round then runs llama-bench (`-p 64 -n 32 -t T -r 1`, its own
warm-up included) and ours (pp64 and tg32 as `bonsai bench` times them: fresh random ids, the KV slot
cleared) back to back, the order alternating per round, so that the load of a shared machine hits
both alike. Prints mean ± stdev per engine and the ratio ours / llama.cpp. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

N_PROMPT, N_GEN = 64, 32


def llama_bench(binary: Path, model: Path, threads: int, repack: bool = False) -> dict[str, float]:
    """One llama-bench invocation (one timed repetition per test): {'pp64': tok/s, 'tg32': tok/s}."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(N_PROMPT), "-n", str(N_GEN), "-t", str(threads),
                          "-r", "1", "-o", "json", "--repack", "1" if repack else "0"],
                         capture_output=True, text=True, check=True).stdout
    result = {}
    for row in json.loads(out):
        name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        result[name] = float(row["avg_ts"])
    return result


def ours_bench(engine, special_ids, seed: int) -> dict[str, float]:
    from engine.bench.model_bench import BenchTest, run_test
    pp = run_test(engine, BenchTest(N_PROMPT, 0), seed, special_ids)
    tg = run_test(engine, BenchTest(0, N_GEN), seed, special_ids)
    return {f"pp{N_PROMPT}": N_PROMPT / pp, f"tg{N_GEN}": N_GEN / tg}


def fmt(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):8.2f} ± {sd:6.2f}"


def main() -> None:
    from engine.sources import store
    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    from llama_cpp_build import DEFAULT_DIR, build

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    ap.add_argument("--cpu-int4", choices=["auto", "on", "off"], default="auto",
                    help="runtime.cpu_int4 (auto: as `bonsai bench` runs the model)")
    ap.add_argument("--cpu-kernels", default="auto", help="runtime.cpu_kernels, or a comma list (auto, native, "
                    "torch): each loaded once and run in every round beside llama.cpp")
    ap.add_argument("--output-dtype", choices=["auto", "float32", "float16"], default="auto", help="runtime.output_dtype")
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repack", action="store_true", help="llama-bench --repack 1 (its weight repacking on; off by "
                    "default: the 0.3.36 build segfaults at load on Qwen2.5-Coder-0.5B and dies with SIGILL on SmolLM2 on "
                    "an AMX machine with it, 2026-12-06)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    binary = build(args.llama_dir) / "llama-bench"
    wdtype = None if args.weight_dtype == "auto" else getattr(torch, args.weight_dtype)
    report = {"threads": args.threads, "rounds": args.rounds, "weight_dtype": args.weight_dtype,
              "cpu_int4": args.cpu_int4, "output_dtype": args.output_dtype, "cpu_kernels": args.cpu_kernels,
              "torch": torch.__version__, "models": {}}
    print(f"threads {args.threads}, {args.rounds} rounds interleaved, weights {args.weight_dtype}, "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    for name in args.models.split(","):
        path = store.find_pulled(name) or Path(name)
        if not path.is_file():
            print(f"{name}: not pulled (bonsai pull {name}), skipped", flush=True)
            continue
        from engine.run.config import RunConfig  # the settings `bonsai bench MODEL` runs with
        runtime = {"weight_dtype": args.weight_dtype, "output_dtype": args.output_dtype}
        if args.cpu_int4 != "auto":
            runtime["cpu_int4"] = args.cpu_int4 == "on"
        cfg = RunConfig.from_dict({"model": {"path": str(path)}, "runtime": runtime})
        from engine.decoding.engine import Engine
        engines = {}
        for kernels in args.cpu_kernels.split(","):
            loaded = load_model(path, "cpu", weight_dtype=wdtype, cpu_int4=cfg.cpu_int4, narrow_head=cfg.narrow_head,
                                cpu_kernels=kernels)
            label = f"bonsai-{loaded.cpu_kernels or 'float'}"
            print(f"{name}: {label}: {loaded.int4_layers} matrices as stored, output layer "
                  f"{type(loaded.model.lm_head).__name__}", flush=True)
            engine = Engine(ModelRunner(loaded, max_seq_len=N_PROMPT + N_GEN + 8), None)  # run_test drives an engine
            special = frozenset(loaded.tokenizer.special_ids)
            ours_bench(engine, special, 10_000)  # warm-up (llama-bench warms up inside each call)
            engines[label] = (engine, special)
        samples = {"llama.cpp": {}, **{label: {} for label in engines}}
        for r in range(args.rounds):
            runs = [("llama.cpp", lambda: llama_bench(binary, path, args.threads, args.repack))]
            runs += [(label, lambda e=e, s=s: ours_bench(e, s, r + 1)) for label, (e, s) in engines.items()]
            for engine, run in (runs if r % 2 == 0 else runs[::-1]):
                for test, tps in run().items():
                    samples[engine].setdefault(test, []).append(tps)
        entry = {}
        for test in (f"pp{N_PROMPT}", f"tg{N_GEN}"):
            theirs = samples["llama.cpp"][test]
            entry[test] = {"llama.cpp": theirs}
            for label in engines:
                ours = samples[label][test]
                ratio = statistics.mean(ours) / statistics.mean(theirs)
                entry[test][label] = ours
                entry[test][f"ratio_{label}"] = ratio
                print(f"{name:20} {test:5} {label:14} {fmt(ours)}  llama.cpp {fmt(theirs)}  tok/s  "
                      f"ratio {ratio:.2f}x", flush=True)
        report["models"][name] = entry
        del engines, loaded
    report["load_average_end"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

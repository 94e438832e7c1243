"""Issue 19: the graphed one-row decode step with the CUDA C++ one-row products (quant.kernels.cuda_gemv) against
the same step on Triton's kernels, in one process on the same generated weights, interleaved.

    python3 tests/perf/cuda_gemv_step.py --models qwen3-8b:tri:int4,qwen3-8b:bin:int4 --json $OUT/cuda_step.json

Per model (name:weights:head, configs/models/NAME.yaml, group 128): the model is generated once; two DecodeStepRunner
(rows 1) are captured, one with BONSAI_CUDA_GEMV=0 (Triton, as before) and one with it on; first a check — both
steps on the same token and position give logits within a last-int8-step tolerance and the same argmax — then
`--rounds` rounds of `--replays` graph replays of each, alternating (A B A B …: the machine's drift falls on both).
Reported: µs a step (mean ± std over rounds, min), the ratio, the tok/s it implies, and which kernel each shape ran.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def step_timing(graph, replays: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays * 1e6


def measure(spec: str, rounds: int, replays: int, context: int) -> dict:
    import yaml

    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.kv_cache import KVCache
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    from engine.weights.packed_linear import decode_paths
    name, weights, head = spec.split(":")
    cfg = ModelConfig.from_hf_config(yaml.safe_load((ROOT / "configs" / "models" / f"{name}.yaml").read_text()))
    dev = torch.device("cuda")
    loaded = load_dummy(cfg, name, dev, WeightFormat(weights, 128, head))
    cache = KVCache(cfg, context + 64, 1, dtype=torch.bfloat16, device=dev)
    steps, logits, paths = {}, {}, {}
    for flag in ("0", "1"):
        os.environ["BONSAI_CUDA_GEMV"] = flag
        steps[flag] = DecodeStepRunner(loaded.model, cache, 1, 4)
        logits[flag] = steps[flag].run([7], [context], [0]).float().clone()  # [1, V]
        paths[flag] = decode_paths(loaded.model)
    os.environ["BONSAI_CUDA_GEMV"] = "1"
    a, b = logits["0"], logits["1"]
    diff = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-9)
    same_top = bool(a.argmax() == b.argmax())
    ok = diff < 2e-2 and same_top and bool(torch.isfinite(b).all())
    print(f"[{'ok' if ok else 'FAIL'}] {spec}: CUDA C++ vs Triton logits max |Δ| {diff:.1e} of the scale, "
          f"same argmax {same_top}", flush=True)
    times: dict[str, list[float]] = {"0": [], "1": []}
    for flag in ("0", "1"):  # warm
        step_timing(steps[flag].graph, 20)
    for _ in range(rounds):
        for flag in ("0", "1"):
            times[flag].append(step_timing(steps[flag].graph, replays))
    row = {"model": spec, "check_ok": ok, "rel_diff": diff, "same_top": same_top, "paths_cuda": paths["1"],
           "paths_triton": paths["0"]}
    for flag, label in (("0", "triton"), ("1", "cuda")):
        t = times[flag]
        row[label] = {"us_mean": statistics.mean(t), "us_std": statistics.stdev(t) if len(t) > 1 else 0.0,
                      "us_min": min(t), "tok_s": 1e6 / statistics.mean(t)}
    row["ratio"] = row["cuda"]["us_mean"] / row["triton"]["us_mean"]
    print(f"{spec:24} triton {row['triton']['us_mean']:8.1f} ± {row['triton']['us_std']:.1f} us "
          f"({row['triton']['tok_s']:.0f} tok/s)  cuda {row['cuda']['us_mean']:8.1f} ± {row['cuda']['us_std']:.1f} us "
          f"({row['cuda']['tok_s']:.0f} tok/s)  ratio {row['ratio']:.3f}", flush=True)
    for shape, path in paths["1"].items():
        print(f"    {shape:28} {paths['0'][shape]:18} -> {path}", flush=True)
    del steps, loaded, cache
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-8b:tri:int4,qwen3-8b:bin:int4,dense-27b:tri:int4,qwen3-1.7b:tri:int4")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "errors": {}}
    for spec in args.models.split(","):
        try:
            result["rows"].append(measure(spec, args.rounds, args.replays, args.context))
        except Exception as error:  # noqa: BLE001 - recorded; the next model runs
            result["errors"][spec] = f"{type(error).__name__}: {error}"[:400]
            print(f"ERROR {spec}: {result['errors'][spec]}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    failed = [r["model"] for r in result["rows"] if not r["check_ok"]]
    print(f"{len(result['rows'])} models, checks failed: {failed or 'none'}; errors: {result['errors'] or 'none'}")
    return 1 if failed or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

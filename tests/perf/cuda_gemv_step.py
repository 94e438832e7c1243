"""Issue 19: the graphed one-row decode step with the CUDA C++ one-row products (quant.kernels.cuda_gemv) against
the same step on Triton's kernels, in one process on the same generated weights, interleaved.

    python3 tests/perf/cuda_gemv_step.py --models qwen3-8b:tri:int4,qwen3-8b:bin:int4 --json $OUT/cuda_step.json

Per model (name:weights:head, configs/models/NAME.yaml, group 128): the model is generated once; one DecodeStepRunner
(rows 1) is captured per variant (`--variants`, VARIANTS below: "triton" = BONSAI_CUDA_GEMV=0, the first is the
baseline of the ratios). First a check: each step on the same token and position gives logits within a last-int8-step
tolerance of the first's and the same argmax. Then `--rounds` rounds of `--replays` graph replays of each,
alternating (A B C D A B C D …: the machine's drift falls on all).
Reported: µs a step (mean ± std over rounds, min), the ratio, the tok/s it implies, and which kernel each shape ran.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.gpu_kern import replay_us  # noqa: E402  (µs a replay, back to back)


# every switch a variant sets (the others' values are put back to these first)
DEFAULTS = {"BONSAI_CUDA_GEMV": "1", "BONSAI_CUDA_GEMV_INPUT": "auto", "BONSAI_CUDA_ATTN": "1",
            "BONSAI_CUDA_ATTN_PREFETCH": "0", "BONSAI_CUDA_ATTN_SPLITS": "", "BONSAI_CUDA_ATTN_FENCE": "",
            "BONSAI_CUDA_ATTN_TRIGGER": "", "BONSAI_CUDA_ATTN_CLUSTER": "", "BONSAI_CUDA_ATTN_COMBINE": "auto"}
LAST = {"BONSAI_CUDA_ATTN_COMBINE": "attention"}  # session 33: the last attention block combines
OP = {"BONSAI_CUDA_ATTN_COMBINE": "product"}  # session 34: o_proj's product combines (whatever the heads)
VARIANTS = {
    "triton": {"BONSAI_CUDA_GEMV": "0", "BONSAI_CUDA_ATTN": "0"}, # session 31's step
    "cuda": {"BONSAI_CUDA_GEMV_INPUT": "int8", "BONSAI_CUDA_ATTN": "0"}, # CUDA C++ products, int8 from kernels
    "norm": {"BONSAI_CUDA_GEMV_INPUT": "norm", "BONSAI_CUDA_ATTN": "0"}, # ... the norms fused into q/k/v, gate/up
    "fused": {"BONSAI_CUDA_GEMV_INPUT": "all", "BONSAI_CUDA_ATTN": "0"}, # ... SwiGLU into down too
    "before": {"BONSAI_CUDA_ATTN": "0"}, # session 32's default
    "attn": {},                          # + rope/KV/attention in one launch (default)
    "attn-last": {"BONSAI_CUDA_ATTN_COMBINE": "attention"}, # ... splits combined by the last block (s33)
    "attn-op": OP,
    "attn-op-t1": {**OP, "BONSAI_CUDA_ATTN_TRIGGER": "1"},  # o_proj launched once the partials are written
    "attn-op-s8": {**OP, "BONSAI_CUDA_ATTN_SPLITS": "8"},   # ... 8 / 16 / 32 splits
    "attn-op-s16": {**OP, "BONSAI_CUDA_ATTN_SPLITS": "16"},
    "attn-op-s32": {**OP, "BONSAI_CUDA_ATTN_SPLITS": "32"},
    # session 33's variants of the last block's combine (each with BONSAI_CUDA_ATTN_COMBINE=attention)
    "attn-pf": {**LAST, "BONSAI_CUDA_ATTN_PREFETCH": "1"}, # ... with the L2 prefetch before the wait
    "attn-f0": {**LAST, "BONSAI_CUDA_ATTN_FENCE": "0"}, # every thread fences (the counter hand-off)
    "attn-f1": {**LAST, "BONSAI_CUDA_ATTN_FENCE": "1"}, # thread 0's acq_rel atomic
    "attn-t0": {**LAST, "BONSAI_CUDA_ATTN_TRIGGER": "0"}, # PDL trigger at the start
    "attn-t1": {**LAST, "BONSAI_CUDA_ATTN_TRIGGER": "1"}, # ... once the partial is written
    "attn-f1t1": {**LAST, "BONSAI_CUDA_ATTN_FENCE": "1", "BONSAI_CUDA_ATTN_TRIGGER": "1"},
    "attn-cl8": {**LAST, "BONSAI_CUDA_ATTN_CLUSTER": "8"}, # a kv head's 8 splits one cluster (sm_90)
    "attn-cl16": {**LAST, "BONSAI_CUDA_ATTN_CLUSTER": "16"}, # ... 16 (non-portable)
    "attn-s8": {**LAST, "BONSAI_CUDA_ATTN_SPLITS": "8"},
    "attn-s16": {**LAST, "BONSAI_CUDA_ATTN_SPLITS": "16"},
    "attn-s32": {**LAST, "BONSAI_CUDA_ATTN_SPLITS": "32"},
}


def measure(spec: str, rounds: int, replays: int, context: int, labels: list[str]) -> dict:
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
    variants = {label: VARIANTS[label] for label in labels}
    steps, logits, paths = {}, {}, {}
    for label, env in variants.items():
        os.environ.update(DEFAULTS | env)
        steps[label] = DecodeStepRunner(loaded.model, cache, 1, 4)
        logits[label] = steps[label].run([7], [context], [0]).float().clone()  # [1, V]
        paths[label] = decode_paths(loaded.model)
        paths[label]["attention"] = _attention(steps[label])
    os.environ.update(DEFAULTS)
    first, last = labels[0], labels[-1]
    row = {"model": spec, "paths": paths, "check_ok": True}
    a = logits[first]
    for label in labels[1:]:
        b = logits[label]
        diff = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-9)
        same_top = bool(a.argmax() == b.argmax())
        ok = diff < 2e-2 and same_top and bool(torch.isfinite(b).all())
        row["check_ok"] &= ok
        row[f"{label}_rel_diff"], row[f"{label}_same_top"] = diff, same_top
        print(f"[{'ok' if ok else 'FAIL'}] {spec} {label}: logits max |Δ| {diff:.1e} of the scale against {first}'s, "
              f"same argmax {same_top}", flush=True)
    times: dict[str, list[float]] = {label: [] for label in variants}
    for label in variants:  # warm
        replay_us(steps[label].graph, 20)
    for _ in range(rounds):
        for label in variants:
            times[label].append(replay_us(steps[label].graph, replays))
    for label, t in times.items():
        row[label] = {"us_mean": statistics.mean(t), "us_std": statistics.stdev(t) if len(t) > 1 else 0.0,
                      "us_min": min(t), "tok_s": 1e6 / statistics.mean(t)}
    base = row[first]["us_mean"]
    print(f"{spec:24} " + "  ".join(f"{label} {row[label]['us_mean']:7.1f} ± {row[label]['us_std']:.1f} us "
                                     f"({row[label]['tok_s']:.0f} tok/s, {row[label]['us_mean'] / base:.3f}x)"
                                     for label in variants), flush=True)
    for shape, path in paths[last].items():
        print(f"    {shape:28} {paths[first][shape]:28} -> {path}", flush=True)
    del steps, loaded, cache
    torch.cuda.empty_cache()
    return row


def _attention(step) -> str:
    buffers = step.workspace.attention
    if buffers is None:
        return "triton"
    return (f"cuda {buffers.splits} splits fence {buffers.fence} trigger {buffers.trigger} cluster {buffers.cluster}"
            + (" prefetch" if buffers.prefetch else "") + ("" if buffers.combine else " o_proj combines"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-8b:tri:int4,qwen3-8b:bin:int4,dense-27b:tri:int4,qwen3-1.7b:tri:int4")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--variants", default="triton,before,attn,attn-pf,attn-s8,attn-s32",
                   help=f"comma-separated, the first the baseline: {', '.join(VARIANTS)}")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "errors": {}}
    for spec in args.models.split(","):
        try:
            result["rows"].append(measure(spec, args.rounds, args.replays, args.context, args.variants.split(",")))
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

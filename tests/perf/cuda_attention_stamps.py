"""Issue 19: where one decode row's fused attention kernel (engine.kernels.cuda_attention) spends its time, phase by
phase, inside the graphed one-row step as the engine runs it.

    python3 tests/perf/cuda_attention_stamps.py --models qwen3-8b:tri:int4,dense-27b:tri:int4 --context 512

With BONSAI_CUDA_ATTN_STAMPS=1 thread 0 of every block records clock64() at each phase boundary (the kernel's STAMP
points) and the global timer at its start; the last layer's stamps of one replay are read back. Reported per phase,
over the blocks: median and max cycles (µs at --ghz): waiting for the q/k/v product (PDL), norm + rotary + K/V write,
the attention loop, the warps' merge + partial write + fence, the counter's atomic, and the last block's combine;
and the spread of the blocks' start times (ns, global timer).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PHASES = ("wait for q/k/v", "norm+rope+KV", "attention loop", "merge+partial", "atomic", "combine (last)")


def measure(spec: str, context: int, ghz: float) -> None:
    import yaml

    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.kv_cache import KVCache
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    name, weights, head = spec.split(":")
    cfg = ModelConfig.from_hf_config(yaml.safe_load((ROOT / "configs" / "models" / f"{name}.yaml").read_text()))
    dev = torch.device("cuda")
    loaded = load_dummy(cfg, name, dev, WeightFormat(weights, 128, head))
    cache = KVCache(cfg, context + 64, 1, dtype=torch.bfloat16, device=dev)
    os.environ["BONSAI_CUDA_ATTN_STAMPS"] = "1"
    step = DecodeStepRunner(loaded.model, cache, 1, 4)
    buffers = step.workspace.attention
    if buffers is None:
        print(f"{spec}: the fused attention is not taken")
        return
    step.run([7], [context], [0])
    for _ in range(20):
        step.graph.replay()
    buffers.stamps.zero_()
    step.graph.replay()
    torch.cuda.synchronize()
    s = buffers.stamps.cpu().tolist()  # [KV·NS, 8]
    print(f"{spec}: {len(s)} blocks ({cfg.num_kv_heads} kv heads x {buffers.splits} splits), {context} keys, "
          f"prefetch {buffers.prefetch}; block starts spread over {max(r[7] for r in s) - min(r[7] for r in s)} ns")
    for i, phase in enumerate(PHASES):
        cycles = [r[i + 1] - r[i] for r in s if r[i + 1] and r[i]]
        if not cycles:
            continue
        med, top = statistics.median(cycles), max(cycles)
        print(f"    {phase:18} median {med:8.0f} cycles ({med / ghz / 1e3:5.2f} µs)  max {top:8.0f} "
              f"({top / ghz / 1e3:5.2f} µs)  blocks {len(cycles)}")
    total = [r[6] - r[1] for r in s if r[6] and r[1]]
    if total:
        print(f"    after the wait to the end of the last block: median {statistics.median(total) / ghz / 1e3:.2f} µs")
    del step, loaded, cache
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-8b:tri:int4,dense-27b:tri:int4,qwen3-1.7b:tri:int4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--ghz", type=float, default=1.98, help="SM clock for the µs column (H100 SXM boost: 1.98)")
    args = p.parse_args(argv)
    for spec in args.models.split(","):
        measure(spec, args.context, args.ghz)
    return 0


if __name__ == "__main__":
    sys.exit(main())

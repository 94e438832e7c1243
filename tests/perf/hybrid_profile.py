"""Where the hybrid decode step's time goes on a GPU (issue 18): the runner's own graphed step (DeltaNet states
attached as serving has them) replayed under the profiler, per kernel.
    python3 tests/perf/hybrid_profile.py [--model qwen3.6-27b] [--weights tri] [--head int4] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402
from tests.perf.gpu_steps import RESULTS, profile_replays  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.6-27b")
    ap.add_argument("--weights", default="tri")
    ap.add_argument("--head", default="int4")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--old-gates", action="store_true",
                    help="the DeltaNet gate projections as before the gate kernel (RMSNorm, casts, cuBLAS): an A/B")
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[2]
    cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs" / "models" / f"{a.model}.yaml").read_text()))
    loaded = load_dummy(cfg, a.model, "cuda", WeightFormat(a.weights, 128, a.head))
    runner = ModelRunner(loaded, max_seq_len=1024, num_slots=1, prefill_graphs=False)
    if a.old_gates:
        def old_gates(x, norm, gates, eps):
            normed = torch.nn.functional.rms_norm(x, norm.shape, norm, eps)  # [M, H] float32
            return torch.nn.functional.linear(normed.to(gates.dtype), gates).float()  # [M, 2Hv]
        runner.decoder.ops.gate_project = old_gates
        runner.decoder._capture()  # the step was captured when the runner was built: again, with the old path
    slot = runner.slot(0)
    runner.forward(slot, list(range(1, 65)))  # 64 tokens of prompt (eager)
    for t in range(8):
        runner.forward(slot, [t + 7])  # the graphed one-row step (captured on first use)
    assert runner.decoder is not None and runner.decoder.graph is not None, "the hybrid decode step is not graphed"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        runner.decoder.graph.replay()
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / 100 * 1e6
    print(f"{a.model} {a.weights}/{a.head}{' (old gates)' if a.old_gates else ''}: graphed step {us:.0f} us = {1e6 / us:.0f} tok/s", flush=True)
    profile_replays(runner.decoder.graph)
    RESULTS["step_us"] = us
    if a.json:
        a.json.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()

"""Batched decode through a 2-GPU pipeline: a step of S slots whole vs cut into 2 micro-batches in flight.

On a GPU the fused step reads all of a stage's weights whatever its rows (up to 16), so two
micro-batches read them twice and take 3 half-steps; they pay only where the rows' own work (the KV
they read) outweighs that. This measures both on the dense-27b shape (generated weights):
  NCCL_NVLS_ENABLE=0 python3 tests/perf/pipeline_micro_batches.py [--slots 8] [--context 1024] [--steps 64]
Prints one JSON object: steps/s and aggregate tokens/s of each way, and whether their logits agree.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bonsai_cli.run_options import dummy_architecture  # noqa: E402
from engine.memory.budget import dummy_formats, run_settings  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.pipeline.launch import ModelSource  # noqa: E402
from engine.pipeline.setup import open_pipeline, plan_pipeline  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dense-27b")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="tokens each slot holds before the timed steps")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kv-type", default="bf16")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="cpu,cpu checks the script without GPUs")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    devices = args.devices.split(",")
    sync = torch.cuda.synchronize if devices[0].startswith("cuda") else (lambda: None)
    config, path = dummy_architecture(args.model)
    fmt = WeightFormat("tri", args.group_size, "int4")
    seq = args.context + args.steps * 2 + 8
    settings = run_settings(config, devices[0], seq, slots=args.slots, kv_type=args.kv_type, dummy=True)
    formats = dummy_formats(config, WeightFormat("tri", args.group_size, "int4")).formats
    pp = plan_pipeline(config, formats, settings, devices)
    runner = open_pipeline(ModelSource(architecture=config, name=path.stem, weight_format=fmt), pp, seq,
                           num_slots=args.slots, prefill_chunk_size=512, kv_type=args.kv_type)
    try:
        runner.prepare_rows(args.slots)
        g = torch.Generator().manual_seed(0)
        slots = [runner.slot(i) for i in range(args.slots)]
        for slot in slots:
            runner.prefill(slot, torch.randint(0, 30000, (args.context,), generator=g).tolist())
        result = {"model": args.model, "slots": args.slots, "context": args.context,
                  "split": [(s.device, s.first, s.end) for s in pp.stages]}
        logits = {}
        for name, flat in (("whole", True), ("two_micro_batches", False)):
            runner.flat_step_cost = flat
            for slot in slots:
                slot.rewind(slot.length - args.context)
            tokens = [1] * args.slots
            runner.decode_batch(slots, tokens)  # warm-up (graph capture of the micro-batch widths)
            for slot in slots:
                slot.rewind(1)
            sync()
            start = time.perf_counter()
            for step in range(args.steps):
                out = runner.decode_batch(slots, tokens)
                if step == 0:
                    logits[name] = out.clone()
                tokens = out.argmax(-1).tolist()
            sync()
            seconds = time.perf_counter() - start
            result[name] = {"steps_per_second": args.steps / seconds,
                            "tokens_per_second": args.steps * args.slots / seconds}
        diff = (logits["whole"] - logits["two_micro_batches"]).abs().max().item()
        result["first_step_max_abs_logit_difference"] = diff
        print(json.dumps(result))
    finally:
        runner.close()


if __name__ == "__main__":
    main()

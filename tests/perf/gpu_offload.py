"""KV offload and weight offload on a GPU: decode speed against the PCIe bound, and what the overlap gains.

    python3 tests/perf/gpu_offload.py --section kv        # Qwen3-8B shape, 32K context, KV in host RAM
    python3 tests/perf/gpu_offload.py --section weights   # 27B-class shape, every block streamed from host RAM
    python3 tests/perf/gpu_offload.py --cpu-smoke         # tiny shapes on the CPU: the same code runs

Prints one JSON line per result. The PCIe bound of a decode step is (bytes it moves host → GPU) /
(pinned host → GPU bandwidth, measured here). Dummy weights (engine.weights.loader.load_dummy); the KV
pool is left at zeros and the slot set to the wanted length (no prefill: speed does not depend on
the values). "overlap": prefetch of the next layer while one computes (the default); "serial":
each layer copied just before its use. Resident runs (everything on the GPU) are given for scale.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.memory.host_copies import HostAllocator  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
TINY = ModelConfig("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=4096)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def architecture(name: str) -> ModelConfig:
    import yaml
    return ModelConfig.from_hf_config(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()))


def host_to_device_bandwidth(device: torch.device, mib: int, repeats: int = 5) -> dict:
    """Bytes/s of one large copy from pinned (and from pageable) host memory to the device."""
    result = {}
    for kind in ("pinned", "pageable"):
        host = HostAllocator(pin=kind == "pinned" and device.type == "cuda", what="bandwidth test").empty(
            (mib * 2**20,), torch.uint8)
        dst = torch.empty_like(host, device=device)
        best = float("inf")
        for _ in range(repeats + 1):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        result[kind] = host.numel() / best
    return result


def time_decode(runner: ModelRunner, steps: int, rows: int = 1) -> float:
    """Seconds per forward pass of `rows` new tokens of slot 0 (the slot rewound after each pass, so
    the context stays put)."""
    slot = runner.slot(0)
    device = runner.device

    def one() -> None:
        if rows == 1:
            runner.forward(slot, [5])
        else:
            runner.verify(slot, [5] * rows)
        slot.rewind(rows)

    for _ in range(2):
        one()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    sync(device)
    return (time.perf_counter() - t0) / steps


def fill(runner: ModelRunner, context: int) -> None:
    runner.slot(0).tokens[:] = [1] * context


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def section_kv(args, device: torch.device, bandwidth: float) -> None:
    cfg = TINY if args.cpu_smoke else architecture(args.kv_model)
    fmt = WeightFormat(args.weights, 128 if not args.cpu_smoke else 64, args.head_weights)
    loaded = load_dummy(cfg, args.kv_model, device=device, weight_format=fmt)
    context = args.context
    base = dict(section="kv", model=args.kv_model, weights=args.weights, context=context)
    if args.resident:
        runner = ModelRunner(loaded, max_seq_len=context + 16)
        fill(runner, context)
        seconds = time_decode(runner, args.steps)
        emit(**base, case="resident", tokens_per_second=1 / seconds, cuda_graph=runner.decoder is not None
             and runner.decoder.graph is not None, peak_gpu_gib=peak_gib(device))
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(loaded, max_seq_len=context + 16, kv_offload=True)
    fill(runner, context)
    moved = runner.cache.transfer_bytes(context)
    bound = bandwidth / moved
    for overlap in (True, False):
        runner.cache.overlap = overlap
        seconds = time_decode(runner, args.steps)
        emit(**base, case="offload " + ("overlap" if overlap else "serial"), tokens_per_second=1 / seconds,
             pcie_bound_tokens_per_second=bound, fraction_of_bound=(1 / seconds) / bound,
             host_to_device_bytes_per_token=moved, kv_host_gib=runner.cache.nbytes / 2**30,
             gpu_buffers_gib=runner.cache.working_nbytes / 2**30, pinned=runner.cache.allocator.pinned_all,
             peak_gpu_gib=peak_gib(device))
    runner.cache.overlap = True
    for rows in args.verify_rows:  # speculative verification: one transfer of the context serves `rows` tokens
        seconds = time_decode(runner, args.steps, rows=rows)
        emit(**base, case=f"offload verify {rows} rows", passes_per_second=1 / seconds,
             tokens_per_second_if_all_accepted=rows / seconds, pcie_bound_passes_per_second=bound,
             fraction_of_bound=(1 / seconds) / bound)


def section_weights(args, device: torch.device, bandwidth: float) -> None:
    cfg = TINY if args.cpu_smoke else architecture(args.weights_model)
    fmt = WeightFormat(args.weights, 128 if not args.cpu_smoke else 64, args.head_weights)
    context = args.weights_context
    base = dict(section="weights", model=args.weights_model, weights=args.weights, context=context)
    n = cfg.num_layers if args.offload_layers < 0 else min(args.offload_layers, cfg.num_layers)
    layers = range(cfg.num_layers - n, cfg.num_layers)  # the last n blocks
    if args.resident:
        loaded = load_dummy(cfg, args.weights_model, device=device, weight_format=fmt)
        runner = ModelRunner(loaded, max_seq_len=context + 16)
        fill(runner, context)
        seconds = time_decode(runner, args.steps)
        emit(**base, case="resident", tokens_per_second=1 / seconds, peak_gpu_gib=peak_gib(device))
        del runner, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    loaded = load_dummy(cfg, args.weights_model, device=device, weight_format=fmt)
    runner = ModelRunner(loaded, max_seq_len=context + 16, offload_layers=layers)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    fill(runner, context)
    stream = runner.weight_stream
    bound = bandwidth / stream.offloaded_bytes
    for overlap in (True, False):
        stream.overlap = overlap
        seconds = time_decode(runner, args.steps)
        emit(**base, case=f"offload {n} blocks " + ("overlap" if overlap else "serial"), tokens_per_second=1 / seconds,
             pcie_bound_tokens_per_second=bound, fraction_of_bound=(1 / seconds) / bound,
             host_to_device_bytes_per_token=stream.offloaded_bytes, embedding_on_host=stream.embedding_on_host,
             staging_gib=stream.staging_nbytes / 2**30, pinned=stream.allocator.pinned_all,
             peak_gpu_gib=peak_gib(device))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=["kv", "weights", "all"], default="all")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the same code path)")
    p.add_argument("--kv-model", default="qwen3-8b")
    p.add_argument("--weights-model", default="dense-27b")
    p.add_argument("--weights", default="tri", help="block matrices: bf16 | tri | bin | int4 | int8")
    p.add_argument("--head-weights", default="bf16")
    p.add_argument("--context", type=int, default=32768, help="kv section: positions in the cache")
    p.add_argument("--weights-context", type=int, default=1024, help="weights section: positions in the cache")
    p.add_argument("--offload-layers", type=int, default=-1, help="weights section: the last N blocks (-1: all)")
    p.add_argument("--verify-rows", default="4,8", help="kv section: rows of the verify passes timed")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-resident", dest="resident", action="store_false", help="skip the all-on-GPU runs")
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    args = p.parse_args()
    args.verify_rows = [int(r) for r in args.verify_rows.split(",") if r.strip()]
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.weights, args.head_weights, args.steps, args.bandwidth_mib = "bf16", "bf16", 2, 16
        args.context, args.weights_context, args.verify_rows = min(args.context, 256), 64, [4]
        args.kv_model = args.weights_model = "tiny"
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU: use --cpu-smoke")
        device = torch.device("cuda")
    bw = host_to_device_bandwidth(device, args.bandwidth_mib)
    emit(section="bandwidth", host_to_device_pinned_bytes_per_second=bw["pinned"],
         host_to_device_pageable_bytes_per_second=bw["pageable"], device=str(device))
    if args.section in ("kv", "all"):
        section_kv(args, device, bw["pinned"])
    if args.section in ("weights", "all"):
        section_weights(args, device, bw["pinned"])


if __name__ == "__main__":
    main()

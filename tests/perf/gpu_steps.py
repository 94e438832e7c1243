"""tests/perf/gpu_kernels.py's whole-model sections on generated weights: the graphed decode step at several
rows (steprows), where a prefill chunk spends its time (prefill), and the graphed decode step against the
eager one with its per-kernel profile (step)."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from tests.perf.gpu_common import RESULTS, check


def step_rows_timing(dev, models: tuple[str, ...] = ("qwen3-8b:tri:int4",),
                     rows_list: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)) -> None:
    """The graphed decode step of each dummy model (name:weights:head) at several rows: batched
    slots, and the verify widths (k + 1 rows) that speculative decoding pays per step."""
    import yaml

    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.kv_cache import KVCache
    from engine.weights.loader import load_dummy
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    root = Path(__file__).resolve().parents[2]
    for spec in models:
        name, weights, head = spec.split(":")
        cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs" / "models" / f"{name}.yaml").read_text()))
        loaded = load_dummy(cfg, name, dev, WeightFormat(weights, 128, head))
        cache = KVCache(cfg, 1024, max(rows_list), dtype=torch.bfloat16, device=dev)
        base = None
        for rows in rows_list:
            step = DecodeStepRunner(loaded.model, cache, rows, 4)
            args = ([1] * rows, [512] * rows, list(range(rows)))
            step.run(*args)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                step.graph.replay()
            torch.cuda.synchronize()
            t = (time.perf_counter() - t0) / 50
            base = base or t
            print(f"step {name} {weights}/{head} rows={rows:2}: {t * 1e6:7.1f} us ({t / base:.2f}x one row, "
                  f"{rows / t:.0f} tok/s aggregate)", flush=True)
            RESULTS.setdefault("step_rows", []).append({"model": name, "weights": weights, "head": head,
                                                        "rows": rows, "us": t * 1e6})
            if rows in (2, 3, 8) and spec == models[0] and name == "qwen3-8b":
                profile_replays(step.graph)
            del step
        del loaded, cache
        torch.cuda.empty_cache()


def profile_replays(graph, reps: int = 20) -> None:
    """GPU time per kernel name inside the graphed step (CUPTI sees kernels of graph replays)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / reps, e.count // reps) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"  kernels per step: {sum(r[2] for r in rows)}, summed kernel time {total:.0f} us", flush=True)
    for key, us, count in rows[:12]:
        print(f"  {us:8.1f} us  x{count:4d}  {key[:90]}", flush=True)
    RESULTS.setdefault("profile", []).append([{"kernel": k, "us": u, "count": c} for k, u, c in rows])


def section_prefill(dev, models: list[str]) -> None:
    """Where a 512-token prefill chunk spends its time, per kernel (the plain model path)."""
    import yaml

    from engine.runtime.kv_cache import CacheBatch, KVCache
    from engine.weights.loader import load_dummy
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from torch.profiler import ProfilerActivity, profile
    root = Path(__file__).resolve().parents[2]
    for spec in models:
        name, weights, head = spec.split(":")
        cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs" / "models" / f"{name}.yaml").read_text()))
        loaded = load_dummy(cfg, name, dev, WeightFormat(weights, 128, head))
        loaded.model.use_fused_prologue(True)  # as the runner does where the fused decode step runs
        cache = KVCache(cfg, 600, 1, dtype=torch.bfloat16, device=dev)
        ids = torch.randint(0, cfg.vocab_size, (1, 512), device=dev)

        def run():
            with torch.inference_mode():
                loaded.model(ids, CacheBatch.make([0], [0], 512, dev), cache, 512, 1)
        run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / 5
        print(f"prefill {name} {weights}/{head} 512 tokens: {t * 1e3:.1f} ms = {512 / t:.0f} tok/s", flush=True)
        from engine.runtime.cuda_graphs import PrefillGraphs  # the same chunk replayed from a CUDA graph (the runner's path)
        graphs, tokens = PrefillGraphs(loaded.model, cache, 512), ids[0].tolist()
        graphs.run(0, 0, tokens)  # capture
        graph_ms = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs.run(0, 0, tokens)
            torch.cuda.synchronize()
            graph_ms.append((time.perf_counter() - t0) * 1e3)
        tg = statistics.median(graph_ms) / 1e3
        print(f"  graphed: {tg * 1e3:.1f} ms = {512 / tg:.0f} tok/s ({t / tg:.2f}x eager; "
              f"min {min(graph_ms):.1f} max {max(graph_ms):.1f} ms)", flush=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run()
            torch.cuda.synchronize()
        host = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
        print(f"  host time by op (self): {sum(r[1] for r in host) / 1e3:.1f} ms", flush=True)
        for key, us, count in host[:14]:
            print(f"  host {us / 1e3:8.2f} ms  x{count:4d}  {key[:80]}", flush=True)
        rows = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0),
                      key=lambda r: -r[1])
        print(f"  summed kernel time {sum(r[1] for r in rows) / 1e3:.1f} ms", flush=True)
        for key, us, count in rows[:8]:
            print(f"  {us / 1e3:8.2f} ms  x{count:4d}  {key[:100]}", flush=True)
        RESULTS.setdefault("prefill", []).append({"model": name, "weights": weights, "ms": t * 1e3, "graphed_ms": tg * 1e3,
                                                  "kernels": [{"kernel": k, "us": u, "count": c} for k, u, c in rows]})
        del loaded, cache, graphs
        torch.cuda.empty_cache()


def section_step(dev, models: list[str]) -> None:
    import yaml

    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.kernels.attention_decode import default_num_splits
    from engine.runtime.kv_cache import KVCache
    from engine.weights.loader import load_dummy
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    root = Path(__file__).resolve().parents[2]
    for spec in models:  # name:weights:head
        name, weights, head = spec.split(":")
        cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs" / "models" / f"{name}.yaml").read_text()))
        loaded = load_dummy(cfg, name, dev, WeightFormat(weights, 128, head))
        for ctx, pdl in ((512, "1"), (512, "0"), (4096, "1")):
            os.environ["BONSAI_PDL"] = pdl  # programmatic dependent launch on / off (read at capture)
            cache = KVCache(cfg, ctx + 64, 1, dtype=torch.bfloat16, device=dev)
            step = DecodeStepRunner(loaded.model, cache, 1, default_num_splits(ctx + 64, cfg.num_kv_heads, head_dim=cfg.head_dim))
            logits = step.run([1], [ctx], [0]).clone()
            eager = DecodeStepRunner(loaded.model, cache, 1, step.num_splits, use_graph=False)
            os.environ["BONSAI_PDL"] = "0"
            want = eager.run([1], [ctx], [0]).clone()
            again = eager.run([1], [ctx], [0])
            noise = ((again - want).abs().max() / want.abs().max()).item()  # split-K atomics: sum order varies
            err = ((logits - want).abs().max() / want.abs().max()).item()
            check(f"step {name} {weights} ctx={ctx} pdl={pdl} graph vs eager", err < max(1e-3, 4 * noise),
                  f"max rel err {err:.2e} (eager vs eager {noise:.2e})")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            reps = 200
            for i in range(reps):
                step.graph.replay()
            torch.cuda.synchronize()
            t = (time.perf_counter() - t0) / reps
            if ctx == 512:
                profile_replays(step.graph)
            wbytes = sum(b.numel() * b.element_size() for n_, b in loaded.model.named_buffers() if n_.endswith(("words", "scales")))
            wbytes += sum(p.numel() * p.element_size() for n_, p in loaded.model.named_parameters()
                          if p.dim() == 2 and "embed" not in n_)
            kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * ctx
            row = {"model": name, "weights": weights, "head": head, "context": ctx, "pdl": pdl, "us_per_token": t * 1e6,
                   "tokens_per_second": 1 / t, "bytes_per_token": wbytes + kv, "gb_per_s": (wbytes + kv) / t / 1e9}
            RESULTS["step"].append(row)
            print(f"step {name} {weights}/{head} ctx={ctx} pdl={pdl}: {t * 1e6:.0f} us/token = {1 / t:.0f} tok/s, "
                  f"{(wbytes + kv) / 1e9:.2f} GB/token, {(wbytes + kv) / t / 1e9:.0f} GB/s", flush=True)
            del step, eager, cache
        del loaded
        torch.cuda.empty_cache()

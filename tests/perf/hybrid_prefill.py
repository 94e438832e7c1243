"""Where a hybrid's prefill chunk spends its time on a GPU (issue 18 item 7: pp512 ≥ 6,000 on the 27B shape), and the
Triton chunked gated delta rule (engine.kernels.deltanet_prefill) against the torch maths it replaces:

1. the delta rule alone at the model's head shapes, T = 512: torch chunked maths vs the Triton kernels (tf32 and
   ieee dots), the largest difference against the float64 recurrence, and each Triton kernel's time;
2. the runner's 512-token prefill of the whole model (generated weights) with each path: wall time (median of
   --reps, CUDA-synchronized) and the top kernels / host ops of one chunk under the profiler.

    python3 tests/perf/hybrid_prefill.py [--model qwen3.6-27b] [--weights tri] [--head int4] [--tokens 512]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.kernels import deltanet_prefill as dp  # noqa: E402
from engine.runtime import deltanet  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.formats import WeightFormat  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def top(prof, n: int = 14) -> None:
    rows = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0),
                  key=lambda r: -r[1])
    print(f"    kernels: {sum(r[2] for r in rows)}, summed kernel time {sum(r[1] for r in rows) / 1e3:.2f} ms")
    for key, us, count in rows[:n]:
        print(f"    {us / 1e3:8.3f} ms  x{count:5d}  {key[:96]}")
    host = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    print(f"    host (self) {sum(r[1] for r in host) / 1e3:.1f} ms; top:")
    for key, us, count in host[:8]:
        print(f"    host {us / 1e3:8.2f} ms  x{count:5d}  {key[:80]}")


def rule_alone(cfg: ModelConfig, t: int, reps: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    hc = cfg.hybrid
    hk, hv, dk, dv = hc.linear_num_key_heads, hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, t, hk, dk, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, t, hk, dk, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, t, hv, dv, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(1, t, hv, device="cuda", generator=gen) * 0.5
    beta = torch.rand(1, t, hv, device="cuda", generator=gen)
    s0 = torch.randn(1, hv, dk, dv, device="cuda", generator=gen) * 0.1
    ref, ref_s, _ = deltanet.recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(),
                                                        beta.double(), s0.double())
    ms = timed(lambda: deltanet.chunk_gated_delta_rule(q, k, v, g, beta, s0), reps) * 1e3
    out, _ = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    print(f"  torch chunked: {ms:.3f} ms a layer, max |out - fp64| {(out.double() - ref).abs().max().item():.2e}")
    for prec in ("tf32", "ieee"):
        run = lambda: dp.chunk_gated_delta_rule_triton(q, k, v, g, beta, s0.clone(), prec)  # noqa: E731
        ms = timed(run, reps) * 1e3
        out, s = run()
        print(f"  triton {prec}: {ms:.3f} ms a layer (incl. one state copy), max |out - fp64| "
              f"{(out.double() - ref).abs().max().item():.2e}, state {(s.double() - ref_s).abs().max().item():.2e}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:4]:
            if e.device_time_total > 0:
                print(f"    {e.device_time_total / 5 / 1e3:8.3f} ms  {e.key[:80]}")


def sweep(cfg: ModelConfig, t: int, reps: int) -> None:
    """The rule's launch constants (module constants of engine.kernels.deltanet_prefill, set here for the sweep)."""
    hc = cfg.hybrid
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, t, hc.linear_num_key_heads, hc.linear_key_head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn_like(q)
    v = torch.randn(1, t, hc.linear_num_value_heads, hc.linear_value_head_dim, device="cuda").bfloat16()
    g = -torch.rand(1, t, hc.linear_num_value_heads, device="cuda") * 0.5
    beta = torch.rand_like(g)
    s0 = torch.zeros(1, hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim, device="cuda")
    ref, _ = dp.chunk_gated_delta_rule_triton(q, k, v, g, beta, s0.clone())
    base = (dp.PREPARE_WARPS, dp.VALUE_BLOCK, dp.OUT_BLOCK)
    for warps, vb, ob in ((8, 32, 64), (4, 32, 64), (8, 16, 64), (8, 64, 64), (8, 32, 32), (8, 16, 32)):
        dp.PREPARE_WARPS, dp.VALUE_BLOCK, dp.OUT_BLOCK = warps, vb, ob
        try:
            ms = timed(lambda: dp.chunk_gated_delta_rule_triton(q, k, v, g, beta, s0.clone()), reps) * 1e3
            out, _ = dp.chunk_gated_delta_rule_triton(q, k, v, g, beta, s0.clone())
            print(f"  sweep prepare warps {warps}, state block {vb}, output block {ob}: {ms:.3f} ms, "
                  f"max |out - default| {(out - ref).abs().max().item():.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant over the shared memory is reported, not fatal
            print(f"  sweep {warps}/{vb}/{ob}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
    dp.PREPARE_WARPS, dp.VALUE_BLOCK, dp.OUT_BLOCK = base


def model_prefill(cfg: ModelConfig, name: str, fmt: WeightFormat, t: int, reps: int) -> None:
    """The runner's prefill of t tokens from position 0: eager with the torch maths, eager with the Triton
    kernels, then replayed from the prefill graph (the runner's default on a GPU)."""
    from torch.profiler import ProfilerActivity, profile
    loaded = load_dummy(cfg, name, "cuda", fmt)
    eager = ModelRunner(loaded, max_seq_len=max(1024, 2 * t), num_slots=1, prefill_chunk_size=t, prefill_graphs=False)
    graphed = ModelRunner(loaded, max_seq_len=max(1024, 2 * t), num_slots=1, prefill_chunk_size=t)
    assert graphed.prefill_graphs is not None, "the hybrid's prefill chunks are not graphed"
    tokens = [(i * 7919) % cfg.vocab_size for i in range(t)]
    usable = deltanet.kernels_usable
    logits = {}
    for label, runner, kernels in (("eager torch", eager, False), ("eager triton", eager, True),
                                   ("graphed triton", graphed, True)):
        deltanet.kernels_usable = usable if kernels else (lambda device: False)
        slot = runner.slot(0)
        try:
            def run():
                slot.reset()  # position 0: the state starts from zeros
                return runner.forward(slot, tokens)
            s = timed(run, reps)
            print(f"  model prefill {label}: {s * 1e3:.1f} ms = {t / s:.0f} tok/s", flush=True)
            logits[label] = run().float()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                run()
                torch.cuda.synchronize()
            top(prof)
        finally:
            deltanet.kernels_usable = usable
    assert not graphed.prefill_graphs.failed, "the hybrid's prefill capture failed"
    ref = logits["eager torch"]
    for label in ("eager triton", "graphed triton"):
        diff = (logits[label] - ref).abs().max().item()
        same = logits[label].argmax(-1).eq(ref.argmax(-1)).all().item()
        print(f"  last logits, {label} vs eager torch: max |diff| {diff:.3e} (scale {ref.abs().max().item():.1f}), "
              f"same argmax {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.6-27b")
    ap.add_argument("--weights", default="tri")
    ap.add_argument("--head", default="int4")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="rule,model")
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[2]
    cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs" / "models" / f"{a.model}.yaml").read_text()))
    print(f"{a.model} {a.weights}/{a.head}, {a.tokens} tokens", flush=True)
    if "rule" in a.parts:
        rule_alone(cfg, a.tokens, a.reps)
    if "sweep" in a.parts:
        sweep(cfg, a.tokens, max(a.reps, 10))
    if "model" in a.parts:
        model_prefill(cfg, a.model, WeightFormat(a.weights, 128, a.head), a.tokens, a.reps)


if __name__ == "__main__":
    main()

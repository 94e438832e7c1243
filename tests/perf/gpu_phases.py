"""Where a graphed decode step's time goes, phase by phase, measured in place (issue 19 item 4): the step is
captured again with one kind of kernel left out (its launches replaced by the outputs of an earlier real call)
or doubled (launched twice), and the replay time compared with the plain step's in the same run; the step as
is also at other attention split counts (--splits: the first is the one the phases run with), each with the
row's keys spread over the splits (the default) and with fixed ranges of the cache ("static"). Left out says
what the step would gain if that phase were free (the bound for fusing it away); doubled says what one more
copy costs where it sits (launch gaps and tails included, which kernel durations alone miss). Needs no
hardware counters. Results are timing-only: a step with a phase left out computes garbage.

    python3 tests/perf/gpu_phases.py [--models qwen3-8b:tri:int4,qwen3-1.7b:tri:int4] [--context 512]
        [--cache-len 8192] [--splits auto,32] [--reps 200] [--rounds 3] [--phases quantize,gemv]
        [--modes skip,double] [--json $OUT/phases.json]

Phases (engine.runtime.decode_step._Ops attributes): quantize (RMSNorm / SwiGLU → int8), gemv (the layers'
packed products), head (the output layer's product), rope_write (q/k norm + rope + KV write), attention
(split attention + combine, int8 out for the o projection), deltanet (a hybrid's gate projection, conv and
recurrent update). Not for CI.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PHASES = ("quantize", "gemv", "head", "rope_write", "attention")
# the _Ops attributes of each phase (attention: also the unquantized one, for o projections that are not packed;
# a hybrid's DeltaNet layers: the gate projection, the conv and the recurrent update; its gated attention's rope)
ATTRS = {"gemv": ("gemv",), "head": ("gemv",), "quantize": ("quantize",), "rope_write": ("rope_write", "gated_rope"),
         "attention": ("attention_int8", "attention"), "deltanet": ("gate_project", "conv_update", "recurrent_update")}


class Phase:
    """One _Ops attribute wrapped: "skip" returns what the call at the same index of an earlier real step
    returned (no launch), "double" launches it twice; `select` picks the calls it applies to."""

    def __init__(self, fn, mode: str, select):
        self.fn, self.mode, self.select = fn, mode, select
        self.cache: dict[int, object] = {}
        self.index = 0

    def __call__(self, *args, **kwargs):
        i, self.index = self.index, self.index + 1
        if not self.select(*args, **kwargs):
            return self.fn(*args, **kwargs)
        if self.mode == "double":
            self.fn(*args, **kwargs)
            return self.fn(*args, **kwargs)
        if i not in self.cache:  # the first (eager warm-up) step runs it for real
            self.cache[i] = self.fn(*args, **kwargs)
        out = kwargs.get("out")
        return out if out is not None else self.cache[i]


def _selector(phase: str, head_weight):
    """Which calls of the phase's _Ops attribute it takes: gemv the layers' products, head the output layer's
    (the call whose packed words are the head's)."""
    head = None if head_weight is None else head_weight.words.data_ptr()
    if phase in ("gemv", "head"):
        return lambda *args, **kwargs: (args[3].words.data_ptr() == head) == (phase == "head")
    return lambda *args, **kwargs: True


def timed_step(loaded, cache, phase: str | None, mode: str, context: int, reps: int, rounds: int,
               splits: int) -> list[float]:
    """µs per graph replay of the one-row step with `phase` left out / doubled (None: as the engine runs it)."""
    from engine.runtime.cuda_graphs import DecodeStepRunner
    step = DecodeStepRunner(loaded.model, cache, 1, splits, use_graph=False)
    if mode.endswith("static"):  # each split a fixed range of the cache (the kernel before session 24)
        from engine.kernels.attention_decode import split_length
        floor = split_length(cache.max_seq_len, splits, loaded.model.config.head_dim)
        for attr in ("attention", "attention_int8"):
            setattr(step.ops, attr, functools.partial(getattr(step.ops, attr), min_split_len=floor))
    head = getattr(loaded.model.lm_head, "packed", None)
    wrapped = []
    if phase is not None:
        for attr in ATTRS[phase]:
            w = Phase(getattr(step.ops, attr), mode, _selector(phase, head))
            setattr(step.ops, attr, w)
            wrapped.append(w)
    original = step._eager

    def eager():
        for w in wrapped:
            w.index = 0
        return original()

    step._eager = eager
    step.run([1], [context], [0])  # the real first call (fills a left-out phase's outputs)
    step._capture()
    step.run([1], [context], [0])
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            step.graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    del step
    return times


def main(argv: list[str] | None = None) -> int:
    import yaml

    from engine.kernels.attention_decode import default_num_splits
    from engine.runtime.hybrid_state import attach_states
    from engine.runtime.kv_cache import KVCache
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b:tri:int4,qwen3-1.7b:tri:int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--cache-len", type=int, help="the KV cache's length (default: context + 128)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--splits", default="auto", help="attention splits (auto: the engine's rule for the cache): "
                    "the phases run with the first")
    ap.add_argument("--modes", default="skip,double", help="skip (left out), double (launched twice), or both")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    root = Path(__file__).resolve().parents[2]
    results = []
    for spec in args.models.split(","):
        name, weights, head = spec.split(":")
        cfg = ModelConfig.from_hf_config(yaml.safe_load((root / "configs" / "models" / f"{name}.yaml").read_text()))
        loaded = load_dummy(cfg, name, dev, WeightFormat(weights, 128, head))
        cache = KVCache(cfg, args.cache_len or args.context + 128, 1, dtype=torch.bfloat16, device=dev)
        if cfg.hybrid is not None:  # the DeltaNet layers' states
            attach_states(cache, cfg)
        splits = [default_num_splits(cache.max_seq_len, cfg.num_kv_heads, head_dim=cfg.head_dim) if n == "auto"
                  else int(n) for n in args.splits.split(",")]
        runs = [(None, f"as is, {n} splits{kind}") for n in splits for kind in ("", " static")]
        for phase in filter(None, args.phases.split(",")):
            runs += [(phase, mode) for mode in args.modes.split(",")]
        runs.append((None, f"as is, {splits[0]} splits"))  # again at the end: the machine's drift over the run
        base = None
        for phase, mode in runs:
            n = int(mode.split()[2]) if mode.startswith("as is") else splits[0]
            with torch.inference_mode():
                t = timed_step(loaded, cache, phase, mode, args.context, args.reps, args.rounds, n)
            mean, spread = statistics.mean(t), (max(t) - min(t)) / 2
            base = base or mean
            label = f"step {mode}" if phase is None else f"{phase} {'left out' if mode == 'skip' else 'doubled'}"
            print(f"{spec} ctx {args.context}: {label:24s} {mean:8.1f} ± {spread:4.1f} us "
                  f"({mean - base:+7.1f} us, {1e6 / mean:6.1f} tok/s)", flush=True)
            results.append({"model": spec, "phase": phase, "mode": mode, "us": t})
        del loaded, cache
        torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

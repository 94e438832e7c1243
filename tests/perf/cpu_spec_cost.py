"""Speculative vs plain decoding on the CPU in CPU seconds of one thread: a ratio that the load of a
shared machine leaves alone (wall-clock suites swing 2-3x within one prompt there).

Usage: python tests/perf/cpu_spec_cost.py --target qwen2.5-coder-1.5b --spec draft:qwen2.5-coder-0.5b
           [--weight-dtype bfloat16] [--categories code-edit,summarization] [--suite coder] [--draft-tokens 4]
           [--prefill-rows N]  (A/B of the CPU int4 layers' GEMM path for prompt chunks)
Per prompt of the suite: plain greedy decoding, then speculative, each timed with time.process_time()
(torch on one thread, so CPU seconds are the work done); the outputs must be identical. Prints the
tokens per target pass and the speedup per prompt; with --float16-plain also plain decoding with the
float16 matrices (the CPU default) as the baseline to beat. Not part of CI.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timed(runner, tok, ids, max_tokens, drafter=None, num_draft_tokens=4, gate=False):
    from engine.decoding.engine import Engine
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    engine = Engine(runner, tok, drafters=None if drafter is None else [drafter], num_draft_tokens=num_draft_tokens,
                    spec_gate=gate)
    start = time.process_time()
    _, out, _, stats = generate_text(engine, Request(list(ids), max_tokens=max_tokens))
    return out, time.process_time() - start, stats


def main() -> None:
    from engine.sources import store
    from engine.bench.suites import load_suite
    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    from engine.speculative.config import SpeculativeConfig, build_drafter

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--spec", default="draft:qwen2.5-coder-0.5b")
    ap.add_argument("--weight-dtype", default="bfloat16",
                    choices=["float16", "bfloat16", "float32", "cpu-fast", "cpu-fast-bf16"],
                    help="cpu-fast: the CPU default of generate/chat/serve (a GGUF's 4-bit matrices as stored, the "
                    "int8 output layer: engine.runtime.cpu_int4 / narrow_head); cpu-fast-bf16: the other matrices (Q6_K) as bfloat16")
    ap.add_argument("--float16-plain", action="store_true", help="also time plain decoding with float16 matrices")
    ap.add_argument("--suite", default="coder")
    ap.add_argument("--categories", default="code-edit,summarization")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--draft-weights", default="auto", choices=["auto", "stored"],
                    help="a draft model's matrices: auto (all 4-bit codes), stored (as its file stores them)")
    ap.add_argument("--gate", action="store_true", help="with the spec gate, as a run's engine has it (adaptive)")
    ap.add_argument("--prefill-rows", type=int, default=None,
                    help="engine.runtime.cpu_int4.PREFILL_ROWS for both models (1000000: int4 kernel only, as before)")
    args = ap.parse_args()
    if args.prefill_rows is not None:
        from engine.runtime import cpu_int4
        cpu_int4.PREFILL_ROWS = args.prefill_rows
    torch.set_num_threads(1)
    path = store.resolve_model(args.target)
    fast = args.weight_dtype.startswith("cpu-fast")
    dtype = torch.bfloat16 if args.weight_dtype == "cpu-fast-bf16" else None if fast else getattr(torch, args.weight_dtype)
    target = load_model(path, "cpu", weight_dtype=dtype,
                        cpu_int4=fast, narrow_head="int8" if fast else None)
    plain16 = load_model(path, "cpu", weight_dtype=torch.float16) if args.float16_plain else None
    seq = 1024
    drafter = build_drafter(SpeculativeConfig.from_spec(args.spec, num_draft_tokens=args.draft_tokens,
                                                      draft_weights=args.draft_weights), target, seq)
    tok = target.tokenizer
    print(f"{args.target} ({args.weight_dtype}) with {args.spec}, k={args.draft_tokens}, 1 thread, CPU seconds",
          flush=True)
    for p in load_suite(args.suite, categories=args.categories.split(",")):
        ids = tok.encode(tok.apply_chat_template(p.messages))
        request = p.max_tokens
        plain, t_plain, _ = timed(ModelRunner(target, seq), tok, ids, request)
        got, t_spec, stats = timed(ModelRunner(target, seq), tok, ids, request, drafter=drafter,
                                   num_draft_tokens=args.draft_tokens, gate=args.gate)
        s = stats.speculative
        line = (f"{p.category:14} {len(plain):3} tokens  plain {t_plain:6.1f} s  spec {t_spec:6.1f} s  "
                f"speedup {t_plain / t_spec:.2f}x  tokens/pass {s.mean_accepted_length:.2f}  "
                f"accepted {s.accepted}/{s.drafted}  identical {got == plain}")
        if plain16 is not None:
            out16, t16, _ = timed(ModelRunner(plain16, seq), tok, ids, request)
            line += f"  float16 plain {t16:6.1f} s (spec {t16 / t_spec:.2f}x of it)"
        print(line, flush=True)


if __name__ == "__main__":
    main()

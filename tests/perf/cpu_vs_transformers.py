"""CPU decode speed of SmolLM2: bonsai vs transformers generate, same prompt, same run.

Usage: python tests/perf/cpu_vs_transformers.py [--tokens 64] [--reps 3] [--threads N]
Both run float32 over the same dequantized GGUF weights, greedy, EOS ignored; timing excludes
tokenization and model loading; prefill is timed apart from decode for both.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def bench_ours(path, n_tokens: int, reps: int) -> list[float]:
    from engine.decoding.engine import Engine
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_model

    loaded = load_model(path)
    engine = Engine(ModelRunner(loaded, max_seq_len=512), loaded.tokenizer)
    ids = loaded.tokenizer.encode(PROMPT)

    def request() -> Request:
        return Request(ids, max_tokens=n_tokens, ignore_eos=True, reuse_prefix=False)
    generate_text(engine, request())  # warm-up
    rates = []
    for _ in range(reps):
        _, out, _, stats = generate_text(engine, request())
        assert len(out) == n_tokens
        rates.append(stats.decode_tokens_per_second)
    return rates


def bench_transformers(path, n_tokens: int, reps: int) -> list[float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        assert out.shape[1] - ids.shape[1] == n
        return time.perf_counter() - t0

    run(4)  # warm-up
    rates = []
    for _ in range(reps):
        t_first = run(1)  # prefill + first token
        t_all = run(n_tokens)
        rates.append((n_tokens - 1) / (t_all - t_first))
    return rates


def main() -> None:
    from engine.sources import store

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = store.resolve_model(store.DEFAULT_MODEL, auto_pull=True)
    ours = bench_ours(path, args.tokens, args.reps)
    theirs = bench_transformers(path, args.tokens, args.reps)

    def fmt(xs: list[float]) -> str:
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return f"{statistics.mean(xs):6.2f} ± {sd:4.2f} tok/s  samples {[round(x, 2) for x in xs]}"

    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, {args.tokens} tokens, {args.reps} reps")
    print(f"bonsai        decode {fmt(ours)}")
    print(f"transformers  decode {fmt(theirs)}")
    print(f"ratio (bonsai / transformers): {statistics.mean(ours) / statistics.mean(theirs):.2f}x")


if __name__ == "__main__":
    main()

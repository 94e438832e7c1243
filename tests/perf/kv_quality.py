"""Quality of the quantized KV cache types on SmolLM2-135M-Instruct: same-top % and KL of each KV type
against the model's own float KV cache (same weights, same runner, only the cache differs), teacher-forced.

Usage: python tests/perf/kv_quality.py [--types int8,k8v4,int4] [--suite short] [--answer-tokens 48]
       [--long-context 2048] [--long-windows 3] [--device cpu] [--threads 2] [--model GGUF] [--json OUT]

Two sets, scored with engine.quantization.evaluate (window_logprobs + Tally: one reference pass per window):
- chat: every prompt of the bench suite (engine/data/suites/short.json) in the chat template, followed
  by the greedy answer of the float-KV model (--answer-tokens at most); each conversation is one window.
- long: the pydoc topics text (`bonsai eval`'s default) in --long-windows windows of --long-context
  tokens (SmolLM2 holds 8192), every position scored, so most see more than a thousand cached keys.
The reference KV is the model's dtype: float32 on a CPU (weights read as float32), bfloat16 on a GPU.
The model path: --model, else $BONSAI_SMOLLM2_GGUF, else the pulled smollm2-135m.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.quantization.evaluate import Tally, default_eval_text, window_logprobs, windows_of  # noqa: E402


def model_path(arg: str | None) -> Path:
    from engine.sources import store
    if arg:
        return Path(arg)
    if os.environ.get("BONSAI_SMOLLM2_GGUF"):
        return Path(os.environ["BONSAI_SMOLLM2_GGUF"])
    return store.find_pulled(store.DEFAULT_MODEL) or store.pull(store.DEFAULT_MODEL)


def chat_sequences(runner, tokenizer, suite: str, answer_tokens: int) -> list[list[int]]:
    """Each suite prompt in the chat template + the float-KV model's greedy answer, as token ids."""
    from engine.bench.suites import load_suite
    from engine.decoding.engine import Engine
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    engine = Engine(runner, tokenizer)
    sequences = []
    for prompt in load_suite(suite):
        ids = tokenizer.encode(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True))
        request = Request(ids, max_tokens=min(answer_tokens, prompt.max_tokens or answer_tokens), reuse_prefix=False)
        answer = generate_text(engine, request)[1]
        sequences.append(ids + answer)
    return sequences


def score(runners: dict, reference, windows: list[list[int]]) -> dict[str, dict]:
    tallies = {name: Tally() for name in runners}
    for window in windows:
        targets = torch.tensor(window[1:], device=reference.device)  # [L-1]
        ref_logp = window_logprobs(reference, window)  # [L-1, V]
        for name, runner in runners.items():
            tallies[name].add(window_logprobs(runner, window), ref_logp, targets)
    return {name: t.result().as_dict() for name, t in tallies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="int8,k8v4,int4")
    parser.add_argument("--suite", default="short")
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--long-context", type=int, default=2048)
    parser.add_argument("--long-windows", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    path = model_path(args.model)
    loaded = load_model(path, device=args.device, weight_dtype=torch.float32 if args.device == "cpu" else None)
    tokenizer = loaded.require_tokenizer()
    context = max(args.long_context, 1024)
    reference = ModelRunner(loaded, max_seq_len=context, kv_type="bf16")
    runners = {t: ModelRunner(loaded, max_seq_len=context, kv_type=t) for t in args.types.split(",")}
    report = {"model": path.name, "device": args.device, "reference_kv": str(loaded.dtype).replace("torch.", ""),
              "sets": {}}
    started = time.perf_counter()
    chats = chat_sequences(reference, tokenizer, args.suite, args.answer_tokens)
    report["sets"]["chat"] = {"sequences": len(chats), "tokens": sum(map(len, chats)),
                              "results": score(runners, reference, chats)}
    ids = tokenizer.encode(default_eval_text())[:args.long_context * args.long_windows]
    long_windows = windows_of(ids, args.long_context)
    report["sets"]["long"] = {"windows": len(long_windows), "context": args.long_context,
                              "results": score(runners, reference, long_windows)}
    report["seconds"] = time.perf_counter() - started
    for name, data in report["sets"].items():
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in data.items() if k != "results"))
        print(f"  {'kv':6} {'same-top':>9} {'mean KL':>10} {'p99 KL':>9} {'ppl':>8} {'ref ppl':>8} {'tokens':>7}")
        for kv, r in data["results"].items():
            print(f"  {kv:6} {100 * r['same_top']:8.2f}% {r['kl_mean']:10.5f} {r['kl_p99']:9.5f} "
                  f"{r['perplexity']:8.3f} {r['reference_perplexity']:8.3f} {r['tokens']:7d}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

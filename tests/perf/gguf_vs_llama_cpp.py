"""Perplexity of exported GGUFs by llama.cpp's own `llama-perplexity` (CPU) against bonsai's on the same file.

Usage: python tests/perf/gguf_vs_llama_cpp.py FILE.gguf [FILE.gguf ...] [--llama-bin DIR] [--chunks 8]
       [--ctx 512] [--threads 2] [--json OUT]

llama.cpp is the one vendored in llama-cpp-python 0.3.36, built once for the CPU outside the repository
(issue 23's tests/perf/llama_cpp_build.py builds llama-bench and llama-perplexity into
/work/build/llama.cpp/build/bin; --llama-bin points elsewhere). The text is Python's pydoc topics
(`bonsai eval`'s default) written to a file. Both sides score exactly what llama-perplexity scores: the
text tokenized once (BOS first if the model adds one), cut into chunks of --ctx tokens (the first token of
each replaced by BOS if the model adds one), and in each chunk the tokens after its first half
(positions ctx/2 + 1 .. ctx - 1), each predicted by the model from the chunk's tokens before it.
bonsai's side reads the same GGUF (float32 matrices). The target of issue 25: within 1%.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT_BIN = Path("/work/build/llama.cpp/build/bin")


def llama_cpp_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int,
                         no_repack: bool = False) -> float:
    proc = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                           "--chunks", str(chunks), "-t", str(threads)] + (["-nr"] if no_repack else []),
                          capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.eE+-]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise SystemExit(f"llama-perplexity failed on {gguf} (exit {proc.returncode}): {' | '.join(tail)}")
    return float(found.group(1))


@torch.inference_mode()
def bonsai_perplexity(gguf: Path, text: str, ctx: int, chunks: int) -> float:
    from engine.quantization.evaluate import window_logprobs
    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    loaded = load_model(gguf, weight_dtype=torch.float32)
    tok = loaded.tokenizer
    bos = getattr(tok, "bos_id", None) if getattr(tok, "add_bos", False) else None
    ids = ([bos] if bos is not None else []) + tok.encode(text)
    runner = ModelRunner(loaded, max_seq_len=ctx)
    first, nll, count = ctx // 2, 0.0, 0
    for i in range(min(chunks, len(ids) // ctx)):
        window = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            window[0] = bos
        logp = window_logprobs(runner, window)  # [ctx - 1, V]: row j predicts window[j + 1]
        targets = torch.tensor(window[first + 1:])
        nll -= float(logp[first:].gather(-1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path, nargs="+")
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_BIN)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp's -nr: its CPU weight repacking off (in "
                    "0.3.36 it crashes on Q1_0 matrices: exit -11 on our 1-bit Qwen2.5-Coder-0.5B export)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    binary = args.llama_bin / "llama-perplexity"
    if not binary.is_file():
        raise SystemExit(f"{binary} not found: build it first (issue 23's tests/perf/llama_cpp_build.py) or pass "
                         "--llama-bin")
    from engine.quantization.evaluate import default_eval_text
    text = default_eval_text()
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    for gguf in args.gguf:
        t0 = time.perf_counter()
        theirs = llama_cpp_perplexity(binary, gguf, Path(f.name), args.ctx, args.chunks, args.threads,
                                      args.no_repack)
        t1 = time.perf_counter()
        ours = bonsai_perplexity(gguf, text, args.ctx, args.chunks)
        t2 = time.perf_counter()
        rows.append({"gguf": str(gguf), "llama_cpp_ppl": theirs, "bonsai_ppl": ours,
                     "relative_difference": theirs / ours - 1, "llama_cpp_s": t1 - t0, "bonsai_s": t2 - t1})
        print(f"{gguf.name:40s} llama.cpp {theirs:12.4f}  bonsai {ours:12.4f}  ({100 * (theirs / ours - 1):+.2f}%)",
              flush=True)
        if args.json:
            args.json.write_text(json.dumps({"chunks": args.chunks, "ctx": args.ctx, "rows": rows}, indent=1))
    Path(f.name).unlink()


if __name__ == "__main__":
    main()

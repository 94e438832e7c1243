"""Unit-test pass rate of a coder model on 30 small code-completion problems (tests/perf/code_tasks.json).

Usage: python tests/perf/code_tasks.py MODEL [MODEL ...] [--max-tokens 160] [--threads 2] [--json OUT] [--cpu-fast]
(--cpu-fast: as generate/chat/serve run a model on the CPU by default: a GGUF's 4-bit matrices as stored and the
float16 output layer, engine.runtime.cpu_int4 / narrow_head; without it, float16 matrices and a float32 head)

Each problem is a Python function signature with its docstring (written for this project; none is from a
public benchmark). The model continues it greedily (bonsai's generation core, plain completion, no chat
template) until a line that starts at column 0, EOS or --max-tokens; the prompt plus the completion is
then run with the problem's asserts in a fresh `python -I` process (no network is reachable from the
machine; 10 s timeout). A problem passes when that process exits 0. Each MODEL (a path or a pulled name:
the source GGUF and its quantized checkpoints) gets its pass rate and the list of problems it passed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
TASKS = Path(__file__).with_name("code_tasks.json")


def body_of(completion: str) -> str:
    """The completion up to the first non-empty line that is not indented (the function's end)."""
    lines = completion.split("\n")
    out = []
    for line in lines:
        if line.strip() and not line.startswith((" ", "\t")):
            break
        out.append(line)
    return "\n".join(out)


def passes(program: str) -> bool:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
    try:
        return subprocess.run([sys.executable, "-I", f.name], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        Path(f.name).unlink()


def run_model(model: str, tasks: list[dict], max_tokens: int, fast: bool = False) -> dict:
    from engine.sources import store
    from engine.decoding.engine import Engine
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    from engine.weights.loader import load_model
    from engine.runtime.runner import ModelRunner
    loaded = load_model(store.resolve_model(model), cpu_int4=fast, narrow_head="int8" if fast else None)
    runner = ModelRunner(loaded, max_seq_len=512)
    tok = loaded.require_tokenizer()
    passed, start = [], time.perf_counter()
    for task in tasks:
        request = Request(tok.encode(task["prompt"]), max_tokens=max_tokens,
                          stop=("\ndef ", "\nclass ", "\nif __name__", "\nprint("))
        text, _, _, _ = generate_text(Engine(runner, tok), request)
        program = task["prompt"] + body_of(text) + "\n\n" + task["test"] + "\n"
        if passes(program):
            passed.append(task["name"])
    return {"model": model, "cpu_fast": fast, "int4_layers": loaded.int4_layers, "passed": len(passed), "total": len(tasks), "pass_rate": len(passed) / len(tasks),
            "passed_names": passed, "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu-fast", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks = json.loads(TASKS.read_text())
    rows = []
    for model in args.models:
        row = run_model(model, tasks, args.max_tokens, args.cpu_fast)
        rows.append(row)
        print(f"{model}: {row['passed']}/{row['total']} passed ({row['seconds']:.0f} s)", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

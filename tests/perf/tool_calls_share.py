"""The share of valid tool calls (parsed, the right tool, arguments valid against its schema) on our
own tool-use prompts, with tool_choice auto and required, against a real `bonsai serve` on the CPU.

    .venv/bin/python tests/perf/tool_calls_share.py --model qwen2.5-coder-1.5b --limit 10
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from engine.sources import store  # noqa: E402
from tests.serve_process import start_server  # noqa: E402
from tests.tool_prompts import PROMPTS, TOOLS  # noqa: E402

TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def valid(call: dict, want: str) -> str | None:
    """None when the call is valid, else why not."""
    fn = call["function"]
    if fn["name"] != want:
        return f"called {fn['name']}, wanted {want}"
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return "arguments are not JSON"
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == want)
    if not isinstance(args, dict):
        return "arguments are not an object"
    missing = [k for k in schema["required"] if k not in args]
    if missing:
        return f"missing {missing}"
    for k, v in args.items():
        prop = schema["properties"].get(k)
        if prop is None:
            return f"unknown argument {k}"
        if not isinstance(v, TYPES[prop["type"]]) or isinstance(v, bool) and prop["type"] != "boolean":
            return f"{k} is not {prop['type']}"
        if "enum" in prop and v not in prop["enum"]:
            return f"{k}={v!r} not in {prop['enum']}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--limit", type=int, default=len(PROMPTS))
    ap.add_argument("--start", type=int, default=0, help="skip the first START prompts")
    ap.add_argument("--modes", default="auto,required")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="runtime.device of the server (cpu, cuda)")
    args = ap.parse_args()
    path = store.find_pulled(args.model)
    assert path is not None, f"bonsai pull {args.model}"
    tmp = Path(tempfile.mkdtemp())
    (tmp / "serve.yaml").write_text(f"model:\n  path: {path}\n  max_context: 2048\nruntime:\n  device: {args.device}\n"
                                    "  max_batch_size: 1\nserver:\n  default_max_tokens: 128\n")
    server = start_server(tmp / "serve.yaml", tmp / "server.log", threads=args.threads)
    try:
        for mode in args.modes.split(","):
            ok, notes = 0, []
            for prompt, want in PROMPTS[args.start:args.start + args.limit]:
                r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
                    "messages": [{"role": "user", "content": prompt}], "tools": TOOLS, "tool_choice": mode,
                    "temperature": 0, "max_tokens": 128})
                if r.status_code != 200:
                    notes.append(f"{r.status_code}: {r.json()['error']['message']}")
                    if r.status_code == 400:
                        break
                    continue
                message = r.json()["choices"][0]["message"]
                calls = message.get("tool_calls") or []
                why = "no call: " + repr((message.get("content") or "")[:80]) if not calls else valid(calls[0], want)
                ok += why is None
                print(f"  {mode}: {prompt[:50]!r}: {why or 'valid'}", flush=True)
                if why:
                    notes.append(f"{prompt[:40]!r}: {why}")
            n = len(PROMPTS[args.start:args.start + args.limit])
            print(f"tool_choice {mode}: {ok}/{n} valid calls ({args.model}, {args.device})")
            for note in notes:
                print("   ", note)
    finally:
        server.stop()


if __name__ == "__main__":
    main()

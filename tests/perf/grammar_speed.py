"""The cost of grammar-constrained decoding (issue 21): the token mask per step at the Qwen2.5-Coder
vocabulary (151,936 ids): the matcher's fill and the mask's apply, 1 and 8 rows; then decode tokens/s
of smollm2 with and without a json_schema grammar.
    .venv/bin/python tests/perf/grammar_speed.py [--device cuda] [--qwen GGUF] [--smollm2 GGUF]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.decoding.grammar import GrammarSpec
from engine.decoding.grammar_match import GrammarMatch, mask_rows
from engine.sources.gguf_file import GGUFFile
from engine.sources.tokenizer import Tokenizer

MODELS = Path.home() / ".cache/bonsai/models"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["maths", "engines", "poetry"]}'


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mask_cost(gguf: Path, device: torch.device, reps: int = 30) -> dict:
    tok = Tokenizer.from_gguf_metadata(GGUFFile(gguf).metadata)
    vocab = 151_936
    begin = time.perf_counter()
    GrammarMatch(GrammarSpec.json_schema(SCHEMA), tok, vocab)
    out = {"vocab": vocab, "first_compile_ms": 1e3 * (time.perf_counter() - begin)}
    ids = tok.encode(TEXT)
    for rows in (1, 8):
        matches = [GrammarMatch(GrammarSpec.json_schema(SCHEMA), tok, vocab) for _ in range(rows)]
        logits = torch.randn(rows, vocab, device=device)  # [B, V]
        times = []
        for t in ids[:reps]:
            sync(device)
            begin = time.perf_counter()
            masked = mask_rows(logits, matches, list(range(rows)))
            sync(device)
            times.append(time.perf_counter() - begin)
            assert torch.isfinite(masked[:, t]).all()
            for m in matches:
                assert m.accept(t)
        times.sort()
        out[f"mask_ms_{rows}_rows"] = 1e3 * times[len(times) // 2]  # fill + apply + copy, median over the text
    return out


def tokens_per_second(gguf: Path, device: str, tokens: int = 64) -> dict:
    from engine.decoding.engine import Engine
    from engine.decoding.generate import generate_text
    from engine.decoding.sequence import Request
    from engine.runtime.runner import ModelRunner
    from engine.weights.loader import load_model
    loaded = load_model(gguf, device)
    runner = ModelRunner(loaded, 512, num_slots=1)
    prompt = loaded.tokenizer.encode("Describe a person as JSON with name, age and tags:\n")
    engine = Engine(runner, loaded.tokenizer)

    def run_engine(runner, tokenizer, prompt, **kw):  # noqa: ANN001
        return generate_text(engine, Request(list(prompt), **kw))

    out = {}
    for name, grammar in (("free", None), ("json_schema", GrammarSpec.json_schema(SCHEMA))):
        run_engine(runner, loaded.tokenizer, prompt, max_tokens=8, grammar=grammar)  # warm
        text, ids, reason, stats = run_engine(runner, loaded.tokenizer, prompt, max_tokens=tokens, grammar=grammar,
                                              ignore_eos=grammar is None)
        out[name] = {"tokens": len(ids), "tokens_per_s": stats.decode_tokens_per_second, "finish": reason}
        if grammar is not None:
            out[name]["text"] = text[:200]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--qwen", type=Path, default=MODELS / "qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf")
    ap.add_argument("--smollm2", type=Path, default=MODELS / "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"device": args.device, "mask": mask_cost(args.qwen, torch.device(args.device))}
    if not args.skip_speed:
        result["decode"] = tokens_per_second(args.smollm2, args.device)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Why does a greedy run with speculation differ from plain greedy decoding? (issue 17: summarization-01 on the
seed recipe's GPU run). Two levels, one run:

1. Engine: each suite prompt answered plain twice (A, B) and with the config's speculation once (S), greedy;
   the first position where B or S leaves A (plain decode's own run-to-run determinism against speculation's).
2. Runner, on the first prompt's text + A's tokens: the 1-row decode step twice (max |logit difference|: the
   kernels' run-to-run determinism), then the same tokens verified in chunks of 2..8 rows (max |difference| to the
   1-row logits, argmax flips and the 1-row top-1/top-2 margin at each flip).

    python tests/perf/spec_greedy_diag.py --config serve.yaml [--set model.ternary_layout=2bit ...] \
        [--categories code-edit,summarization] [--limit 2] [--widths 2,5,8] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bonsai_cli.run_options import open_cli_run, run_config  # noqa: E402
from engine.bench.suite_runner import run_prompt  # noqa: E402
from engine.bench.suites import load_suite  # noqa: E402
from engine.decoding.sampling import SamplingParams  # noqa: E402


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter's length when one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def value(text: str):
    """A --set value: an int, a float, true/false, else the string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def margin(logits: torch.Tensor) -> float:
    """top-1 minus top-2 of one row of logits."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def one_row_logits(runner, prompt_ids: list[int], out_ids: list[int], vocab: int) -> torch.Tensor:
    """Logits [n, V] predicting out_ids[1:], each from one 1-row decode step, after the prompt's prefill."""
    slot = runner.slot(0)
    slot.reset()
    runner.forward(slot, prompt_ids)
    rows = [runner.forward(slot, [t]).float()[-1, :vocab] for t in out_ids[:-1]]  # each [V]
    slot.reset()
    return torch.stack(rows)  # [n - 1, V]


def verified_logits(runner, prompt_ids: list[int], out_ids: list[int], width: int, vocab: int) -> torch.Tensor:
    """The same predictions, from verify passes of `width` rows (every row accepted)."""
    slot = runner.slot(0)
    slot.reset()
    runner.forward(slot, prompt_ids)
    rows = []
    tokens = out_ids[:-1]
    for j in range(0, len(tokens), width):
        chunk = tokens[j:j + width]
        if len(chunk) == 1:
            rows.append(runner.forward(slot, chunk).float()[-1:, :vocab])
        else:
            logits, _ = runner.verify(slot, chunk)  # [w, V]
            rows.append(logits.float()[:, :vocab])
    slot.reset()
    return torch.cat(rows)  # [n - 1, V]


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    diff = (ref - other).abs()  # [n, V]
    flips = (ref.argmax(-1) != other.argmax(-1)).nonzero().flatten().tolist()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "rows_differing": int((diff.amax(-1) > 0).sum()), "rows": int(ref.shape[0]),
            "argmax_flips": [{"row": r, "one_row_margin": round(margin(ref[r]), 6),
                              "other_margin": round(margin(other[r]), 6)} for r in flips[:10]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--set", action="append", default=[], help="section.key=value over the config")
    ap.add_argument("--suite", default="full")
    ap.add_argument("--categories", default="code-edit,summarization")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--widths", default="2,5,8")
    ap.add_argument("--runner-tokens", type=int, default=48, help="output tokens the runner-level check uses")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    flags = {k: value(v) for k, v in (item.split("=", 1) for item in args.set)}
    cfg = run_config(None, flags, args.config)
    run = open_cli_run(cfg, quiet=True, from_flags=False)
    tok = run.require_tokenizer()
    prompts = load_suite(args.suite, args.categories.split(","), args.limit)
    greedy = SamplingParams()
    report: dict = {"config": str(args.config), "set": args.set, "prompts": []}
    plain = run.engine(speculative=False)
    answers = {p.id: [run_prompt(plain, p, greedy).output_token_ids for _ in range(2)] for p in prompts}
    spec = run.engine()
    spoken: dict[str, list[int]] = {}
    for p in prompts:
        a, b = answers[p.id]
        s = spoken[p.id] = run_prompt(spec, p, greedy).output_token_ids
        row = {"id": p.id, "tokens": len(a), "plain_vs_plain": first_divergence(a, b),
               "spec_vs_plain": first_divergence(a, s)}
        report["prompts"].append(row)
        print(json.dumps(row), flush=True)
    # the runner-level check on the first prompt whose speculative answer left plain decoding's (else the first)
    split = [r for r in report["prompts"] if r["spec_vs_plain"] is not None]
    p = next(q for q in prompts if q.id == split[0]["id"]) if split else prompts[0]
    at = split[0]["spec_vs_plain"] if split else None
    a = answers[p.id][0]
    n = max(args.runner_tokens, (at or 0) + 2)
    out = a[:n]
    ids = tok.encode(tok.apply_chat_template(p.messages, add_generation_prompt=True))
    runner = run.runner
    vocab = min(run.loaded.config.vocab_size, tok.vocab_size)  # the engine's argmax range
    ref = one_row_logits(runner, ids, out, vocab)
    again = one_row_logits(runner, ids, out, vocab)
    picked = ref.argmax(-1).tolist()
    level = {"prompt": p.id, "one_row_argmax_differs_from_plain_at": [i for i, (x, y) in
                                                                       enumerate(zip(picked, out[1:])) if x != y][:10],
             "one_row_vs_one_row": compare(ref, again)}
    margins = [margin(r) for r in ref]  # [n - 1]
    level["one_row_margin_min"] = round(min(margins), 6)
    level["one_row_margin_median"] = round(sorted(margins)[len(margins) // 2], 6)
    if at is not None and at >= 1:  # the answer's token `at` is predicted by row at - 1
        top = torch.topk(ref[at - 1], 2)
        s = spoken[p.id]
        level["at_divergence"] = {"token": at, "plain": a[at] if at < len(a) else None,
                                  "speculative": s[at] if at < len(s) else None,
                                  "top2_ids": top.indices.tolist(),
                                  "top2_margin": round(float(top.values[0] - top.values[1]), 6)}
    for w in (int(x) for x in args.widths.split(",")):
        level[f"verify_{w}_vs_one_row"] = compare(ref, verified_logits(runner, ids, out, w, vocab))
    report["runner"] = level
    print(json.dumps(level, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""A Qwen3.5 / 3.6 checkpoint's own MTP head as the drafter (`--spec mtp`, issue 18 item 5; or --spec ngram), on one GPU with
generated weights of a real shape (the head's weights are generated too, so acceptance means nothing here):

1. greedy output with `--spec mtp` (k drafts, fixed) against plain greedy, per suite prompt (must be identical);
2. what drafting costs: one 1-row target decode step, a verify pass of 2 and 4 rows (rolled back), and the head's
   propose() of k = 1..4 tokens after a verify pass has given it rows (median of --reps, CUDA-synchronized), as
   a share of the target step (--limit 0: this part alone).

    python tests/perf/gpu_mtp.py --model configs/models/qwen3.6-27b.yaml --tokenizer .tok/smollm2.gguf \
        [--weights tri] [--head-weights int4] [--device cuda] [--limit 1] [--json OUT]
On the CPU (slowly) with a small shape: --model configs/models/qwen3.5-0.8b.yaml --device cpu --weights bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bonsai_cli.run_options import open_cli_run, run_config  # noqa: E402
from engine.bench.suite_runner import run_prompt  # noqa: E402
from engine.bench.suites import load_suite  # noqa: E402
from engine.decoding.sampling import SamplingParams  # noqa: E402
from engine.speculative.config import SpeculativeConfig, build_drafter  # noqa: E402
from engine.speculative.drafter import Draft, Feedback  # noqa: E402


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, device) -> float:
    """Median seconds of fn() over reps (after one warm-up call)."""
    fn()
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--weights", default="tri")
    ap.add_argument("--head-weights", default="int4")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--spec", default="mtp", help="the speculation compared with plain decoding (e.g. ngram)")
    ap.add_argument("--adaptive", action="store_true", help="the planner sizes drafts (default: k fixed)")
    ap.add_argument("--suite", default="short")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    flags = {"--load-format": "dummy", "--device": args.device, "--weights": args.weights,
             "--head-weights": args.head_weights, "model.tokenizer": args.tokenizer, "--max-seq-len": 4096,
             "--spec": args.spec, "--draft-tokens": args.draft_tokens, "speculative.adaptive": args.adaptive}
    run = open_cli_run(run_config(args.model, flags), quiet=True)
    report: dict = {"model": args.model, "weights": args.weights, "head": args.head_weights, "spec": args.spec,
                    "prompts": []}
    greedy = SamplingParams()
    plain, spec = run.engine(speculative=False), run.engine()
    for p in load_suite(args.suite, None, args.limit) if args.limit else []:
        p = type(p)(**{**vars(p), "max_tokens": min(p.max_tokens, args.max_tokens)})
        a = run_prompt(plain, p, greedy)
        s = run_prompt(spec, p, greedy)
        row = {"id": p.id, "tokens": len(a.output_token_ids), "identical": a.output_token_ids == s.output_token_ids,
               "drafted": s.drafted, "accepted": s.accepted, "plain_tok_s": round(a.decode_tokens_per_second, 1),
               "spec_tok_s": round(s.decode_tokens_per_second, 1)}
        report["prompts"].append(row)
        print(json.dumps(row), flush=True)
    if args.spec != "mtp":
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return
    # the cost of drafting against one target step
    runner, loaded, device = run.runner, run.loaded, run.loaded.device
    drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=4, adaptive=False), loaded, 4096)
    slot = runner.slot(0)
    slot.reset()
    prompt = [(i * 7919 + 13) % 1000 + 10 for i in range(256)]
    runner.forward(slot, prompt)
    drafter.begin(prompt)
    verify = [11, 12, 13, 14]  # a verify pass of 4 rows, all "accepted": the head gets 4 rows
    logits, hidden = runner.verify(slot, verify, drafter.hidden_layers)
    drafter.observe(Feedback(Draft(verify[1:], None, "test"), accepted=3, bonus=15, hidden=hidden))
    context = prompt + verify + [15]
    drafter.propose(context, 1)  # commits the rows
    step = timed(lambda: runner.forward(slot, [16]), args.reps, device)  # the slot grows by reps + 1 tokens
    cost = {"target_step_ms": round(1e3 * step, 3)}
    for width in (2, 4):  # a verify pass of `width` rows of the slot (then rolled back: every row rejected)
        t = timed(lambda: (runner.verify(slot, [17] * width, drafter.hidden_layers), slot.rewind(width)),
                  args.reps, device)
        cost[f"verify_{width}_ms"] = round(1e3 * t, 3)
        cost[f"verify_{width}_share_of_step"] = round(t / step, 3)
    for k in (1, 2, 3, 4):
        t = timed(lambda: drafter.propose(context, k), args.reps, device)
        cost[f"propose_{k}_ms"] = round(1e3 * t, 3)
        cost[f"propose_{k}_share_of_step"] = round(t / step, 3)
    report["cost"] = cost
    report["head_bytes"] = sum(p.numel() * p.element_size() for p in drafter.module.parameters())
    print(json.dumps(cost), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

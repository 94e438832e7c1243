"""Quality and time of rtn / gptq / gsq on SmolLM2-135M-Instruct: perplexity, KL and same-top vs the float model.

Usage: python tests/perf/quant_methods.py [--rows int4:rtn,int4:gptq,...] [--samples 64] [--seq-len 256]
       [--gsq-steps 200] [--gsq-tokens 16384] [--gsq-batch 0] [--gsq-lr 1e-3] [--act-order]
       [--rotate] [--no-online-hadamard]
       [--device cpu] [--threads 1] [--model GGUF] [--json OUT]

Calibration text: docstrings of Python standard-library modules (inspect.getdoc of each module and of
its public classes, functions and methods), never pydoc_data, whose topics are the evaluation text
(the default of `bonsai eval`). Scoring: engine.quantization.evaluate.evaluate on the first 4,096 tokens of the
pydoc topics in 512-token windows, the reference being the same GGUF loaded in float32.
Rows (recipe:method): int4 = int4 g64 everywhere (the tied embedding / output included, by rtn);
tq = ternary g64 for gate/up/down with q/k/v/o at int4 g64, embedding int4 g64 (rtn);
tri = ternary g64 everywhere (embedding int4 g64); tqd = tq with down_proj at int4 too;
bq = 1-bit g64 for gate/up/down with q/k/v/o at int4 g64;
emb = only the embedding at int4 g64 (what rtn of the tied embedding alone costs).
--rotate: the model rotated first as `bonsai quantize --rotate` does (engine.quantization.rotation.load_rotated): the
tied embedding is untied, the output layer is then a separate int4 tensor (gptq / gsq: by GPTQ).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

@dataclass(frozen=True)
class Spec:
    quant_type: str
    group_size: int


def plan_for(recipe: str):
    def plan(name: str) -> Spec | None:
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":
            return Spec("int4", 64)
        if recipe == "emb":
            return None
        if recipe == "int4" or ("self_attn" in name and recipe != "tri") or (recipe == "tqd" and "down_proj" in name):
            return Spec("int4", 64)
        return Spec("bin" if recipe == "bq" else "tri", 64)
    return plan


def quantize_rtn(loaded, plan) -> None:
    from engine.quantization.calibration import block_targets
    from quant.grids import dequantize
    from quant.gptq import rtn
    model = loaded.model
    with torch.no_grad():
        weights = [("model.embed_tokens.weight", model.embed.weight, 0, model.embed.weight.shape[0], plan(
            "model.embed_tokens.weight"))]
        if model.lm_head is not None:
            weights.append(("lm_head.weight", model.lm_head.weight, 0, model.lm_head.weight.shape[0],
                            plan("lm_head.weight")))
        for i, block in enumerate(model.layers):
            for targets in block_targets(block, i, loaded.config, plan).values():
                weights += [(t.name, t.param, t.start, t.rows, t.spec) for t in targets]
        for _, param, start, rows, spec in weights:
            if spec is None:
                continue
            codes, scales = rtn(param[start:start + rows].float(), spec.quant_type, spec.group_size)
            param[start:start + rows] = dequantize(codes, scales, spec.group_size).to(param.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="int4:rtn,int4:gptq,tq:rtn,tq:gptq,tq:gsq")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--gsq-steps", type=int, default=200)
    ap.add_argument("--gsq-tokens", type=int, default=16384)
    ap.add_argument("--gsq-batch", type=int, default=0, help="0: all rows through the Gram matrix")
    ap.add_argument("--gsq-lr", type=float, default=1e-3)
    ap.add_argument("--gsq-scale-lr", type=float, default=1e-3)
    ap.add_argument("--model", type=Path, help="the GGUF (default: the pulled SmolLM2)")
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--scale-refits", type=int, default=0, help="rounds of least-squares scales + GPTQ codes")
    ap.add_argument("--tune-steps", type=int, default=0, help="end-to-end scale tuning steps after gptq / gsq")
    ap.add_argument("--tune-lr", default="5e-4", help="comma-separated: one tuned row each, from the same start")
    ap.add_argument("--tune-batch", type=int, default=4, help="sequences per tuning step")
    ap.add_argument("--rotate", action="store_true")
    ap.add_argument("--no-online-hadamard", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.sources import store
    from engine.quantization.calibration import CalibrationOptions, calibration_sequences, quantize_with_calibration
    from engine.quantization.evaluate import default_calibration_text, default_eval_text, evaluate
    from engine.weights.loader import load_model
    from engine.quantization.rotation import load_rotated
    from engine.runtime.runner import ModelRunner
    from engine.quantization.scale_tuning import ScaleTuningOptions, tune_scales
    from quant.gsq import GSQOptions

    path = args.model or store.find_pulled(store.DEFAULT_MODEL)
    reference = ModelRunner(load_model(path, weight_dtype=torch.float32), max_seq_len=512)
    tok = reference.loaded.tokenizer
    eval_ids = tok.encode(default_eval_text())[:4096]
    calib_ids = tok.encode(default_calibration_text())
    sequences = calibration_sequences(calib_ids, args.samples, args.seq_len)
    print(f"calibration: {len(calib_ids)} tokens of stdlib docstrings, {len(sequences)} x {args.seq_len} used; "
          f"eval: {len(eval_ids)} tokens of pydoc topics", file=sys.stderr)
    options = CalibrationOptions(samples=args.samples, seq_len=args.seq_len, act_order=args.act_order,
                                 scale_refits=args.scale_refits,
                                 device=args.device, gsq_tokens=args.gsq_tokens,
                                 gsq=GSQOptions(steps=args.gsq_steps, batch_size=args.gsq_batch, lr=args.gsq_lr,
                                                scale_lr=args.gsq_scale_lr))
    results = []

    def score(loaded, label: str, recipe: str, method: str, wall: float, cpu: float, tuning=None) -> None:
        loaded.model.to("cpu")
        r = evaluate(ModelRunner(loaded, max_seq_len=512), reference, eval_ids, 512)
        results.append({"recipe": recipe, "method": method, "rotate": args.rotate, "samples": len(sequences),
                        "online_hadamard": args.rotate and not args.no_online_hadamard, "ppl": r.perplexity,
                        "ref_ppl": r.reference_perplexity, "kl_mean": r.kl_mean, "kl_p99": r.kl_p99,
                        "same_top": r.same_top, "tokens": r.tokens, "wall_s": wall, "cpu_s": cpu,
                        "device": args.device, "scale_tuning": tuning})
        print(f"{label:24s} ppl {r.perplexity:10.3f} (ref {r.reference_perplexity:.3f})  KL {r.kl_mean:.4f} "
              f"p99 {r.kl_p99:.3f}  same-top {100 * r.same_top:.1f}%  {wall:.1f} s wall, {cpu:.0f} s cpu"
              + (f"  (held-out KL {tuning['kl_before']:.4f} -> {tuning['kl_after']:.4f})" if tuning else ""),
              flush=True)
        if args.json:  # after every row: a run stopped by a time limit keeps what it measured
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=1))

    def synced_clock() -> tuple[float, float]:
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter(), time.process_time()

    for row in args.rows.split(","):
        recipe, method = row.split(":")
        loaded = (load_rotated(path, online=not args.no_online_hadamard) if args.rotate
                  else load_model(path, weight_dtype=torch.float32))
        plan = plan_for(recipe)
        wall, cpu = synced_clock()
        quantized = {}
        if method == "rtn":
            quantize_rtn(loaded, plan)
        else:
            quantized = {name: (codes, scales, spec) for name, codes, scales, spec in
                         quantize_with_calibration(loaded, sequences, plan, method, options)}
        done, done_cpu = synced_clock()
        score(loaded, row, recipe, method, done - wall, done_cpu - cpu)
        if not (args.tune_steps and quantized):
            continue
        start = {n: t.clone() for n, t in loaded.model.state_dict().items()}  # the calibrated model, on the CPU
        teacher = load_model(path, weight_dtype=torch.float32, device=args.device).model
        for lr in (float(x) for x in args.tune_lr.split(",")):
            loaded.model.load_state_dict(start)
            wall, cpu = synced_clock()
            _, report = tune_scales(loaded.model.to(args.device), teacher, sequences, quantized,
                                    ScaleTuningOptions(steps=args.tune_steps, lr=lr, batch_sequences=args.tune_batch),
                                    torch.device(args.device), lambda m: print(m, file=sys.stderr, flush=True))
            done, done_cpu = synced_clock()
            score(loaded, f"{row}+tune lr={lr:g}", recipe, f"{method}+tune", done - wall, done_cpu - cpu,
                  {**vars(report), "lr": lr})
        del teacher

if __name__ == "__main__":
    main()

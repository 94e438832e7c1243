"""Time of `bonsai quantize`'s per-layer work at a model's full shape, with generated weights: one decoder
layer quantized by GPTQ (+ scale refits) stage by stage on calibration activations (engine.quantization.calibration's
stages, as engine.quantization.layerwise runs them), plus one slice of the output layer; the predicted total for the
model is layers × the layer time + the output layer's slices.

Usage: python tests/perf/gptq_layer_time.py [--config configs/models/qwen3-8b.yaml ...] [--device cuda]
       [--tokens 8192] [--seq-len 256] [--recipe tq] [--layers 2] [--threads 2] [--json OUT]
       [--asymmetric 0.25] [--block-tune-steps 50]   (bonsai quantize's defaults: the float pass kept next to the
       quantized one, each linear fitted partly to it, then the block's scales tuned; 0 / 0: plain GPTQ)
Recipes: tq = ternary g128 with q/k/v/o at int4 g128 (the seed's); int4 = int4 g128 everywhere.
Runs on the CPU too (a small --config for a check). Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, nargs="+", default=[Path("configs/models/qwen3-8b.yaml"),
                                                                 Path("configs/models/dense-27b.yaml")])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens (the default 32 x 256)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--recipe", default="tq", choices=("tq", "int4"))
    ap.add_argument("--layers", type=int, default=2, help="layers timed (the first warms up)")
    ap.add_argument("--refits", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--asymmetric", type=float, default=0.0, help="share of the float model's target (quantize: 0.25)")
    ap.add_argument("--block-tune-steps", type=int, default=0, help="block tuning steps a layer (quantize: 50)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import yaml

    from engine.quantization.block_pass import float_stream
    from engine.quantization.block_tuning import BlockTuningOptions, Quantized, tune_block
    from engine.quantization.calibration import CalibrationOptions, block_targets, quantize_block
    from engine.runtime.model import Block, Transformer, rotary_inverse_frequencies
    from engine.sources.model_config import ModelConfig
    from quant.formats import QuantSpec
    from quant.gptq import gptq_with_refits
    dev = torch.device(args.device)
    rows = []
    for path in args.config:
        cfg = ModelConfig.from_hf_config(yaml.safe_load(path.read_text()))
        attn = lambda n: any(p in n for p in ("q_proj", "k_proj", "v_proj", "o_proj"))  # noqa: E731
        plan = (lambda n: QuantSpec("int4" if args.recipe == "int4" or attn(n) else "tri", 128))
        options = CalibrationOptions(samples=args.tokens // args.seq_len, seq_len=args.seq_len, scale_refits=args.refits,
                                     asymmetric=args.asymmetric, device=args.device)
        tuning = BlockTuningOptions(steps=args.block_tune_steps)
        with torch.device("meta"):
            model = Transformer(cfg)
        model.inv_freq = rotary_inverse_frequencies(cfg).to(dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        times = []
        for i in range(args.layers):
            block = Block(cfg, 0).to(dev)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
                sequences = max(1, args.tokens // args.seq_len)
                hidden = [torch.randn(min(8, sequences - b), args.seq_len, cfg.hidden_size, device=dev, generator=gen)
                          for b in range(0, sequences, 8)]
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                targets = block_targets(block, 0, cfg, plan)
                by_name = {t.name: t for group in targets.values() for t in group}
                floats = float_stream(block, hidden, model) if args.asymmetric or tuning.steps else None
                outputs = floats.outputs if floats is not None else None  # the float block's: tuning's targets
                stages = quantize_block(block, hidden, targets, None, "gptq", options, model, lambda m: None,
                                        floats if args.asymmetric else None)
                del floats
                done = []
                try:
                    while True:
                        name, codes, scales, _ = next(stages)
                        done.append(Quantized(by_name[name], codes, scales))
                except StopIteration as end:
                    quantized = end.value
                split = time.perf_counter() - start
                if tuning.steps:
                    tune_block(block, model, hidden, outputs, quantized, done, tuning)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            print(f"{path.name}: layer {i}: {times[-1]:.1f} s (gptq {split:.1f} s)", file=sys.stderr, flush=True)
            del block, hidden
        slice_rows = max(1, (256 << 20) // (4 * cfg.hidden_size))
        w = torch.randn(slice_rows, cfg.hidden_size, device=dev, generator=gen) * 0.02
        x = torch.randn(args.tokens, cfg.hidden_size, device=dev, generator=gen)
        hessian = x.T @ x
        start = time.perf_counter()
        gptq_with_refits(w, hessian, "int4", 128, refits=args.refits)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        head = (time.perf_counter() - start) * cfg.vocab_size / slice_rows
        layer = min(times[1:] or times)
        total = layer * cfg.num_layers + head
        rows.append({"config": str(path), "device": args.device, "tokens": args.tokens, "recipe": args.recipe,
                     "asymmetric": args.asymmetric, "block_tune_steps": tuning.steps,
                     "layer_s": layer, "layers": cfg.num_layers, "output_layer_s": head, "predicted_total_s": total,
                     "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None})
        print(f"{path.name}: {layer:.1f} s a layer x {cfg.num_layers} + output layer {head:.0f} s = "
              f"{total / 60:.1f} min predicted ({args.device}, {args.tokens} calibration tokens)", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

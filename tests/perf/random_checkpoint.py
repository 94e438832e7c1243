"""Peak memory of `bonsai quantize` on a model of a real shape with random bf16 weights, written to disk first.

Usage: python tests/perf/random_checkpoint.py [--config configs/models/qwen3-8b.yaml] [--layers N] --dir DIR
       [--method gptq] [--threads 2] [--keep] [-- extra quantize options]

Writes (in a child process) a Hugging Face directory (config.json of --config with N layers, one safetensors shard per layer,
random bf16 weights of std 0.02, unit norms, the Qwen2.5 tokenizer taken from a GGUF of the same
151,936-token vocabulary, --tokenizer) under --dir, then quantizes it in this process with the default
recipe of `bonsai quantize` (ternary + q/k/v/o int4, group 128, 64 x 256 calibration tokens, asymmetric calibration
0.25, 50 block-tuning steps a layer) and prints VmHWM / VmRSS after every layer: a peak set by the
largest layer stays flat with depth. The directory is deleted afterwards unless --keep. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def memory() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def write_random(config_path: Path, layers: int, out: Path, tokenizer_gguf: Path) -> Path:
    import yaml
    from safetensors.torch import save_file

    from engine.sources.gguf_file import GGUFFile
    from engine.sources.model_config import ModelConfig
    from engine.sources.tokenizer import Tokenizer
    hf = yaml.safe_load(config_path.read_text())
    hf = {"model_type": "qwen2" if "Qwen2ForCausalLM" in hf.get("architectures", ()) else "qwen3", **hf,
          "num_hidden_layers": layers, "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_hf_config(hf)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    for name, text in Tokenizer.from_gguf_metadata(GGUFFile(tokenizer_gguf).metadata).hf_files().items():
        (out / name).write_text(text)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
    h, v = cfg.hidden_size, cfg.vocab_size
    weight_map = {}
    shards = [("model-embed.safetensors", {"model.embed_tokens.weight": rand(v, h), "model.norm.weight":
                                           torch.ones(h, dtype=torch.bfloat16)})]
    if not cfg.tie_word_embeddings:
        shards.append(("model-head.safetensors", {"lm_head.weight": rand(v, h)}))
    for file, tensors in shards:
        save_file(tensors, str(out / file))
        weight_map.update({n: file for n in tensors})
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        for part, (rows, cols) in cfg.linear_shapes().items():
            section = "self_attn." if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp."
            tensors[p + section + part + ".weight"] = rand(rows, cols)
        if cfg.attention_bias:  # qwen2: q/k/v biases
            for part in ("q_proj", "k_proj", "v_proj"):
                tensors[p + f"self_attn.{part}.bias"] = rand(cfg.linear_shapes()[part][0])
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                tensors[p + f"self_attn.{n}.weight"] = torch.ones(cfg.head_dim, dtype=torch.bfloat16)
        file = f"model-layer-{i:03d}.safetensors"
        save_file(tensors, str(out / file))
        weight_map.update({n: file for n in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=Path("configs/models/qwen3-8b.yaml"))
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=Path("/work/models/qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--calib-samples", type=int, default=64, help="as `bonsai quantize` (its default)")
    ap.add_argument("--block-tune-steps", type=int, default=50, help="as `bonsai quantize` (its default for gptq)")
    ap.add_argument("--asymmetric", type=float, default=None, help="as `bonsai quantize` (default: its ASYMMETRIC)")
    ap.add_argument("--write-only", action="store_true", help="(internal) write the model and exit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.quantization.quantize import ASYMMETRIC, QuantizeOptions, quantize
    from quant.formats import QuantSpec
    from quant.recipe import Recipe, Rule
    src = args.dir / "model"
    if args.write_only:
        write_random(args.config, args.layers, src, args.tokenizer)
        return
    t0 = time.perf_counter()  # written by a child process: this one's peak memory is the quantizer's alone
    subprocess.run([sys.executable, __file__, "--write-only", "--config", str(args.config), "--layers", str(args.layers),
                    "--dir", str(args.dir), "--tokenizer", str(args.tokenizer)], check=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"wrote {size / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s; peak so far {memory()}", flush=True)
    recipe = Recipe(QuantSpec("tri", 128), rules=(Rule("q_proj|k_proj|v_proj|o_proj", QuantSpec("int4", 128)),))
    log = []

    def progress(message: str, done: int, total: int) -> None:
        if message.startswith("layer") or message in ("output layer", "written"):
            log.append({"step": message, "seconds": time.perf_counter() - t1, **memory()})
            print(f"{message:14s} {log[-1]['seconds']:7.0f} s  VmHWM {log[-1]['VmHWM'] / 2**30:.2f} GiB  "
                  f"VmRSS {log[-1]['VmRSS'] / 2**30:.2f} GiB", flush=True)
    t1 = time.perf_counter()
    try:
        report = quantize(src, args.dir / "out", QuantizeOptions(recipe, method=args.method, rotate=True,
                                                                online_hadamard=True, evaluate=not args.no_eval,
                                                                force=True, calib_samples=args.calib_samples,
                                                                block_tune_steps=args.block_tune_steps
                                                                if args.method != "rtn" else 0,
                                                                asymmetric=(ASYMMETRIC if args.asymmetric is None
                                                                            else args.asymmetric)
                                                                if args.method != "rtn" else 0.0),
                          progress=progress, announce=lambda p: print("predicted", {k: f"{v / 2**30:.2f} GiB"
                                                                                     for k, v in p.items()}))
        result = {"on_disk_bytes": size, "layers": args.layers, "config": str(args.config), "log": log,
                  "report": report.as_dict()}
        print(f"peak RSS {report.peak_rss_bytes / 2**30:.2f} GiB (predicted {report.predicted_peak_bytes / 2**30:.2f}),"
              f" {report.seconds:.0f} s, {report.cpu_seconds:.0f} CPU s")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
            print(f"deleted {args.dir}")


if __name__ == "__main__":
    main()

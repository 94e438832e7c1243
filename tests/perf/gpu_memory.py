"""The memory plan against the CUDA allocator on whole dummy models: one JSON line per case.

    python tests/perf/gpu_memory.py                 # Qwen3-8B and the 27B-class model, bin and tri, 4K context,
                                                    # then the 27B under max_gpu_memory 6GB
    python tests/perf/gpu_memory.py --only dense-27b  # one architecture (each case takes a minute or two)
    python tests/perf/gpu_memory.py --cpu-smoke     # a tiny config on the CPU (no allocator statistics)
    python tests/perf/gpu_memory.py --case configs/models/dense-27b.yaml bin cuda:0 6GB --kv-type int8
                                                    # one case (the issue's: 27B 1-bit, 4K context, under 6 GB)
    python tests/perf/gpu_memory.py --case configs/models/dense-27b.yaml bin cuda:0 6GB --context 32768 --kv-offload

Each case runs in its own process (the allocator's peaks and its memory fraction are per process):
plan (engine.memory.plan) → load (dummy weights) → runner (KV cache, CUDA-graph capture) →
prefill of --prompt random tokens (several 512-token chunks: the masked attention of later chunks) → a
--decode-token greedy decode (prompt + decode fill the context: the last prefill chunk attends over
almost all of it, the plan's worst case). Under a limit the plan may put the embedding table in host memory and shrink the
prefill chunk (its "chosen" choices, used for the run). Printed per stage: torch.cuda.max_memory_allocated /
max_memory_reserved (peaks since the previous stage), and the plan's total and categories. A plan
over the limit prints its one-line refusal instead ("refused"); under a limit, the case then runs
again at the largest context the refusal says would fit (the limit enforced on a real run).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PCIE_BYTES_PER_SECOND = 55e9  # pinned host → H200, measured (docs/perf.md, field notes §8)
TINY = ("architectures: [Qwen3ForCausalLM]\nvocab_size: 4096\nhidden_size: 256\nintermediate_size: 512\n"
        "num_hidden_layers: 2\nnum_attention_heads: 4\nnum_key_value_heads: 2\nhead_dim: 64\n")


def run_case(arch: str, weights: str, head: str, device: str, ctx: int, prompt: int, decode: int,
             limit: str | None, kv_type: str = "bf16", kv_offload: bool = False) -> dict:
    import torch

    from bonsai_cli.run_options import dummy_architecture, run_config
    from engine.errors import BonsaiError
    from engine.memory.budget import CLI_KEYS, check_budget
    from engine.memory.limit import limit_device_memory
    from engine.run.plan import plan_run
    from engine.weights.loader import load_dummy
    from engine.memory.limit import usage, within_limit
    from engine.weights.formats import WeightFormat
    from engine.runtime.runner import ModelRunner

    case = {"arch": Path(arch).stem, "weights": weights, "head_weights": head, "device": device, "context": ctx,
            "max_gpu_memory": limit, "kv_type": kv_type, "kv_offload": kv_offload}
    try:
        cfg = run_config(arch, {"--device": device, "--max-seq-len": ctx, "--max-gpu-memory": limit,
                                "--load-format": "dummy", "--weights": weights, "--head-weights": head,
                                "--kv-type": kv_type, "--kv-offload": kv_offload})
        budget = plan_run(cfg, dummy_architecture(arch)[0])
        check_budget(budget.plan, budget.limit, budget.weights, budget.settings, CLI_KEYS, "--max-gpu-memory",
                     budget.drafter)
        if budget.limit is not None:
            limit_device_memory(budget.limit, device)
    except BonsaiError as e:
        return {**case, "refused": str(e)}
    case.update(plan_bytes=budget.plan.total, plan=budget.plan.categories(), stages={},
                chosen={c.key: c.value for c in budget.choices})
    cuda = device.startswith("cuda")

    def stage(name: str) -> None:
        if cuda:
            torch.cuda.synchronize()
        used = usage(device)
        case["stages"][name] = {"peak_allocated": used["peak_allocated"], "peak_reserved": used["peak_reserved"],
                                "allocated": used["allocated"]}
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    config, path = dummy_architecture(arch)
    try:
        with within_limit(budget.limit, "loading"):
            loaded = load_dummy(config, path.stem, device=device,
                                weight_format=WeightFormat(weights, 128, head_type=head),
                                embedding_on_host=budget.settings.embedding_on_host)
        stage("load")
        with within_limit(budget.limit, "capturing"):
            runner = ModelRunner(loaded, max_seq_len=ctx, kv_type=kv_type, kv_offload=kv_offload,
                                 prefill_chunk_size=budget.settings.prefill_chunk_size)
        case["cuda_graph"] = getattr(runner.decoder, "graph", None) is not None
        stage("runner_and_graph")
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (prompt,), generator=g).tolist()
        slot = runner.slot(0)
        start = time.perf_counter()
        with within_limit(budget.limit, "prefill"):
            logits = runner.prefill(slot, tokens)
        if cuda:
            torch.cuda.synchronize()
        case["prefill_seconds"] = time.perf_counter() - start
        stage("prefill")
        start = time.perf_counter()
        with within_limit(budget.limit, "decode"):
            for _ in range(decode):
                logits = runner.forward(slot, [int(logits.argmax())])[-1]
        if cuda:
            torch.cuda.synchronize()
        case["decode_tokens_per_second"] = decode / (time.perf_counter() - start)
        if runner.cache.streamed:  # KV offload: the rows that cross PCIe per token, and the bound at 55 GB/s
            per_token = runner.cache.transfer_bytes(prompt + decode // 2)
            case["kv_host_to_device_bytes_per_token"] = per_token
            case["pcie_bound_tokens_per_second"] = PCIE_BYTES_PER_SECOND / per_token
            case["share_of_pcie_bound"] = case["decode_tokens_per_second"] / case["pcie_bound_tokens_per_second"]
        stage("decode")
    except BonsaiError as e:
        case["error"] = str(e)
    peaks = [s["peak_allocated"] for s in case["stages"].values()]
    case["peak_allocated"] = max(peaks, default=0)
    case["peak_reserved"] = max((s["peak_reserved"] for s in case["stages"].values()), default=0)
    case["plan_minus_peak"] = case["plan_bytes"] - case["peak_allocated"] if cuda else None
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny config on the CPU, to check the script runs")
    ap.add_argument("--head-weights", default="int4", help="the output layer's format (a 27B needs it packed in 6 GB)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=0, help="prefill tokens (default: the context less the decode, "
                    "so the last chunk attends over almost all of it: the prefill's worst case)")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--only", default="", help="comma list of architectures to run (qwen3-8b, dense-27b); "
                    "each case takes a minute or two, all of them may pass a 10-minute limit")
    ap.add_argument("--kv-type", default="bf16")
    ap.add_argument("--kv-offload", action="store_true", help="the KV cache in host memory (streamed per layer)")
    ap.add_argument("--case", nargs=4, metavar=("ARCH", "WEIGHTS", "DEVICE", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        arch, weights, device, limit = args.case
        prompt = args.prompt or max(1, args.context - args.decode - 8)
        print(json.dumps(run_case(arch, weights, args.head_weights, device, args.context, prompt, args.decode,
                                  None if limit == "-" else limit, args.kv_type, args.kv_offload)), flush=True)
        return
    if args.cpu_smoke:
        tmp = Path(tempfile.mkdtemp()) / "tiny.yaml"
        tmp.write_text(TINY)
        cases = [(str(tmp), w, "cpu", lim) for w in ("bin", "tri") for lim in ("-", "8.3MB")]
        extra = ["--context", "256", "--prompt", "80", "--decode", "4"]
    else:
        models = ROOT / "configs" / "models"
        cases = [(str(models / f"{m}.yaml"), w, "cuda:0", "-")
                 for m in ("qwen3-8b", "dense-27b") for w in ("bin", "tri")]
        cases += [(str(models / "dense-27b.yaml"), w, "cuda:0", "6GB") for w in ("bin", "tri")]
        if args.only:
            cases = [c for c in cases if Path(c[0]).stem in args.only.split(",")]
        prompt = args.prompt or args.context - args.decode - 8
        extra = ["--context", str(args.context), "--prompt", str(prompt), "--decode", str(args.decode)]
    for case in cases:
        result = _run(case, args.head_weights, extra)
        fit = re.search(r"--max-seq-len <= (\d+)", result.get("refused", ""))
        if fit and case[3] != "-":  # refused under the limit: run it at the largest context the plan accepts
            ctx = int(fit.group(1))
            decode = min(args.decode, ctx // 4)
            _run(case, args.head_weights, ["--context", str(ctx), "--prompt", str(ctx - decode - 8),
                                           "--decode", str(decode)])


def _run(case, head_weights: str, extra: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--case", *case, "--head-weights", head_weights, *extra],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        result = {"case": case, "failed": proc.stderr.strip().splitlines()[-3:]}
    else:
        result = json.loads(lines[-1])
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# One H200 run for the graphed prefill (issue 4, pp512): kernel checks, the GPU test of the graphed
# chunks, the 512-token chunk eager vs replayed (gpu_kernels.py prefill section, with its per-kernel
# profile), then `bonsai bench` pp512/tg128 with prefill graphs (default) and without them (a memory
# cap turns them off: --max-gpu-memory 120GB), side by side. Results under $OUT.
#   OUT=out bash tests/perf/gpu_prefill.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
B="python3 -m bonsai_cli"
echo "== kernel checks"
timeout 240 python3 tests/perf/gpu_kernels.py --sections check --json "$OUT/check.json" 2>&1 | tail -4
echo "== GPU tests: graphed prefill, CUDA paths"
timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -4
echo "== 512-token chunk: eager vs graphed, per-kernel profile"
timeout 200 python3 tests/perf/gpu_kernels.py --sections prefill --models qwen3-8b:tri:int4,qwen3-8b:bin:int4 \
    --json "$OUT/prefill.json" 2>&1 | grep -v '^  host' | head -40
for w in tri bin; do
    for mode in graphs eager; do
        cap=""; [ "$mode" = eager ] && cap="--max-gpu-memory 120GB"
        echo "== bench 8B $w, prefill $mode"
        timeout 150 $B bench configs/models/qwen3-8b.yaml --load-format dummy --device cuda --weights $w \
            --head-weights int4 -p 512 -n 128 -r 5 --no-pg $cap --json "$OUT/bench-8b-$w-$mode.json" 2>&1 | tail -5
    done
done

#!/usr/bin/env bash
# One H200 run for the graphed prefill (issue 4, pp512): kernel checks, the GPU test of the graphed
# chunks, the 512-token chunk eager vs replayed (gpu_kernels.py prefill section, with its per-kernel
# profile). Prefill graphs are off by default (ModelRunner(prefill_graphs=True) turns them on) until
# this has run on a GPU. Results under $OUT.
#   OUT=out bash tests/perf/gpu_prefill.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "== kernel checks"
timeout 240 python3 tests/perf/gpu_kernels.py --sections check --json "$OUT/check.json" 2>&1 | tail -4
echo "== GPU tests: graphed prefill, CUDA paths"
timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -4
echo "== 512-token chunk: eager vs graphed, per-kernel profile"
timeout 200 python3 tests/perf/gpu_kernels.py --sections prefill --models qwen3-8b:tri:int4,qwen3-8b:bin:int4 \
    --json "$OUT/prefill.json" 2>&1 | grep -v '^  host' | head -40

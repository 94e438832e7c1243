#!/usr/bin/env bash
# One H200 run for issue 8 (memory): GPU-marked tests of the new paths, the plan vs the allocator and
# the 27B-class model under max_gpu_memory 6GB, KV offload at 32K vs the PCIe bound, weight offload,
# decode attention on quantized KV caches. Results under $OUT.
#   OUT=out bash tests/perf/gpu_issue8.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
B="python3 -m bonsai_cli"
echo "== GPU tests of the merged paths (offload, quantized KV, batched speculation, kernels)"
timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_offload.py tests/test_kv_quant_kernels.py \
    tests/test_kv_quant_decode.py tests/test_kv_cache_quant.py tests/test_packed_kernels.py 2>&1 | tail -6
echo "== memory plan vs allocator: 27B-class under max_gpu_memory 6GB (bin, tri), 4K context"
for w in bin tri; do
    timeout 90 python3 tests/perf/gpu_memory.py --case configs/models/dense-27b.yaml $w cuda:0 6GB 2>&1 | grep '^{' | tee -a "$OUT/memory.jsonl" | cut -c1-600
done
echo "== 27B-class 1-bit decode under --max-gpu-memory 6GB (bench)"
timeout 100 $B bench configs/models/dense-27b.yaml --load-format dummy --device cuda --weights bin --head-weights int4 \
    -p 128 -n 128 -r 3 --max-seq-len 4096 --max-gpu-memory 6GB --no-pg --json "$OUT/bench-27b-bin-6gb.json" 2>&1 | tail -8
echo "== KV offload, Qwen3-8B shape, 32K context"
timeout 110 python3 tests/perf/gpu_offload.py --section kv --steps 5 2>&1 | grep '^{' | tee "$OUT/offload-kv.jsonl" | cut -c1-400
echo "== weight offload, 27B-class"
timeout 70 python3 tests/perf/gpu_offload.py --section weights --steps 5 2>&1 | grep '^{' | tee "$OUT/offload-w.jsonl" | cut -c1-400
echo "== decode attention on quantized KV caches"
timeout 60 python3 tests/perf/attention_kernels_gpu.py --reps 100 2>&1 | tail -30

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
    tests/test_kv_quant_decode.py tests/test_kv_cache_quant.py tests/test_packed_kernels.py tests/test_host_embedding.py tests/test_load_peak.py \
    2>&1 | tail -6
echo "== 27B-class 1-bit, int4 head, 4K context under max_gpu_memory 6GB: plan vs allocator per stage (the plan puts"
echo "   the embedding table in host memory; decode stays CUDA-graphed), int8 and bf16 KV"
COLUMNS=160 $B info configs/models/dense-27b.yaml --plan configs/serve-27b-6gb.yaml 2>&1 | tail -6
for kv in int8 bf16; do
    timeout 150 python3 tests/perf/gpu_memory.py --case configs/models/dense-27b.yaml bin cuda:0 6GB --kv-type $kv \
        2>&1 | grep '^{' | tee -a "$OUT/memory.jsonl" | cut -c1-900
done
echo "== the same through bonsai bench (-p 512 -n 128): tok/s and the allocator's peak"
for kv in int8 bf16; do
    timeout 150 $B bench configs/models/dense-27b.yaml --load-format dummy --device cuda --weights bin --head-weights int4 \
        -p 512 -n 128 -r 3 --max-seq-len 4096 --kv-type $kv --max-gpu-memory 6GB --no-pg \
        --json "$OUT/bench-27b-bin-6gb-$kv.json" 2>&1 | tail -8
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); m=r['memory']; print('kv', sys.argv[2], 'peak allocated', \
(m['peak_allocated_bytes'] or 0)/1e9, 'GB, peak reserved', (m['peak_reserved_bytes'] or 0)/1e9, 'GB, planned', m['planned_bytes']/1e9, \
'GB, chosen', m['chosen_to_fit'], 'graph', r['settings']['cuda_graph'], [(t['name'], round(t['tokens_per_second'],1)) \
for t in r['tests']])" "$OUT/bench-27b-bin-6gb-$kv.json" $kv
done
echo "== 27B-class 1-bit at 32K context, KV offloaded to host RAM, under 6GB: tok/s vs the PCIe bound (55 GB/s)"
for kv in bf16 int8; do
    timeout 300 python3 tests/perf/gpu_memory.py --case configs/models/dense-27b.yaml bin cuda:0 6GB --context 32768 \
        --kv-offload --kv-type $kv --decode 32 2>&1 | grep '^{' | tee -a "$OUT/memory.jsonl" | cut -c1-900
done
echo "== KV offload, Qwen3-8B shape, 32K context"
timeout 110 python3 tests/perf/gpu_offload.py --section kv --steps 5 2>&1 | grep '^{' | tee "$OUT/offload-kv.jsonl" | cut -c1-400
echo "== weight offload, 27B-class"
timeout 70 python3 tests/perf/gpu_offload.py --section weights --steps 5 2>&1 | grep '^{' | tee "$OUT/offload-w.jsonl" | cut -c1-400
echo "== decode attention on quantized KV caches"
timeout 60 python3 tests/perf/attention_kernels_gpu.py --reps 100 2>&1 | tail -30

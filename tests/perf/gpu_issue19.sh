#!/usr/bin/env bash
# Issue 19 (batch-1 decode at the bandwidth limit) on the GPU in one call: the decode step's and packed GEMVs' GPU
# tests, then where the graphed step's time goes phase by phase (tests/perf/gpu_phases.py: each phase left out or
# doubled, the attention at other split counts), then `bonsai bench` tg128 of the dummy shapes (BENCH).
#   OUT=out bash tests/perf/gpu_issue19.sh   # MODELS="qwen3-8b:tri:int4,…" PHASES=… MODES=skip,double SPLITS=4,1,8
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_step.py tests/test_packed_kernels.py 2>&1 | tail -4
MODELS=${MODELS:-qwen3-8b:tri:int4,dense-27b:tri:int4,qwen3.6-27b:tri:int4}
timeout 420 python3 tests/perf/gpu_phases.py --models "$MODELS" --splits "${SPLITS:-4}" \
    --phases "${PHASES-quantize,gemv,head,rope_write,attention,deltanet}" --modes "${MODES:-skip,double}" \
    --json "$OUT/phases.json" 2>&1 | grep -v Warning | tee "$OUT/phases.txt"
for model in ${BENCH-qwen3-8b}; do
    timeout 170 python3 -m bonsai_cli bench "configs/models/$model.yaml" --load-format dummy --device cuda --weights tri \
        --head-weights int4 -p 512 -n 128 -r 3 --no-pg --json "$OUT/bench-$model.json" > "$OUT/bench-$model.log" 2>&1 \
        || { echo "FAILED bench $model"; tail -3 "$OUT/bench-$model.log"; }
done
[ -n "${BENCH-qwen3-8b}" ] && python3 tests/perf/bench_summary.py "$OUT" | tee "$OUT/summary.txt"

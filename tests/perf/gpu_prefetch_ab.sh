#!/usr/bin/env bash
# Issue 19: each packed product of the decode step asks L2 for the next one's weights (engine.runtime.prefetch_chain)
# — its tests compiled on the GPU, the GEMV chain with and without it (tests/perf/gemv_probe.py --sections chain),
# then `bonsai bench` per model with BONSAI_L2_PREFETCH=2 (after each program's last group: the default), 0 (off)
# and 1 (at the programs' start), alternated in one run (MODES, MODELS: name:weights pairs).
#   OUT=out bash tests/perf/gpu_prefetch_ab.sh
#   PARTS="bench" MODELS="qwen3.6-27b:tri" MODES="2 0 2 0" OUT=out bash tests/perf/gpu_prefetch_ab.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
PARTS=${PARTS:-"tests chain bench"}
MODES=${MODES:-"2 0 1 2 0"}
MODELS=${MODELS:-"qwen3-8b:tri qwen3-1.7b:tri"}
REPS=${REPS:-3}
if [[ " $PARTS " == *" tests "* ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_packed_kernels.py tests/test_decode_step.py \
        -k "prefetch or shares or fused_step" 2>&1 | tail -3
fi
if [[ " $PARTS " == *" chain "* ]]; then
    timeout 150 python3 tests/perf/gemv_probe.py --sections copy,chain --budget-s 120 --json "$OUT/chain.json" 2>&1 \
        | grep -v "^\[ok\]" | tee "$OUT/chain.txt"
fi
if [[ " $PARTS " == *" bench "* ]]; then
    for pair in $MODELS; do
        model=${pair%%:*}; weights=${pair#*:}; i=0
        for mode in $MODES; do
            i=$((i + 1))
            BONSAI_L2_PREFETCH=$mode timeout 200 python3 -m bonsai_cli bench "configs/models/$model.yaml" \
                --load-format dummy --device cuda --weights "$weights" --head-weights int4 -p 512 -n 128 -r "$REPS" \
                --no-pg --json "$OUT/bench-$model-$weights-pf$mode-$i.json" > "$OUT/bench-$model-$weights-pf$mode-$i.log" 2>&1 \
                || { echo "FAILED $model $weights pf$mode"; tail -3 "$OUT/bench-$model-$weights-pf$mode-$i.log"; }
        done
    done
    python3 tests/perf/bench_summary.py "$OUT" | tee "$OUT/summary.txt"
fi

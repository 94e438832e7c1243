#!/usr/bin/env bash
# Issue 19: the one-row "kwarps" GEMV (quant.kernels.packed_gemv: two warps split K in a program, for large ternary
# g128 matrices) on the GPU — its tests compiled, its per-shape timing against the one-warp kernel
# (tests/perf/gemv_variants.py --sections engine), then `bonsai bench` of the 8B and 27B hybrid ternary shapes with
# the kernel file as committed (new) and other versions of it (ALTS: name=path of a copy of packed_gemv.py, e.g. the
# previous one), alternated per model in one run.
#   ALTS="old=.ab/packed_gemv_old.py" OUT=out bash tests/perf/gpu_kwarps_ab.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
ALTS=${ALTS:?set ALTS to name=path pairs of other packed_gemv.py versions}
NEW=$(mktemp); cp quant/kernels/packed_gemv.py "$NEW"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_packed_kernels.py -k "gemv or kwarps" 2>&1 | tail -2
timeout 150 python3 tests/perf/gemv_variants.py --sections engine --budget-s 120 --json "$OUT/engine.json" 2>&1 \
    | grep -v "^\[ok\]" | tee "$OUT/engine.txt"
bench() {  # name, yaml, weights
    timeout 170 python3 -m bonsai_cli bench "configs/models/$2.yaml" --load-format dummy --device cuda --weights "$3" \
        --head-weights int4 -p 512 -n 128 -r 3 --no-pg --json "$OUT/bench-$1.json" > "$OUT/bench-$1.log" 2>&1 \
        || { echo "FAILED $1"; tail -3 "$OUT/bench-$1.log"; }
}
for model in ${MODELS:-qwen3-8b qwen3.6-27b}; do
    for side in "new=$NEW" $ALTS; do
        cp "${side#*=}" quant/kernels/packed_gemv.py
        bench "$model-tri-${side%%=*}" "$model" tri
    done
done
cp "$NEW" quant/kernels/packed_gemv.py
python3 tests/perf/bench_summary.py "$OUT" | tee "$OUT/summary.txt"

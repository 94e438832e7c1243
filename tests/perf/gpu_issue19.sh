#!/usr/bin/env bash
# Issue 19 (batch-1 decode at the bandwidth limit) on the GPU in one call, in parts (PARTS, comma-separated):
#   tests  the decode step's, packed GEMVs' and CUDA C++ kernels' GPU tests
#   cuda   the graphed one-row step with the CUDA C++ products against Triton's, in one process, interleaved
#          (tests/perf/cuda_gemv_step.py; STEP_MODELS)
#   phases where the graphed step's time goes phase by phase (tests/perf/gpu_phases.py: each phase left out or
#          doubled, the attention at other split counts)
#   bench  `bonsai bench` tg128 / pp512 of the dummy shapes (BENCH) as the engine runs them ("new"), and the first
#          model (every model with BASE_ALL=1) also with BASELINE's switches ("base"; default BONSAI_CUDA_ATTN=0:
#          the in-run baseline); BENCH_ARGS: more `bonsai bench` options (e.g. --max-seq-len 4096, a server's context)
#   OUT=out PARTS=tests,cuda,bench bash tests/perf/gpu_issue19.sh   # MODELS=… PHASES=… MODES=skip,double SPLITS=4
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; PARTS=${PARTS:-tests,cuda,bench}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ ,$PARTS, == *,tests,* ]]; then
    echo "== GPU tests"
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py tests/test_cuda_gemv.py \
        tests/test_cuda_rt.py tests/test_decode_step.py ${MORE_TESTS-tests/test_packed_kernels.py} 2>&1 | tail -8
fi
if [[ ,$PARTS, == *,cuda,* ]]; then
    echo "== graphed step, CUDA C++ vs Triton one-row products"
    timeout 300 python3 tests/perf/cuda_gemv_step.py --json "$OUT/cuda_step.json" \
        ${STEP_MODELS:+--models $STEP_MODELS} ${VARIANTS:+--variants $VARIANTS} ${ROUNDS:+--rounds $ROUNDS} 2>&1 | grep -v Warning | tee "$OUT/cuda_step.txt"
fi
if [[ ,$PARTS, == *,phases,* ]]; then
    MODELS=${MODELS:-qwen3-8b:tri:int4,dense-27b:tri:int4,qwen3.6-27b:tri:int4}
    timeout 420 python3 tests/perf/gpu_phases.py --models "$MODELS" --splits "${SPLITS:-4}" \
        --phases "${PHASES-quantize,gemv,head,rope_write,attention,deltanet}" --modes "${MODES:-skip,double}" \
        --json "$OUT/phases.json" 2>&1 | grep -v Warning | tee "$OUT/phases.txt"
fi
if [[ ,$PARTS, == *,bench,* ]]; then
    first=1
    for model in ${BENCH-qwen3-8b:tri dense-27b:tri qwen3-8b:bin}; do
        name=${model%%:*}; weights=${model##*:}
        for tag in $([ $first = 1 ] || [ -n "${BASE_ALL:-}" ] && echo "base new" || echo new); do
            switches=$([ $tag = base ] && echo "${BASELINE:-BONSAI_CUDA_ATTN=0}" || echo "BONSAI_BENCH_TAG=new")
            env $switches timeout 170 python3 -m bonsai_cli bench "configs/models/$name.yaml" --load-format dummy \
                --device cuda --weights "$weights" --head-weights int4 -p 512 -n 128 -r 3 --no-pg ${BENCH_ARGS:-} \
                --json "$OUT/bench-$name-$weights-$tag.json" > "$OUT/bench-$name-$weights-$tag.log" 2>&1 \
                || { echo "FAILED bench $name-$weights-$tag"; tail -3 "$OUT/bench-$name-$weights-$tag.log"; }
        done
        first=0
    done
    python3 tests/perf/bench_summary.py "$OUT" | tee "$OUT/summary.txt"
fi

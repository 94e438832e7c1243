#!/usr/bin/env bash
# GPU measurements of speculative decoding and of the server (one H200 run; results under $OUT).
#   BONSAI_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=out bash tests/perf/gpu_spec_serve.sh
# PARTS picks sections (default: all; each part fits a 10-minute command on its own):
#   spec   n-gram vs plain decoding (SmolLM2 suite, dummy 8B)
#   serve  the dummy 8B server at concurrency 1/2/4/8
#   spec-serve  the dummy 8B server at concurrency 1/2/4/8, plain vs speculative, repetitive prompts
# BUDGET=N sets server.max_prefill_tokens_per_step for spec-serve (default: one 512-token prefill chunk).
set -u
SMOL=${BONSAI_SMOLLM2_GGUF:?set BONSAI_SMOLLM2_GGUF}
OUT=${OUT:-out}; mkdir -p "$OUT"
PARTS=${PARTS:-spec serve spec-serve}
B="python3 -m bonsai_cli"
sed "s#tokenizer: smollm2-135m#tokenizer: $SMOL#" configs/serve-dummy-bench.yaml > "$OUT/serve.yaml"
part() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
if part spec; then
echo "== speculative, SmolLM2 on the GPU: n-gram vs plain, suite short"
timeout 150 $B bench "$SMOL" --device cuda --suite short --spec ngram --vs-plain -r 1 --json "$OUT/spec-smol-ngram.json" 2>&1 | tail -30
echo "== speculative, Qwen3-8B shape ternary (dummy), n-gram"
timeout 120 $B bench configs/models/qwen3-8b.yaml --load-format dummy --device cuda --weights tri --head-weights int4 \
    -p 128 -n 128 -r 3 --no-pg --spec ngram --json "$OUT/spec-8b-ngram.json" 2>&1 | tail -12
fi
if part serve; then
echo "== server, Qwen3-8B shape ternary (dummy), 8 slots"
$B serve --config "$OUT/serve.yaml" > "$OUT/serve.log" 2>&1 &
PID=$!
for i in $(seq 1 120); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8080/health 2>/dev/null | grep -q 200 && break; sleep 1; done
echo "server ready after ${i}s"
timeout 240 $B bench --url http://127.0.0.1:8080 --suite short --concurrency 1,2,4,8 -r 1 --json "$OUT/serve-8b.json" 2>&1 | tail -30
kill -INT $PID; wait $PID; tail -5 "$OUT/serve.log"
fi
if part spec-serve; then
echo "== server, Qwen3-8B shape ternary (dummy), 8 slots: plain vs n-gram speculation, repetitive prompts"
# aggregate tok/s at concurrency 1/2/4/8 with and without speculation (each slot drafts, all verified together)
BASE="$OUT/serve.yaml" OUT="$OUT/spec-serve" LEVELS=1,2,4,8 REPS=2 timeout 570 bash tests/perf/serve_spec_concurrency.sh
fi

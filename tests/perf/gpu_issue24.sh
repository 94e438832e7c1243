#!/usr/bin/env bash
# One H200 run for issue 24 (hardening), < 8 minutes: the CPU tests where CUDA is present (the
# device checks see a real GPU), then `bonsai serve` on cuda:0 with SmolLM2 and model.quant_type tri
# (stored Q4_1, not kept as codes: rounded at load, so its measured cost must be logged), one request,
# a port in use, and SIGTERM during a stream. Results under $OUT.
#   BONSAI_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=out bash tests/perf/gpu_issue24.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=${BONSAI_SMOLLM2_GGUF:?set BONSAI_SMOLLM2_GGUF to the SmolLM2 GGUF}
echo "== the issue's tests with a GPU present"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_engine_guard.py tests/test_serve_edge.py \
    tests/test_context_fit.py tests/test_model_files.py tests/test_serve_preflight.py tests/test_pull_limits.py \
    tests/test_serve_soak.py 2>&1 | tail -4
echo "== serve on cuda:0 with quant_type tri: the rounding's cost is logged before ready"
PORT=18424
printf "model:\n  path: %s\n  quant_type: tri\n  max_context: 512\nruntime:\n  device: cuda:0\n  max_batch_size: 2\nserver:\n  port: %s\n" \
    "$MODEL" "$PORT" > "$OUT/serve-tri.yaml"
python3 -m bonsai_cli serve --config "$OUT/serve-tri.yaml" > "$OUT/serve.log" 2>&1 &
PID=$!
for _ in $(seq 1 120); do curl -s "localhost:$PORT/health" | grep -q '"ok"' && break; sleep 1; done
grep -m1 "model.quant_type tri" "$OUT/serve.log" | cut -c1-400
echo "== a second server on the same port: one line, exit 1"
python3 -m bonsai_cli serve --config "$OUT/serve-tri.yaml" 2>&1 | tail -2; echo "exit ${PIPESTATUS[0]}"
echo "== a stream, SIGTERM after its first chunk: it must end with an error event, exit 0, no traceback"
curl -sN "localhost:$PORT/v1/chat/completions" -d '{"messages":[{"role":"user","content":"Count to 500."}],"max_tokens":400,"stream":true}' \
    > "$OUT/stream.txt" &
CURL=$!
for _ in $(seq 1 100); do grep -q '"content":"[^"]' "$OUT/stream.txt" 2>/dev/null && break; sleep 0.1; done
kill -TERM $PID; wait $PID; echo "server exit $?"; wait $CURL
tail -c 300 "$OUT/stream.txt"; echo
grep -c Traceback "$OUT/serve.log" | sed 's/^/tracebacks in the log: /'

#!/usr/bin/env bash
# ITL against TTFT by the prefill budget (server.max_prefill_tokens_per_step): `bonsai serve` of
# configs/serve-dummy-bench.yaml (tokenizer TOK) once per budget, `bonsai bench --url --suite short` at LEVELS.
# A budget `nomix` is the default budget with server.mixed_prefill off (short prompts in passes of their own).
#   OUT=out TOK=.tok/smollm2.gguf BUDGETS=none,nomix,16,32 LEVELS=8 REPS=2 bash tests/perf/serve_budget.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; TOK=${TOK:-.tok/smollm2.gguf}
for b in ${BUDGETS//,/ }; do
    python3 - "$TOK" "$OUT/serve-b$b.yaml" "$b" <<'PY'
import sys, yaml
data = yaml.safe_load(open("configs/serve-dummy-bench.yaml"))
data["model"]["tokenizer"] = sys.argv[1]
data["server"]["port"] = 18090
if sys.argv[3] == "nomix":
    data["server"]["mixed_prefill"] = False
elif sys.argv[3] != "none":
    data["server"]["max_prefill_tokens_per_step"] = int(sys.argv[3])
yaml.safe_dump(data, open(sys.argv[2], "w"), sort_keys=False)
PY
    python3 -m bonsai_cli serve --config "$OUT/serve-b$b.yaml" > "$OUT/serve-b$b.log" 2>&1 &
    PID=$!
    for i in $(seq 1 240); do curl -s localhost:18090/health | grep -q '"ok"' && break; kill -0 $PID 2>/dev/null || break; sleep 1; done
    echo "== budget $b (ready after ${i}s)"
    timeout ${BENCH_S:-150} python3 -m bonsai_cli bench --url http://127.0.0.1:18090 --suite short \
        --concurrency ${LEVELS:-8} -r ${REPS:-2} --json "$OUT/bench-b$b.json" > "$OUT/bench-b$b.log" 2>&1
    python3 - "$OUT/bench-b$b.json" "$b" <<'PY'
import json, sys
for level in json.load(open(sys.argv[1]))["concurrency"]:
    s = level["summary"]
    print(f"budget {sys.argv[2]:>4} c={level['concurrency']}: {s['aggregate_tokens_per_second']:.1f} tok/s, TTFT p50/p90 "
          f"{s['ttft_ms_p50']:.0f}/{s['ttft_ms_p90']:.0f} ms, ITL p50/p99 {s['itl_ms_p50']:.1f}/{s['itl_ms_p99']:.1f} ms "
          f"({s['itl_ms_p99'] / s['itl_ms_p50']:.1f}x)")
PY
    kill -INT $PID; wait $PID
done

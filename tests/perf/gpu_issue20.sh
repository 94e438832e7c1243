#!/usr/bin/env bash
# One H200 run for issue 20 (< 10 minutes): the rows kernels swept and compared per path and in the graphed
# decode step (tests/perf/gpu_issue20.py), then a short prompt's prefill through the runner and through the
# engine (tests/perf/gpu_core_overhead.py --prompt 40). Results under $OUT.
# feed: the server's levels (tests/perf/serve_levels.py: short + repetitive suites, FEED_LEVELS) with the decode
#   step launched ahead fed from the host (BONSAI_TOKEN_FEED=host, session 34's way) and on the device, one
#   server each, one after the other. HEAD=bf16 (any part): the output layer in another format than the config's.
# serve: `bonsai serve` of configs/serve-dummy-bench.yaml (the tokenizer: TOK, a metadata-only GGUF) and
# `bonsai bench --url --suite short --concurrency 1,2,4,8`; spec: tests/perf/serve_spec_concurrency.sh on it.
#   OUT=out PARTS=kernels,ttft,serve,spec TOK=.tok/smollm2.gguf bash tests/perf/gpu_issue20.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; PARTS=${PARTS:-kernels,ttft}
if [[ ,$PARTS, == *,kernels,* ]]; then
    echo "== kernels"
    timeout ${KERNELS_S:-460} python3 tests/perf/gpu_issue20.py --json "$OUT/issue20.json" --budget-s ${BUDGET_S:-400} \
        ${SECTIONS:+--sections $SECTIONS} > "$OUT/issue20.log" 2>&1
    echo "exit $?"; grep -E "^(best|sum over|step|\{)" "$OUT/issue20.log" | cut -c1-300
fi
if [[ ,$PARTS, == *,ttft,* ]]; then
    echo "== a 40-token prompt's prefill, runner vs engine"
    for p in 40 200; do timeout 120 python3 tests/perf/gpu_core_overhead.py --prompt $p --tokens 64 --reps 5 2>&1 | tail -3; done
fi
if [[ ,$PARTS, == *,serve,* || ,$PARTS, == *,spec,* || ,$PARTS, == *,feed,* ]]; then
    python3 - "${TOK:-.tok/smollm2.gguf}" "$OUT/serve.yaml" <<'PY'
import os, sys, yaml
data = yaml.safe_load(open("configs/serve-dummy-bench.yaml"))
data["model"]["tokenizer"] = sys.argv[1]
data["model"]["head_type"] = os.environ.get("HEAD") or data["model"]["head_type"]
data["server"]["port"] = 18080
yaml.safe_dump(data, open(sys.argv[2], "w"), sort_keys=False)
PY
fi
if [[ ,$PARTS, == *,serve,* ]]; then
    echo "== bonsai serve (8B ternary, 8 slots) + bonsai bench --url, short suite"
    python3 -m bonsai_cli serve --config "$OUT/serve.yaml" > "$OUT/serve.log" 2>&1 &
    PID=$!
    for i in $(seq 1 240); do curl -s "localhost:18080/health" | grep -q '"ok"' && break; kill -0 $PID 2>/dev/null || break; sleep 1; done
    echo "ready after ${i}s"
    timeout ${SERVE_S:-200} python3 -m bonsai_cli bench --url http://127.0.0.1:18080 --suite short --concurrency ${LEVELS:-1,2,4,8} \
        -r ${REPS:-2} --json "$OUT/serve-bench.json" 2>&1 | tail -12
    kill -INT $PID; wait $PID
fi
if [[ ,$PARTS, == *,spec,* ]]; then
    echo "== plain vs n-gram speculation through the server, repetitive suite"
    BASE="$OUT/serve.yaml" LEVELS=${SPEC_LEVELS:-1,8} REPS=${SPEC_REPS:-1} PORT=18081 BENCH_S=${SPEC_S:-150} timeout ${SPEC_TIMEOUT:-400} \
        bash tests/perf/serve_spec_concurrency.sh 2>&1 | tail -12
fi
if [[ ,$PARTS, == *,feed,* ]]; then
    echo "== the step launched ahead: tokens fed from the host vs on the device, through the server"
    for feed in ${FEEDS:-host device}; do
        BONSAI_TOKEN_FEED=$feed python3 -m bonsai_cli serve --config "$OUT/serve.yaml" > "$OUT/serve-$feed.log" 2>&1 &
        PID=$!
        for i in $(seq 1 240); do curl -s "localhost:18080/health" | grep -q '"ok"' && break; kill -0 $PID 2>/dev/null || break; sleep 1; done
        echo "-- feed $feed: ready after ${i}s"
        timeout ${FEED_S:-200} python3 tests/perf/serve_levels.py --url http://127.0.0.1:18080 \
            --suites short,tests/perf/repetitive_suite.json --levels ${FEED_LEVELS:-1,8} -r ${FEED_REPS:-2} \
            --json "$OUT/levels-$feed.json" 2>&1 | tail -6
        kill -INT $PID; wait $PID
    done
fi

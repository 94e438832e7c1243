#!/usr/bin/env bash
# Aggregate tok/s of `bonsai serve` at several concurrencies, without and with speculative decoding
# (each slot drafts; all slots verified together), on repetitive prompts, measured by `bonsai bench --url`.
#   BASE=serve.yaml OUT=out bash tests/perf/serve_spec_concurrency.sh
# BASE: a serve config with max_batch_size >= the largest level. The plain run uses it as is; the
# speculative run adds runtime.decode_algorithm: speculative, draft_model: none and a speculative
# section (method $SPEC, num_draft_tokens $K). Results: $OUT/serve-{plain,spec}.json and a table.
# Knobs: LEVELS=1,2,4,8  REPS=2 (each suite prompt runs REPS times per level, fresh each time)
#        SUITE=tests/perf/repetitive_suite.json  EXTRA="--limit 1" (more bench options)  PORT=8080
#        READY_S=300 (seconds to wait for a server)  BENCH_S=200 (seconds per bench run)
#        BUDGET=N (server.max_prefill_tokens_per_step; default: the config's, else one prefill chunk)
#        SAME=1: one speculative server; each level's requests run plain ("speculative.n_max": 0) and as served,
#        side by side in that process (`bonsai bench --url --vs-plain`): no spread between two server processes
set -u
BASE=${BASE:?set BASE to a serve config}
OUT=${OUT:-out}; mkdir -p "$OUT"
LEVELS=${LEVELS:-1,2,4,8}; REPS=${REPS:-2}; PORT=${PORT:-8080}; K=${K:-4}; SPEC=${SPEC:-ngram}
SUITE=${SUITE:-tests/perf/repetitive_suite.json}; EXTRA=${EXTRA:-}; READY_S=${READY_S:-300}; BENCH_S=${BENCH_S:-200}
BUDGET=${BUDGET:-}; SAME=${SAME:-0}
B="python3 -m bonsai_cli"
MODES="plain spec"; VS=""
if [ "$SAME" = 1 ]; then MODES="spec"; VS="--vs-plain"; fi
for mode in $MODES; do
    cfg="$OUT/serve-$mode.yaml"
    python3 - "$BASE" "$cfg" "$mode" "$SPEC" "$K" "$BUDGET" <<'PY'
import sys, yaml
base, out, mode, spec, k, budget = sys.argv[1:]
data = yaml.safe_load(open(base))
server = data.setdefault("server", {}) or {}
server["max_queue"] = max(int(server.get("max_queue", 16)), 64)
if budget:
    server["max_prefill_tokens_per_step"] = int(budget)
data["server"] = server
if mode == "spec":
    rt = data.setdefault("runtime", {})
    rt["decode_algorithm"] = "speculative"
    rt["draft_model"] = "none"
    data["speculative"] = {"method": spec, "num_draft_tokens": int(k)}
yaml.safe_dump(data, open(out, "w"), sort_keys=False)
PY
    echo "== $mode: $(grep -A3 '^speculative' "$cfg" | tr '\n' ' ')"
    $B serve --config "$cfg" --port "$PORT" > "$OUT/serve-$mode.log" 2>&1 &
    PID=$!
    ok=0
    for i in $(seq 1 "$READY_S"); do
        curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$PORT/health" 2>/dev/null | grep -q 200 && { ok=1; break; }
        kill -0 $PID 2>/dev/null || break
        sleep 1
    done
    if [ $ok != 1 ]; then echo "server ($mode) did not start:"; tail -5 "$OUT/serve-$mode.log"; kill $PID 2>/dev/null; exit 1; fi
    echo "server ready after ${i}s"
    timeout "$BENCH_S" $B bench --url "http://127.0.0.1:$PORT" --suite "$SUITE" --concurrency "$LEVELS" -r "$REPS" $EXTRA $VS \
        --json "$OUT/serve-$mode.json" 2>&1 | tail -18
    curl -s "http://127.0.0.1:$PORT/metrics" | grep '^bonsai_spec_decode' > "$OUT/metrics-$mode.txt"
    kill -INT $PID; wait $PID
done
python3 - "$OUT/serve-plain.json" "$OUT/serve-spec.json" "$SAME" <<'PY'
import json, sys
if sys.argv[3] == "1":  # one server: each level's plain run is inside the speculative report
    spec = json.load(open(sys.argv[2]))
    plain = {"concurrency": [{"concurrency": lv["concurrency"], **lv["plain"]} for lv in spec["concurrency"]]}
else:
    plain, spec = (json.load(open(p)) for p in sys.argv[1:3])
print(f"{'concurrency':>11} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'accepted':>14}")
for a, b in zip(plain["concurrency"], spec["concurrency"]):
    x, y = a["summary"], b["summary"]
    ratio = y["aggregate_tokens_per_second"] / x["aggregate_tokens_per_second"] if x["aggregate_tokens_per_second"] else 0
    acc = f"{y.get('draft_tokens_accepted', 0)}/{y.get('draft_tokens', 0)}"
    print(f"{a['concurrency']:>11} {x['aggregate_tokens_per_second']:>12.1f} {y['aggregate_tokens_per_second']:>11.1f} "
          f"{ratio:>7.2f}x {acc:>14}")
first = plain["concurrency"][0]["summary"]["aggregate_tokens_per_second"]
for name, r in (("plain", plain), ("spec", spec)):
    last = r["concurrency"][-1]
    print(f"{name}: concurrency {last['concurrency']} gives {last['summary']['aggregate_tokens_per_second'] / first:.2f}x "
          "the aggregate tok/s of plain concurrency " + str(plain["concurrency"][0]["concurrency"]))
PY

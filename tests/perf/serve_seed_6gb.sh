#!/usr/bin/env bash
# The seed scenario end to end on a GPU: `bonsai serve --config configs/serve-27b-6gb-ternary.yaml` (27B-class
# ternary, 4-bit KV, n-gram speculation, 6 GB with weight_offload auto), two chat requests, their timings.
#   OUT=out TOK=.tok/smollm2.gguf bash tests/perf/serve_seed_6gb.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; TOK=${TOK:-.tok/smollm2.gguf}
python3 - "$TOK" "$OUT/seed.yaml" <<'PY'
import sys, yaml
data = yaml.safe_load(open("configs/serve-27b-6gb-ternary.yaml"))
data["model"]["tokenizer"] = sys.argv[1]
data.setdefault("server", {})["port"] = 18091
yaml.safe_dump(data, open(sys.argv[2], "w"), sort_keys=False)
PY
python3 -m bonsai_cli serve --config "$OUT/seed.yaml" > "$OUT/seed-serve.log" 2>&1 &
PID=$!
for i in $(seq 1 300); do curl -s localhost:18091/health | grep -q '"ok"' && break; kill -0 $PID 2>/dev/null || break; sleep 1; done
echo "ready after ${i}s"; grep -i -E "plan|stream|fits|peak" "$OUT/seed-serve.log" | head -8
for n in 1 2; do
    curl -s localhost:18091/v1/chat/completions -H 'Content-Type: application/json' -d '{"messages": [{"role": "user",
      "content": "Repeat after me: one two three four five six seven eight nine ten, one two three four five."}],
      "max_tokens": 96, "temperature": 0}' > "$OUT/seed-answer-$n.json"
    python3 - "$OUT/seed-answer-$n.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    print("error:", r["error"]); sys.exit()
t = r.get("timings", {})
print({k: t.get(k) for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
                             "draft_n", "draft_n_accepted")}, r["usage"])
PY
done
curl -s localhost:18091/health; echo
kill -INT $PID; wait $PID; tail -3 "$OUT/seed-serve.log"

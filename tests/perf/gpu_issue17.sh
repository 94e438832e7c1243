#!/usr/bin/env bash
# Issue 17 on one H200, in two parts (each under 10 minutes; results under $OUT):
#   PART=a: the GPU tests (graphed streamed step on pinned blocks, base-3 vs 2-bit kernels, load peak), the pinned
#           host->GPU bandwidth, and tg128 of the 8B and 27B-class ternary models (int4 head) in the 2-bit and the
#           base-3 layout, side by side (`bonsai bench --ternary-layout 2bit|base3 -p 512 -n 128 -r 3`).
#   PART=b: the seed recipe (ternary blocks, int4 q/k/v/o, int4 head, int4 KV) in 6 GB at 4K context through
#           `bonsai bench --config`: the plan, tg128 plain, then the repetitive suite categories (code-edit,
#           summarization) with n-gram speculation against plain (--vs-plain: same prompts, identical outputs);
#           the 1-bit 27B-class model with int8 KV in 6 GB; then the seed YAML served (tests/perf/serve_seed_6gb.sh).
#   PART=a TOK=.tok/smollm2.gguf OUT=out bash tests/perf/gpu_issue17.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; TOK=${TOK:-.tok/smollm2.gguf}; PART=${PART:-a}
B="python3 -m bonsai_cli"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
bench() {  # $1: name, rest: bench arguments
    name=$1; shift
    timeout 300 $B bench "$@" --json "$OUT/bench-$name.json" > "$OUT/bench-$name.log" 2>&1 \
        || { echo "FAILED $name:"; tail -3 "$OUT/bench-$name.log" | cut -c1-400; }
    python3 - "$OUT/bench-$name.json" "$name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit()
mem = r.get("memory", {})
ws = mem.get("weight_streaming") or {}
row = {"case": sys.argv[2]}
for t in r.get("tests", []):
    row[t["name"]] = f'{t["tokens_per_second"]:.2f} ± {t.get("stddev", 0):.2f}'
    if t.get("decode_bandwidth"):
        row[t["name"] + " share of copy BW"] = round(t["decode_bandwidth"]["fraction_of_copy"], 3)
row.update({"streamed": len(ws.get("streamed_layers", [])), "bound_tok_s": ws.get("predicted_tokens_per_second"),
            "peak_alloc_GB": round((mem.get("peak_allocated_bytes") or 0) / 1e9, 3),
            "peak_reserved_GB": round((mem.get("peak_reserved_bytes") or 0) / 1e9, 3),
            "planned_GB": round((mem.get("planned_bytes") or 0) / 1e9, 3)})
print(json.dumps(row)[:1500])
PY
}
if [ "$PART" = a ]; then
    echo "== GPU tests"
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_offload.py tests/test_run_formats.py \
        tests/test_load_peak.py -k "cuda or gpu or peak" 2>&1 | tail -4
    echo "== pinned host->GPU bandwidth"
    timeout 60 python3 - <<'PY' | tee "$OUT/pcie.json"
import json, sys, torch
sys.path.insert(0, "tests/perf")
from gpu_offload import host_to_device_bandwidth
print(json.dumps(host_to_device_bandwidth(torch.device("cuda"), 1024)))
PY
    for model in qwen3-8b dense-27b; do for layout in 2bit base3; do
        echo "== $model ternary + int4 head, $layout"
        bench "$model-$layout" configs/models/$model.yaml --load-format dummy --weights tri --head-weights int4 \
            --ternary-layout $layout --device cuda -p 512 -n 128 -r 2 --no-pg
    done; done
    exit 0
fi
seed() {  # $1: max_context, $2: extra model keys
    sed "s/max_context: 1536/max_context: $1/; s|tokenizer: smollm2-135m|tokenizer: $TOK|" configs/serve-27b-6gb-ternary.yaml
}
seed 4096 > "$OUT/seed-4k.yaml"
echo "== seed recipe at 4K, 6 GB: the plan"
COLUMNS=220 timeout 60 $B info configs/models/dense-27b.yaml --plan "$OUT/seed-4k.yaml" > "$OUT/plan-seed-4k.txt" 2>&1
grep -E "weight streaming: (blocks|predicted)|chosen to fit|fits max_gpu|over max_gpu" "$OUT/plan-seed-4k.txt" | cut -c1-300
echo "== seed recipe at 4K, 6 GB: plain tg128"
bench seed-4k-plain --config "$OUT/seed-4k.yaml" --spec none -p 512 -n 128 -r 2 --no-pg
echo "== seed recipe at 4K, 6 GB: repetitive categories, n-gram vs plain"
bench seed-4k-suite --config "$OUT/seed-4k.yaml" --suite full --categories code-edit,summarization --limit 2 \
    --spec ngram --vs-plain -r 1
COLUMNS=200 tail -30 "$OUT/bench-seed-4k-suite.log" | cut -c1-220
echo "== 1-bit 27B-class, int4 head, int8 KV, 6 GB, 4K"
bench bin-27b-int8kv configs/models/dense-27b.yaml --load-format dummy --weights bin --head-weights int4 \
    --kv-type int8 --max-gpu-memory 6GB --max-seq-len 4096 --device cuda -p 512 -n 128 -r 3 --no-pg
echo "== the seed YAML served"
OUT=$OUT TOK=$TOK timeout 200 bash tests/perf/serve_seed_6gb.sh

#!/usr/bin/env bash
# Pipeline parallelism on a 2×H200 machine: the 27B-class dense model (generated ternary weights) on one
# GPU vs pipelined over two (one process per GPU, NCCL between them). Results under $OUT.
#   BONSAI_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=out bash tests/perf/gpu_pipeline.sh
# PARTS picks sections (default: all; each fits a 10-minute command on its own):
#   check  SmolLM2 greedy on cuda:0 vs cuda:0,cuda:1 pipelined (plain and n-gram): the same token ids
#   tg     bonsai bench dense-27b tri / int4 head: pp512 and tg128, 1 GPU vs 2 GPUs pipelined
#   serve  the dense-27b server (8 slots): aggregate tok/s at concurrency 1/4/8, 1 GPU vs 2 GPUs pipelined
#   micro  8 slots' batched decode on 2 GPUs: the step whole vs in 2 micro-batches (engine/pipeline/protocol.py)
set -u
# NVLink multicast stays off in everything started here (and in the pipeline workers, which inherit it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SMOL=${BONSAI_SMOLLM2_GGUF:?set BONSAI_SMOLLM2_GGUF}
OUT=${OUT:-out}; mkdir -p "$OUT"
PARTS=${PARTS:-check tg serve micro}
B="python3 -m bonsai_cli"
TWO="--device cuda:0,cuda:1 --pipeline-parallel"
part() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
python3 -c 'import torch, torch.distributed as d; print("GPUs:", torch.cuda.device_count(), "NCCL:", d.is_nccl_available())'

if part check; then
echo "== SmolLM2 greedy: one GPU vs two pipelined (token ids must be equal)"
P="The three primary colors are red, yellow and blue. Mixing them gives"
timeout 120 $B generate "$SMOL" -p "$P" -n 64 --json --device cuda:0 > "$OUT/check-1gpu.json"
timeout 120 $B generate "$SMOL" -p "$P" -n 64 --json $TWO > "$OUT/check-2gpu.json"
timeout 120 $B generate "$SMOL" -p "$P" -n 64 --json $TWO --spec ngram > "$OUT/check-2gpu-ngram.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
ids = {n: json.load(open(f"{out}/check-{n}.json"))["token_ids"] for n in ("1gpu", "2gpu", "2gpu-ngram")}
for n in ("2gpu", "2gpu-ngram"):
    print(f"{n}: {'SAME' if ids[n] == ids['1gpu'] else 'DIFFERENT'} token ids as 1gpu ({len(ids[n])} tokens)")
PY
fi

if part tg; then
for setup in 1gpu 2gpu; do
  if [ $setup = 1gpu ]; then DEV="--device cuda:0"; else DEV=$TWO; fi
  echo "== dense-27b tri/int4 head, $setup: pp512, tg128"
  timeout 280 $B bench configs/models/dense-27b.yaml --load-format dummy --weights tri --head-weights int4 $DEV \
      -p 512 -n 128 -r 3 --no-pg --json "$OUT/tg-$setup.json" 2>&1 | tail -8
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for setup in ("1gpu", "2gpu"):
    r = json.load(open(f"{out}/tg-{setup}.json"))
    print(setup, {t["name"]: round(t["tokens_per_second"], 1) for t in r.get("tests", [])}, r.get("pipeline", ""))
PY
fi

if part serve; then
sed "s#tokenizer: smollm2-135m#tokenizer: $SMOL#; s#path: qwen3-8b .*#path: dense-27b#; s#max_context: 4096#max_context: 2048#; s#max_seq_len: 4096#max_seq_len: 2048#" \
    configs/serve-dummy-bench.yaml > "$OUT/serve-1gpu.yaml"
sed "s#device: cuda:0#device: cuda:0,cuda:1#" "$OUT/serve-1gpu.yaml" > "$OUT/serve-2gpu.yaml"
printf 'memory:\n  pipeline_parallel: true\n' >> "$OUT/serve-2gpu.yaml"
for setup in 1gpu 2gpu; do
  echo "== server dense-27b tri, 8 slots, $setup: concurrency 1/4/8"
  $B serve --config "$OUT/serve-$setup.yaml" --port 8090 > "$OUT/serve-$setup.log" 2>&1 &
  PID=$!
  for i in $(seq 1 240); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8090/health 2>/dev/null | grep -q 200 && break; sleep 1; done
  echo "server ready after ${i}s"
  timeout 240 $B bench --url http://127.0.0.1:8090 --suite short --concurrency 1,4,8 -r 1 \
      --json "$OUT/serve-$setup.json" 2>&1 | tail -12
  kill -INT $PID; wait $PID; tail -3 "$OUT/serve-$setup.log"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for setup in ("1gpu", "2gpu"):
    r = json.load(open(f"{out}/serve-{setup}.json"))
    print(setup, "aggregate tok/s by concurrency:",
          {c["concurrency"]: round(c["summary"]["aggregate_tokens_per_second"], 1) for c in r.get("concurrency", [])})
PY
fi
if part micro; then
echo "== batched decode, 8 slots at 1024 tokens, 2 GPUs: whole step vs 2 micro-batches"
timeout 300 python3 tests/perf/pipeline_micro_batches.py --slots 8 --context 1024 | tee "$OUT/micro.json"
timeout 300 python3 tests/perf/pipeline_micro_batches.py --slots 16 --context 2048 | tee "$OUT/micro-16.json"
fi
# leftover pipeline workers would show here (there should be none)
pgrep -af engine.pipeline.worker || echo "no pipeline workers left"

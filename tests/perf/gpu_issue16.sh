#!/usr/bin/env bash
# Issue 16 on one H200 (every GPU path a config can select runs): the GPU tests of the kernels and the engine,
# `bonsai bench` of the Qwen3-8B shape and the 27B-class dense shape with every --kv-type, then `bonsai serve`
# with the seed YAML as written (runtime.device cuda:0, int4 KV, n-gram speculation, max_gpu_memory 6GB) on
# generated weights with SmolLM2's tokenizer borrowed, answering a chat request. Results under $OUT.
#   python3 tests/perf/tokenizer_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf .tok/smollm2.gguf   # here, 1.8 MB
#   TOK=.tok/smollm2.gguf OUT=out bash tests/perf/gpu_issue16.sh                           # there
# PARTS picks sections (default: all): tests bench serve
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
TOK=${TOK:?set TOK to a tokenizer GGUF (tests/perf/tokenizer_gguf.py writes one)}
PARTS=${PARTS:-tests bench serve}
B="python3 -m bonsai_cli"
part() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if part tests; then
echo "== GPU tests: kernels, quantized KV decode, the CUDA paths"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kv_quant_kernels.py tests/test_kv_quant_decode.py \
    tests/test_kv_cache_quant.py tests/test_cuda.py tests/test_packed_kernels.py tests/test_kernels_attention.py 2>&1 | tail -4
fi
if part bench; then
echo "== bonsai bench, ternary blocks + int4 head, every KV type (-p 512 -n 128)"
for model in qwen3-8b dense-27b; do
    reps=3; [ $model = dense-27b ] && reps=2
    for kv in bf16 int8 int4 k8v4; do
        timeout 150 $B bench configs/models/$model.yaml --load-format dummy --device cuda --weights tri --head-weights int4 \
            -p 512 -n 128 -r $reps --kv-type $kv --no-pg --json "$OUT/bench-$model-$kv.json" > "$OUT/bench-$model-$kv.log" 2>&1 \
            || { echo "FAILED $model $kv:"; tail -3 "$OUT/bench-$model-$kv.log"; }
    done
done
python3 - "$OUT" <<'EOF'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    r = json.loads(path.read_text())
    tests = {t["name"]: t for t in r["tests"]}
    row = [f"{t['name']} {t['tokens_per_second']:,.1f} ± {t.get('stddev', 0):.1f}" for t in tests.values()]
    print(path.stem, "|", " | ".join(row), "| graph", r["settings"].get("cuda_graph"))
EOF
fi
if part serve; then
echo "== bonsai serve, the seed YAML as written (cuda:0, kv_cache_quant + kv_cache_bits 4, speculative, draft_model none, 6GB)"
serve_one() {  # $1: label, $2: config; a chat request, its answer and timings, then the server stopped
    $B serve --config "$2" --port 8188 > "$OUT/serve-$1.log" 2>&1 &
    local pid=$! ok=0
    for i in $(seq 1 150); do
        if ! kill -0 $pid 2>/dev/null; then break; fi
        curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8188/health 2>/dev/null | grep -q 200 && { ok=1; break; }
        sleep 1
    done
    if [ $ok = 1 ]; then
        echo "-- $1: ready after ${i}s"
        curl -s http://127.0.0.1:8188/v1/chat/completions -H 'content-type: application/json' \
            -d '{"messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":48,"temperature":0}' \
            | python3 -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({k: r.get(k) for k in ('usage','timings')})[:600]); print('finish', r['choices'][0]['finish_reason'], 'text', repr(r['choices'][0]['message']['content'][:80]))"
        kill -INT $pid; wait $pid
    else
        echo "-- $1: the server did not start (exit $(wait $pid; echo $?)):"
    fi
    grep -vE "^\s*$" "$OUT/serve-$1.log" | tail -3 | cut -c1-400
}
seed() {  # the seed YAML; $1: architecture, $2: extra memory lines
    printf 'model:\n  path: %s\n  load_format: dummy\n  tokenizer: %s\n  quant_type: tri\n  max_context: 1536\n  kv_cache_quant: true\n  kv_cache_bits: 4\nruntime:\n  device: cuda:0\n  max_batch_size: 1\n  max_seq_len: 1536\n  prefill_chunk_size: 512\n  decode_algorithm: speculative\n  draft_model: none\nmemory:\n  weight_offload: %s\n  activation_checkpoint: false\n  max_gpu_memory: 6GB\n' "$1" "$TOK" "$2"
}
seed qwen3-8b false > "$OUT/seed-8b.yaml"; serve_one seed-8b "$OUT/seed-8b.yaml"
seed dense-27b false > "$OUT/seed-27b.yaml"; serve_one seed-27b "$OUT/seed-27b.yaml"
seed dense-27b true > "$OUT/seed-27b-offload.yaml"; serve_one seed-27b-offload "$OUT/seed-27b-offload.yaml"
fi

#!/usr/bin/env bash
# Issue 5 on one H200: the quantization methods' GPU timings and the quality push with end-to-end scale
# tuning, on SmolLM2-135M-Instruct (results under $OUT, one JSON per part, written after every row).
#   BONSAI_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=out PARTS="tests timing" bash tests/perf/gpu_quant.sh
# PARTS (default all): tests  the GPU tests that need SmolLM2
#                      timing rtn / gptq / gsq at the CPU table's settings (64 x 256 calibration tokens)
#                      tune   ternary + q/k/v/o int4 and int4 everywhere: 512 x 256 tokens, scale tuning at 3 rates
#                      gsq    the same recipe with GSQ (300 steps per layer) under the tuning
set -u
SMOL=${BONSAI_SMOLLM2_GGUF:?set BONSAI_SMOLLM2_GGUF}
OUT=${OUT:-out}; mkdir -p "$OUT"
PARTS=${PARTS:-tests timing tune gsq}
part() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
Q="python3 tests/perf/quant_methods.py --model $SMOL --device cuda --threads 16 --rotate --scale-refits 1"
if part tests; then
echo "== GPU tests with SmolLM2"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu_model.py tests/test_calibration.py \
    tests/test_serve_engine.py tests/test_serve_spec.py tests/test_spec_smollm2.py tests/test_smollm2_parity.py \
    tests/test_chat_session.py tests/test_cli_e2e.py tests/test_gptq.py tests/test_gsq.py tests/test_serve_api.py \
    2>&1 | tee "$OUT/tests-smol.log" | tail -12
fi
if part timing; then
echo "== methods on the GPU, the CPU table's settings"
timeout 240 $Q --rows int4:rtn,int4:gptq,tq:gptq,tq:gsq --gsq-steps 100 --json "$OUT/methods-gpu.json" 2>&1 | grep -v Warn | grep -v "add(getattr"
fi
if part tune; then
echo "== scale tuning, 512 x 256 calibration tokens"
timeout 270 $Q --rows tq:gptq --samples 512 --tune-steps 1000 --tune-lr 5e-4,1e-3,3e-3 --json "$OUT/tune-tq.json" 2>&1 | grep -v Warn | grep -v "add(getattr" | grep -v "step [0-9]*/"
timeout 150 $Q --rows int4:gptq --samples 512 --tune-steps 1000 --tune-lr 1e-3 --json "$OUT/tune-int4.json" 2>&1 | grep -v Warn | grep -v "add(getattr" | grep -v "step [0-9]*/"
fi
if part gsq; then
echo "== GSQ 300 steps + scale tuning"
timeout 400 $Q --rows tq:gsq --gsq-steps 300 --samples 512 --tune-steps 1000 --tune-lr 1e-3,3e-3 --json "$OUT/tune-tq-gsq.json" 2>&1 | grep -v Warn | grep -v "add(getattr" | grep -v "step [0-9]*/"
fi

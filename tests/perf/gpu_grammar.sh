#!/usr/bin/env bash
# Grammar-constrained decoding on one H200 (issue 21, < 5 minutes): the token mask per step at the Qwen2.5-Coder
# vocabulary (151,936 ids; fill on the host + apply on the GPU, 1 and 8 rows), then smollm2's decode tokens/s with
# and without a json_schema grammar (tests/perf/grammar_speed.py). xgrammar 0.2.8 and apache-tvm-ffi travel in
# .whl/ (1.3 + 3.3 MB); xgrammar also imports pydantic (in .whl/) and transformers (must be on the machine).
#   OUT=out QWEN=path/qwen2.5-coder-0.5b-instruct.gguf SMOLLM2=path/SmolLM2-135M-Instruct.Q4_1.gguf bash tests/perf/gpu_grammar.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -c "import xgrammar" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .whl/xgrammar-0.2.8-*.whl \
    .whl/apache_tvm_ffi-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl .whl/annotated_types-*.whl \
    .whl/typing_inspection-*.whl 2>&1 | tail -2
python3 -c "import xgrammar" || { echo "xgrammar does not import here (transformers missing?)"; exit 1; }
timeout 280 python3 tests/perf/grammar_speed.py --device cuda ${QWEN:+--qwen $QWEN} ${SMOLLM2:+--smollm2 $SMOLLM2} \
    > "$OUT/grammar_speed.json" 2> "$OUT/grammar_speed.log"
echo "exit $?"; cat "$OUT/grammar_speed.json"; tail -3 "$OUT/grammar_speed.log"

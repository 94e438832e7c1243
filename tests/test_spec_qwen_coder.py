"""Draft-model speculation on the real Qwen2.5-Coder pair: the 1.5B target with the 0.5B drafter (by
its pulled name), alone and mixed with n-gram, gives at temperature 0 token for token what plain
decoding gives. bfloat16 matrices (cheap verify passes on an AVX512-BF16 CPU) and the float16
default. Skipped unless both models are pulled (CI pulls only SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from engine.sources import store
from engine.weights.loader import load_model
from engine.runtime.runner import ModelRunner
from engine.speculative.config import SpeculativeConfig, build_drafter
from tests.engine_runs import run_engine

pytestmark = pytest.mark.slow

PROMPTS = ["Add a docstring to this function and show it again:\n\n```python\ndef clamp(x, lo, hi):\n"
           "    return max(lo, min(x, hi))\n```",
           "Summarize in one sentence: the cache keeps the last 100 responses and evicts the oldest first."]
MAX_TOKENS = 32
SEQ = 256


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def target(request):
    path = store.find_pulled("qwen2.5-coder-1.5b")
    if path is None or store.find_pulled("qwen2.5-coder-0.5b") is None:
        pytest.skip("needs `bonsai pull qwen2.5-coder-1.5b` and `bonsai pull qwen2.5-coder-0.5b`")
    return load_model(path, "cpu", weight_dtype=getattr(torch, request.param))


@pytest.mark.parametrize("spec", ["draft:qwen2.5-coder-0.5b", "mix:ngram,draft:qwen2.5-coder-0.5b"])
def test_output_equals_plain_decoding(target, spec):
    tok = target.tokenizer
    request = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    drafter = build_drafter(SpeculativeConfig.from_spec(spec), target, SEQ)
    for text in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        plain = run_engine(ModelRunner(target, SEQ), tok, ids, **request)[1]
        _, got, _, stats = run_engine(ModelRunner(target, SEQ), tok, ids, drafter=drafter, k=4, **request)
        assert got == plain, (spec, tok.decode(got), tok.decode(plain))
        assert stats.speculative.steps > 0

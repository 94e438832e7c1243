"""The real SmolLM2-135M-Instruct GGUF against transformers loading the same file."""
from __future__ import annotations

import pytest
import torch

from engine.runtime.runner import ModelRunner
from tests.engine_runs import run_engine

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a screw press adapted from wine making. Within fifty years, "
    "presses were running in more than two hundred cities across Europe, and the price of books fell so "
    "quickly that reading spread from monasteries and universities to merchants, craftsmen and their "
    "families. Historians still argue about how much of the Reformation, the scientific revolution and "
    "the rise of vernacular literature can be traced back to this one machine, but few doubt its weight. "
    "Printers became publishers, editors and booksellers at once, and their shops turned into meeting "
    "places where scholars, translators and artists argued about texts before they went to press.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    if n <= 0:\n        return []\n    sequence = [0, 1]\n    while len(sequence) < n:\n"
    "        sequence.append(sequence[-1] + sequence[-2])\n    return sequence[:n]\n\n\n"
    "def is_prime(k: int) -> bool:\n    if k < 2:\n        return False\n    for d in range(2, int(k ** 0.5) + 1):\n"
    "        if k % d == 0:\n            return False\n    return True\n\n\nif __name__ == \"__main__\":\n"
    "    print([x for x in fibonacci(30) if is_prime(x)])\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nI am planning a trip to "
    "Japan in the spring. Which cities should I visit to see cherry blossoms, how many days should I plan "
    "for each, and what should I pack? Please also suggest a few dishes I should try and tell me how the "
    "train passes work for tourists.<|im_end|>\n<|im_start|>assistant\nSpring is a wonderful time to visit "
    "Japan. Here is a plan that covers the best places for cherry blossoms, with practical advice on "
    "packing, food and getting around by train across the country. First, a word on timing: the blossoms "
    "open in the south in late March and move north through April, so the order of your cities matters.",
]
GREEDY_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
                  "def add(a, b):", "Water boils at", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def ours(smollm2_loaded):
    return smollm2_loaded  # the default CPU path: float16 matrices, float32 activations


@pytest.fixture(scope="module")
def ours_fp32(smollm2_loaded_f32):
    return smollm2_loaded_f32


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model, tok


# max |Δ log-prob| over all 3 x 128 positions and the whole vocabulary: float32 weights differ from
# transformers by summation order only; float16 matrices round each weight by <= 2^-11 relative
# (measured worst 0.04, mean KL 2e-6, top-1 100%).
TOLERANCE = {"float16": 0.1, "float32": 1e-3}


@pytest.mark.parametrize("variant", ["float16", "float32"])
def test_next_token_logits_match(variant, request, reference):
    ours = request.getfixturevalue("ours" if variant == "float16" else "ours_fp32")
    ref_model, _ = reference
    runner = ModelRunner(ours, max_seq_len=256)
    agree, total, worst = 0, 0, 0.0
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)[:128]
        assert len(ids) == 128, len(ids)
        runner.slot().reset()
        got = torch.log_softmax(runner.forward(runner.slot(), ids, num_logits=None), -1)  # [128, V]
        with torch.no_grad():
            want = torch.log_softmax(ref_model(torch.tensor([ids])).logits[0].float(), -1)  # [128, V]
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float((got - want).abs().max()))
    assert agree / total >= 0.99, agree / total
    assert worst < TOLERANCE[variant], worst


def test_greedy_continuations_identical(ours, reference):
    ref_model, _ = reference
    runner = ModelRunner(ours, max_seq_len=256)
    eos = sorted(ours.tokenizer.eos_ids)
    for prompt in GREEDY_PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        text, got, finish, _ = run_engine(runner, ours.tokenizer, ids, max_tokens=32)
        with torch.no_grad():
            out = ref_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
        expected = out[:next((i for i, t in enumerate(out) if t in eos), len(out))]
        assert got == expected, prompt
        assert finish == ("length" if len(expected) == 32 else "stop")
        assert text == ours.tokenizer.decode(got)


def test_int8_kv_cache_generates_the_same_first_tokens(ours):
    """An int8 KV cache (quantized on write, keys minus their calibrated mean) starts every greedy
    continuation as the float cache does (its measured quality is in docs/quality.md)."""
    plain, int8 = (ModelRunner(ours, max_seq_len=64, kv_type=kv_type) for kv_type in ("bf16", "int8"))
    for prompt in GREEDY_PROMPTS[:3]:
        ids = ours.tokenizer.encode(prompt)
        want = run_engine(plain, ours.tokenizer, ids, max_tokens=12)[1]
        got = run_engine(int8, ours.tokenizer, ids, max_tokens=12)[1]
        assert got == want, prompt

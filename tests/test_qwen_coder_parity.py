"""The real Qwen2.5-Coder 0.5B and 1.5B GGUFs (built-in names) against transformers loading the same file.

Skipped unless pulled (`bonsai pull qwen2.5-coder-0.5b`, `... -1.5b`): CI pulls only SmolLM2. Each model
is handled in turn and transformers' copy (float32, ~7 GB for the 1.5B) is freed before ours loads,
so the 24 GB machine holds one model at a time.
"""
from __future__ import annotations

import gc

import pytest
import torch

from engine.sources import store
from engine.runtime.runner import ModelRunner
from tests.engine_runs import run_engine

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
PROMPTS = [  # 96 tokens of each are compared position by position
    "import heapq\nfrom dataclasses import dataclass, field\n\n\n@dataclass(order=True)\nclass Job:\n"
    "    priority: int\n    name: str = field(compare=False)\n\n\nclass Scheduler:\n    \"\"\"Runs the most urgent "
    "job first; ties keep their arrival order.\"\"\"\n\n    def __init__(self) -> None:\n        self._heap: "
    "list[tuple[int, int, Job]] = []\n        self._count = 0\n\n    def push(self, job: Job) -> None:\n"
    "        heapq.heappush(self._heap, (job.priority, self._count, job))\n        self._count += 1\n\n"
    "    def pop(self) -> Job:\n        return heapq.heappop(self._heap)[2]\n",
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nMy Flask app returns 500 when the JSON body is missing the 'email' field. How should I "
    "validate the request and return a 400 with a clear message instead? Show the route.<|im_end|>\n"
    "<|im_start|>assistant\nValidate the body before you use it, and answer 400 with a message that names the "
    "missing field. Here is the route with the check in place, using only Flask itself:\n",
]
GREEDY_PROMPTS = ["def binary_search(items: list[int], target: int) -> int:\n",
                  "<|im_start|>user\nWrite a SQL query that counts orders per customer.<|im_end|>\n"
                  "<|im_start|>assistant\n",
                  "# Reverse a singly linked list in place\nclass Node:\n"]
GREEDY_TOKENS = 24
# max |Δ log-prob| over every position and the whole vocabulary (as tests/test_smollm2_parity.py):
# float32 matrices differ from transformers by summation order; float16 ones round each weight.
TOLERANCE = {"float16": 0.15, "float32": 2e-3}


def _reference(path, tokenizer) -> dict:
    """transformers on the GGUF: log-probs of PROMPTS' first 96 tokens, greedy ids of GREEDY_PROMPTS
    (up to the first end-of-generation id, as ours stops)."""
    eos = sorted(tokenizer.eos_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    out = {"logprobs": [], "greedy": []}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)[:96]
            assert len(ids) == 96, len(ids)
            out["logprobs"].append((ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)))
        for prompt in GREEDY_PROMPTS:
            ids = tokenizer.encode(prompt)
            gen = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
            out["greedy"].append((ids, gen[:next((i for i, t in enumerate(gen) if t in eos), len(gen))]))
    del model
    gc.collect()
    return out


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    """(name, path, reference results) of one pulled model; ours is loaded by each test."""
    from engine.sources.gguf_file import GGUFFile
    from engine.sources.tokenizer import Tokenizer
    path = store.find_pulled(request.param)
    if path is None:
        pytest.skip(f"{request.param} is not pulled (`bonsai pull {request.param}`)")
    return request.param, path, _reference(path, Tokenizer.from_gguf_metadata(GGUFFile(path).metadata))


def _ours(path, variant: str):
    from engine.weights.loader import load_model
    return load_model(path, "cpu", weight_dtype=torch.float32 if variant == "float32" else None)


@pytest.mark.parametrize("variant", ["float32", "float16"])
def test_logits_match_transformers(case, variant):
    name, path, ref = case
    ours = _ours(path, variant)
    runner = ModelRunner(ours, max_seq_len=128)
    agree, total, worst = 0, 0, 0.0
    for ids, want in ref["logprobs"]:
        runner.slot().reset()
        got = torch.log_softmax(runner.forward(runner.slot(), ids, num_logits=None), -1)  # [96, V]
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float((got - want).abs().max()))
    del runner, ours
    gc.collect()
    print(f"{name} {variant}: top-1 agreement {agree}/{total}, max |Δ log-prob| {worst:.2e}")  # shown with -rP
    assert agree / total >= 0.99, (name, agree / total)
    assert worst < TOLERANCE[variant], (name, worst)


def test_greedy_continuations_identical(case):
    """The default CPU path (float16 matrices) continues as transformers does, token for token."""
    name, path, ref = case
    ours = _ours(path, "float16")
    runner = ModelRunner(ours, max_seq_len=128)
    for ids, expected in ref["greedy"]:
        text, got, _, _ = run_engine(runner, ours.tokenizer, ids, max_tokens=GREEDY_TOKENS)
        assert got == expected, (name, ours.tokenizer.decode(got), ours.tokenizer.decode(expected))
        assert text == ours.tokenizer.decode(got)

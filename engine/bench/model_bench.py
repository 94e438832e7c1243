"""llama-bench style runs on the local engine: pp (prefill), tg (decode), pp+tg, at a depth.

Each repetition uses fresh random token ids (no cache can help), the KV slot is cleared first,
depth tokens are prefilled untimed, and timing excludes tokenization (there is none: ids only).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.bench.records import Measurement
from engine.errors import BonsaiError
from engine.runtime.model import Linear
from engine.weights.packed_linear import PackedLinear
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams
from engine.speculative.drafter import Drafter
from engine.speculative.stats import SpecStats


@dataclass(frozen=True)
class BenchTest:
    n_prompt: int
    n_gen: int
    depth: int = 0

    @property
    def name(self) -> str:
        parts = ([f"pp{self.n_prompt}"] if self.n_prompt else []) + ([f"tg{self.n_gen}"] if self.n_gen else [])
        return "+".join(parts) + (f" @ d{self.depth}" if self.depth else "")


def plan_tests(n_prompt: list[int], n_gen: list[int], depths: list[int], combined: bool) -> list[BenchTest]:
    """The llama-bench matrix: every pp, every tg, optionally every pp+tg pair, at every depth."""
    if any(n < 0 for n in n_prompt + n_gen + depths):
        raise BonsaiError("-p, -n and -d take non-negative token counts")
    tests: list[BenchTest] = []
    for d in depths:
        tests += [BenchTest(p, 0, d) for p in n_prompt if p > 0]
        tests += [BenchTest(0, g, d) for g in n_gen if g > 0]
        if combined:
            tests += [BenchTest(p, g, d) for p in n_prompt for g in n_gen if p > 0 and g > 0]
    if not tests:
        raise BonsaiError("nothing to measure: give -p and/or -n greater than 0")
    return tests


def fresh_tokens(vocab_size: int, special_ids: frozenset[int], n: int, seed: int) -> list[int]:
    """n random ordinary token ids; a different seed per repetition keeps every prompt fresh."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab_size)
        if t not in special_ids:
            out.append(t)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CountingSink:
    """The end rule of a bench run: exactly n tokens, no text, no EOS."""

    def __init__(self, n: int):
        self.n, self.generated = n, 0

    @property
    def remaining(self) -> int:
        return self.n - self.generated

    def push(self, token: int) -> tuple[bool, str, str | None]:
        self.generated += 1
        return True, "", "length" if self.generated >= self.n else None


def run_test(runner: ModelRunner, test: BenchTest, seed: int, special_ids: frozenset[int],
             drafter: Drafter | None = None, num_draft_tokens: int = 4, spec_stats: SpecStats | None = None) -> float:
    """One repetition; returns the timed seconds (prefill of n_prompt + decode of n_gen tokens).
    With a drafter the decode is speculative (greedy) and its statistics add up in spec_stats."""
    vocab = runner.loaded.config.vocab_size
    slot = runner.slot(0)
    needed = test.depth + test.n_prompt + test.n_gen + 1
    if needed > slot.capacity:
        raise BonsaiError(f"test {test.name} needs {needed} positions but the context holds {slot.capacity}: "
                          "raise --max-seq-len or lower -p/-n/-d")
    slot.reset()
    if test.depth:
        runner.prefill(slot, fresh_tokens(vocab, special_ids, test.depth, seed * 7919 + 1))
    prompt = fresh_tokens(vocab, special_ids, max(test.n_prompt, 1), seed)
    _sync(runner.device)
    start = time.perf_counter()
    if test.n_prompt:
        logits = runner.prefill(slot, prompt)
    else:  # a decode-only test starts from one token that is not timed separately
        logits = runner.forward(slot, prompt[:1])[-1]
        _sync(runner.device)
        start = time.perf_counter()
    if drafter is not None and test.n_gen:
        from engine.speculative.decode import speculative_decode
        stats = spec_stats if spec_stats is not None else SpecStats()
        # n_gen tokens after the one the prompt gives, as below
        for _ in speculative_decode(runner, slot, drafter, num_draft_tokens, logits, list(prompt), _CountingSink(test.n_gen + 1),
                                    SamplingParams(), None, None, None, stats):
            pass
        _sync(runner.device)
        return time.perf_counter() - start
    token = int(torch.argmax(logits))
    for _ in range(test.n_gen):
        token = int(torch.argmax(runner.forward(slot, [token])[-1]))
    _sync(runner.device)
    return time.perf_counter() - start


def run_model_bench(runner: ModelRunner, tests: list[BenchTest], repetitions: int, special_ids: frozenset[int],
                    on_sample: Callable[[BenchTest, int, float], None] = lambda t, r, s: None,
                    drafter: Drafter | None = None, num_draft_tokens: int = 4) -> list[Measurement]:
    """Warm up once per test, then `repetitions` timed runs with fresh tokens each (speculative
    decode with a drafter: the measurement's `speculative` holds the draft statistics)."""
    if repetitions < 1:
        raise BonsaiError("-r (repetitions) must be >= 1")
    results = []
    for test in tests:
        # warm-up at the test's own prompt length and depth: the same kernels, shapes and allocations
        run_test(runner, BenchTest(test.n_prompt, min(test.n_gen, 4), test.depth), 10_000, special_ids,
                 drafter, num_draft_tokens)
        m = Measurement(test.name, test.n_prompt, test.n_gen, test.depth)
        if drafter is not None and test.n_gen:
            m.speculative = SpecStats(drafter.name)
        for rep in range(repetitions):
            seconds = run_test(runner, test, seed=rep + 1, special_ids=special_ids, drafter=drafter,
                               num_draft_tokens=num_draft_tokens, spec_stats=m.speculative)
            m.samples_seconds.append(seconds)
            on_sample(test, rep, seconds)
        results.append(m)
    return results


def decode_bytes_per_token(runner: ModelRunner, context: int) -> int:
    """Bytes one decode step must read: every matrix (incl. the output layer), one embedding row,
    and the KV cache of `context` positions."""
    model = runner.model
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, Linear))
    weights += sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    emb = model.embed.weight
    if model.lm_head is None:
        weights += emb.numel() * emb.element_size()  # tied: the embedding is the output matrix
    weights += emb.shape[1] * emb.element_size()
    cache = runner.cache  # every storage tensor is [L, slots, kv_heads, S, X]: one position of one slot
    per_position = sum(t[:, 0, :, 0].numel() * t.element_size() for t in cache.tensors.values())
    return weights + context * per_position


def measure_copy_bandwidth(device: torch.device, megabytes: int = 0, repeats: int = 5) -> float:
    """Device memory copy bandwidth in bytes/s (read + write counted), best of `repeats`."""
    mb = megabytes or (1024 if device.type == "cuda" else 256)
    src = torch.empty(mb * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best

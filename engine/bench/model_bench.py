"""llama-bench style runs on the local engine: pp (prefill), tg (decode), pp+tg, at a depth.

Each repetition uses fresh random token ids (no cache can help), the KV slot is cleared first,
depth tokens are prefilled untimed, and timing excludes tokenization (there is none: ids only).
The prompt and its tokens go through the engine (generate.py) as one request of token ids that
ignores end-of-sequence: the same decode step, sampling and speculation as every other command.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.bench.records import Measurement
from engine.decoding.engine import Engine
from engine.decoding.generate import generate_text
from engine.decoding.sequence import Request
from engine.errors import BonsaiError
from engine.runtime.linear import Linear
from engine.runtime.narrow_head import Int8Head
from engine.runtime.runner import Runner
from engine.speculative.stats import SpecStats
from engine.runtime.cpu_int4 import Int4CpuLinear
from engine.runtime.cpu_kquant import KQuantCpuLinear
from engine.weights.packed_linear import PackedLinear


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


def run_test(engine: Engine, test: BenchTest, seed: int, special_ids: frozenset[int],
             spec_stats: SpecStats | None = None) -> float:
    """One repetition in slot 0; returns the timed seconds (prefill of n_prompt + decode of n_gen
    tokens). With the engine's drafters the decode is speculative (greedy) and its statistics add
    up in spec_stats."""
    runner = engine.runner
    vocab = runner.loaded.config.vocab_size
    slot = runner.slot(0)
    needed = test.depth + test.n_prompt + test.n_gen + 1
    if needed > slot.capacity:
        raise BonsaiError(f"test {test.name} needs {needed} positions but the context holds {slot.capacity}: "
                          "raise --max-seq-len or lower -p/-n/-d")
    slot.reset()
    context = fresh_tokens(vocab, special_ids, test.depth, seed * 7919 + 1) if test.depth else []
    if context:
        runner.prefill(slot, context)  # untimed: the request reuses it as its cached prefix
    prompt = fresh_tokens(vocab, special_ids, max(test.n_prompt, 1), seed)
    _sync(runner.device)
    # n_gen tokens after the one the prompt gives; a decode-only test starts from one untimed token
    request = Request(context + prompt, max_tokens=test.n_gen + 1, ignore_eos=True, text=False)
    _, _, _, stats = generate_text(engine, request)
    if spec_stats is not None and stats.speculative is not None:
        spec_stats.merge(stats.speculative)
    if not test.n_prompt:
        return stats.decode_seconds
    return stats.prefill_seconds + (stats.decode_seconds if test.n_gen else 0.0)


def run_model_bench(engine: Engine, tests: list[BenchTest], repetitions: int, special_ids: frozenset[int],
                    on_sample: Callable[[BenchTest, int, float], None] = lambda t, r, s: None) -> list[Measurement]:
    """Warm up once per test, then `repetitions` timed runs with fresh tokens each (with the engine's
    drafters: speculative decoding, the measurement's `speculative` holds the draft statistics)."""
    if repetitions < 1:
        raise BonsaiError("-r (repetitions) must be >= 1")
    results = []
    for test in tests:
        # warm-up at the test's own prompt length and depth: the same kernels, shapes and allocations
        run_test(engine, BenchTest(test.n_prompt, min(test.n_gen, 4), test.depth), 10_000, special_ids)
        m = Measurement(test.name, test.n_prompt, test.n_gen, test.depth)
        if engine.spec is not None and test.n_gen:
            m.speculative = SpecStats(engine.spec.method)
        for rep in range(repetitions):
            seconds = run_test(engine, test, seed=rep + 1, special_ids=special_ids, spec_stats=m.speculative)
            m.samples_seconds.append(seconds)
            on_sample(test, rep, seconds)
        results.append(m)
    return results


def decode_bytes_per_token(runner: Runner, context: int) -> int:
    """Bytes one decode step must read: every matrix (incl. the output layer), one embedding row,
    and the KV cache of `context` positions; a hybrid's DeltaNet state of one slot (fp32 recurrent state
    and conv window, engine.runtime.hybrid_state) is read and written back: counted twice."""
    model = runner.model
    weights = sum(_matrix_bytes(m) for m in model.modules() if isinstance(m, Linear))
    weights += sum(m.nbytes for m in model.modules() if isinstance(m, (PackedLinear, Int4CpuLinear, KQuantCpuLinear)))
    emb = model.embed.weight
    if model.lm_head is None:
        weights += emb.numel() * emb.element_size()  # tied: the embedding is the output matrix
    weights += emb.shape[1] * emb.element_size()
    cache = runner.cache  # every storage tensor is [L, slots, kv_heads, S, X]: one position of one slot
    per_position = sum(t[:, 0, :, 0].numel() * t.element_size() for t in cache.tensors.values())
    states = getattr(cache, "states", None)
    state = 0 if states is None else sum(t[:, 0].numel() * t.element_size() for t in (states.recurrent, states.conv))
    return weights + context * per_position + 2 * state


def _matrix_bytes(m: Linear) -> int:
    """What a decode step reads of one float matrix: its weight, or an int8 output layer's codes and scales (the
    float16 weight it keeps is read only for the few recomputed logits)."""
    if isinstance(m, Int8Head):
        return m.codes.nbytes + m.scales.nbytes
    return m.weight.numel() * m.weight.element_size()


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

"""Hybrid prefix points on the GPU (engine.runtime.hybrid_state.save_point), on generated weights (Qwen3.5-0.8B
shape by default): the logits after a prompt resumed from a restored point against the same chunking run from zero
(bit for bit if the restore is exact) and against the plain chunking (rounding of another chunking), then through
the engine: cache_n and the wall time of the same prompt again and of a changed tail.
    python -m tests.perf.gpu_prefix_points --model qwen3.5-0.8b --tokens 3000
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml

from engine.decoding.engine import Engine
from engine.decoding.generate import generate_text
from engine.decoding.sequence import Request
from engine.runtime.runner import ModelRunner
from engine.sources.model_config import ModelConfig
from engine.weights.formats import WeightFormat
from engine.weights.loader import load_dummy
from tests.test_spec_generate import TinyTokenizer

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--tokens", type=int, default=3000)
    a = ap.parse_args()
    cfg = ModelConfig.from_hf_config(yaml.safe_load((ROOT / "configs" / "models" / f"{a.model}.yaml").read_text()))
    loaded = load_dummy(cfg, a.model, "cuda", WeightFormat("tri", 128, "int4"))
    prompt = [(i * 7919) % 50000 + 10 for i in range(a.tokens)]
    cut = (a.tokens - 1) // 512 * 512  # the last chunk boundary before the final token
    plain = ModelRunner(loaded, a.tokens + 64)
    want = plain.prefill(plain.slot(0), prompt).float()
    split = ModelRunner(loaded, a.tokens + 64)
    split.prefill(split.slot(0), prompt[:cut])
    same_cut = split.prefill(split.slot(0), prompt[cut:]).float()
    resumed = ModelRunner(loaded, a.tokens + 64)
    slot = resumed.slot(0)
    resumed.prefill(slot, prompt)
    assert slot.keepable(a.tokens - 1) == cut
    slot.rewind(a.tokens - cut)
    got = resumed.prefill(slot, prompt[cut:]).float()
    scale = want.abs().max().item()
    print(f"resumed at {cut} vs the same chunking from zero: max |diff| {(got - same_cut).abs().max().item():.3e}; "
          f"vs plain chunking {(got - want).abs().max().item():.3e}; same chunking vs plain "
          f"{(same_cut - want).abs().max().item():.3e} (logit scale {scale:.2f})", flush=True)
    tok, req = TinyTokenizer(), dict(max_tokens=16, ignore_eos=True)
    engine = Engine(ModelRunner(loaded, a.tokens + 64), tok)
    for label, p in (("first", prompt), ("same again", prompt), ("changed tail", prompt[:-50] + [11] * 60)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate_text(engine, Request(list(p), **req))
        torch.cuda.synchronize()
        print(f"{label}: {len(p)} tokens, cache_n {out[3].cached_tokens}, {(time.perf_counter() - t0) * 1e3:.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()

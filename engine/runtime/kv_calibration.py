"""The key offset of a quantized KV cache: the mean key of each (layer, kv head) over a fixed text.

Keys of Llama-family models share a large component (on SmolLM2 the mean key is 55-85% of a key's
norm, layer by layer). Per-row quantization spends its range on it; subtracting one fixed vector per
(layer, kv head) before quantizing leaves the attention unchanged (each query's scores all shift by
q·offset) and divides the keys' quantization error by about two (docs/quality.md has the numbers).
The offset is measured once, when the runner is built, on CALIBRATION_TOKENS tokens of a fixed
text: docstrings of standard-library modules (never the pydoc topics, which are the evaluation text).
"""
from __future__ import annotations

import inspect

import torch

from engine.runtime.kv_cache import CacheBatch, KVCache

CALIBRATION_TOKENS = 256
_MODULES = ("argparse", "json", "collections", "textwrap", "inspect", "email")


def calibration_text() -> str:
    import importlib
    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in _MODULES)


def calibration_ids(tokenizer, vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """Token ids of the calibration text; without a tokenizer (generated weights), fixed random ids."""
    if tokenizer is not None:
        ids = tokenizer.encode(calibration_text())
        if len(ids) >= n:
            return ids[:n]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


@torch.inference_mode()
def key_offsets(model, config, token_ids: list[int], dtype: torch.dtype, device: torch.device | str
                ) -> torch.Tensor:
    """[L, KV, D] float32: the mean key (after norms and rotary, as cached) of each attention layer and kv head
    over positions 1.. of token_ids (position 0 is left out: the first token's key is an outlier)."""
    n = len(token_ids)
    assert n >= 2
    cache = calibration_cache(config, n, dtype, device)
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # [1, n]
    model(ids, CacheBatch.make([0], [0], n, device), cache, n, 1)
    return mean_keys(cache)


def calibration_cache(config, n: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
    """A float cache of n positions and one slot for the calibration pass (the keys as they are); a hybrid's with
    its DeltaNet states, for the pass (their layers cache no keys)."""
    cache = KVCache(config, n, 1, dtype=dtype, device=device)
    if config.hybrid is not None:
        from engine.runtime.hybrid_state import attach_states
        attach_states(cache, config)
    return cache


def mean_keys(cache: KVCache) -> torch.Tensor:
    """[L, KV, D] float32: the calibration pass's mean key of each attention layer and kv head over positions 1..
    (position 0 is left out: the first token's key is an outlier)."""
    return cache.k[:, 0, :, 1:].float().mean(dim=2).contiguous()

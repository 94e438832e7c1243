"""The static KV cache: writes, rewinds, prefix reuse, on a tiny random model."""
from __future__ import annotations

import torch

from engine.runtime.kv_cache import CacheBatch, KVCache, KVSlot
from engine.runtime.model import Transformer
from engine.sources.model_config import ModelConfig

TINY = ModelConfig(architecture="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=64)


def tiny_model(cfg: ModelConfig = TINY) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def run(model, cache, slot: KVSlot, tokens: list[int]) -> torch.Tensor:
    start, device = slot.length, cache.k.device
    ids = torch.tensor([tokens], device=device)
    batch = CacheBatch.make([slot.index], [start], len(tokens), device)
    with torch.no_grad():
        out = model(ids, batch, cache, start + len(tokens), None)
    slot.tokens.extend(tokens)
    return out[0]


def test_prefill_equals_token_by_token():
    model = tiny_model()
    cache = KVCache(TINY, 32)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    full = run(model, cache, cache.slots[0], tokens)
    cache2 = KVCache(TINY, 32)
    steps = torch.cat([run(model, cache2, cache2.slots[0], [t]) for t in tokens])
    torch.testing.assert_close(full, steps, atol=1e-5, rtol=1e-5)


def test_rewind_then_continue_equals_fresh_cache():
    model = tiny_model()
    cache = KVCache(TINY, 32)
    slot = cache.slots[0]
    run(model, cache, slot, [1, 2, 3, 4, 5, 6])
    slot.rewind(3)  # as after rejected draft tokens
    assert slot.tokens == [1, 2, 3]
    after = run(model, cache, slot, [7, 8])
    fresh_cache = KVCache(TINY, 32)
    fresh = run(model, fresh_cache, fresh_cache.slots[0], [1, 2, 3, 7, 8])
    torch.testing.assert_close(after, fresh[-2:], atol=1e-5, rtol=1e-5)
    n = slot.length
    torch.testing.assert_close(cache.k[:, 0, :, :n], fresh_cache.k[:, 0, :, :n])
    torch.testing.assert_close(cache.v[:, 0, :, :n], fresh_cache.v[:, 0, :, :n])


def test_slots_are_independent_and_batched_forward_matches():
    model = tiny_model()
    cache = KVCache(TINY, 32, num_slots=2)
    a, b = cache.slots
    run(model, cache, a, [5, 6, 7, 8, 9])
    run(model, cache, b, [10, 11])
    # one batched decode step for both slots at different positions
    ids = torch.tensor([[20], [21]])
    batch = CacheBatch.make([0, 1], [a.length, b.length], 1, "cpu")
    with torch.no_grad():
        batched = model(ids, batch, cache, a.length + 1, None)[:, -1]
    ref_cache = KVCache(TINY, 32)
    ref_a = run(model, ref_cache, ref_cache.slots[0], [5, 6, 7, 8, 9, 20])[-1]
    ref_cache.slots[0].reset()
    ref_b = run(model, ref_cache, ref_cache.slots[0], [10, 11, 21])[-1]
    torch.testing.assert_close(batched[0], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], ref_b, atol=1e-5, rtol=1e-5)


def test_common_prefix():
    slot = KVSlot(0, 16, [1, 2, 3, 4])
    assert slot.common_prefix([1, 2, 9]) == 2
    assert slot.common_prefix([1, 2, 3, 4, 5]) == 4
    assert slot.common_prefix([7]) == 0


def test_runner_verify_scores_every_row_and_returns_hidden_states():
    from tests.test_bench_model import tiny_runner
    runner = tiny_runner()
    slot = runner.slot(0)
    prompt, drafts = [1, 5, 9, 2], [7, 3, 11]
    runner.prefill(slot, prompt)
    logits, hidden = runner.verify(slot, drafts, hidden_layers=(0, -1))
    assert logits.shape == (3, TINY.vocab_size) and slot.length == 7
    assert set(hidden) == {0, -1} and hidden[-1].shape == (3, TINY.hidden_size)
    reference = tiny_runner()
    ref_slot = reference.slot(0)
    reference.prefill(ref_slot, prompt)
    for i, token in enumerate(drafts):
        torch.testing.assert_close(logits[i], reference.forward(ref_slot, [token])[-1], rtol=1e-4, atol=1e-4)
    slot.rewind(2)  # reject the last two drafts, then continue as if only [7] had been accepted
    ref_slot.rewind(2)
    torch.testing.assert_close(runner.forward(slot, [4])[-1], reference.forward(ref_slot, [4])[-1],
                               rtol=1e-4, atol=1e-4)

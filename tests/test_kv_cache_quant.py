"""A quantized KV cache (int8 / int4 / k8v4): its tensors cost what the format says, writes quantize
and reads dequantize on every path, rewinds and prefix reuse keep working, on the tiny model."""
from __future__ import annotations

import pytest
import torch

from engine.errors import BonsaiError
from engine.runtime.kv_cache import CacheBatch, KVCache
from quant.kv_format import KV_TYPES, kv_bytes_per_token
from quant.kv_quant import dequantize_rows, hadamard_rows, quantize_rows
from tests.test_kv_cache import TINY, run, tiny_model

QUANTIZED = ["int8", "int4", "k8v4"]
CFG64 = TINY.__class__(**{**TINY.__dict__, "head_dim": 64})  # int4 needs head_dim a multiple of 32


@pytest.mark.parametrize("kv_type", ["bf16", *QUANTIZED])
def test_tensors_cost_what_the_format_says(kv_type):
    cache = KVCache(CFG64, 24, num_slots=3, dtype=torch.bfloat16, kv_type=kv_type)
    per_token = kv_bytes_per_token(KV_TYPES[kv_type], CFG64.num_layers, CFG64.num_kv_heads, CFG64.head_dim)
    assert cache.nbytes == per_token * 24 * 3
    for name, t in cache.tensors.items():
        assert t.shape[:4] == (CFG64.num_layers, 3, CFG64.num_kv_heads, 24), name  # [L, slots, KV, S, X]
    expected = {"bf16": {"k", "v"}, "int8": {"k", "v", "k_scale", "v_scale"},
                "int4": {"k", "v", "k_scale", "k_min", "v_scale", "v_min"},
                "k8v4": {"k", "v", "k_scale", "v_scale", "v_min"}}[kv_type]
    assert set(cache.tensors) == expected and set(cache.layer_scales(0)) == expected - {"k", "v"}


def test_unknown_or_unfit_kv_types_are_one_line_errors():
    with pytest.raises(BonsaiError, match="unknown KV type 'fp8'.*k8v4"):
        KVCache(TINY, 8, kv_type="fp8")
    with pytest.raises(BonsaiError, match="int4 does not fit.*head_dim"):
        KVCache(TINY, 8, kv_type="int4")  # head_dim 16


@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_write_quantizes_and_read_dequantizes_on_both_paths(kv_type, one_thread):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, CFG64.num_kv_heads, 3, 64, generator=g)  # [B, KV, T, D] each
    single, batched = (KVCache(CFG64, 16, num_slots=2, kv_type=kv_type) for _ in range(2))
    for b, (slot, start) in enumerate([(1, 4), (0, 2)]):  # one row at a time: the single-slot path
        single.write(1, CacheBatch.make([slot], [start], 3, "cpu"), k[b:b + 1], v[b:b + 1])
    batched.write(1, CacheBatch.make([1, 0], [4, 2], 3, "cpu"), k, v)  # index_put
    for name in single.tensors:
        assert torch.equal(single.tensors[name], batched.tensors[name]), name
    keys, values = single.read(1, CacheBatch.make([1], [7], 1, "cpu"), 7)  # [1, KV, 7, D]
    assert single.key_rotation  # quantized keys are stored rotated by H, int4 values too
    assert single.value_rotation == (KV_TYPES[kv_type].value == "int4")
    for got, x, element, rotate in ((keys, k, KV_TYPES[kv_type].key, True),
                                    (values, v, KV_TYPES[kv_type].value, single.value_rotation)):
        want = dequantize_rows(element, quantize_rows(element, x[0], torch.float32, rotate=rotate), torch.float32)
        assert torch.equal(got[0, :, 4:7], want) and (got[0, :, :4] == 0).all()
        assert not torch.equal(got[0, :, 4:7], x[0])  # quantized, not stored as given
        back = hadamard_rows(got[0, :, 4:7]) if rotate else got[0, :, 4:7]  # H·H = I
        torch.testing.assert_close(back, x[0], atol=0.6 if element == "int4" else 0.05, rtol=0)
    keys, _ = single.read(1, CacheBatch.make([1, 0], [7, 5], 1, "cpu"), 7)  # [2, KV, 7, D]
    assert torch.equal(keys[0], single.read(1, CacheBatch.make([1], [7], 1, "cpu"), 7)[0][0])


def test_key_offset_leaves_attention_unchanged_and_is_calibrated_by_the_runner(one_thread):
    """Keys stored minus a fixed vector: every score of a query shifts alike, the softmax does not."""
    model = tiny_model(CFG64)
    tokens = [3, 14, 15, 92, 65]
    plain, shifted = KVCache(CFG64, 16, kv_type="int8"), KVCache(CFG64, 16, kv_type="int8")
    shifted.key_offset = torch.randn(CFG64.num_layers, CFG64.num_kv_heads, 64) * 0.01  # small: same codes mostly
    a = run(model, plain, plain.slots[0], tokens)
    b = run(model, shifted, shifted.slots[0], tokens)
    torch.testing.assert_close(a, b, atol=0.02 * a.abs().max().item(), rtol=0)
    keys, _ = shifted.read(0, CacheBatch.make([0], [5], 1, "cpu"), 5)
    keys_plain, _ = plain.read(0, CacheBatch.make([0], [5], 1, "cpu"), 5)
    torch.testing.assert_close(keys + shifted.key_offset[0][:, None], keys_plain, atol=0.05, rtol=0)
    from pathlib import Path

    from engine.weights.loader import LoadedModel, TensorSummary
    from engine.runtime.runner import ModelRunner
    loaded = LoadedModel(model=model, tokenizer=None, config=CFG64, path=Path("tiny"),
                         summary=TensorSummary("test", 0, 0, 0), device=torch.device("cpu"),
                         dtype=torch.float32, weight_dtype=torch.float32)
    assert ModelRunner(loaded, max_seq_len=16).cache.key_offset is None  # float keys: nothing to shift
    offset = ModelRunner(loaded, max_seq_len=16, kv_type="k8v4").cache.key_offset  # [L, KV, D]
    assert offset.shape == (CFG64.num_layers, CFG64.num_kv_heads, 64) and offset.abs().sum() > 0


@pytest.mark.parametrize("kv_type", ["int8", "k8v4"])
def test_tiny_model_with_a_quantized_cache(kv_type, one_thread):
    """Close to the float cache (not equal), and rewinding then continuing equals a fresh cache
    exactly: a row's codes depend only on the row."""
    model = tiny_model(CFG64)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    float_cache, cache = KVCache(CFG64, 32), KVCache(CFG64, 32, kv_type=kv_type)
    want = run(model, float_cache, float_cache.slots[0], tokens)
    got = run(model, cache, cache.slots[0], tokens)
    assert not torch.equal(got, want)
    error = ((got - want).abs().mean() / want.abs().mean()).item()
    assert error < {"int8": 0.01, "k8v4": 0.25}[kv_type], error  # int4 rows of a random model: ~8% each
    slot = cache.slots[0]
    slot.rewind(3)
    after = run(model, cache, slot, [7, 8])
    fresh_cache = KVCache(CFG64, 32, kv_type=kv_type)
    fresh = run(model, fresh_cache, fresh_cache.slots[0], tokens[:5] + [7, 8])
    torch.testing.assert_close(after, fresh[-2:], atol=1e-5, rtol=1e-5)

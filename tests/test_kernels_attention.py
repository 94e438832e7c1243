"""Decode attention and q/k-norm + rotary + KV-cache write kernels vs their plain-torch references.

Without CUDA the kernels run under Triton's interpreter on the CPU at small shapes (TRITON_INTERPRET is
read when a kernel is decorated, so it is set before the kernel modules are imported). With CUDA the
same tests run compiled on the GPU, and the `gpu` tests add the real shapes (Qwen3-8B heads, 4K/32K).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from engine.kernels import UnsupportedKernelShape, triton_available  # noqa: E402
from engine.kernels.attention_decode import (_launch, block_size, decode_attention,  # noqa: E402
                                             decode_attention_int8, decode_attention_int8_reference,
                                             decode_attention_reference, default_num_splits, split_length)
from engine.kernels.rope_cache import qk_norm_rope_write, qk_norm_rope_write_reference  # noqa: E402
from engine.runtime.kv_cache import CacheBatch, KVCache  # noqa: E402
from engine.runtime.model import RMSNorm, apply_rotary, rotary_inverse_frequencies  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(9, 3, 64), (4, 1, 128), (8, 8, 64)]  # (H, KV, D): SmolLM2 heads, MQA, MHA
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@contextlib.contextmanager
def interpreter_like_gpu():
    """Make Triton's interpreter do two things as a GPU does: round float32 -> bfloat16 casts to nearest
    even (it truncates), and multiply bfloat16 dot operands as numbers (it multiplies their raw uint16
    bits; the kernels widen to float32 themselves on a CPU, `test_native_bfloat16_dot_path` checks the
    GPU's native path). Without the first, bf16 results sit one ulp towards zero."""
    import numpy as np
    from triton.runtime import interpreter
    builder, tl = interpreter.InterpreterBuilder, interpreter.tl
    original_cast, original_dot = builder.cast_impl, builder.create_dot

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)
        return original_cast(self, src, dst_type)

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.cast_impl, builder.create_dot = cast_impl, create_dot
    try:
        yield
    finally:
        builder.cast_impl, builder.create_dot = original_cast, original_dot


@pytest.fixture(autouse=True, scope="module")
def _interpreter_like_gpu():
    with interpreter_like_gpu() if DEVICE == "cpu" else contextlib.nullcontext():
        yield


def test_bfloat16_rounding_is_to_nearest_even():
    """float32 activations into a bfloat16 cache round as torch does (the interpreter alone truncates)."""
    x = torch.tensor([1 + 3 * 2 ** -9, 1 + 3 * 2 ** -8, -(1 + 3 * 2 ** -9), 2 ** -8 * 255 / 256] * 4)  # [16]
    qkv = x.repeat(3)[None].to(DEVICE)  # [1, (1 + 2) * 16]: one q, k and v head, all equal to x
    k_cache = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    zero = ints([0])
    qk_norm_rope_write(qkv, zero, zero, torch.zeros(8, device=DEVICE), k_cache, v_cache, 1, 1, 16)  # angle 0
    assert torch.equal(v_cache[0, 0, 0].cpu(), x.to(torch.bfloat16))
    assert torch.equal(k_cache[0, 0, 0].cpu(), x.to(torch.bfloat16))
    assert not torch.equal(x.to(torch.bfloat16), (x.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16())


def test_kernels_run_here():
    assert triton_available(DEVICE)


def attention_inputs(h, kv, d, s, dtype, rows, slots=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv, s, d, generator=g).to(DEVICE, dtype)  # [slots, KV, S, D]
    v = torch.randn(slots, kv, s, d, generator=g).to(DEVICE, dtype)  # [slots, KV, S, D]
    q = (2 * torch.randn(rows, h, d, generator=g)).to(DEVICE, dtype)  # [M, H, D] peaked softmax
    return q, k, v


def ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kv,d", SHAPES)
def test_decode_attention_matches_reference(h, kv, d, dtype):
    s = 300
    q, k, v = attention_inputs(h, kv, d, s, dtype, rows=3)
    for splits in (1, 3):
        boundary = split_length(s, splits, d)  # first key of the second split
        slots, lengths = [2, 0, 1], [1, boundary + 1 if splits > 1 else 129, s]
        for slot, n in zip(slots, lengths):  # large values at the last key in and the first key out
            v[slot, :, n - 1:n + 1] += 20
        slot_ids, lens = ints(slots), ints(lengths)
        got = decode_attention(q, k, v, slot_ids, lens, d ** -0.5, splits)
        want = decode_attention_reference(q, k, v, slot_ids, lens, d ** -0.5)
        torch.testing.assert_close(got, want, **TOL[dtype])
        for off_by_one in (lens - 1, (lens + 1).clamp(max=s)):  # the mistakes this comparison must catch
            wrong = decode_attention_reference(q, k, v, slot_ids, off_by_one, d ** -0.5)
            for row in torch.nonzero(off_by_one != lens).flatten().tolist():
                assert not torch.allclose(got[row].float(), wrong[row].float(), **TOL[dtype]), (row, off_by_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_int8_is_attention_then_quantize(dtype):
    """The fused attention → int8 (per-head scale) equals quantizing the kernel's own attention output,
    and stays within one int8 step of the reference path."""
    from quant.kernels.act_quant import quantize_activations_reference
    h, kv, d, s = 4, 2, 64, 200
    q, k, v = attention_inputs(h, kv, d, s, dtype, rows=2, slots=2, seed=3)
    slot_ids, lens = ints([1, 0]), ints([150, 37])
    for splits in (1, 3):
        xq, sx, sumx = decode_attention_int8(q, k, v, slot_ids, lens, d ** -0.5, splits)
        assert xq.shape == (2, h * d) and xq.dtype == torch.int8 and sx.shape == sumx.shape == (2, h)
        out = decode_attention(q, k, v, slot_ids, lens, d ** -0.5, splits)
        want = quantize_activations_reference(out.reshape(2, h * d), d)
        assert torch.equal(xq, want[0]) and torch.equal(sumx, want[2])
        torch.testing.assert_close(sx, want[1], rtol=1e-6, atol=0)
        ref = decode_attention_int8_reference(q, k, v, slot_ids, lens, d ** -0.5)
        assert (xq.int() - ref[0].int()).abs().max() <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_at_each_split_boundary(dtype):
    h, kv, d, s, splits = 4, 1, 128, 256, 4  # 64 keys per split, one tile each
    q, k, v = attention_inputs(h, kv, d, s, dtype, rows=1, slots=1, seed=1)
    length = split_length(s, splits, d)
    for n in (0, 1, length - 1, length, length + 1, 3 * length, s):  # 0: zeros, not NaN
        got = decode_attention(q, k, v, ints([0]), ints([n]), 0.1, splits)
        torch.testing.assert_close(got, decode_attention_reference(q, k, v, ints([0]), ints([n]), 0.1), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_splits_spread_each_rows_keys_or_keep_fixed_ranges(dtype):
    """By default a row's keys are spread over the splits in whole tiles (a short row: one tile a split); with
    min_split_len each split keeps at least that many keys (split_length: fixed ranges of the cache). Rows of
    lengths at and around both kinds of boundary, and longer than splits × one tile, match the reference."""
    h, kv, d, s, splits = 4, 2, 64, 700, 5  # tiles of 128 keys at d=64
    q, k, v = attention_inputs(h, kv, d, s, dtype, rows=6, slots=2, seed=4)
    lengths = [1, 128, 129, 640, 641, 700]
    slot_ids, lens = ints([i % 2 for i in range(6)]), ints(lengths)
    want = decode_attention_reference(q, k, v, slot_ids, lens, d ** -0.5)
    for floor in (None, split_length(s, splits, d), 256):
        got = decode_attention(q, k, v, slot_ids, lens, d ** -0.5, splits, min_split_len=floor)
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("d", [32, 256])
def test_other_head_dims(d):
    q, k, v = attention_inputs(6, 2, d, 100, torch.float32, rows=2, slots=2, seed=2)
    slot_ids, lens = ints([1, 0]), ints([40, 100])
    got = decode_attention(q, k, v, slot_ids, lens, 0.2, 2)
    torch.testing.assert_close(got, decode_attention_reference(q, k, v, slot_ids, lens, 0.2), **TOL[torch.float32])


def test_keys_past_each_length_are_never_read():
    h, kv, d, s = 9, 3, 64, 200
    q, k, v = attention_inputs(h, kv, d, s, torch.float32, rows=3)
    lens = [5, 130, 200]
    for slot, n in enumerate(lens):  # row i reads slot i: poison everything past its length
        k[slot, :, n:], v[slot, :, n:] = float("nan"), float("nan")
    out = torch.full_like(q, 7.0)
    got = decode_attention(q, k, v, ints([0, 1, 2]), ints(lens), 0.125, 2, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    clean = [(k[i, :, :n], v[i, :, :n]) for i, n in enumerate(lens)]
    for i, (keys, values) in enumerate(clean):  # one row at a time with an unpoisoned cache of its own
        want = decode_attention_reference(q[i:i + 1], keys[None], values[None], ints([0]), ints([lens[i]]), 0.125)
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)


def test_native_bfloat16_dot_path():
    h, kv, d, s = 9, 3, 64, 300
    q, k, v = attention_inputs(h, kv, d, s, torch.bfloat16, rows=2)
    slot_ids, lens = ints([1, 2]), ints([200, 300])
    out = torch.empty_like(q)
    _launch(q, k, v, slot_ids, lens, d ** -0.5, 2, out, dot_f32=False, block_s=block_size(d))  # as on a GPU
    want = decode_attention_reference(q, k, v, slot_ids, lens, d ** -0.5)
    torch.testing.assert_close(out, want, **TOL[torch.bfloat16])


def test_reference_is_the_models_attention():
    """decode_attention_reference = the SDPA call of engine.runtime.model.Attention over the first seq_len keys."""
    h, kv, d = 9, 3, 64
    q, k, v = attention_inputs(h, kv, d, 40, torch.float32, rows=2)
    slot_ids, lens = ints([1, 2]), ints([17, 40])
    got = decode_attention_reference(q, k, v, slot_ids, lens, d ** -0.5)
    for row, (slot, n) in enumerate([(1, 17), (2, 40)]):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[row][None, :, None], k[slot, :, :n][None], v[slot, :, :n][None], enable_gqa=True)  # [1, H, 1, D]
        torch.testing.assert_close(got[row], want[0, :, 0], atol=1e-5, rtol=1e-5)


def test_default_num_splits():
    assert default_num_splits(64) == 1 and default_num_splits(128, num_kv_heads=3, head_dim=64) == 1  # one tile
    assert default_num_splits(640) == 5 and default_num_splits(1024) == 8  # short caches: MIN_SPLITS, whole tiles
    for s in (200, 640, 1024, 4096, 32768, 131072):
        n = default_num_splits(s)
        assert (n - 1) * split_length(s, n, 128) < s  # none empty at full length
        assert s < 4096 or split_length(s, n, 128) >= 256  # long caches: MIN_SPLIT_LEN keys a split at least
    assert default_num_splits(32768) * 8 >= 132  # a 32K cache fills an H200's SMs


def test_unsupported_shapes_raise_value_errors():
    q, k, v = attention_inputs(4, 2, 64, 32, torch.float32, rows=1)
    one = ints([1])
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(q[..., :48], k[..., :48], v[..., :48], one, one, 1.0, 1)
    with pytest.raises(UnsupportedKernelShape, match="multiple of num_kv_heads"):
        decode_attention(q[:, :3], k, v, one, one, 1.0, 1)
    with pytest.raises(UnsupportedKernelShape, match="dtype"):
        decode_attention(q.half(), k, v, one, one, 1.0, 1)
    with pytest.raises(UnsupportedKernelShape, match="num_splits"):
        decode_attention(q, k, v, one, one, 1.0, 0)


# --- q/k norm + rotary + cache write -------------------------------------------------------------------

def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within 1e-5. bfloat16: at most 1% of elements differ (float32 sums in another order can
    round the other way), and those by one ulp."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2 ** -7)
    differ = (got != want).float().mean().item()
    assert differ <= 0.01, f"{differ:.1%} of the elements differ from the reference"


def rope_inputs(h, kv, d, dtype, rows, norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (h + 2 * kv) * d, generator=g).to(DEVICE, dtype)  # [M, (H + 2KV) * D]
    weights = [(1 + 0.5 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in range(2)] if norm else [None, None]
    inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float().to(DEVICE)  # [D/2]
    return qkv, weights, inv_freq


def sentinel_caches(kv, d, dtype, slots=3, s=40):
    k = torch.full((slots, kv, s, d), -3.0, dtype=dtype, device=DEVICE)  # [slots, KV, S, D]
    return k, k.clone() - 1


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kv,d", SHAPES[:2])
def test_qk_norm_rope_write_matches_reference(h, kv, d, dtype, norm):
    qkv, (qw, kw), inv_freq = rope_inputs(h, kv, d, dtype, rows=3, norm=norm)
    positions, slot_ids = torch.tensor([0, 17, 39], device=DEVICE), ints([2, 0, 2])
    k_cache, v_cache = sentinel_caches(kv, d, dtype)
    k_ref, v_ref = sentinel_caches(kv, d, dtype)
    q = qk_norm_rope_write(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, h, kv, d, qw, kw, eps=1e-6)
    q_ref = qk_norm_rope_write_reference(qkv, positions, slot_ids, inv_freq, k_ref, v_ref, h, kv, d, qw, kw, 1e-6)
    assert q.shape == (3, h, d) and q.dtype == dtype
    assert_rounded_alike(q, q_ref)
    assert torch.equal(v_cache, v_ref)  # values are copied exactly
    written = torch.zeros(3, 40, dtype=torch.bool)
    written[[2, 0, 2], [0, 17, 39]] = True
    k_rows, v_rows = k_cache.transpose(1, 2).cpu(), v_cache.transpose(1, 2).cpu()  # [slots, S, KV, D]
    assert_rounded_alike(k_rows[written], k_ref.transpose(1, 2).cpu()[written])
    assert (k_rows[written] != -3).all() and (v_rows[written] != -4).all()
    assert (k_rows[~written] == -3).all() and (v_rows[~written] == -4).all()  # nothing else touched
    wrong = qk_norm_rope_write_reference(qkv, positions + 1, slot_ids, inv_freq, k_ref, v_ref, h, kv, d, qw, kw)
    with pytest.raises(AssertionError):  # a planted off-by-one position is caught
        assert_rounded_alike(q, wrong)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope_write_is_the_models_attention_prologue(norm, dtype):
    """Same q and cache rows as engine.runtime.model.Attention: RMSNorm modules, apply_rotary, KVCache.write."""
    cfg = ModelConfig(architecture="qwen3", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                      num_heads=9, num_kv_heads=3, head_dim=64, qk_norm=norm, rope_theta=50000.0)
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t = 2, 3
    qkv, (qw, kw), _ = rope_inputs(h, kv, d, dtype, rows=b * t, norm=norm, seed=3)
    inv_freq = rotary_inverse_frequencies(cfg).to(DEVICE)
    batch = CacheBatch.make([1, 0], [4, 9], t, DEVICE)
    cache = KVCache(cfg, 16, num_slots=2, dtype=dtype, device=DEVICE)
    q, k, v = qkv.view(b, t, -1).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q, k, v = q.view(b, t, h, d), k.view(b, t, kv, d), v.view(b, t, kv, d)  # [B, T, heads, D]
    if norm:
        q_norm, k_norm = RMSNorm(d, cfg.rms_norm_eps).to(DEVICE), RMSNorm(d, cfg.rms_norm_eps).to(DEVICE)
        q_norm.weight.data, k_norm.weight.data = qw, kw
        q, k = q_norm(q), k_norm(k)
    angles = batch.positions[..., None].float() * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    q_model = apply_rotary(q, cos, sin)  # [B, T, H, D]
    cache.write(0, batch, apply_rotary(k, cos, sin).transpose(1, 2), v.transpose(1, 2))
    k_cache, v_cache = torch.zeros_like(cache.k[0]), torch.zeros_like(cache.v[0])
    got = qk_norm_rope_write(qkv, batch.positions.reshape(-1), batch.slot_ids.repeat_interleave(t), inv_freq,
                             k_cache, v_cache, h, kv, d, qw, kw, eps=cfg.rms_norm_eps)
    assert_rounded_alike(got, q_model.reshape(b * t, h, d))
    for slot, start in zip(batch.slots, batch.starts):
        assert_rounded_alike(k_cache[slot, :, start:start + t], cache.k[0, slot, :, start:start + t])
    assert torch.equal(k_cache == 0, cache.k[0] == 0) and torch.equal(v_cache, cache.v[0])


def test_position_past_the_cache_is_not_written():
    qkv, _, inv_freq = rope_inputs(4, 1, 128, torch.float32, rows=2, norm=False)
    k_cache, v_cache = sentinel_caches(1, 128, torch.float32, slots=1, s=8)
    qk_norm_rope_write(qkv, torch.tensor([7, 8], device=DEVICE), ints([0, 0]), inv_freq, k_cache, v_cache, 4, 1, 128)
    assert (k_cache[0, 0, 7] != -3).all() and (k_cache[0, 0, :7] == -3).all()


def test_rope_unsupported_shapes_raise_value_errors():
    qkv, (qw, kw), inv_freq = rope_inputs(4, 1, 128, torch.float32, rows=1, norm=True)
    k_cache, v_cache = sentinel_caches(1, 128, torch.float32)
    one = ints([0])
    with pytest.raises(ValueError, match="head_dim"):
        qk_norm_rope_write(qkv[:, :576], one, one, inv_freq[:48], k_cache, v_cache, 4, 1, 96)
    with pytest.raises(UnsupportedKernelShape, match="qkv"):
        qk_norm_rope_write(qkv, one, one, inv_freq, k_cache, v_cache, 5, 1, 128)
    with pytest.raises(UnsupportedKernelShape, match="or neither"):
        qk_norm_rope_write(qkv, one, one, inv_freq, k_cache, v_cache, 4, 1, 128, qw, None)
    with pytest.raises(UnsupportedKernelShape, match="inv_freq"):
        qk_norm_rope_write(qkv, one, one, inv_freq.double(), k_cache, v_cache, 4, 1, 128)


# --- real shapes, on a GPU only -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("s", [4096, 32768])
def test_decode_attention_qwen3_8b_shape(s):
    h, kv, d = 32, 8, 128
    q, k, v = attention_inputs(h, kv, d, s, torch.bfloat16, rows=4, slots=2)
    slot_ids = ints([0, 1, 1, 1])
    lens = ints([s, s // 2 + 1, s // 2 + 2, s // 2 + 3])  # a decode row and three causal verify rows
    splits = default_num_splits(s, num_kv_heads=kv, head_dim=d)
    got = decode_attention(q, k, v, slot_ids, lens, d ** -0.5, splits)
    want = decode_attention_reference(q, k, v, slot_ids, lens, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(decode_attention(q, k, v, slot_ids, lens, d ** -0.5, 1), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [32, 40])
def test_qk_norm_rope_write_qwen3_shape_long_positions(h):
    kv, d, s = 8, 128, 32768
    qkv, (qw, kw), inv_freq = rope_inputs(h, kv, d, torch.bfloat16, rows=4, norm=True)
    positions, slot_ids = torch.tensor([0, 4095, 30001, s - 1], device=DEVICE), ints([0, 1, 0, 1])
    k_cache, v_cache = sentinel_caches(kv, d, torch.bfloat16, slots=2, s=s)
    k_ref, v_ref = sentinel_caches(kv, d, torch.bfloat16, slots=2, s=s)
    q = qk_norm_rope_write(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, h, kv, d, qw, kw)
    q_ref = qk_norm_rope_write_reference(qkv, positions, slot_ids, inv_freq, k_ref, v_ref, h, kv, d, qw, kw)
    assert_rounded_alike(q, q_ref)
    assert_rounded_alike(k_cache[slot_ids.long(), :, positions], k_ref[slot_ids.long(), :, positions])
    assert torch.equal(k_cache == -3, k_ref == -3) and torch.equal(v_cache, v_ref)


def random_qwen3_model():
    """A 2-layer qwen3-style Transformer (q/k norms, GQA 4:2, head_dim 64) with N(0, 0.2²) weights on
    DEVICE, seeded (torch's global generator, seed 0: the test's later draws follow from it)."""
    from engine.runtime.model import Transformer
    cfg = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return cfg, model.to(DEVICE)


def test_model_forward_with_the_fused_prologue_matches_the_plain_one():
    """Transformer.use_fused_prologue (what ModelRunner turns on with the GPU fast path): prefill and
    batched rows of several slots give the same logits and cache as the plain prologue."""
    cfg, model = random_qwen3_model()
    tokens = torch.randint(0, 64, (2, 5), device=DEVICE)
    logits = []
    for fused in (False, True):
        model.use_fused_prologue(fused)
        cache = KVCache(cfg, 16, num_slots=2, dtype=torch.float32, device=DEVICE)
        with torch.no_grad():
            first = model(tokens[:1], CacheBatch.make([1], [0], 5, DEVICE), cache, 5, None)  # [1, 5, V]
            both = model(tokens[:, :1], CacheBatch.make([1, 0], [5, 0], 1, DEVICE), cache, 6, None)  # [2, 1, V]
        logits.append((first, both, cache.k.clone()))
    model.use_fused_prologue(False)
    for a, b in zip(logits[0], logits[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

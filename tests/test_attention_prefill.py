"""Chunk (prefill) attention over a quantized cache, reading the codes (engine/kernels/attention_prefill.py),
against its plain-torch reference; the reference against SDPA over the dequantized rows. Under Triton's
interpreter on a CPU: small shapes. The `gpu` test runs the real shapes (Qwen3-8B heads, a 512-token
chunk after 4K cached rows)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from engine.kernels import UnsupportedKernelShape  # noqa: E402
from engine.kernels.attention_prefill import prefill_attention, prefill_attention_reference  # noqa: E402
from engine.kernels.kv_codes import dequantize_layer  # noqa: E402
from quant.kv_quant import hadamard_rows  # noqa: E402
# the module's autouse fixture (Triton's interpreter rounding like a GPU) and helper, shared
from tests.test_kernels_attention import _interpreter_like_gpu, ints  # noqa: E402,F401
from tests.test_kv_quant_kernels import quantized  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cache_of(kv_type: str, kv: int, s: int, d: int, dtype: torch.dtype, seed: int, v_rotate: bool = False):
    """Codes (or values) of two slots [2, KV, S, D] and their scale tensors by name."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, 2, kv, s, d, generator=g) + 0.3).to(DEVICE)  # [slots, KV, S, D] each
    if kv_type == "bf16":
        return k.to(dtype), v.to(dtype), {}
    return quantized(kv_type, k, v, dtype, v_rotate)


@pytest.mark.parametrize("kv_type", ["bf16", "int8", "int4", "k8v4"])
def test_kernel_equals_the_reference(kv_type, one_thread):
    h, kv, d, t = 6, 2, 64, 30  # GROUP 3: a block's rows end mid-position; 90 rows, one block
    v_rotate = kv_type == "int4"  # values stored rotated, the output rotated back
    k, v, scales = cache_of(kv_type, kv, 200, d, torch.float32, 0, v_rotate)
    q = torch.randn(2, t, h, d, generator=torch.Generator().manual_seed(1)).to(DEVICE).transpose(1, 2)  # [B, H, T, D]
    slot_ids, starts = ints([1, 0]), ints([150, 3])  # a cached prefix, and nearly a fresh sequence
    for name, x in scales.items():  # poison every row past the ones in use: never read
        x[1, :, 180:] = float("nan")
        x[0, :, 33:] = float("nan")
    got = prefill_attention(q, k, v, slot_ids, starts, d ** -0.5, v_rotate, **scales)
    want = prefill_attention_reference(q, k, v, slot_ids, starts, d ** -0.5, v_rotate, **scales)
    assert got.shape == (2, h, t, d) and torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_many_blocks_bfloat16_and_positions_past_the_cache(one_thread):
    h, kv, d, t = 4, 1, 64, 40  # GROUP 4: 160 rows, two blocks
    k, v, scales = cache_of("k8v4", kv, 64, d, torch.bfloat16, 2, v_rotate=True)
    scales["v_rotate"] = True
    q = torch.randn(1, h, t, d, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    slot_ids, starts = ints([1]), ints([30])  # positions 64..69 lie past the cache: only rows < 64 exist
    got = prefill_attention(q, k, v, slot_ids, starts, d ** -0.5, **scales)
    want = prefill_attention_reference(q, k, v, slot_ids, starts, d ** -0.5, **scales)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_reference_is_causal_attention_over_the_dequantized_rows(one_thread):
    h, kv, d, t, start = 4, 2, 64, 7, 9
    k, v, scales = cache_of("int4", kv, 32, d, torch.float32, 4, v_rotate=True)
    q = torch.randn(1, h, t, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = prefill_attention_reference(q, k, v, ints([1]), ints([start]), d ** -0.5, v_rotate=True, **scales)
    rows = {n: x[1, :, :start + t] for n, x in scales.items()}
    keys = dequantize_layer(k[1, :, :start + t], rows["k_scale"], rows["k_min"], torch.float32)  # [KV, L, D]
    values = dequantize_layer(v[1, :, :start + t], rows["v_scale"], rows["v_min"], torch.float32)
    mask = torch.arange(start + t)[None, :] <= (start + torch.arange(t))[:, None]  # [T, L]
    want = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask.to(DEVICE), enable_gqa=True)
    want = hadamard_rows(want)  # the values were stored rotated: the output rotated back
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shapes_are_checked():
    k, v, scales = cache_of("int8", 2, 16, 64, torch.float32, 6)
    q = torch.randn(1, 4, 3, 64, device=DEVICE)
    with pytest.raises(UnsupportedKernelShape, match="v_scale"):
        prefill_attention(q, k, v, ints([0]), ints([0]), 1.0, k_scale=scales["k_scale"])
    with pytest.raises(UnsupportedKernelShape, match="slot_ids and starts"):
        prefill_attention(q, k, v, ints([0, 1]), ints([0]), 1.0, **scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_type", ["bf16", "int8", "int4", "k8v4"])
def test_real_shapes_on_the_gpu(kv_type):
    h, kv, d, t, start = 32, 8, 128, 512, 4096
    k, v, scales = cache_of(kv_type, kv, start + t, d, torch.bfloat16, 7, v_rotate=kv_type != "bf16")
    if kv_type != "bf16":
        scales["v_rotate"] = True
    q = torch.randn(1, t, h, d, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)  # [1, H, T, D] strided
    got = prefill_attention(q, k, v, ints([1]), ints([start]), d ** -0.5, **scales)
    want = prefill_attention_reference(q, k, v, ints([1]), ints([start]), d ** -0.5, **scales)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

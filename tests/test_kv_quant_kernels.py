"""The KV kernels on a quantized cache (int8, int4, k8v4) against their torch references: the rope /
KV-write kernel quantizes what the reference quantizes, decode attention reads the codes as the
reference reads the dequantized rows. Under Triton's interpreter on a CPU: tiny shapes, few cases."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from engine.kernels import UnsupportedKernelShape  # noqa: E402
from engine.kernels.attention_decode import (decode_attention, decode_attention_int8,  # noqa: E402
                                             decode_attention_reference)
from engine.kernels.rope_cache import qk_norm_rope_write, qk_norm_rope_write_reference  # noqa: E402
from engine.runtime.kv_cache import KVCache  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from quant.kv_quant import quantize_rows  # noqa: E402
# the module's autouse fixture (Triton's interpreter rounding like a GPU) and helpers, shared
from tests.test_kernels_attention import _interpreter_like_gpu, ints, random_qwen3_model  # noqa: E402,F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = ModelConfig(architecture="qwen3", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)


def quantized(kv_type: str, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, v_rotate: bool = False):
    """Codes of k and v [slots, KV, S, D] in the kv type's formats (values rotated by H if v_rotate), and
    the scale tensors by name."""
    elements = {"int8": ("int8", "int8"), "int4": ("int4", "int4"), "k8v4": ("int8", "int4")}[kv_type]
    kp = quantize_rows(elements[0], k, dtype)
    vp = quantize_rows(elements[1], v, dtype, rotate=v_rotate)
    scales = {f"k_{n}": t for n, t in kp.items() if n} | {f"v_{n}": t for n, t in vp.items() if n}
    return kp[""], vp[""], scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_type", ["int8", "int4", "k8v4"])
def test_rope_write_quantizes_like_the_reference(kv_type, dtype):
    h, kv, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    g = torch.Generator().manual_seed(1)
    qkv = (3 * torch.randn(3, (h + 2 * kv) * d, generator=g)).to(DEVICE)  # [M, (H + 2KV) * D] float32 workspace
    weights = [(1 + 0.5 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in range(2)]
    inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float().to(DEVICE)
    positions, slots = torch.tensor([0, 5, 8], device=DEVICE), ints([1, 0, 1])  # 8: past the cache, dropped
    got, want = (KVCache(CFG, 8, num_slots=2, dtype=dtype, device=DEVICE, kv_type=kv_type) for _ in range(2))
    got.key_offset = want.key_offset = torch.randn(1, kv, d, generator=g).to(DEVICE)  # [L, KV, D]
    got.value_rotation = want.value_rotation = kv_type != "int8"  # int4 values rotated too
    q = qk_norm_rope_write(qkv, positions, slots, inv_freq, got.k[0], got.v[0], h, kv, d, *weights,
                           out_dtype=dtype, **got.layer_write_args(0))
    q_ref = qk_norm_rope_write_reference(qkv, positions, slots, inv_freq, want.k[0], want.v[0], h, kv, d, *weights,
                                         out_dtype=dtype, **want.layer_write_args(0))
    no_offset = KVCache(CFG, 8, num_slots=2, dtype=dtype, device=DEVICE, kv_type=kv_type)
    qk_norm_rope_write_reference(qkv, positions, slots, inv_freq, no_offset.k[0], no_offset.v[0], h, kv, d, *weights,
                                 out_dtype=dtype, **no_offset.layer_write_args(0))
    assert not torch.equal(no_offset.k, want.k)  # the offset is subtracted before quantizing
    torch.testing.assert_close(q, q_ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    _assert_rows_written_alike(got, want, dtype)


@pytest.mark.parametrize("kv_type", ["int8", "int4", "k8v4"])
def test_decode_attention_reads_the_codes(kv_type):
    h, kv, d, s = 4, 2, 64, 150
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 2, kv, s, d, generator=g).to(DEVICE)  # [slots, KV, S, D] each
    q = (2 * torch.randn(3, h, d, generator=g)).to(DEVICE)  # [M, H, D]
    v_rotate = kv_type != "int8"  # int4 values stored rotated, the output rotated back
    k_codes, v_codes, scales = quantized(kv_type, k, v, torch.float32, v_rotate)
    scales_only = dict(scales)
    if v_rotate:
        scales["v_rotate"] = True
    slot_ids, lens = ints([1, 0, 1]), ints([150, 37, 65])
    for name, t in scales_only.items():  # poison every scale past each row's length: never read
        t[1, :, 150:] = float("nan")
        t[0, :, 37:] = float("nan")
    for splits in (1, 2):  # one split and v_rotate: the combine kernel runs anyway, to rotate back
        got = decode_attention(q, k_codes, v_codes, slot_ids, lens, d ** -0.5, splits, **scales)
        want = decode_attention_reference(q, k_codes, v_codes, slot_ids, lens, d ** -0.5, **scales)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    exact = decode_attention_reference(q, k, v, slot_ids, lens, d ** -0.5)  # the float cache: close, not equal
    error = (got - exact).abs().max().item()
    assert 0 < error < (0.05 if kv_type == "int8" else 0.5), error
    xq, sx, _ = decode_attention_int8(q, k_codes, v_codes, slot_ids, lens, d ** -0.5, 2, **scales)
    torch.testing.assert_close(xq.float() * sx.repeat_interleave(d, dim=1), got.reshape(3, h * d),
                               atol=0.6 * sx.max().item(), rtol=0)


def test_bfloat16_queries_on_an_int8_cache():
    h, kv, d, s = 4, 1, 128, 70
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 1, kv, s, d, generator=g).to(DEVICE)
    q = torch.randn(2, h, d, generator=g).to(DEVICE, torch.bfloat16)
    k_codes, v_codes, scales = quantized("int8", k, v, torch.bfloat16)
    got = decode_attention(q, k_codes, v_codes, ints([0, 0]), ints([70, 3]), d ** -0.5, 1, **scales)
    want = decode_attention_reference(q, k_codes, v_codes, ints([0, 0]), ints([70, 3]), d ** -0.5, **scales)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_quantized_cache_shapes_are_checked():
    k, v = torch.randn(2, 1, 2, 16, 64).to(DEVICE)
    k_codes, v_codes, scales = quantized("int4", k, v, torch.float32)
    q, one = torch.randn(1, 4, 64, device=DEVICE), ints([1])
    with pytest.raises(UnsupportedKernelShape, match="v_min"):
        decode_attention(q, k_codes, v_codes, one, one, 1.0, 1, k_scale=scales["k_scale"], k_min=scales["k_min"],
                         v_scale=scales["v_scale"])
    with pytest.raises(UnsupportedKernelShape, match="float k cache takes no scale"):
        decode_attention(q, k, v_codes, one, one, 1.0, 1, **scales)


@pytest.mark.parametrize("kv_type", ["int8", "int4"])
def test_model_on_a_rotated_cache_kernels_equal_plain_torch(kv_type):
    """Every path over a quantized cache with centred, rotated keys: the plain prologue (KVCache.write,
    key_space, the prefill reference) against the fused one (the rope / KV-write kernel rotating k and
    q, the prefill kernel reading the codes), on a prefill then batched rows of two slots. Both close to
    the float cache; forgetting to rotate q on either path would not be."""
    from engine.runtime.kv_cache import CacheBatch
    cfg, model = random_qwen3_model()
    tokens = torch.randint(0, 64, (2, 6), device=DEVICE)
    offset = torch.randn(cfg.num_layers, cfg.num_kv_heads, 64, device=DEVICE)  # [L, KV, D]
    results = {}
    for name, fused in (("float", False), ("plain", False), ("fused", True)):
        model.use_fused_prologue(fused)
        cache = KVCache(cfg, 16, num_slots=2, dtype=torch.float32, device=DEVICE,
                        kv_type="bf16" if name == "float" else kv_type)
        if name != "float":
            cache.key_offset = offset
            cache.value_rotation = kv_type == "int4"
            assert cache.key_rotation
        with torch.no_grad():
            first = model(tokens[:1], CacheBatch.make([1], [0], 6, DEVICE), cache, 6, None)  # [1, 6, V]
            model(tokens[1:, :3], CacheBatch.make([0], [0], 3, DEVICE), cache, 3, None)
            both = model(tokens[:, :1], CacheBatch.make([1, 0], [6, 3], 1, DEVICE), cache, 7, None)  # [2, 1, V]
        results[name] = torch.cat([first[0], both[:, 0]])  # [8, V]
    model.use_fused_prologue(False)
    top = results["float"].abs().max().item()
    torch.testing.assert_close(results["fused"], results["plain"], rtol=0, atol=(2e-4 if kv_type == "int8" else 2e-2) * top)
    error = (results["plain"] - results["float"]).abs().max().item() / top
    assert 0 < error < (0.02 if kv_type == "int8" else 0.2), error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_type", ["int8", "int4", "k8v4"])
def test_gated_rope_write_quantizes_like_the_reference(kv_type, dtype):
    """A hybrid's gated attention prologue (partial rotary over 16 of 64 values) on a quantized cache: the
    key offset and the Hadamard rotations as KVCache.layer_write_args gives them."""
    from engine.kernels.gated_rope import gated_rope_write, gated_rope_write_reference
    h, kv, d, rh = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, 8
    g = torch.Generator().manual_seed(4)
    qkv = (3 * torch.randn(3, 2 * (h + kv) * d, generator=g)).to(DEVICE)  # [M, 2H·D + 2KV·D] float32
    weights = [(1 + 0.5 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in range(2)]
    inv_freq = (1.0 / 10000 ** (torch.arange(rh, dtype=torch.float64) / rh)).float().to(DEVICE)
    positions, slots = torch.tensor([0, 5, 8], device=DEVICE), ints([1, 0, 1])  # 8: past the cache, dropped
    got, want = (KVCache(CFG, 8, num_slots=2, dtype=dtype, device=DEVICE, kv_type=kv_type) for _ in range(2))
    got.key_offset = want.key_offset = torch.randn(1, kv, d, generator=g).to(DEVICE)  # [L, KV, D]
    args = (positions, slots, inv_freq, *weights)
    q = gated_rope_write(qkv, *args, got.k[0], got.v[0], h, kv, d, 1e-6, out_dtype=dtype, **got.layer_write_args(0))
    q_ref = gated_rope_write_reference(qkv, *args, want.k[0], want.v[0], h, kv, d, 1e-6, out_dtype=dtype,
                                       **want.layer_write_args(0))
    assert want.layer_write_args(0)["k_rotate"] and want.value_rotation == (kv_type != "int8")
    torch.testing.assert_close(q, q_ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    _assert_rows_written_alike(got, want, dtype)
    # what the reference writes is the eager path's KVCache.write of the projected keys, read back the same
    eager = KVCache(CFG, 8, num_slots=2, dtype=dtype, device=DEVICE, kv_type=kv_type)
    eager.key_offset = want.key_offset
    float_cache = [torch.zeros(2, kv, 8, d, dtype=dtype, device=DEVICE) for _ in range(2)]
    q_float = gated_rope_write_reference(qkv, *args, *float_cache, h, kv, d, 1e-6)
    from engine.runtime.kv_cache import CacheBatch
    for r in (0, 1):
        batch = CacheBatch.make([int(slots[r])], [int(positions[r])], 1, DEVICE)
        eager.write(0, batch, float_cache[0][slots[r], :, positions[r]][None, :, None],
                    float_cache[1][slots[r], :, positions[r]][None, :, None])
    for name in eager.tensors:
        assert torch.equal(eager.tensors[name], want.tensors[name]), name
    torch.testing.assert_close(q_ref, eager.key_space(q_float))


def _assert_rows_written_alike(got: KVCache, want: KVCache, dtype: torch.dtype) -> None:
    """Two caches' codes and scales after writing rows (slot 0, position 5) and (slot 1, position 0): float32
    bit-exact, else codes within one step and scales within one float16 step on at most 5% of the entries."""
    for name, t in got.tensors.items():
        ref = want.tensors[name]
        if t.dtype == torch.float16:  # scales and minima: equal, or one float16 step apart
            torch.testing.assert_close(t, ref, rtol=2e-3, atol=0)
        elif t.dtype == torch.uint8:  # int4 codes two per byte: each nibble within one step
            assert ((t & 15).int() - (ref & 15).int()).abs().max() <= 1
            assert ((t >> 4).int() - (ref >> 4).int()).abs().max() <= 1
        else:
            assert (t.int() - ref.int()).abs().max() <= 1
        differ = (t != ref).float().mean().item()
        assert differ <= (0 if dtype == torch.float32 else 0.05), (name, differ)  # float32: bit-exact
        written = t[0, :, :, 5].abs().sum() + t[0, 1, :, 0].abs().sum()
        assert written > 0 and (t[0, 0, :, :5] == 0).all()  # only rows (slot 0, pos 5), (slot 1, pos 0)

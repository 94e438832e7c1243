"""The prologue of a hybrid's gated attention layer in one launch (Qwen3.5 / Qwen3.6, engine.runtime.hybrid_step):
q/k RMSNorm, the partial rotary (half-split over the first R of each head's D values, the rest passed), the K/V
write at [slot, head, position] and q out. One program per (row, head) of the fused projection, whose q part
holds per head D query values then D gate values (the gate is left to the caller). The roundings are the eager
path's (engine.runtime.model.Attention.project): the projection rounded to the model's dtype, the norm in float32
rounded again, the rotary in float32 rounded again.
A quantized cache (int8 / int4 codes with float16 scales, engine/kernels/kv_codes.py) is written as the dense
models' rope kernel writes it (engine/kernels/rope_cache.py, whose row store this kernel shares): the row in the
model's dtype, minus the layer's key offset (keys, float32), rotated by the Hadamard matrix where the cache's keys
(and then q) or values are, quantized in the same program. A head is handled as its two halves [D/2] (the layout
the row store and the Hadamard transform take); each element's rotary partner is loaded apart.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2
from engine.kernels.hadamard import hadamard_halves
from engine.kernels.kv_codes import FLOAT, cache_format, scale_strides, write_rows
from engine.kernels.rope_cache import _store_row
from quant.kv_quant import transform_queries


@triton.jit
def _round(x, ref):
    """x rounded to the element dtype of the pointer ref (the model's dtype), as float32."""
    return x.to(ref.dtype.element_ty).to(tl.float32)


@triton.jit
def _normed(src, norm_ptr, idx, inv_rms, ref):
    """The normed values at idx [HALF] of a head (src: its first value), rounded as the model rounds them."""
    x = _round(tl.load(src + idx), ref)
    return _round(x * inv_rms * tl.load(norm_ptr + idx).to(tl.float32), ref)


@triton.jit
def _rotated(src, norm_ptr, inv_freq_ptr, idx, inv_rms, pos, ref, RH: tl.constexpr):
    """Values idx [HALF] of a q or k head after norm and the partial rotary over its first 2·RH values, in the
    model's dtype (as float32)."""
    partner = tl.where(idx < RH, idx + RH, tl.where(idx < 2 * RH, idx - RH, idx))  # [HALF]
    x = _normed(src, norm_ptr, idx, inv_rms, ref)
    xp = _normed(src, norm_ptr, partner, inv_rms, ref)
    pair = tl.where(idx < RH, idx, idx - RH)
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + pair, mask=idx < 2 * RH, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    r = tl.where(idx < RH, x * cos - xp * sin, x * cos + xp * sin)
    return _round(tl.where(idx < 2 * RH, r, x), ref)


@triton.jit
def _gated_rope_write_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr,
                             v_cache_ptr, q_out_ptr, k_scale_ptr, k_min_ptr, v_scale_ptr, v_min_ptr, k_offset_ptr,
                             stride_m, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                             stride_kss, stride_ksh, stride_kst, stride_vss, stride_vsh, stride_vst,
                             stride_qm, stride_qh, max_seq, eps, NUM_HEADS: tl.constexpr,
                             NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, RH: tl.constexpr,
                             K_FMT: tl.constexpr, V_FMT: tl.constexpr, HAS_K_OFFSET: tl.constexpr,
                             K_ROTATE: tl.constexpr, V_ROTATE: tl.constexpr):
    m, j = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, HALF)  # [HALF]: the first half of a head; HALF + cols the second
    pos = tl.load(pos_ptr + m)
    slot = tl.load(slot_ptr + m).to(tl.int64)
    at = pos.to(tl.int64)
    row = qkv_ptr + m * stride_m
    if j < NUM_HEADS + NUM_KV_HEADS:  # a q head (its D query values) or a k head: norm, rotary
        is_q = j < NUM_HEADS
        kh = j - NUM_HEADS
        src = row + tl.where(is_q, j * 4 * HALF, NUM_HEADS * 4 * HALF + kh * 2 * HALF)
        norm_ptr = tl.where(is_q, q_norm_ptr, k_norm_ptr)
        x1 = _round(tl.load(src + cols), q_out_ptr)
        x2 = _round(tl.load(src + HALF + cols), q_out_ptr)
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        a1 = _rotated(src, norm_ptr, inv_freq_ptr, cols, inv_rms, pos, q_out_ptr, RH)  # [HALF]
        a2 = _rotated(src, norm_ptr, inv_freq_ptr, HALF + cols, inv_rms, pos, q_out_ptr, RH)
        if is_q:
            if K_ROTATE:  # q in the rotated keys' space: rotated in float32, rounded again
                a1, a2 = hadamard_halves(a1, a2, HALF)
            q_dst = q_out_ptr + m * stride_qm + j * stride_qh
            tl.store(q_dst + cols, a1.to(q_out_ptr.dtype.element_ty))
            tl.store(q_dst + HALF + cols, a2.to(q_out_ptr.dtype.element_ty))
        else:
            # each branch its own names: Triton refuses a variable two runtime branches give other pointer types
            k_dst = k_cache_ptr + slot * stride_ks + kh * stride_kh + at * stride_kt
            k_at = slot * stride_kss + kh * stride_ksh + at * stride_kst
            if HAS_K_OFFSET:
                a1 -= tl.load(k_offset_ptr + kh * 2 * HALF + cols)
                a2 -= tl.load(k_offset_ptr + kh * 2 * HALF + HALF + cols)
            if K_ROTATE:
                a1, a2 = hadamard_halves(a1, a2, HALF)
            _store_row(k_dst, k_scale_ptr + k_at, k_min_ptr + k_at, a1, a2, cols, pos, max_seq, K_FMT, HALF)
    else:  # a v head: copied to the cache (rotated first where the cache's values are)
        vh = j - NUM_HEADS - NUM_KV_HEADS
        src = row + NUM_HEADS * 4 * HALF + NUM_KV_HEADS * 2 * HALF + vh * 2 * HALF
        a1 = _round(tl.load(src + cols), q_out_ptr)
        a2 = _round(tl.load(src + HALF + cols), q_out_ptr)
        if V_ROTATE:
            a1, a2 = hadamard_halves(a1, a2, HALF)
        v_dst = v_cache_ptr + slot * stride_vs + vh * stride_vh + at * stride_vt
        v_at = slot * stride_vss + vh * stride_vsh + at * stride_vst
        _store_row(v_dst, v_scale_ptr + v_at, v_min_ptr + v_at, a1, a2, cols, pos, max_seq, V_FMT, HALF)


def gated_rope_write(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, inv_freq: torch.Tensor,
                     q_norm: torch.Tensor, k_norm: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                     out_dtype: torch.dtype | None = None, k_scale: torch.Tensor | None = None,
                     k_min: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     v_min: torch.Tensor | None = None, k_offset: torch.Tensor | None = None,
                     k_rotate: bool = False, v_rotate: bool = False) -> torch.Tensor:
    """qkv [M, 2·H·D + 2·KV·D] (per q head D query then D gate values; then k, v); positions, slot_ids [M]
    integers; inv_freq [R/2] float32 (R ≤ D: the rotated values of a head); q_norm, k_norm [D]; caches
    [slots, KV, S, D] of the model's dtype, or the codes of a quantized cache with their scales
    (KVCache.layer_write_args: k_scale / k_min / v_scale / v_min, k_offset [KV, D] float32, k_rotate, v_rotate),
    written at each row's position (a position ≥ S is not). Returns q [M, H, D] in out_dtype (the model's dtype;
    default: a float cache's), rotated as the stored keys are."""
    scales = {n: t for n, t in (("k_scale", k_scale), ("k_min", k_min), ("v_scale", v_scale), ("v_min", v_min))
              if t is not None}
    m, k_fmt, v_fmt, dtype = _check(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads,
                                    head_dim, out_dtype, scales, k_offset, k_rotate, v_rotate)
    q = torch.empty(m, num_heads, head_dim, dtype=dtype, device=qkv.device)  # [M, H, D]
    if m == 0:
        return q
    half = head_dim // 2
    _gated_rope_write_kernel[(m, num_heads + 2 * num_kv_heads)](
        qkv, positions, slot_ids, inv_freq, q_norm, k_norm, k_cache, v_cache, q,
        k_scale if k_scale is not None else k_cache, k_min if k_min is not None else k_cache,
        v_scale if v_scale is not None else v_cache, v_min if v_min is not None else v_cache,
        k_offset if k_offset is not None else inv_freq, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *scale_strides(k_fmt, k_scale), *scale_strides(v_fmt, v_scale), q.stride(0), q.stride(1),
        k_cache.shape[2], eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, RH=inv_freq.shape[0],
        K_FMT=k_fmt, V_FMT=v_fmt, HAS_K_OFFSET=k_offset is not None, K_ROTATE=k_rotate, V_ROTATE=v_rotate,
        num_warps=1 if half <= 64 else 2)
    return q


def gated_rope_write_reference(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                               inv_freq: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                               head_dim: int, eps: float, out_dtype: torch.dtype | None = None,
                               k_scale: torch.Tensor | None = None, k_min: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, v_min: torch.Tensor | None = None,
                               k_offset: torch.Tensor | None = None, k_rotate: bool = False,
                               v_rotate: bool = False) -> torch.Tensor:
    """Plain torch, the eager path's maths (Attention.project, then KVCache.write and KVCache.key_space)."""
    from engine.runtime.model import apply_rotary
    m = qkv.shape[0]
    dtype = out_dtype or k_cache.dtype
    q_rows, kv = 2 * num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_rows, kv, kv], dim=-1)
    q = q.view(m, num_heads, 2 * head_dim)[..., :head_dim].to(dtype)  # [M, H, D]
    k = k.reshape(m, num_kv_heads, head_dim).to(dtype)  # [M, KV, D]
    q, k = (torch.nn.functional.rms_norm(x.float(), (head_dim,), w.float(), eps).to(dtype)
            for x, w in ((q, q_norm), (k, k_norm)))
    angles = positions[:, None].float() * inv_freq  # [M, R/2]
    cos, sin = angles.cos()[:, None, None], angles.sin()[:, None, None]  # [M, 1, 1, R/2]
    q = apply_rotary(q[:, None], cos, sin)[:, 0]  # [M, H, D]
    k = apply_rotary(k[:, None], cos, sin)[:, 0]  # [M, KV, D]
    keep = positions < k_cache.shape[2]  # [M]
    rows = (slot_ids[keep, None].long(), torch.arange(num_kv_heads, device=qkv.device)[None, :],
            positions[keep, None].long())
    write_rows(k_cache, k_scale, k_min, rows, k[keep], dtype if k_scale is not None else k_cache.dtype, k_offset,
               k_rotate)
    write_rows(v_cache, v_scale, v_min, rows, v.reshape(m, num_kv_heads, head_dim)[keep],
               dtype if v_scale is not None else v_cache.dtype, rotate=v_rotate)
    return transform_queries(q, k_rotate).contiguous()


def _check(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim, out_dtype,
           scales, k_offset, k_rotate, v_rotate) -> tuple[int, int, int, torch.dtype]:
    """(rows, the keys' and values' element formats, q's dtype) after checking every input."""
    m = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 2 * (num_heads + num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise UnsupportedKernelShape(f"gated_rope_write needs qkv [M, {2 * (num_heads + num_kv_heads) * head_dim}] "
                                     f"(contiguous rows); got {tuple(qkv.shape)}")
    if head_dim < 4 or next_power_of_2(head_dim) != head_dim:
        raise UnsupportedKernelShape(f"gated_rope_write needs a power-of-two head_dim; got {head_dim}")
    k_fmt = cache_format("k", k_cache, scales.get("k_scale"), scales.get("k_min"), head_dim)
    v_fmt = cache_format("v", v_cache, scales.get("v_scale"), scales.get("v_min"), head_dim)
    lead = (k_cache.shape[0], num_kv_heads, k_cache.shape[2]) if k_cache.dim() == 4 else None
    for name, cache, fmt in (("k", k_cache, k_fmt), ("v", v_cache, v_fmt)):
        if cache.dim() != 4 or tuple(cache.shape[:3]) != lead or cache.stride(3) != 1 \
                or (fmt == FLOAT and cache.shape[3] != head_dim):
            raise UnsupportedKernelShape(f"gated_rope_write needs {name} cache [slots, {num_kv_heads}, S, "
                                         f"{head_dim}] (or its codes); got {tuple(cache.shape)} {cache.dtype}")
    floats = {c.dtype for c, f in ((k_cache, k_fmt), (v_cache, v_fmt)) if f == FLOAT}
    dtype = out_dtype or next(iter(floats), None)
    if dtype is None or not dtype.is_floating_point or len(floats) > 1 or floats - {dtype}:
        raise UnsupportedKernelShape(f"gated_rope_write needs float caches of the model's dtype (out_dtype) and "
                                     f"out_dtype for two quantized caches; got k {k_cache.dtype}, v {v_cache.dtype}, "
                                     f"out_dtype {out_dtype}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > head_dim or inv_freq.dtype != torch.float32:
        raise UnsupportedKernelShape(f"gated_rope_write needs float32 inv_freq [R/2] with R <= {head_dim}; got "
                                     f"{tuple(inv_freq.shape)} {inv_freq.dtype}")
    for what, t in (("positions", positions), ("slot_ids", slot_ids)):
        if t.shape != (m,) or t.dtype.is_floating_point:
            raise UnsupportedKernelShape(f"gated_rope_write needs integer {what} [{m}]; got {tuple(t.shape)} {t.dtype}")
    if k_offset is not None and (k_fmt == FLOAT or tuple(k_offset.shape) != (num_kv_heads, head_dim)
                                 or k_offset.dtype != torch.float32 or not k_offset.is_contiguous()):
        raise UnsupportedKernelShape(f"gated_rope_write needs k_offset float32 [{num_kv_heads}, {head_dim}] "
                                     f"(contiguous) with quantized keys; got {tuple(k_offset.shape)} {k_offset.dtype}")
    if (k_rotate and k_fmt == FLOAT) or (v_rotate and v_fmt == FLOAT):
        raise UnsupportedKernelShape("gated_rope_write rotates quantized keys / values only")
    return m, k_fmt, v_fmt, dtype

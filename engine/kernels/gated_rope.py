"""The prologue of a hybrid's gated attention layer in one launch (Qwen3.5 / Qwen3.6, engine.runtime.hybrid_step):
q/k RMSNorm, the partial rotary (half-split over the first R of each head's D values, the rest passed), the K/V
write at [slot, head, position] and q out. One program per (row, head) of the fused projection, whose q part
holds per head D query values then D gate values (the gate is left to the caller). The roundings are the eager
path's (engine.runtime.model.Attention.project): the projection rounded to the model's dtype, the norm in float32
rounded again, the rotary in float32 rounded again. Float caches only (hybrids run bf16 KV).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, next_power_of_2


@triton.jit
def _round(x, dtype_ref):
    return x.to(dtype_ref.dtype.element_ty).to(tl.float32)


@triton.jit
def _gated_rope_write_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr,
                             v_cache_ptr, q_out_ptr, stride_m, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh,
                             stride_vt, stride_qm, stride_qh, max_seq, eps, NUM_HEADS: tl.constexpr,
                             NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, HALF: tl.constexpr,
                             BH: tl.constexpr):
    m, j = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BD)  # [BD] the head's values
    half = tl.arange(0, BH)  # [BH] the rotated pairs (i, i + HALF)
    pos = tl.load(pos_ptr + m)
    slot = tl.load(slot_ptr + m).to(tl.int64)
    row = qkv_ptr + m * stride_m
    if j < NUM_HEADS + NUM_KV_HEADS:  # a q head (its D query values) or a k head: norm, rotary
        is_q = j < NUM_HEADS
        kh = j - NUM_HEADS
        base = tl.where(is_q, j * 2 * D, NUM_HEADS * 2 * D + kh * D)
        norm_ptr = tl.where(is_q, q_norm_ptr, k_norm_ptr)
        if is_q:
            dst = q_out_ptr + m * stride_qm + j * stride_qh
        else:
            dst = k_cache_ptr + slot * stride_ks + kh * stride_kh + pos.to(tl.int64) * stride_kt
        x = _round(tl.load(row + base + cols, mask=cols < D, other=0.0), dst)  # [BD]
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(norm_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        in_cache = (cols * 0 + pos) < max_seq
        tl.store(dst + cols, _round(x * inv_rms * w, dst).to(dst.dtype.element_ty),
                 mask=(cols >= 2 * HALF) & (cols < D) & in_cache)  # the values past the rotary, normed
        hm = half < HALF
        x1 = _round(tl.load(row + base + half, mask=hm, other=0.0), dst)
        x2 = _round(tl.load(row + base + HALF + half, mask=hm, other=0.0), dst)
        x1 = _round(x1 * inv_rms * tl.load(norm_ptr + half, mask=hm, other=0.0).to(tl.float32), dst)
        x2 = _round(x2 * inv_rms * tl.load(norm_ptr + HALF + half, mask=hm, other=0.0).to(tl.float32), dst)
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + half, mask=hm, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        in_half = hm & ((half * 0 + pos) < max_seq)
        tl.store(dst + half, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=in_half)
        tl.store(dst + HALF + half, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=in_half)
    else:  # a v head: copied to the cache
        vh = j - NUM_HEADS - NUM_KV_HEADS
        dst = v_cache_ptr + slot * stride_vs + vh * stride_vh + pos.to(tl.int64) * stride_vt
        v = tl.load(row + NUM_HEADS * 2 * D + NUM_KV_HEADS * D + vh * D + cols, mask=cols < D, other=0.0)
        tl.store(dst + cols, v.to(dst.dtype.element_ty), mask=(cols < D) & ((cols * 0 + pos) < max_seq))


def gated_rope_write(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, inv_freq: torch.Tensor,
                     q_norm: torch.Tensor, k_norm: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """qkv [M, 2·H·D + 2·KV·D] (per q head D query then D gate values; then k, v); positions, slot_ids [M]
    integers; inv_freq [R/2] float32 (R ≤ D: the rotated values of a head); q_norm, k_norm [D]; caches
    [slots, KV, S, D] of the model's dtype, written at each row's position. Returns q [M, H, D] in that dtype."""
    m = _check(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    q = torch.empty(m, num_heads, head_dim, dtype=k_cache.dtype, device=qkv.device)  # [M, H, D]
    half = inv_freq.shape[0]
    _gated_rope_write_kernel[(m, num_heads + 2 * num_kv_heads)](
        qkv, positions, slot_ids, inv_freq, q_norm, k_norm, k_cache, v_cache, q, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), q.stride(0), q.stride(1), k_cache.shape[2], eps, NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, D=head_dim, BD=next_power_of_2(head_dim), HALF=half, BH=next_power_of_2(half))
    return q


def gated_rope_write_reference(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                               inv_freq: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                               head_dim: int, eps: float) -> torch.Tensor:
    from engine.runtime.model import apply_rotary
    m, dtype = qkv.shape[0], k_cache.dtype
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
    rows, at = slot_ids.long(), positions.long()
    k_cache[rows, :, at] = k
    v_cache[rows, :, at] = v.reshape(m, num_kv_heads, head_dim).to(dtype)
    return q.contiguous()


def _check(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim) -> int:
    m = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 2 * (num_heads + num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise UnsupportedKernelShape(f"gated_rope_write needs qkv [M, {2 * (num_heads + num_kv_heads) * head_dim}] "
                                     f"(contiguous rows); got {tuple(qkv.shape)}")
    want = (num_kv_heads, head_dim)
    for name, cache in (("k", k_cache), ("v", v_cache)):
        if cache.dim() != 4 or (cache.shape[1], cache.shape[3]) != want or cache.stride(3) != 1 \
                or cache.dtype != k_cache.dtype or not cache.dtype.is_floating_point:
            raise UnsupportedKernelShape(f"gated_rope_write needs float {name} cache [slots, {num_kv_heads}, S, "
                                         f"{head_dim}]; got {tuple(cache.shape)} {cache.dtype}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > head_dim or inv_freq.dtype != torch.float32:
        raise UnsupportedKernelShape(f"gated_rope_write needs float32 inv_freq [R/2] with R <= {head_dim}; got "
                                     f"{tuple(inv_freq.shape)} {inv_freq.dtype}")
    for what, t in (("positions", positions), ("slot_ids", slot_ids)):
        if t.shape != (m,) or t.dtype.is_floating_point:
            raise UnsupportedKernelShape(f"gated_rope_write needs integer {what} [{m}]; got {tuple(t.shape)} {t.dtype}")
    return m

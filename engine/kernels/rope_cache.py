"""q/k RMSNorm (Qwen3) + rotary embedding + KV-cache write, fused in one launch.

One program per (token row, head) of the fused qkv projection: a q head is normed, rotated and written
to the returned q; a k head is normed, rotated and written to the k cache at [slot, head, position];
a v head is copied to the v cache. The maths and roundings are those of engine/runtime/model.py: the norm in
float32 rounded to the activation dtype, then the half-split (NeoX / HF) rotary in float32 rounded again.
A quantized cache (int8 or int4 codes with float16 scales, engine/kernels/kv_codes.py) gets the row
rounded to the model's dtype (q's output dtype) and quantized in the same program, as quant/kv_quant.py does;
quantized keys have the layer's key offset (KVCache.key_offset) subtracted first, in float32, and with
`k_rotate` they are then rotated by the orthonormal Hadamard matrix H over head_dim (a fast Walsh-Hadamard
transform in registers, engine/kernels/hadamard.py), and so is q (rounded
to the model's dtype, rotated in float32, rounded again): attention then reads rotated keys with
rotated queries, (qH)·(kH) = q·k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait
from quant.kernels import pdl_options

from engine.kernels import UnsupportedKernelShape
from engine.kernels.hadamard import hadamard_halves
from engine.kernels.kv_codes import FLOAT, INT4, INT8, cache_format, scale_strides, write_rows
from quant.kv_quant import transform_queries

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _store_row(dst, scale_dst, min_dst, a1, a2, cols, pos, max_seq, FMT: tl.constexpr, HALF: tl.constexpr):
    """Store one row given as its two halves a1, a2 [HALF] (float32 values of the model's dtype, or
    any values for a float cache) in the cache's format at dst (codes) / scale_dst / min_dst. A position
    past the cache is dropped (the comparisons are made on vectors: the interpreter mistypes a scalar
    comparison used as a mask)."""
    in_cache = cols * 0 + pos < max_seq  # [HALF]
    if FMT == 0:  # float: the values themselves
        tl.store(dst + cols, a1.to(dst.dtype.element_ty), mask=in_cache)
        tl.store(dst + HALF + cols, a2.to(dst.dtype.element_ty), mask=in_cache)
    elif FMT == 1:  # int8, one scale per row: max|x| / 127 rounded to float16, codes from the rounded scale
        amax = tl.maximum(tl.max(tl.abs(a1), 0), tl.max(tl.abs(a2), 0))
        scale = tl.minimum(amax / 127.0, 65504.0).to(tl.float16).to(tl.float32)
        inv = tl.where(scale > 0, 1.0 / scale, 0.0)
        c1 = tl.minimum(tl.maximum(tl.floor(a1 * inv + 0.5), -127.0), 127.0)
        c2 = tl.minimum(tl.maximum(tl.floor(a2 * inv + 0.5), -127.0), 127.0)
        tl.store(dst + cols, c1.to(tl.int8), mask=in_cache)
        tl.store(dst + HALF + cols, c2.to(tl.int8), mask=in_cache)
        tl.store(scale_dst + cols * 0, (tl.zeros_like(a1) + scale).to(tl.float16),
                 mask=in_cache & (cols == 0))  # lane 0 stores the row's scale
    else:  # int4: whole groups of 32 in each half, float16 scale and min per group, two codes per byte
        _store_int4_half(dst, scale_dst, min_dst, a1, pos, max_seq, 0, HALF)
        _store_int4_half(dst, scale_dst, min_dst, a2, pos, max_seq, HALF, HALF)


@triton.jit
def _store_int4_half(dst, scale_dst, min_dst, a, pos, max_seq, OFFSET: tl.constexpr, HALF: tl.constexpr):
    GROUPS: tl.constexpr = HALF // 32
    g = tl.reshape(a, [GROUPS, 32])  # [G, 32]
    low = tl.minimum(tl.maximum(tl.min(g, 1), -65504.0), 65504.0).to(tl.float16).to(tl.float32)  # [G]
    scale = tl.minimum((tl.max(g, 1) - low) / 15.0, 65504.0).to(tl.float16).to(tl.float32)  # [G]
    inv = tl.where(scale > 0, 1.0 / scale, 0.0)
    codes = tl.minimum(tl.maximum(tl.floor((g - low[:, None]) * inv[:, None] + 0.5), 0.0), 15.0)  # [G, 32]
    even, odd = tl.split(tl.reshape(codes, [HALF // 2, 2]))  # elements 2j and 2j + 1, [HALF / 2] each
    pairs = tl.arange(0, HALF // 2)
    tl.store(dst + OFFSET // 2 + pairs, even.to(tl.uint8) | (odd.to(tl.uint8) << 4), mask=pairs * 0 + pos < max_seq)
    groups = tl.arange(0, GROUPS)
    tl.store(scale_dst + OFFSET // 32 + groups, scale.to(tl.float16), mask=groups * 0 + pos < max_seq)
    tl.store(min_dst + OFFSET // 32 + groups, low.to(tl.float16), mask=groups * 0 + pos < max_seq)


@triton.jit
def _qk_norm_rope_write_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr,
                               k_cache_ptr, v_cache_ptr, q_out_ptr, k_scale_ptr, k_min_ptr, v_scale_ptr, v_min_ptr,
                               k_offset_ptr,
                               stride_qkv, stride_qo_m, stride_qo_h,
                               stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                               stride_kss, stride_ksh, stride_kst, stride_vss, stride_vsh, stride_vst, max_seq, eps,
                               NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                               HAS_NORM: tl.constexpr, ZERO_INPUT: tl.constexpr, K_FMT: tl.constexpr,
                               V_FMT: tl.constexpr, HAS_K_OFFSET: tl.constexpr, ROTATE: tl.constexpr,
                               V_ROTATE: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: let the next kernel start, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    cols = tl.arange(0, HALF)
    src = qkv_ptr + row * stride_qkv + head * (2 * HALF)
    x1 = tl.load(src + cols)  # [HALF] first half of the head
    x2 = tl.load(src + HALF + cols)  # [HALF] second half
    if ZERO_INPUT:  # leave the input zeroed: the next step's split-K projection accumulates into it
        tl.store(src + cols, tl.zeros_like(x1))
        tl.store(src + HALF + cols, tl.zeros_like(x2))
    in_dtype = x1.dtype
    pos = tl.load(pos_ptr + row)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    model_dtype = q_out_ptr.dtype.element_ty  # what a quantized row is rounded to before quantizing
    if head >= NUM_HEADS + NUM_KV_HEADS:
        kv_head = head - NUM_HEADS - NUM_KV_HEADS
        v_dst = v_cache_ptr + slot * stride_vs + kv_head * stride_vh + pos * stride_vt
        v_scale = slot * stride_vss + kv_head * stride_vsh + pos * stride_vst
        if V_FMT == 0:
            _store_row(v_dst, v_scale_ptr, v_min_ptr, x1, x2, cols, pos, max_seq, V_FMT, HALF)
        else:
            v1 = x1.to(model_dtype).to(tl.float32)
            v2 = x2.to(model_dtype).to(tl.float32)
            if V_ROTATE:
                v1, v2 = hadamard_halves(v1, v2, HALF)
            _store_row(v_dst, v_scale_ptr + v_scale, v_min_ptr + v_scale, v1, v2, cols, pos, max_seq, V_FMT, HALF)
    else:
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        if HAS_NORM:
            if head < NUM_HEADS:
                w1 = tl.load(q_norm_ptr + cols).to(tl.float32)
                w2 = tl.load(q_norm_ptr + HALF + cols).to(tl.float32)
            else:
                w1 = tl.load(k_norm_ptr + cols).to(tl.float32)
                w2 = tl.load(k_norm_ptr + HALF + cols).to(tl.float32)
            mean_square = (tl.sum(a1 * a1, 0) + tl.sum(a2 * a2, 0)) / (2 * HALF)
            rstd = 1.0 / tl.sqrt(mean_square + eps)
            a1 = (a1 * rstd * w1).to(in_dtype).to(tl.float32)  # the model rounds between norm and rotary
            a2 = (a2 * rstd * w2).to(in_dtype).to(tl.float32)
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + cols)  # [HALF] float32
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        r1 = (a1 * cos - a2 * sin).to(in_dtype)
        r2 = (a2 * cos + a1 * sin).to(in_dtype)
        # r1/r2 keep one dtype on both sides of the runtime branch below (Triton refuses a variable that a
        # branch redefines with another dtype; the interpreter does not): each side uses its own names
        if head < NUM_HEADS:
            q_dst = q_out_ptr + row * stride_qo_m + head * stride_qo_h
            q1 = r1.to(model_dtype).to(tl.float32)  # exact: model_dtype is q's output dtype
            q2 = r2.to(model_dtype).to(tl.float32)
            if ROTATE:  # q in the rotated keys' space: rounded to the model's dtype, rotated, rounded
                q1, q2 = hadamard_halves(q1, q2, HALF)
            tl.store(q_dst + cols, q1.to(q_out_ptr.dtype.element_ty))
            tl.store(q_dst + HALF + cols, q2.to(q_out_ptr.dtype.element_ty))
        else:
            k_dst = k_cache_ptr + slot * stride_ks + (head - NUM_HEADS) * stride_kh + pos * stride_kt
            k_scale = slot * stride_kss + (head - NUM_HEADS) * stride_ksh + pos * stride_kst
            if K_FMT == 0:
                _store_row(k_dst, k_scale_ptr, k_min_ptr, r1, r2, cols, pos, max_seq, K_FMT, HALF)
            else:
                k1 = r1.to(model_dtype).to(tl.float32)
                k2 = r2.to(model_dtype).to(tl.float32)
                if HAS_K_OFFSET:
                    offset = k_offset_ptr + (head - NUM_HEADS) * (2 * HALF)
                    k1 -= tl.load(offset + cols)
                    k2 -= tl.load(offset + HALF + cols)
                if ROTATE:
                    k1, k2 = hadamard_halves(k1, k2, HALF)
                _store_row(k_dst, k_scale_ptr + k_scale, k_min_ptr + k_scale, k1, k2, cols, pos, max_seq, K_FMT, HALF)


def _check(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
           q_norm_weight, k_norm_weight, scales) -> tuple[int, int]:
    """The caches' element formats (FLOAT / INT8 / INT4), after checking every input."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedKernelShape(f"qk_norm_rope_write supports head_dim {SUPPORTED_HEAD_DIMS}; got {head_dim}")
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs qkv [M, {width}] with contiguous rows "
                                     f"((H + 2*KV) * D for H={num_heads}, KV={num_kv_heads}, D={head_dim}); "
                                     f"got {tuple(qkv.shape)}")
    m = qkv.shape[0]
    k_fmt = cache_format("k", k_cache, scales.get("k_scale"), scales.get("k_min"), head_dim)
    v_fmt = cache_format("v", v_cache, scales.get("v_scale"), scales.get("v_min"), head_dim)
    lead = (k_cache.shape[0], num_kv_heads, k_cache.shape[2]) if k_cache.dim() == 4 else None
    if tuple(k_cache.shape[:3]) != lead or tuple(v_cache.shape[:3]) != lead or v_cache.dim() != 4 \
            or (k_fmt == FLOAT and k_cache.shape[3] != head_dim) or (v_fmt == FLOAT and v_cache.shape[3] != head_dim) \
            or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs caches [slots, {num_kv_heads}, S, {head_dim}] "
                                     f"with a contiguous last dim; got k {tuple(k_cache.shape)}, "
                                     f"v {tuple(v_cache.shape)}")
    if positions.shape != (m,) or slot_ids.shape != (m,) or positions.dtype.is_floating_point \
            or slot_ids.dtype.is_floating_point:
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs integer positions and slot_ids of shape [{m}]; "
                                     f"got {tuple(positions.shape)} {positions.dtype}, "
                                     f"{tuple(slot_ids.shape)} {slot_ids.dtype}")
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs inv_freq [{head_dim // 2}] float32; "
                                     f"got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    float_caches = [c.dtype for c, f in ((k_cache, k_fmt), (v_cache, v_fmt)) if f == FLOAT]
    if qkv.dtype not in SUPPORTED_DTYPES or any(d not in SUPPORTED_DTYPES for d in float_caches) \
            or len(set(float_caches)) > 1:
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs float32/float16/bfloat16 qkv and float caches of "
                                     f"one dtype; got qkv {qkv.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise UnsupportedKernelShape("qk_norm_rope_write needs both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (head_dim,) or not w.is_contiguous()):
            raise UnsupportedKernelShape(f"qk_norm_rope_write needs a contiguous {name} [{head_dim}]; "
                                         f"got {tuple(w.shape)}")
    tensors = [qkv, positions, slot_ids, inv_freq, k_cache, v_cache, q_norm_weight, k_norm_weight, *scales.values()]
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs all tensors on one device; "
                                     f"got {sorted(map(str, devices))}")
    return k_fmt, v_fmt


def qk_norm_rope_write(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, inv_freq: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, q_norm_weight: torch.Tensor | None = None,
                       k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       out_dtype: torch.dtype | None = None, zero_input: bool = False,
                       k_scale: torch.Tensor | None = None, k_min: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, v_min: torch.Tensor | None = None,
                       k_offset: torch.Tensor | None = None, k_rotate: bool = False,
                       v_rotate: bool = False) -> torch.Tensor:
    """qkv [M, (H + 2*KV) * D] (rows = tokens; q heads, then k heads, then v heads), positions [M] int
    (absolute), slot_ids [M] int, inv_freq [D/2] float32, k_cache/v_cache [slots, KV, S, D] (or the
    codes of a quantized cache with their k_scale / k_min / v_scale / v_min, engine/kernels/kv_codes.py:
    rows are rounded to out_dtype and quantized as they are written; k_offset [KV, D] float32 is
    subtracted from quantized keys first; k_rotate: quantized keys are then rotated by the Hadamard
    matrix, and the returned q too; v_rotate: quantized values are rotated, KVCache.layer_write_args).
    Applies the optional per-head RMSNorm (Qwen3 q_norm/k_norm, in float32) to q and k, the half-split
    rotary with angle = float(position) * inv_freq, writes k and v to the caches at [slot, :, position, :]
    (a position >= S is not written) and returns q [M, H, D] in qkv's dtype (or out_dtype). zero_input:
    qkv is left all zeros (it is the accumulation buffer of the next step's projection). Raises UnsupportedKernelShape
    (a ValueError) for shapes it cannot handle."""
    scales = {n: t for n, t in (("k_scale", k_scale), ("k_min", k_min), ("v_scale", v_scale), ("v_min", v_min))
              if t is not None}
    k_fmt, v_fmt = _check(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                          q_norm_weight, k_norm_weight, scales)
    if k_offset is not None and (k_fmt == FLOAT or tuple(k_offset.shape) != (num_kv_heads, head_dim)
                                 or k_offset.dtype != torch.float32 or not k_offset.is_contiguous()
                                 or k_offset.device != qkv.device):
        raise UnsupportedKernelShape(f"qk_norm_rope_write needs k_offset float32 [{num_kv_heads}, {head_dim}] "
                                     f"(contiguous, on qkv's device) with quantized keys; got "
                                     f"{tuple(k_offset.shape)} {k_offset.dtype} for {k_cache.dtype} keys")
    m = qkv.shape[0]
    q = torch.empty(m, num_heads, head_dim, dtype=out_dtype or qkv.dtype, device=qkv.device)  # [M, H, D]
    if m == 0:
        return q
    has_norm = q_norm_weight is not None
    _qk_norm_rope_write_kernel[(m, num_heads + 2 * num_kv_heads)](
        qkv, positions, slot_ids, inv_freq, q_norm_weight if has_norm else inv_freq,
        k_norm_weight if has_norm else inv_freq, k_cache, v_cache, q,
        k_scale if k_scale is not None else k_cache, k_min if k_min is not None else k_cache,
        v_scale if v_scale is not None else v_cache, v_min if v_min is not None else v_cache,
        k_offset if k_offset is not None else inv_freq, qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *scale_strides(k_fmt, k_scale), *scale_strides(v_fmt, v_scale), k_cache.shape[2], eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, HAS_NORM=has_norm,
        ZERO_INPUT=zero_input, K_FMT=k_fmt, V_FMT=v_fmt, HAS_K_OFFSET=k_offset is not None, ROTATE=k_rotate,
        V_ROTATE=v_rotate, num_warps=1,
        **pdl_options(qkv.device))
    return q


def qk_norm_rope_write_reference(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                                 inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 num_heads: int, num_kv_heads: int, head_dim: int,
                                 q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                                 eps: float = 1e-6, out_dtype: torch.dtype | None = None,
                                 zero_input: bool = False, k_scale: torch.Tensor | None = None,
                                 k_min: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                 v_min: torch.Tensor | None = None, k_offset: torch.Tensor | None = None,
                                 k_rotate: bool = False, v_rotate: bool = False) -> torch.Tensor:
    """Plain torch, the maths of engine/runtime/model.py (RMSNorm, apply_rotary, KVCache.write, KVCache.key_space)."""
    m = qkv.shape[0]
    heads = qkv.view(m, num_heads + 2 * num_kv_heads, head_dim)  # [M, H + 2KV, D]
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)  # [M, H|KV, D]
    if q_norm_weight is not None:
        q = torch.nn.functional.rms_norm(q.float(), (head_dim,), q_norm_weight.float(), eps).to(qkv.dtype)
        k = torch.nn.functional.rms_norm(k.float(), (head_dim,), k_norm_weight.float(), eps).to(qkv.dtype)
    angles = positions.float()[:, None] * inv_freq  # [M, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [M, 1, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    q, k = rotate(q), rotate(k)  # [M, H, D], [M, KV, D]
    keep = positions < k_cache.shape[2]  # [M]
    rows = (slot_ids[keep, None], torch.arange(num_kv_heads, device=qkv.device)[None, :], positions[keep, None])
    model_dtype = out_dtype or qkv.dtype
    write_rows(k_cache, k_scale, k_min, rows, k[keep], model_dtype if k_scale is not None else k_cache.dtype,
               k_offset, k_rotate)
    write_rows(v_cache, v_scale, v_min, rows, v[keep], model_dtype if v_scale is not None else v_cache.dtype,
               rotate=v_rotate)
    q = transform_queries(q.to(model_dtype), k_rotate).contiguous()
    if zero_input:
        qkv.zero_()
    return q

"""Chunk (prefill) attention over a quantized KV cache that reads the codes, flash-attention style.

The rows of a pass: T query positions of each of B sequences (a prefill chunk, a verify pass, the rows
of batched decode) whose keys and values are already in the cache (the rope / KV-write kernel or
KVCache.write stored them first). Query t of sequence b sits at position starts[b] + t and attends to
positions 0..starts[b] + t of slot slot_ids[b]: causal within the chunk, everything before it.
One program per (block of BLOCK_M rows, kv head, sequence). The GROUP query heads sharing a kv head are
laid out position-major (row r = t · GROUP + g), so every K/V tile is loaded and dequantized once, in
registers (attention_decode.load_tile: int8 × row scale, int4 × group scale + min), for BLOCK_M rows,
and multiplied on tensor cores; an online softmax in float32 runs over the tiles up to the block's last
position. Only the positions in use are read, never the cache's whole capacity.
Queries come as the cache expects them (KVCache.key_space: rotated where the keys are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import UnsupportedKernelShape, target_shared_memory
from engine.kernels.attention_decode import LOG2E, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, load_tile, softmax_tile
from engine.kernels.hadamard import fwht_rows
from engine.kernels.kv_codes import FLOAT, cache_format, dequantize_layer, scale_strides
from quant.kv_quant import hadamard_rows


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, start_ptr, k_scale_ptr, k_min_ptr, v_scale_ptr,
                    v_min_ptr, stride_qb, stride_qh, stride_qt, stride_ob, stride_oh, stride_ot,
                    stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                    stride_kss, stride_ksh, stride_kst, stride_vss, stride_vsh, stride_vst,
                    num_tokens, max_seq, scale_log2, GROUP: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                    DOT_F32: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, V_ROTATE: tl.constexpr):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    start = tl.load(start_ptr + seq).to(tl.int32)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (position, head of the group)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < num_tokens
    pos = start + t  # [BLOCK_M] absolute position of each row's query
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    if DOT_F32:
        q = q.to(tl.float32)
    last_t = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // GROUP, num_tokens - 1)
    end = tl.minimum(start + last_t + 1, max_seq)  # keys this block reads: 0..its last position
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    k_scales = slot * stride_kss + kv_head * stride_ksh
    v_scales = slot * stride_vss + kv_head * stride_vsh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s0 in range(0, end, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        key_ok = keys < end
        k = load_tile(k_base, k_scale_ptr + k_scales, k_min_ptr + k_scales, keys, key_ok, stride_kt, stride_kst,
                      q_ptr.dtype.element_ty, K_FMT, D, BLOCK_S)  # [BLOCK_S, D]
        v = load_tile(v_base, v_scale_ptr + v_scales, v_min_ptr + v_scales, keys, key_ok, stride_vt, stride_vst,
                      q_ptr.dtype.element_ty, V_FMT, D, BLOCK_S)  # [BLOCK_S, D]
        # causal: the max is finite from the first tile on (key 0 is visible to every row)
        m_i, l_i, acc = softmax_tile(q, k, v, key_ok[None, :] & (keys[None, :] <= pos[:, None]), m_i, l_i, acc,
                                     scale_log2, DOT_F32, PRECISION)  # [BLOCK_M], [BLOCK_M], [BLOCK_M, D]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, D] float32
    if V_ROTATE:  # values are stored rotated by H: rotate the output back (H·H = I)
        norm: tl.constexpr = D ** -0.5
        o = fwht_rows(o, BLOCK_M, D) * norm
    o_ptrs = out_ptr + seq * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_ot + dims[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def block_sizes(head_dim: int, v_rotate: bool = False) -> tuple[int, int]:
    """(BLOCK_M query rows, BLOCK_S keys) per program and tile: 128 × 64 up to head_dim 128 (the shape
    of Triton's flash-attention tutorial), halved rows and keys at 256; at 256 with rotated values (the output's
    Hadamard transform over [BLOCK_M, 256] float32 goes through shared memory: 112 KB at 64 rows) 32 rows where
    the target has under 160 KB a block (sm_86 / sm_89: 99 KB; tests/kernel_compile.py checks every cubin)."""
    if head_dim <= 128:
        return 128, 64
    return (32, 32) if v_rotate and target_shared_memory() < 160 << 10 else (64, 32)


def _check(q, k_cache, v_cache, slot_ids, starts, scales) -> tuple[int, int]:
    unknown = set(scales) - {"k_scale", "k_min", "v_scale", "v_min"}
    assert not unknown, f"prefill_attention takes k_scale, k_min, v_scale, v_min; got {sorted(unknown)}"
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise UnsupportedKernelShape(f"prefill_attention needs q [B, H, T, D] and caches [slots, KV, S, X] of one "
                                     f"shape; got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    b, h, _, d = q.shape
    kv = k_cache.shape[1]
    if d not in SUPPORTED_HEAD_DIMS or q.dtype not in SUPPORTED_DTYPES or h % kv:
        raise UnsupportedKernelShape(f"prefill_attention needs head_dim in {SUPPORTED_HEAD_DIMS}, q float32/float16/"
                                     f"bfloat16 and H a multiple of KV; got q {tuple(q.shape)} {q.dtype}, KV {kv}")
    k_fmt = cache_format("k", k_cache, scales.get("k_scale"), scales.get("k_min"), d)
    v_fmt = cache_format("v", v_cache, scales.get("v_scale"), scales.get("v_min"), d)
    for name, cache, fmt in (("k", k_cache, k_fmt), ("v", v_cache, v_fmt)):
        if fmt == FLOAT and (cache.shape[3] != d or cache.dtype != q.dtype):
            raise UnsupportedKernelShape(f"prefill_attention needs a float {name} cache of q's head_dim and dtype; "
                                         f"got q {d} {q.dtype}, {name} {cache.shape[3]} {cache.dtype}")
    if q.stride(3) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise UnsupportedKernelShape("prefill_attention needs the head_dim of q and the caches contiguous")
    if slot_ids.shape != (b,) or starts.shape != (b,) or slot_ids.dtype.is_floating_point \
            or starts.dtype.is_floating_point:
        raise UnsupportedKernelShape(f"prefill_attention needs integer slot_ids and starts of shape [{b}]; got "
                                     f"{tuple(slot_ids.shape)} {slot_ids.dtype}, {tuple(starts.shape)} {starts.dtype}")
    tensors = [q, k_cache, v_cache, slot_ids, starts, *(t for t in scales.values() if t is not None)]
    if len({t.device for t in tensors}) != 1:
        raise UnsupportedKernelShape("prefill_attention needs all tensors on one device")
    return k_fmt, v_fmt


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                      starts: torch.Tensor, scale: float, v_rotate: bool = False, **scales: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, D] (any strides but a contiguous last dim); caches [slots, KV, S, D] (or the codes of a
    quantized cache with its k_scale / k_min / v_scale / v_min, engine/kernels/kv_codes.py) already holding
    the T new rows of each sequence; slot_ids, starts [B] int: query t of sequence b attends to positions
    0..starts[b] + t of slot slot_ids[b] (positions past S are not read). Query head h reads kv head
    h // (H // KV). v_rotate: values are stored rotated by the Hadamard matrix, the output is rotated
    back (KVCache.layer_read_args). Returns [B, H, T, D] in q's dtype. Raises UnsupportedKernelShape (a ValueError) for
    shapes it cannot handle."""
    k_fmt, v_fmt = _check(q, k_cache, v_cache, slot_ids, starts, scales)
    b, h, t, d = q.shape
    kv, s_max = k_cache.shape[1], k_cache.shape[2]
    group = h // kv
    out = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)  # [B, H, T, D]
    if t == 0 or b == 0:
        return out
    block_m, block_s = block_sizes(d, v_rotate)
    k_scale, k_min, v_scale, v_min = (scales.get(n) for n in ("k_scale", "k_min", "v_scale", "v_min"))
    cpu = q.device.type == "cpu"  # the interpreter multiplies bfloat16 tiles as integers: widen to float32
    _prefill_kernel[(triton.cdiv(t * group, block_m), kv, b)](
        q, k_cache, v_cache, out, slot_ids, starts,
        k_scale if k_scale is not None else k_cache, k_min if k_min is not None else k_cache,
        v_scale if v_scale is not None else v_cache, v_min if v_min is not None else v_cache,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *scale_strides(k_fmt, k_scale), *scale_strides(v_fmt, v_scale), t, s_max,
        scale * LOG2E, GROUP=group, D=d, BLOCK_M=block_m, BLOCK_S=block_s,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_F32=cpu, K_FMT=k_fmt, V_FMT=v_fmt,
        V_ROTATE=v_rotate,
        num_warps=4 if cpu or d <= 64 else 8, num_stages=2)
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_ids: torch.Tensor, starts: torch.Tensor, scale: float, v_rotate: bool = False,
                                **scales: torch.Tensor) -> torch.Tensor:
    """Plain torch, sequence by sequence in float32: the rows 0..starts[b] + T - 1 of the slot (only those)
    dequantized to q's dtype (as KVCache.read returns them), then softmax(q kᵀ · scale + causal mask) v,
    rotated back by H if v_rotate."""
    b, h, t, d = q.shape
    group = h // k_cache.shape[1]
    out = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)  # [B, H, T, D]
    for row, (slot, start) in enumerate(zip(slot_ids.tolist(), starts.tolist())):
        length = min(start + t, k_cache.shape[2])
        parts = {n: x[slot, :, :length] for n, x in scales.items() if x is not None}
        keys = dequantize_layer(k_cache[slot, :, :length], parts.get("k_scale"), parts.get("k_min"), q.dtype)
        values = dequantize_layer(v_cache[slot, :, :length], parts.get("v_scale"), parts.get("v_min"), q.dtype)
        keys = keys.float().repeat_interleave(group, dim=0)  # [H, L, D]
        values = values.float().repeat_interleave(group, dim=0)  # [H, L, D]
        scores = torch.einsum("htd,hld->htl", q[row].float(), keys) * scale  # [H, T, L]
        positions = start + torch.arange(t, device=q.device)  # [T]
        visible = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [T, L]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [H, T, L]
        o = torch.einsum("htl,hld->htd", probs, values)  # [H, T, D] float32
        out[row] = (hadamard_rows(o) if v_rotate else o).to(q.dtype)
    return out

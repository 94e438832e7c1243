"""Decode attention over the static KV cache, split across the sequence ("flash decoding").

Each program handles one (row, kv head, split): the query heads that share the kv head form one
[G_PAD, D] tile (padded to 16 rows for tl.dot) and stream the split's keys/values in BLOCK_S tiles with
an online softmax in float32. The grid (M, KV, num_splits) never depends on the values of seq_lens, so
a CUDA graph captures it once and replays it at any length. Each row's keys are spread over the splits in
whole tiles (at least `min_split_len` keys a split; by default one tile), so a short row still keeps many
programs busy; a split past a row's keys only records an empty partial. A second kernel combines the splits'
partials by log-sum-exp.
A quantized cache (int8 codes with a float16 scale per row, or int4 codes two per byte with a float16
scale and min per group of 32: engine/kernels/kv_codes.py) is read as codes and dequantized in
registers, tile by tile, to q's dtype (what KVCache.read would return) before the dots.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait
from quant.kernels import pdl_options

from engine.kernels import UnsupportedKernelShape, next_power_of_2
from engine.kernels.hadamard import fwht
from engine.kernels.kv_codes import FLOAT, cache_format, dequantize_layer, scale_strides
from quant.kv_quant import hadamard_rows

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_GROUP = 64  # query heads per kv head
MAX_SPLITS = 1024
MIN_SPLIT_LEN = 256  # keys: below this a split's fixed costs (q load, partial write) dominate
# ... except that a short cache still gets this many splits (one tile each at least): its rows' keys spread over
# them (the split kernel), so a 512-key row runs 8 tiles at once instead of 2 splits of 4 tiles in a row. H100,
# 8B ternary step at 512 keys of a 640-key cache: 3 splits 1,735-1,761 µs, 8 splits 1,682, 32 splits 1,655.
MIN_SPLITS = 8
PROGRAMS_PER_SM = 4  # at full length: a few waves of programs, each streaming >= MIN_SPLIT_LEN keys
LOG2E = 1.4426950408889634


@triton.jit
def load_tile(base, scale_base, min_base, keys, key_ok, stride_t, stride_st, dtype,
               FMT: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Rows `keys` [BLOCK_S] of one (slot, kv head) of a cache as [BLOCK_S, D] values in dtype:
    loaded as they are (FMT 0), or as int8 codes × the row's scale (1), or int4 codes unpacked from
    their bytes (low nibble first) × the group's scale + its min (2). Masked rows read as zeros."""
    if FMT == 0:
        dims = tl.arange(0, D)
        return tl.load(base + keys[:, None] * stride_t + dims[None, :], mask=key_ok[:, None], other=0.0,
                       eviction_policy="evict_first")
    elif FMT == 1:
        dims = tl.arange(0, D)
        codes = tl.load(base + keys[:, None] * stride_t + dims[None, :], mask=key_ok[:, None], other=0,
                        eviction_policy="evict_first")  # [BLOCK_S, D] int8
        scale = tl.load(scale_base + keys * stride_st, mask=key_ok, other=0.0)  # [BLOCK_S] float16
        return (codes.to(tl.float32) * scale.to(tl.float32)[:, None]).to(dtype)
    else:
        pairs = tl.arange(0, D // 2)
        packed = tl.load(base + keys[:, None] * stride_t + pairs[None, :], mask=key_ok[:, None], other=0,
                         eviction_policy="evict_first")  # [BLOCK_S, D/2] uint8
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_S, D // 32, 32]).to(tl.float32)
        groups = tl.arange(0, D // 32)
        offsets = keys[:, None] * stride_st + groups[None, :]  # [BLOCK_S, G]
        scale = tl.load(scale_base + offsets, mask=key_ok[:, None], other=0.0).to(tl.float32)
        low = tl.load(min_base + offsets, mask=key_ok[:, None], other=0.0).to(tl.float32)
        return tl.reshape(codes * scale[:, :, None] + low[:, :, None], [BLOCK_S, D]).to(dtype)


@triton.jit
def softmax_tile(q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys/values [BLOCK_S, D] folded into the online softmax of queries q [R, D]:
    scores where `visible` [R, BLOCK_S] (else -inf), running max m_i [R], sum l_i [R], output acc [R, D]
    (float32). Returns the updated (m_i, l_i, acc)."""
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [R, BLOCK_S]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [R, BLOCK_S]
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, part_ptr, lse_ptr, out_ptr,
                         k_scale_ptr, k_min_ptr, v_scale_ptr, v_min_ptr,
                         stride_qm, stride_qh, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                         stride_kss, stride_ksh, stride_kst, stride_vss, stride_vsh, stride_vst,
                         stride_om, stride_oh, num_heads, max_seq, split_len, scale_log2,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, PARTIALS: tl.constexpr, PRECISION: tl.constexpr,
                         DOT_F32: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: let the next kernel start, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(len_ptr + row).to(tl.int32), max_seq)  # int32 loop bounds, int64 lengths too
    slot = tl.load(slot_ptr + row).to(tl.int64)
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows  # [G_PAD]
    q = tl.load(q_ptr + row * stride_qm + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [G_PAD, D]
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    k_scales = slot * stride_kss + kv_head * stride_ksh  # offset of this (slot, head) in k_scale and k_min
    v_scales = slot * stride_vss + kv_head * stride_vsh
    # keys per split: the row's keys spread over the splits (whole tiles), at least split_len (the caller's floor)
    length = tl.maximum(split_len, tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_S) * BLOCK_S)
    start = split * length
    end = tl.minimum(start + length, seq_len)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        key_ok = keys < end
        k = load_tile(k_base, k_scale_ptr + k_scales, k_min_ptr + k_scales, keys, key_ok, stride_kt, stride_kst,
                       q_ptr.dtype.element_ty, K_FMT, D, BLOCK_S)  # [BLOCK_S, D]
        v = load_tile(v_base, v_scale_ptr + v_scales, v_min_ptr + v_scales, keys, key_ok, stride_vt, stride_vst,
                       q_ptr.dtype.element_ty, V_FMT, D, BLOCK_S)  # [BLOCK_S, D], issued with K: one round trip
        m_i, l_i, acc = softmax_tile(q, k, v, key_ok[None, :], m_i, l_i, acc, scale_log2, DOT_F32,
                                     PRECISION)  # [G_PAD], [G_PAD], [G_PAD, D]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if not PARTIALS:
        o_ptrs = out_ptr + row * stride_om + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part_rows = (row * num_heads + heads) * NUM_SPLITS + split  # [G_PAD]
        tl.store(part_ptr + part_rows[:, None] * D + dims[None, :], acc / l_safe[:, None],
                 mask=(row_ok & (rows * 0 + end > start))[:, None])  # broadcast first: the interpreter
        # mistypes a scalar comparison inside a mask
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # [G_PAD], -inf: an empty split
        tl.store(lse_ptr + part_rows, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_ptr, lse_ptr, out_ptr, xq_ptr, sx_ptr, sumx_ptr, stride_om, stride_oh, num_heads,
                           NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
                           D: tl.constexpr, QUANT: tl.constexpr, V_ROTATE: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: let the next kernel start, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(lse_ptr + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))  # [SPLITS_PAD]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row without keys gives zeros, not NaN
    total = tl.sum(tl.exp2(lse - top), 0)
    dims = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for c in range(0, NUM_SPLITS, CHUNK):
        chunk = c + tl.arange(0, CHUNK)
        chunk_lse = tl.load(lse_ptr + base + chunk, mask=chunk < NUM_SPLITS, other=float("-inf"))  # [CHUNK]
        used = chunk_lse > float("-inf")
        part = tl.load(part_ptr + (base + chunk)[:, None] * D + dims[None, :], mask=used[:, None],
                       other=0.0)  # [CHUNK, D]
        acc += tl.sum(part * tl.exp2(chunk_lse - top)[:, None], 0)
    total = tl.where(total > 0, total, 1.0)
    o = acc / total  # [D] float32
    if V_ROTATE:  # values are stored rotated by H: rotate the output back (H·H = I)
        norm: tl.constexpr = D ** -0.5
        o = fwht(o, D) * norm
    o = o.to(out_ptr.dtype.element_ty)  # rounded as the unfused path stores it
    if QUANT:  # int8 with one scale per head (group = head_dim), exactly as quantize_activations
        y = o.to(tl.float32)
        sx = tl.max(tl.abs(y), 0) / 127.0
        inv = tl.where(sx > 0, 1.0 / sx, 0.0)
        qv = tl.minimum(tl.maximum(tl.floor(y * inv + 0.5), -127.0), 127.0)  # [D]
        tl.store(xq_ptr + (row * num_heads + head) * D + dims, qv.to(tl.int8))
        tl.store(sx_ptr + row * num_heads + head, sx)
        tl.store(sumx_ptr + row * num_heads + head, tl.sum(qv, 0).to(tl.int32))
    else:
        tl.store(out_ptr + row * stride_om + head * stride_oh + dims, o)


def block_size(head_dim: int) -> int:
    """Keys per tile of the split kernel: 16 KB of K (and of V) per pipeline stage in bf16."""
    return {256: 32, 128: 64}.get(head_dim, 128)


def split_length(max_seq_len: int, num_splits: int, head_dim: int) -> int:
    """Keys per split (a whole number of tiles): split i covers keys [i * length, (i + 1) * length)."""
    block = block_size(head_dim)
    return triton.cdiv(triton.cdiv(max_seq_len, num_splits), block) * block


def default_num_splits(max_seq_len: int, num_kv_heads: int = 8, batch: int = 1, num_sms: int = 132,
                       head_dim: int = 128) -> int:
    """Splits for a cache of max_seq_len keys: at full length the grid holds about PROGRAMS_PER_SM programs
    per SM (batch * kv_heads * splits), but no split is shorter than MIN_SPLIT_LEN keys there; a short cache
    is still cut into up to MIN_SPLITS splits of whole tiles (640 keys at head_dim 128: 5 of 128; one tile:
    one split, which skips the combine kernel); no split is left empty at full length."""
    assert max_seq_len > 0 and num_kv_heads > 0 and batch > 0 and num_sms > 0
    wanted = max(1, math.ceil(PROGRAMS_PER_SM * num_sms / (batch * num_kv_heads)))
    length = split_length(max_seq_len, min(wanted, MAX_SPLITS), head_dim)
    length = max(length, split_length(MIN_SPLIT_LEN, 1, head_dim))
    fewest = min(MIN_SPLITS, triton.cdiv(max_seq_len, block_size(head_dim)), wanted)
    length = min(length, split_length(max_seq_len, fewest, head_dim))
    return triton.cdiv(max_seq_len, length)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
           seq_lens: torch.Tensor, num_splits: int, scales: dict[str, torch.Tensor | None]) -> tuple[int, int]:
    """The caches' element formats (FLOAT / INT8 / INT4), after checking every input."""
    unknown = set(scales) - {"k_scale", "k_min", "v_scale", "v_min"}
    assert not unknown, f"decode_attention takes k_scale, k_min, v_scale, v_min; got {sorted(unknown)}"
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise UnsupportedKernelShape(
            f"decode_attention needs q [M, H, D] and caches [slots, KV, S, X] of one shape; got q "
            f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    m, h, d = q.shape
    kv = k_cache.shape[1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedKernelShape(f"decode_attention supports head_dim {SUPPORTED_HEAD_DIMS}; got q {d}")
    k_fmt = cache_format("k", k_cache, scales.get("k_scale"), scales.get("k_min"), d)
    v_fmt = cache_format("v", v_cache, scales.get("v_scale"), scales.get("v_min"), d)
    for name, cache, fmt in (("k", k_cache, k_fmt), ("v", v_cache, v_fmt)):
        if fmt == FLOAT and (cache.shape[3] != d or cache.dtype != q.dtype):
            raise UnsupportedKernelShape(f"decode_attention needs a float {name} cache of q's head_dim and dtype; "
                                         f"got q {d} {q.dtype}, {name} {cache.shape[3]} {cache.dtype}")
    if h % kv or h // kv > MAX_GROUP:
        raise UnsupportedKernelShape(f"decode_attention needs num_heads ({h}) a multiple of num_kv_heads ({kv}) "
                                     f"with at most {MAX_GROUP} query heads per kv head")
    if q.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedKernelShape(f"decode_attention needs q of one dtype among float32/float16/bfloat16; "
                                     f"got q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise UnsupportedKernelShape("decode_attention needs the head_dim of q and the caches contiguous")
    if slot_ids.shape != (m,) or seq_lens.shape != (m,) or slot_ids.dtype.is_floating_point \
            or seq_lens.dtype.is_floating_point:
        raise UnsupportedKernelShape(f"decode_attention needs integer slot_ids and seq_lens of shape [{m}]; got "
                                     f"{tuple(slot_ids.shape)} {slot_ids.dtype}, {tuple(seq_lens.shape)} "
                                     f"{seq_lens.dtype}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise UnsupportedKernelShape(f"decode_attention needs 1 <= num_splits <= {MAX_SPLITS}; got {num_splits}")
    tensors = [q, k_cache, v_cache, slot_ids, seq_lens, *(t for t in scales.values() if t is not None)]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise UnsupportedKernelShape(f"decode_attention needs all tensors on one device; "
                                     f"got {sorted(map(str, devices))}")
    return k_fmt, v_fmt


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None, v_rotate: bool = False, min_split_len: int | None = None,
                     **scales: torch.Tensor) -> torch.Tensor:
    """q [M, H, D]; caches [slots, KV, S, D] (or the codes of a quantized cache, with its k_scale /
    k_min / v_scale / v_min: engine/kernels/kv_codes.py); slot_ids [M] int32; seq_lens [M] int32 = number
    of valid keys of each row (keys 0..seq_len-1 of its slot; a causal verify row passes position + 1;
    values above S are clamped to S). Query head h reads kv head h // (H // KV). v_rotate: the values are
    stored rotated by the Hadamard matrix (KVCache.layer_read_args), the output is rotated back.
    min_split_len: the fewest keys a split takes (None: one tile; split_length(S, num_splits, D) gives each
    split a fixed range of the cache whatever the rows' lengths). Returns out [M, H, D] in q's dtype. Raises
    UnsupportedKernelShape (a ValueError) for shapes it cannot handle."""
    formats = _check(q, k_cache, v_cache, slot_ids, seq_lens, num_splits, scales)
    m, h, d = q.shape
    if out is None:
        out = torch.empty(m, h, d, dtype=q.dtype, device=q.device)  # [M, H, D]
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise UnsupportedKernelShape(f"decode_attention's out must be {tuple(q.shape)} {q.dtype} with a "
                                     f"contiguous last dim; got {tuple(out.shape)} {out.dtype}")
    # The interpreter multiplies bfloat16 tiles as raw uint16 integers: on the CPU the dots widen their
    # inputs to float32 first (on a GPU, tf32 holds bf16/fp16 values exactly, so the maths is the same).
    _launch(q, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits, out,
            dot_f32=q.device.type == "cpu", block_s=block_size(d), scales=scales, formats=formats, v_rotate=v_rotate,
            min_split_len=min_split_len)
    return out


def decode_attention_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, num_splits: int, v_rotate: bool = False,
                          min_split_len: int | None = None, **scales: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode_attention` whose output goes straight to int8 activations with one scale per head
    (group size = head_dim), as `quantize_activations(out.reshape(M, H * D), D)` would make them:
    (xq [M, H * D] int8, sx [M, H] float32, sumx [M, H] int32). One kernel less per layer."""
    formats = _check(q, k_cache, v_cache, slot_ids, seq_lens, num_splits, scales)
    m, h, d = q.shape
    out = torch.empty(0, dtype=q.dtype, device=q.device)  # only its dtype is used (the rounding step)
    quant = (torch.empty(m, h * d, dtype=torch.int8, device=q.device),
             torch.empty(m, h, dtype=torch.float32, device=q.device),
             torch.empty(m, h, dtype=torch.int32, device=q.device))
    _launch(q, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits, out,
            dot_f32=q.device.type == "cpu", block_s=block_size(d), quant=quant, scales=scales, formats=formats,
            v_rotate=v_rotate, min_split_len=min_split_len)
    return quant


def decode_attention_int8_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                    num_splits: int = 1, v_rotate: bool = False, min_split_len: int | None = None,
                                    **scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from quant.kernels.act_quant import quantize_activations_reference
    m, h, d = q.shape
    out = decode_attention_reference(q, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits, v_rotate=v_rotate,
                                     **scales)
    return quantize_activations_reference(out.reshape(m, h * d), d)


def _launch(q, k_cache, v_cache, slot_ids, seq_lens, scale: float, num_splits: int, out: torch.Tensor,
            dot_f32: bool, block_s: int, num_warps: int = 4, quant=None, scales=None, formats=(FLOAT, FLOAT),
            v_rotate: bool = False, min_split_len: int | None = None) -> None:
    m, h, d = q.shape
    kv, s_max = k_cache.shape[1], k_cache.shape[2]
    group = h // kv
    split_len = triton.cdiv(min_split_len or block_s, block_s) * block_s  # the fewest keys a split takes
    partial_outputs = num_splits > 1 or quant is not None or v_rotate  # the combine kernel rotates back
    if partial_outputs:
        partials = torch.empty(m, h, num_splits, d, dtype=torch.float32, device=q.device)  # [M, H, NS, D]
        lse = torch.empty(m, h, num_splits, dtype=torch.float32, device=q.device)  # [M, H, NS]
    else:
        partials = lse = out  # unused: the split kernel writes out directly
    scales = scales or {}
    k_scale, k_min, v_scale, v_min = (scales.get(n) for n in ("k_scale", "k_min", "v_scale", "v_min"))
    _decode_split_kernel[(m, kv, num_splits)](
        q, k_cache, v_cache, slot_ids, seq_lens, partials, lse, out,
        k_scale if k_scale is not None else k_cache, k_min if k_min is not None else k_cache,
        v_scale if v_scale is not None else v_cache, v_min if v_min is not None else v_cache,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides(formats[0], k_scale), *scale_strides(formats[1], v_scale),
        *(out.stride()[:2] if out.dim() == 3 else (0, 0)), h, s_max, split_len, scale * LOG2E,
        GROUP=group, G_PAD=max(16, next_power_of_2(group)), D=d, BLOCK_S=block_s, NUM_SPLITS=num_splits,
        PARTIALS=partial_outputs, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_F32=dot_f32,
        K_FMT=formats[0], V_FMT=formats[1], num_warps=num_warps, **pdl_options(q.device))
    if partial_outputs:
        xq, sx, sumx = quant if quant is not None else (out, out, out)
        _combine_splits_kernel[(m, h)](
            partials, lse, out, xq, sx, sumx, *(out.stride()[:2] if out.dim() == 3 else (0, 0)), h,
            NUM_SPLITS=num_splits, SPLITS_PAD=max(2, next_power_of_2(num_splits)),
            CHUNK=max(2, min(16, next_power_of_2(num_splits))), D=d, QUANT=quant is not None, V_ROTATE=v_rotate,
            num_warps=4, **pdl_options(q.device))


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, num_splits: int = 1,
                               out: torch.Tensor | None = None, v_rotate: bool = False,
                               min_split_len: int | None = None, **scales: torch.Tensor) -> torch.Tensor:
    """Plain torch, row by row in float32: softmax(q kᵀ * scale) v over the first seq_len keys of the
    row's slot (a quantized cache dequantized to q's dtype first, as KVCache.read does), rotated back by
    H if v_rotate. num_splits and min_split_len are accepted for a matching signature and do not change the
    maths."""
    m, h, d = q.shape
    group = h // k_cache.shape[1]
    result = torch.empty(m, h, d, dtype=q.dtype, device=q.device)  # [M, H, D]
    for row, (slot, length) in enumerate(zip(slot_ids.tolist(), seq_lens.tolist())):
        length = min(length, k_cache.shape[2])
        rows = {n: t[slot, :, :length] for n, t in scales.items() if t is not None}
        keys = dequantize_layer(k_cache[slot, :, :length], rows.get("k_scale"), rows.get("k_min"), q.dtype)
        values = dequantize_layer(v_cache[slot, :, :length], rows.get("v_scale"), rows.get("v_min"), q.dtype)
        keys = keys.float().repeat_interleave(group, dim=0)  # [H, L, D]
        values = values.float().repeat_interleave(group, dim=0)  # [H, L, D]
        scores = torch.einsum("hd,hld->hl", q[row].float(), keys) * scale  # [H, L]
        probs = torch.softmax(scores, dim=-1) if length else scores  # [H, L]
        o = torch.einsum("hl,hld->hd", probs, values)  # [H, D] float32
        result[row] = (hadamard_rows(o) if v_rotate else o).to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result

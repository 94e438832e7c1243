"""One decode row's attention block in one CUDA C++ launch (NVRTC at run time, quant.kernels.cuda_rt).

The one-row decode step ran three kernels between the q/k/v product and o_proj: q/k RMSNorm + rotary + K/V
write (engine.kernels.rope_cache), the split attention and the combine that quantizes the output for o_proj
(engine.kernels.attention_decode). Here one kernel does all of it (issue 19: ~11 µs a layer of the 8B's step
went to those three hand-offs; docs/perf.md). Grid (kv heads, splits), 8 warps a block:

- before the PDL wait each block computes its rotary angles (and, where asked, asks L2 for its split's cached K/V
  rows: those were written by earlier steps, and a prefetch cannot read stale data, L2 being where the GPU is
  coherent);
- after it, each block makes its group's queries from the q/k/v product's float32 output (RMSNorm, half-split
  rotary, rounded to the cache's dtype); the block whose keys end with the row's own makes its key and value too,
  writes them to the cache and scores them from shared memory (no block waits for another's write);
- the block scores its keys with an online softmax (p rounded to the values' dtype for p·v, as the Triton
  kernel), merges its warps and writes one partial; the last block of a kv head to finish (a counter, reset by it)
  combines the splits, rounds the output to the cache's dtype and quantizes it per head (group = head_dim) into
  what o_proj's product takes, then zeroes the q/k/v buffer for the next step's split-K product;
- or (rope_attention_partials, COMBINE 0: where o_proj runs on the CUDA C++ product, heads of 128, and the model
  has enough query heads to gain: combine_in_product)
  every block ends with its partial and o_proj's product combines the splits itself after its PDL wait
  (quant.kernels.cuda_gemv.cuda_splits_gemv): no counter, no last block, no int8 round trip through L2.

One row only (a verify's rows read each other's keys); float (bf16 / fp16) caches; head_dim 64, 128, 256; at most
8 query heads a kv head (padded to 1, 2, 4 or 8). The reference everywhere is `rope_attention_reference`: the
rope/KV-write reference then decode_attention_int8_reference. BONSAI_CUDA_ATTN=0 turns it off (the three kernels).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels import next_power_of_2

_HERE = Path(__file__).resolve().parent
# the kernel (rope_attention_row) after its defines and helpers: one NVRTC source
SOURCE = (_HERE / "cuda_attention_parts.cuh").read_text() + (_HERE / "cuda_attention_row.cu").read_text()

WARPS = 8
MAX_SPLITS = 32  # the combine reads one split a lane
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8
CACHE_KINDS = {torch.bfloat16: 1, torch.float16: 2}
NORM_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the splits' hand-off and the PDL trigger (cuda_attention_row.cu's FENCE / TRIGGER); BONSAI_CUDA_ATTN_FENCE and
# BONSAI_CUDA_ATTN_TRIGGER choose others for measurement (tests/perf/cuda_gemv_step.py)
FENCE, TRIGGER = 1, 0  # measured (H100, session 33): FENCE 1 0.2-1.9% faster on all three shapes; TRIGGER 1 mixed
CLUSTER_SIZES = (8, 16)  # blocks a cluster: the portable size, and H100's largest
KEYS_A_BLOCK = 32  # a short cache's keys per split: a block's 8 warps score 4 keys each at once


def shape_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    group = num_heads // num_kv_heads if num_kv_heads else 0
    return (head_dim in HEAD_DIMS and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and 1 <= group <= MAX_GROUP and next_power_of_2(group) * head_dim <= 1024)


def enabled(device: torch.device) -> bool:
    """A CUDA device, not the Triton interpreter, BONSAI_CUDA_ATTN not 0, NVRTC loadable."""
    if getattr(device, "type", None) != "cuda" or os.environ.get("BONSAI_CUDA_ATTN", "1") == "0":
        return False
    from quant.kernels import interpreting
    from quant.kernels.cuda_gemv import nvrtc_ready
    return not interpreting() and nvrtc_ready()


def num_splits(max_seq: int, num_kv_heads: int, sms: int = 132) -> int:
    """Splits of a cache of max_seq keys (fixed for a captured graph; each row's keys spread over them): about
    KEYS_A_BLOCK keys a split, at least enough blocks to cover the SMs where the cache has the keys, at most
    MAX_SPLITS. BONSAI_CUDA_ATTN_SPLITS overrides (measurement)."""
    forced = os.environ.get("BONSAI_CUDA_ATTN_SPLITS")
    if forced:
        return max(1, min(MAX_SPLITS, int(forced)))
    splits = math.ceil(max_seq / KEYS_A_BLOCK)
    if splits * num_kv_heads < sms:
        splits = max(splits, min(math.ceil(sms / num_kv_heads), math.ceil(max_seq / 16)))
    return max(1, min(MAX_SPLITS, splits))


def defines(head_dim: int, group: int, norm: int | None, cache_kind: int, pdl: bool, fence: int = FENCE,
            trigger: int = TRIGGER, cluster: bool = False, combine: bool = True) -> dict[str, int]:
    """-D values of one variant: norm = the q/k norm weight's NW_KIND, or None for a model without q/k norms;
    cluster: the splits of a kv head are one thread-block cluster (sm_90); combine: the last block combines the
    splits (else the kernel ends with the partials)."""
    return {"D": head_dim, "GP": next_power_of_2(group), "HAS_NORM": int(norm is not None), "NW_KIND": norm or 0,
            "CACHE_KIND": cache_kind, "USE_PDL": int(pdl), "FENCE": fence, "TRIGGER": trigger,
            "CLUSTER": int(cluster), "COMBINE": int(combine)}


# o_proj combines the splits (auto) from this many query heads. Measured on an H100 (session 34, the graphed one-row
# step at 512 keys, µs, last block -> o_proj): Qwen3-8B (32 heads) 1,436.7 -> 1,401.8, dense 27B-class (40)
# 3,837.8 -> 3,644.7, Qwen3-1.7B (16) 622.6 -> 716.8 (slower at every split count tried: 644-717).
PRODUCT_FROM_HEADS = 32


def combine_in_product(num_heads: int) -> bool:
    """Where the splits are combined when o_proj can take them (BONSAI_CUDA_ATTN_COMBINE): "auto" (the default: o_proj
    from PRODUCT_FROM_HEADS query heads, else the attention kernel's last block), "product" or "attention"."""
    mode = os.environ.get("BONSAI_CUDA_ATTN_COMBINE", "auto")
    if mode not in ("auto", "product", "attention"):
        raise ValueError(f"BONSAI_CUDA_ATTN_COMBINE={mode!r}: use auto, product or attention")
    return mode == "product" or (mode == "auto" and num_heads >= PRODUCT_FROM_HEADS)


def engine_variants(arch: int) -> list[dict[str, int]]:
    """Every variant the engine may launch on sm_`arch` (what CI compiles): head_dim × padded group × q/k norm
    (none, or in the cache's dtype) × cache dtype, with PDL and the cluster combine on sm_90+; and at head_dim 128
    the partials-only kernel (o_proj combines)."""
    pdls = (False, True) if arch >= 90 else (False,)
    clusters = (False, True) if arch >= 90 else (False,)
    out = []
    for d in HEAD_DIMS:
        for gp in (1, 2, 4, 8):
            if gp * d > 1024:
                continue
            for cache_kind in CACHE_KINDS.values():
                for norm in (None, cache_kind):
                    out += [defines(d, gp, norm, cache_kind, pdl, cluster=cluster) for pdl in pdls
                            for cluster in clusters]
                    if d == 128:
                        out += [defines(d, gp, norm, cache_kind, pdl, combine=False) for pdl in pdls]
    return out


@dataclass
class AttentionBuffers:
    """The split partials and the per-kv-head counters (zero between launches: the last block resets its own)."""
    part: torch.Tensor  # [KV, NS, GP, D] float32
    ml: torch.Tensor  # [KV, NS, GP, 2] float32: each split's max and sum
    counter: torch.Tensor  # [KV] int32
    # the split's K/V rows asked of L2 before the PDL wait (BONSAI_CUDA_ATTN_PREFETCH=1). Off by default: on an H100
    # it saved 13 µs of the 8B's step but cost 69 µs of Qwen3-1.7B's (its K/V traffic slows the q/k/v product)
    prefetch: bool = False
    stamps: torch.Tensor | None = None  # [KV·NS, 8] int64: phase clocks of each block (BONSAI_CUDA_ATTN_STAMPS=1)
    fence: int = FENCE
    trigger: int = TRIGGER
    # the splits of a kv head one thread-block cluster (sm_90; BONSAI_CUDA_ATTN_CLUSTER=8 or 16 blocks, measurement):
    # the partials combined from the blocks' shared memory, no counter
    cluster: bool = False
    # False: the kernel ends with the partials and o_proj's product combines them (rope_attention_partials)
    combine: bool = True

    @staticmethod
    def make(num_heads: int, num_kv_heads: int, head_dim: int, max_seq: int, device: torch.device,
             combine: bool = True) -> "AttentionBuffers":
        props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
        ns = num_splits(max_seq, num_kv_heads, props.multi_processor_count if props else 132)
        gp = next_power_of_2(num_heads // num_kv_heads)
        size = int(os.environ.get("BONSAI_CUDA_ATTN_CLUSTER") or 0)
        if size and size not in CLUSTER_SIZES:
            raise ValueError(f"BONSAI_CUDA_ATTN_CLUSTER={size}: use 0, 8 or 16")
        cluster = combine and bool(size) and props is not None and props.major >= 9
        ns = size if cluster else ns
        return AttentionBuffers(torch.zeros(num_kv_heads, ns, gp, head_dim, device=device),
                                torch.zeros(num_kv_heads, ns, gp, 2, device=device),
                                torch.zeros(num_kv_heads, dtype=torch.int32, device=device),
                                os.environ.get("BONSAI_CUDA_ATTN_PREFETCH", "0") == "1",
                                torch.zeros(num_kv_heads * ns, 8, dtype=torch.int64, device=device)
                                if os.environ.get("BONSAI_CUDA_ATTN_STAMPS") == "1" else None,
                                int(os.environ.get("BONSAI_CUDA_ATTN_FENCE") or FENCE),
                                int(os.environ.get("BONSAI_CUDA_ATTN_TRIGGER") or TRIGGER), cluster, combine)

    @property
    def splits(self) -> int:
        return self.part.shape[1]


def cache_taken(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Float caches [slots, KV, S, D] of one 16-bit dtype, rows contiguous and aligned for vector loads."""
    return (k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_KINDS and k_cache.dim() == 4
            and v_cache.dim() == 4 and k_cache.shape[3] == head_dim == v_cache.shape[3]
            and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
            and all(s % 8 == 0 for s in (*k_cache.stride()[:3], *v_cache.stride()[:3]))
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def rope_attention(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, inv_freq: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float, scale: float,
                   buffers: AttentionBuffers, zero_input: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row: qkv float32 [1, (H + 2·KV)·D] (the q/k/v product's output; zeroed when zero_input), positions /
    slot_ids int32 [1], inv_freq float32 [D/2], caches [slots, KV, S, D] bf16 or fp16 (the row's K/V written at
    its position, a position >= S not written). Returns o_proj's int8 input (xq int8 [1, H·D], sx float32 [1, H],
    sumx int32 [1, H]) as rope_attention_reference does, up to float rounding."""
    assert buffers.combine, "buffers made for o_proj to combine: rope_attention_partials"
    device = qkv.device
    xq = torch.empty(1, num_heads * head_dim, dtype=torch.int8, device=device)  # [1, H·D]
    sx = torch.empty(1, num_heads, dtype=torch.float32, device=device)  # [1, H]
    sumx = torch.empty(1, num_heads, dtype=torch.int32, device=device)  # [1, H]
    _launch(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim, q_norm_weight,
            k_norm_weight, eps, scale, buffers, zero_input, (xq, sx, sumx))
    return xq, sx, sumx


def rope_attention_partials(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                            inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
                            k_norm_weight: torch.Tensor | None, eps: float, scale: float, buffers: AttentionBuffers
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_attention's first part: the same launch ending with each split's partial. Returns buffers.part
    [KV, S, GP, D] and buffers.ml [KV, S, GP, 2] (max in log2 units, sum), for
    quant.kernels.cuda_gemv.cuda_splits_gemv (o_proj), which must also zero qkv where it is a split-K buffer."""
    assert not buffers.combine and not buffers.cluster
    _launch(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, head_dim, q_norm_weight,
            k_norm_weight, eps, scale, buffers, False, None)
    return buffers.part, buffers.ml


def _launch(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads: int, num_kv_heads: int,
            head_dim: int, q_norm_weight, k_norm_weight, eps: float, scale: float, buffers: AttentionBuffers,
            zero_input: bool, outputs: tuple | None) -> None:
    import ctypes
    from quant.kernels import pdl_enabled
    from quant.kernels.cuda_rt import f32, i32, ptr
    group = num_heads // num_kv_heads
    assert qkv.dtype == torch.float32 and qkv.is_contiguous() and qkv.shape == (1, (num_heads + 2 * num_kv_heads)
                                                                                  * head_dim)
    assert shape_supported(num_heads, num_kv_heads, head_dim) and cache_taken(k_cache, v_cache, head_dim)
    assert positions.dtype == slot_ids.dtype == torch.int32 and positions.numel() == slot_ids.numel() == 1
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() and inv_freq.numel() == head_dim // 2
    assert k_cache.shape[1] == num_kv_heads and buffers.counter.numel() == num_kv_heads
    assert (q_norm_weight is None) == (k_norm_weight is None)
    norm = None
    if q_norm_weight is not None:
        assert q_norm_weight.dtype == k_norm_weight.dtype and q_norm_weight.is_contiguous() \
            and k_norm_weight.is_contiguous() and q_norm_weight.numel() == k_norm_weight.numel() == head_dim
        norm = NORM_KINDS[q_norm_weight.dtype]
    device = qkv.device
    pdl = pdl_enabled(device)
    flags = defines(head_dim, group, norm, CACHE_KINDS[k_cache.dtype], pdl, buffers.fence, buffers.trigger,
                    buffers.cluster, combine=outputs is not None)
    if buffers.stamps is not None:
        flags["STAMPS"] = 1
    kernel = _kernel(device.index if device.index is not None else torch.cuda.current_device(),
                     tuple(sorted(flags.items())))
    null = ctypes.c_void_p(0)
    out_ptrs = [ptr(t) for t in outputs] if outputs is not None else [null, null, null]
    args = [ptr(qkv), ptr(positions), ptr(slot_ids), ptr(inv_freq),
            ptr(q_norm_weight) if norm is not None else null, ptr(k_norm_weight) if norm is not None else null,
            f32(eps), ptr(k_cache), ptr(v_cache), *(ctypes.c_longlong(s) for s in k_cache.stride()[:3]),
            *(ctypes.c_longlong(s) for s in v_cache.stride()[:3]), i32(k_cache.shape[2]), i32(num_heads),
            i32(group), f32(scale * math.log2(math.e)), ptr(buffers.part), ptr(buffers.ml), ptr(buffers.counter),
            *out_ptrs, i32(zero_input), i32(buffers.prefetch),
            ptr(buffers.stamps) if buffers.stamps is not None else null]
    kernel.launch((num_kv_heads, buffers.splits), (WARPS * 32,), args, pdl=pdl,
                  stream=torch.cuda.current_stream(device).cuda_stream,
                  cluster=(1, buffers.splits, 1) if buffers.cluster else None)


@functools.cache
def _kernel(device_index: int, flags: tuple[tuple[str, int], ...]):
    """The loaded kernel of one variant on one device (compiled and loaded once)."""
    from quant.kernels.cuda_rt import CudaKernel, compile_cubin
    with torch.cuda.device(device_index):
        major, minor = torch.cuda.get_device_capability(device_index)
        return CudaKernel(compile_cubin(SOURCE, 10 * major + minor, dict(flags), name="attention_row.cu"),
                          "rope_attention_row")


def rope_attention_reference(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                             inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                             num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
                             k_norm_weight: torch.Tensor | None, eps: float, scale: float,
                             buffers: AttentionBuffers | None = None, zero_input: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the decode step did before: the rope / KV-write reference, then attention quantized per head."""
    from engine.kernels.attention_decode import decode_attention_int8_reference
    from engine.kernels.rope_cache import qk_norm_rope_write_reference
    q = qk_norm_rope_write_reference(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, num_heads, num_kv_heads,
                                     head_dim, q_norm_weight, k_norm_weight, eps, out_dtype=k_cache.dtype,
                                     zero_input=zero_input)  # [1, H, D]
    seq_lens = (positions + 1).to(torch.int32)  # [1]
    return decode_attention_int8_reference(q, k_cache, v_cache, slot_ids, seq_lens, scale)

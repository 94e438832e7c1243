"""The one-row packed GEMV in CUDA C++ (NVRTC at run time, quant.kernels.cuda_rt): decode's small products.

Same maths and layout as quant.kernels.packed_gemv (words [K·BITS/32, N] int32, scales [K/G, N] float16, int8
activations with a scale and a code sum a group; y[n] += sw[g, n]·sx[g]·(MULT·Σ u·xq − OFFSET·sumx[g])), for the
≤ 2-bit layouts (tri, bin) at group 128. What it does that the Triton kernels could not (issue 19, measured with
tests/perf/cuda_gemv_probe.py on an H100, docs/perf.md session 31): every thread requests all of its weight words
as 16-byte loads before it waits for the previous kernel (PDL) or computes, so a small product's bytes are all in
flight at once — 0.66-0.92x the Triton kernel's time on q/k/v, o and down of the 8B / 27B-class shapes.

Grid: 4 output columns a thread, 128 a warp (blockIdx.x); WARPS warps a block, each GPW whole groups of K, the
blocks along blockIdx.y split K further and add with atomics (one float a column a block). The reference on every
device is packed_gemv_reference (the CPU's path); tests/test_cuda_gemv.py compiles every variant the engine
launches for sm_90 and sm_86 without a GPU and, on one, checks each against the reference.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from quant.packed_layout import PackedWeight, layout_kind

log = logging.getLogger(__name__)

SOURCE = r"""
#ifndef NORM_INPUT
#define NORM_INPUT 0
#define NW_KIND 0
#endif
#if NW_KIND == 0
typedef float NW_T;
#else
typedef unsigned short NW_T;
#endif

__device__ __forceinline__ float half_bits_to_float(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float norm_weight(const NW_T* nw, int i)
{
#if NW_KIND == 0
    return nw[i];
#elif NW_KIND == 1  // bfloat16: the high half of a float
    return __int_as_float(((int)nw[i]) << 16);
#else
    return half_bits_to_float(nw[i]);
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_row(
#if NORM_INPUT  // the float row itself: RMSNorm and int8 quantization of the block's own groups in here
         const float* __restrict__ x, const NW_T* __restrict__ nw, float eps, int K,
#else
         const int* __restrict__ xq, const float* __restrict__ sx, const int* __restrict__ sumx,
#endif
         const int* __restrict__ w, const unsigned short* __restrict__ s, float* __restrict__ out, int N, int NG,
         int accumulate)
{
    constexpr int STEPS = 8 / BITS;              // shift steps a word (four codes a byte lane each)
    constexpr int GW = GROUP * BITS / 32;        // word rows a group
    constexpr unsigned MASK = BITS == 2 ? 0x03030303u : 0x01010101u;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = (blockIdx.x * 32 + lane) * 4;              // this thread's first of 4 columns
    const int g0 = (blockIdx.y * WARPS + warp) * GPW;          // this warp's first group
    const bool col_ok = col < N;
    int4 wv[GPW][GW];                                          // every word this thread needs, requested first
#pragma unroll
    for (int gg = 0; gg < GPW; ++gg)
#pragma unroll
        for (int r = 0; r < GW; ++r)
            wv[gg][r] = (col_ok && g0 + gg < NG)
                ? __ldcs(reinterpret_cast<const int4*>(w + (size_t)((g0 + gg) * GW + r) * N + col))
                : make_int4(0, 0, 0, 0);
#if USE_PDL  // the weights are in flight; the activations and the output are the previous kernel's
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if NORM_INPUT
    static_assert(GROUP == 128, "a lane quantizes 4 values of a group");
    __shared__ int xs[WARPS][GPW][GROUP / 4];                 // the warp's groups as int8 words
    __shared__ float red[WARPS];
    float gscale[GPW];
    int gsum[GPW];
    {
        float ss = 0.f;                                        // the row's sum of squares (every block: rows are short)
        for (int i = threadIdx.x * 4; i < K; i += WARPS * 128) {
            const float4 v = *reinterpret_cast<const float4*>(x + i);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) total += red[k];
        const float rstd = 1.f / sqrtf(total / (float)K + eps);
#pragma unroll
        for (int gg = 0; gg < GPW; ++gg) {
            gscale[gg] = 0.f;
            gsum[gg] = 0;
            const int g = g0 + gg;
            if (g < NG) {                                      // warp-uniform
                const int base = g * GROUP + lane * 4;
                const float4 v = *reinterpret_cast<const float4*>(x + base);
                const float y[4] = {v.x * rstd * norm_weight(nw, base), v.y * rstd * norm_weight(nw, base + 1),
                                    v.z * rstd * norm_weight(nw, base + 2), v.w * rstd * norm_weight(nw, base + 3)};
                float amax = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                const float scale = amax / 127.f;
                const float inv = scale > 0.f ? 1.f / scale : 0.f;
                int q[4], qs = 0;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    q[c] = (int)fminf(fmaxf(floorf(y[c] * inv + 0.5f), -127.f), 127.f);
                    qs += q[c];
                }
                xs[warp][gg][lane] = (q[0] & 255) | ((q[1] & 255) << 8) | ((q[2] & 255) << 16) | ((q[3] & 255) << 24);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) qs += __shfl_xor_sync(0xffffffffu, qs, o);
                gscale[gg] = scale;
                gsum[gg] = qs;
            }
        }
        __syncwarp();
    }
#endif
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int gg = 0; gg < GPW; ++gg) {
        const int g = g0 + gg;
        if (g < NG) {
            int is[4] = {0, 0, 0, 0};
#if FLOOR  // the probe's loads-only variant: the arithmetic replaced by an xor
#pragma unroll
            for (int r = 0; r < GW; ++r) {
                is[0] ^= wv[gg][r].x; is[1] ^= wv[gg][r].y; is[2] ^= wv[gg][r].z; is[3] ^= wv[gg][r].w;
            }
            for (int c = 0; c < 4; ++c) acc[c] += (float)is[c];
#else
#if NORM_INPUT
            const int* xg = xs[warp][gg];
#else
            const int* xg = xq + g * (GROUP / 4);              // the group's activation words (4 int8 each)
#endif
#pragma unroll
            for (int r = 0; r < GW; ++r) {
#pragma unroll
                for (int j = 0; j < STEPS; ++j) {
#if NORM_INPUT
                    const int xw = xg[r * STEPS + j];
#else
                    const int xw = __ldg(xg + r * STEPS + j);
#endif
                    is[0] = __dp4a((int)(((unsigned)wv[gg][r].x >> (BITS * j)) & MASK), xw, is[0]);
                    is[1] = __dp4a((int)(((unsigned)wv[gg][r].y >> (BITS * j)) & MASK), xw, is[1]);
                    is[2] = __dp4a((int)(((unsigned)wv[gg][r].z >> (BITS * j)) & MASK), xw, is[2]);
                    is[3] = __dp4a((int)(((unsigned)wv[gg][r].w >> (BITS * j)) & MASK), xw, is[3]);
                }
            }
#if NORM_INPUT
            const float scale = gscale[gg];
            const int codes_sum = gsum[gg];
#else
            const float scale = __ldg(sx + g);
            const int codes_sum = __ldg(sumx + g);
#endif
            if (col_ok) {
                const uint2 raw = __ldg(reinterpret_cast<const uint2*>(s + (size_t)g * N + col));
                const float sw[4] = {half_bits_to_float(raw.x & 0xffffu), half_bits_to_float(raw.x >> 16),
                                     half_bits_to_float(raw.y & 0xffffu), half_bits_to_float(raw.y >> 16)};
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    acc[c] += (float)(is[c] * MULT - OFFSET * codes_sum) * scale * sw[c];
            }
#endif
        }
    }
    __shared__ float part[WARPS][128];
#pragma unroll
    for (int c = 0; c < 4; ++c) part[warp][lane * 4 + c] = acc[c];
    __syncthreads();
    if (threadIdx.x < 128) {
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) total += part[k][threadIdx.x];
        const int n = blockIdx.x * 128 + threadIdx.x;
        if (n < N) {
            if (gridDim.y > 1) atomicAdd(out + n, total);   // split K: out zeroed or accumulated into
            else if (accumulate) out[n] += total;
            else out[n] = total;
        }
    }
}
"""

GROUP = 128
KINDS = ("tri", "bin")
DEFAULT_CONFIG = (4, 1)  # (warps a block, groups a warp): best or within 4% on 12 of the 16 measured shapes
# Measured on an H100 (tests/perf/cuda_gemv_probe.py, 2026-12-07, µs a call with PDL, graph replays over rotated
# copies; Triton with PDL — today's kernel — in brackets): the best config per (kind, N, K); None where Triton
# stays faster. Shapes not listed take DEFAULT_CONFIG (it beat Triton on 15 of the 16).
MEASURED: dict[tuple[str, int, int], tuple[int, int] | None] = {
    ("tri", 6144, 4096): (4, 1),    # 8B q/k/v      3.73 [4.58]
    ("tri", 4096, 4096): (4, 1),    # 8B o          2.96 [4.07]
    ("tri", 24576, 4096): (4, 1),   # 8B gate/up   11.42 [12.60]
    ("tri", 4096, 12288): (4, 1),   # 8B down       6.02 [7.02]
    ("tri", 7168, 5120): (8, 1),    # 27B q/k/v     4.78 [5.87]
    ("tri", 5120, 5120): (8, 1),    # 27B o         3.76 [5.71]
    ("tri", 34816, 5120): (4, 2),   # 27B gate/up  18.90 [20.74]
    ("tri", 5120, 17408): None,     # 27B down     10.38 [9.88]: Triton's kwarps kernel
    ("bin", 6144, 4096): (4, 1),    # 8B q/k/v      4.08 [4.89] (without PDL; 4.2 with)
    ("bin", 4096, 4096): (4, 1),    # 8B o          3.57 [3.99]
    ("bin", 24576, 4096): (8, 1),   # 8B gate/up    7.64 [8.99]
    ("bin", 4096, 12288): (4, 2),   # 8B down       5.23 [7.46]
    ("bin", 7168, 5120): (4, 2),    # 27B q/k/v     4.87 [5.27]
    ("bin", 5120, 5120): (8, 1),    # 27B o         3.72 [4.93]
    ("bin", 34816, 5120): (4, 1),   # 27B gate/up  12.31 [15.66]
    ("bin", 5120, 17408): (4, 1),   # 27B down      7.62 [9.12]
}


def config_for(kind: str, group_size: int, out_features: int, in_features: int) -> tuple[int, int] | None:
    """(warps, groups a warp) of the CUDA C++ one-row product of this matrix, or None where it does not run it
    (another layout or group size, columns not a multiple of 4, or measured slower than Triton)."""
    if kind not in KINDS or group_size != GROUP or out_features % 4 or in_features % GROUP:
        return None
    return MEASURED.get((kind, out_features, in_features), DEFAULT_CONFIG)


NORM_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # NW_KIND: the RMSNorm weight's dtype


def defines(kind: str, warps: int, gpw: int, pdl: bool, floor: bool = False, norm: int | None = None
            ) -> dict[str, int]:
    """The -D values of one compiled variant; norm: NW_KIND of a variant that takes the float row and normalizes
    and quantizes it itself (None: int8 activations given)."""
    lk = layout_kind(kind)
    return {"BITS": lk.bits, "MULT": lk.mult, "OFFSET": lk.offset, "GROUP": GROUP, "WARPS": warps, "GPW": gpw,
            "FLOOR": int(floor), "USE_PDL": int(pdl), "NORM_INPUT": int(norm is not None), "NW_KIND": norm or 0}


def engine_variants(arch: int) -> list[dict[str, int]]:
    """Every variant the engine may launch on sm_`arch` (what CI compiles): each kind × config × input (int8, or
    the float row with each norm weight dtype), with PDL on sm_90+."""
    configs = sorted({c for c in MEASURED.values() if c is not None} | {DEFAULT_CONFIG})
    pdls = (False, True) if arch >= 90 else (False,)
    norms = (None, *NORM_KINDS.values())
    return [defines(kind, w, g, pdl, norm=n) for kind in KINDS for w, g in configs for pdl in pdls for n in norms]


def enabled(device: torch.device) -> bool:
    """Whether one-row products on `device` may take the CUDA C++ kernel: a CUDA device, not the Triton
    interpreter, BONSAI_CUDA_GEMV not 0, and NVRTC loadable (where it is not, Triton runs; said once)."""
    if getattr(device, "type", None) != "cuda" or os.environ.get("BONSAI_CUDA_GEMV", "1") == "0":
        return False
    from quant.kernels import interpreting
    return not interpreting() and _nvrtc_ready()


@functools.cache
def _nvrtc_ready() -> bool:
    from quant.kernels.cuda_rt import CudaCompileError, nvrtc
    try:
        nvrtc()
        return True
    except CudaCompileError as e:
        log.warning("one-row products run on Triton: %s", str(e).splitlines()[0])
        return False


def norm_input_taken(x: torch.Tensor, norm_weight: torch.Tensor, pw: PackedWeight) -> bool:
    """Whether the decode step hands this product its float row with the norm (cuda_norm_gemv) instead of int8
    activations from a quantization kernel: one row on the CUDA C++ path of this matrix, the fusion not turned off
    (BONSAI_CUDA_NORM_GEMV=0), a float32 row aligned for 16-byte loads."""
    if x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_contiguous() or x.data_ptr() % 16:
        return False
    if norm_weight.dtype not in NORM_KINDS or not norm_weight.is_contiguous():
        return False
    if os.environ.get("BONSAI_CUDA_NORM_GEMV", "1") == "0" or not enabled(x.device):
        return False
    return config_for(pw.kind, pw.group_size, pw.out_features, pw.in_features) is not None


def describe(kind: str, group_size: int, out_features: int, in_features: int) -> str | None:
    """What `bonsai bench` reports for the CUDA C++ path of this matrix ("cuda w4 g1 split 8"), None if not taken."""
    config = config_for(kind, group_size, out_features, in_features)
    if config is None:
        return None
    return f"cuda w{config[0]} g{config[1]} split {_splits(in_features // GROUP, *config)}"


def _splits(num_groups: int, warps: int, gpw: int) -> int:
    return -(-num_groups // (warps * gpw))


@functools.cache
def _kernel(device_index: int, kind: str, warps: int, gpw: int, pdl: bool, norm: int | None = None):
    from quant.kernels.cuda_rt import CudaKernel, compile_cubin
    with torch.cuda.device(device_index):
        major, minor = torch.cuda.get_device_capability(device_index)
        cubin = compile_cubin(SOURCE, 10 * major + minor, defines(kind, warps, gpw, pdl, norm=norm),
                              name=f"gemv_row_{kind}.cu")
        return CudaKernel(cubin, "gemv_row")


def cuda_gemv(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
              out: torch.Tensor | None = None, accumulate: bool = False,
              config: tuple[int, int] | None = None) -> torch.Tensor:
    """y [1, N] float32 = x Wᵀ for one row of int8 activations (xq [1, K], sx / sumx [1, K/G]); with accumulate,
    out += y. Launched on torch's current stream of xq's device (captured into graphs), with PDL where the Triton
    kernels use it. config: (warps, groups a warp), else config_for's."""
    assert xq.shape[0] == 1 and xq.dtype == torch.int8 and sx.dtype == torch.float32 and sumx.dtype == torch.int32
    return _launch(xq, pw, out, accumulate, config, None, [xq, sx, sumx], [])


def cuda_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, pw: PackedWeight,
                   out: torch.Tensor | None = None, accumulate: bool = False,
                   config: tuple[int, int] | None = None) -> torch.Tensor:
    """y [1, N] float32 = RMSNorm(x)·w quantized to int8 per group, times Wᵀ, in one launch (no activation
    quantization kernel before it): x float32 [1, K] contiguous, norm_weight [K] float32 / bfloat16 / float16.
    Equal to packed_gemv_reference(*quantize_activations_reference(x, 128, norm_weight, eps), pw) up to the
    float rounding of the row's sum of squares."""
    from quant.kernels.cuda_rt import f32
    assert x.shape[0] == 1 and x.dtype == torch.float32 and x.is_contiguous() and x.data_ptr() % 16 == 0
    assert norm_weight.is_contiguous() and norm_weight.numel() == x.shape[1]
    return _launch(x, pw, out, accumulate, config, NORM_KINDS[norm_weight.dtype], [x, norm_weight], [f32(eps)])


def _launch(x: torch.Tensor, pw: PackedWeight, out, accumulate: bool, config, norm: int | None,
            tensors: list[torch.Tensor], scalars: list) -> torch.Tensor:
    from quant.kernels import pdl_enabled
    from quant.kernels.cuda_rt import i32, ptr
    from quant.kernels.gemv_parts import result_buffer
    k = x.shape[1]
    warps, gpw = config or config_for(pw.kind, pw.group_size, pw.out_features, pw.in_features) or DEFAULT_CONFIG
    assert k == pw.in_features and pw.group_size == GROUP and x.is_contiguous() and pw.words.is_contiguous()
    assert pw.words.data_ptr() % 16 == 0 and pw.scales.data_ptr() % 8 == 0 and pw.out_features % 4 == 0
    assert pw.scales.dtype == torch.float16
    ng, n = k // GROUP, pw.out_features
    grid = (-(-n // 128), _splits(ng, warps, gpw))
    out = result_buffer(out, 1, n, x.device, accumulate, grid[1])
    assert out.is_contiguous() and out.dtype == torch.float32
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    pdl = pdl_enabled(x.device)
    kernel = _kernel(device, pw.kind, warps, gpw, pdl, norm)
    args = ([ptr(t) for t in tensors] + scalars + ([i32(k)] if norm is not None else [])
            + [ptr(pw.words), ptr(pw.scales), ptr(out), i32(n), i32(ng), i32(accumulate)])
    kernel.launch(grid, (warps * 32,), args, pdl=pdl, stream=torch.cuda.current_stream(x.device).cuda_stream)
    return out

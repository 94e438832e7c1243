// The one-row packed GEMV of quant/kernels/cuda_gemv.py, compiled by NVRTC at run time and specialised by -D
// defines (BITS MULT OFFSET GROUP WARPS GPW FLOOR USE_PDL INPUT NW_KIND: cuda_gemv.defines).
// No #include: NVRTC has no system headers.
#ifndef INPUT
#define INPUT 0     // 0: int8 activations given; 1: the float row, RMSNorm'd here; 2: [gate | up] rows, SwiGLU here;
#endif              // 3: a split attention's partials, combined here (a group is a head)
#ifndef NW_KIND
#define NW_KIND 0   // the norm weight: 0 float32, 1 bfloat16, 2 float16 (INPUT 3: the dtype the heads are rounded to)
#endif
#define NEG_INF __int_as_float(0xff800000)             // -infinity (no math.h under NVRTC)
#define SPLITS_IN_FLIGHT 16                            // INPUT 3: partial rows a lane requests at once
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

__device__ __forceinline__ float round_to_kind(float f)  // to NW_KIND's dtype and back (nearest even)
{
    unsigned short h;
#if NW_KIND == 2
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return half_bits_to_float(h);
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return __int_as_float(((int)h) << 16);
#endif
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

#if INPUT == 3
// Query head g's output from its splits' partials (flash-decoding's last step, as engine.kernels.cuda_attention's
// last block does it): lane s < ns reads split s's max and sum, every lane its 4 dims of each split's output (all
// requested before the first is used), the splits weighted by 2^(max_s - max), divided by the weighted sum and
// rounded to NW_KIND's dtype. Partial [kv head, split, head of the group (gp padded), dim].
__device__ __forceinline__ void combine_splits(const float* __restrict__ part, const float* __restrict__ ml, int ns,
                                               int group, int gp, int g, int lane, float y[4])
{
    const int kvh = g / group;
    const long long row0 = (long long)kvh * ns * gp + (g - kvh * group);  // split s: row0 + s·gp
    float ms = NEG_INF, ls = 0.f;
    if (lane < ns) {
        ms = __ldcg(ml + (row0 + (long long)lane * gp) * 2);
        ls = __ldcg(ml + (row0 + (long long)lane * gp) * 2 + 1);
    }
    const float* prow = part + row0 * GROUP + lane * 4;
    float4 r[SPLITS_IN_FLIGHT];
#pragma unroll
    for (int j = 0; j < SPLITS_IN_FLIGHT; ++j)
        r[j] = j < ns ? __ldcg(reinterpret_cast<const float4*>(prow + (long long)j * gp * GROUP))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
    float mx = ms;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float base = mx == NEG_INF ? 0.f : mx;
    const float f = lane < ns ? exp2f(ms - base) : 0.f;
    float total = ls * f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    float o4[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = 0; c0 < ns; c0 += SPLITS_IN_FLIGHT) {
        if (c0) {
#pragma unroll
            for (int j = 0; j < SPLITS_IN_FLIGHT; ++j)
                r[j] = c0 + j < ns ? __ldcg(reinterpret_cast<const float4*>(prow + (long long)(c0 + j) * gp * GROUP))
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < SPLITS_IN_FLIGHT; ++j) {
            const float fs = __shfl_sync(0xffffffffu, f, (c0 + j) & 31);
            o4[0] += r[j].x * fs; o4[1] += r[j].y * fs; o4[2] += r[j].z * fs; o4[3] += r[j].w * fs;
        }
    }
    total = total > 0.f ? total : 1.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) y[c] = round_to_kind(o4[c] / total);
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_row(
#if INPUT == 3  // a split attention's partials [KV, ns, gp, GROUP] and their (max, sum) [KV, ns, gp, 2]
         const float* __restrict__ x, const float* __restrict__ ml, int ns, int group, int gp, int K,
         float* __restrict__ zero, int zero_n,
#elif INPUT  // float rows: each warp makes the int8 activations of its own groups (norm or SwiGLU first)
         const float* __restrict__ x, const NW_T* __restrict__ nw, float eps, int K, float* __restrict__ zero,
         int zero_n,
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
#if INPUT
    static_assert(GROUP == 128, "a lane quantizes 4 values of a group");
    __shared__ int xs[WARPS][GPW][GROUP / 4];                 // the warp's groups as int8 words
    float gscale[GPW];
    int gsum[GPW];
    {
        // a buffer the caller wants zeroed once every earlier kernel is done with it (split-K targets)
        const int threads = gridDim.x * gridDim.y * WARPS * 32;
        for (int i = (blockIdx.y * gridDim.x + blockIdx.x) * WARPS * 32 + threadIdx.x; i < zero_n; i += threads)
            zero[i] = 0.f;
#if INPUT == 1
        __shared__ float red[WARPS];
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
#endif
#pragma unroll
        for (int gg = 0; gg < GPW; ++gg) {
            gscale[gg] = 0.f;
            gsum[gg] = 0;
            const int g = g0 + gg;
            if (g < NG) {                                      // warp-uniform
#if INPUT == 3
                float y[4];
                combine_splits(x, ml, ns, group, gp, g, lane, y);
#else
                const int base = g * GROUP + lane * 4;
                const float4 v = *reinterpret_cast<const float4*>(x + base);
#if INPUT == 1
                const float y[4] = {v.x * rstd * norm_weight(nw, base), v.y * rstd * norm_weight(nw, base + 1),
                                    v.z * rstd * norm_weight(nw, base + 2), v.w * rstd * norm_weight(nw, base + 3)};
#else
                const float4 u = *reinterpret_cast<const float4*>(x + K + base);
                const float y[4] = {v.x / (1.f + __expf(-v.x)) * u.x, v.y / (1.f + __expf(-v.y)) * u.y,
                                    v.z / (1.f + __expf(-v.z)) * u.z, v.w / (1.f + __expf(-v.w)) * u.w};
#endif
#endif
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
#if INPUT
            const int* xg = xs[warp][gg];
#else
            const int* xg = xq + g * (GROUP / 4);              // the group's activation words (4 int8 each)
#endif
#pragma unroll
            for (int r = 0; r < GW; ++r) {
#pragma unroll
                for (int j = 0; j < STEPS; ++j) {
#if INPUT
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
#if INPUT
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

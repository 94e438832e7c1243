// The defines and device helpers of cuda_attention_row.cu (engine/kernels/cuda_attention.py puts this file before
// it: NVRTC has no include path here). One decode row's attention block in one launch: q/k RMSNorm, rotary, the
// row's K/V written to the cache, attention over the cache split across blocks, the splits combined by the last
// block of each kv head, the output rounded to the cache's dtype and quantized to int8 per head for o_proj.
// Compiled by NVRTC and specialised by -D defines (D GP HAS_NORM NW_KIND CACHE_KIND USE_PDL FENCE TRIGGER CLUSTER
// COMBINE, cuda_attention.defines; STAMPS for tests/perf).
// No #include: NVRTC has no system headers.
#define WARPS 8
#define DPL (D / 32)                                     // dims of a head a lane holds
#define U 4                                              // keys a warp scores at a time (short chains)
#define WPH (WARPS / GP)                                 // warps a head in the combine
#define P (GP * U)                                       // (head, key) pairs a warp scores at a time: <= 32
static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
static_assert(P <= 32 && (P & (P - 1)) == 0 && GP * D <= 1024, "query heads a kv head: 1, 2, 4 or 8 (padded)");

#if NW_KIND == 0
typedef float NW_T;
#else
typedef unsigned short NW_T;
#endif
typedef unsigned short bits16;
#define NEG_INF __int_as_float(0xff800000)             // -infinity (no math.h under NVRTC)

__device__ __forceinline__ float half_to_float(bits16 h)
{
#if CACHE_KIND == 1  // bfloat16: the high half of a float
    return __int_as_float(((int)h) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ bits16 float_to_half(float f)  // round to nearest even, as torch's .to(dtype)
{
    bits16 h;
#if CACHE_KIND == 1
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

__device__ __forceinline__ float norm_weight(const NW_T* nw, int i)
{
#if NW_KIND == 0
    return nw[i];
#elif NW_KIND == 1
    return __int_as_float(((int)nw[i]) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(nw[i]));
    return f;
#endif
}

struct Row { unsigned w[DPL / 2]; };                     // a lane's DPL values of a cache row
struct Part { float v[DPL]; };                           // a lane's DPL values of a split's partial output

__device__ __forceinline__ Part load_part(const float* p)  // from L2 (written by the other blocks)
{
    Part r;
#pragma unroll
    for (int j = 0; j < DPL; j += 4 < DPL ? 4 : DPL) {
#if DPL >= 4
        const float4 v = __ldcg(reinterpret_cast<const float4*>(p + j));
        r.v[j] = v.x; r.v[j + 1] = v.y; r.v[j + 2] = v.z; r.v[j + 3] = v.w;
#else
        const float2 v = __ldcg(reinterpret_cast<const float2*>(p + j));
        r.v[j] = v.x; r.v[j + 1] = v.y;
#endif
    }
    return r;
}                     // a lane's DPL values of a cache row

__device__ __forceinline__ Row load_row(const bits16* p)
{
    Row r;
#if DPL == 8
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
#elif DPL == 4
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    r.w[0] = v.x; r.w[1] = v.y;
#else
    r.w[0] = __ldcs(reinterpret_cast<const unsigned*>(p));
#endif
    return r;
}

__device__ __forceinline__ float row_value(const Row& r, int j)
{
    return half_to_float((bits16)(j & 1 ? r.w[j >> 1] >> 16 : r.w[j >> 1] & 0xffffu));
}

__device__ __forceinline__ void store_row(bits16* p, const unsigned* w)  // a lane's DPL values, two a word
{
    Row r;
#pragma unroll
    for (int j = 0; j < DPL / 2; ++j) r.w[j] = w[j];
#if DPL == 8
    *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
#elif DPL == 4
    *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
#else
    *reinterpret_cast<unsigned*>(p) = r.w[0];
#endif
}

// one halving step of a warp's reduce-scatter: lanes with bit HALF set keep values [HALF, 2·HALF), the others
// [0, HALF), each adding its partner's; after the steps HALF = P/2 … 1, lane l holds value (l & (P-1)) summed over P
// lanes. A template a step, so every index is a constant and the values stay in registers.
template <int HALF>
__device__ __forceinline__ void reduce_stage(float* sp, int lane)
{
    const bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float send = upper ? sp[i] : sp[i + HALF];
        const float keep = upper ? sp[i + HALF] : sp[i];
        sp[i] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
    }
}

#ifndef COMBINE
#define COMBINE 1  // 0: each block writes its split's partial and ends; o_proj's product combines (cuda_gemv INPUT 3)
#endif
#ifndef CLUSTER
#define CLUSTER 0  // 1 (sm_90): a kv head's splits are one thread-block cluster; partials stay in shared memory
#endif
#if CLUSTER
static_assert(COMBINE, "a cluster combines its splits itself");
// another block's shared memory in the cluster (distributed shared memory)
__device__ __forceinline__ unsigned cluster_addr(const void* local, int rank)
{
    unsigned a, r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(local));
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}

__device__ __forceinline__ float cluster_load(const float* local, int rank)
{
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(local, rank)));
    return v;
}

__device__ __forceinline__ Part cluster_part(const float* local, int rank)  // a lane's DPL values of a partial
{
    Part r;
#pragma unroll
    for (int j = 0; j < DPL; ++j) r.v[j] = cluster_load(local + j, rank);
    return r;
}

__device__ __forceinline__ void cluster_sync()  // every block's earlier shared-memory writes seen by all
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif
#ifndef FENCE
#define FENCE 1    // the splits' hand-off: 0 every thread fences before the counter and the last block after it;
#endif             // 1 thread 0's counter add is an acq_rel atomic (fences are cumulative; the barriers carry it)
#ifndef TRIGGER
#define TRIGGER 0  // PDL: 0 the next kernel may launch as this one starts; 1 once each block's partial is written
#endif
#ifndef STAMPS
#define STAMPS 0  // 1: thread 0 of each block records clock64() at the phase boundaries (tests/perf, not the engine)
#endif
#if STAMPS
#define STAMP(i) if (threadIdx.x == 0) stamps[(blockIdx.y * gridDim.x + blockIdx.x) * 8 + (i)] = clock64()
#else
#define STAMP(i)
#endif


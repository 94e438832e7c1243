// The kernel of engine/kernels/cuda_attention.py (one decode row's attention block in one launch), compiled by NVRTC
// after cuda_attention_parts.cuh (its defines and device helpers), specialised by -D defines.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
rope_attention_row(float* __restrict__ qkv, const int* __restrict__ pos_ptr, const int* __restrict__ slot_ptr,
                   const float* __restrict__ inv_freq, const NW_T* __restrict__ q_norm,
                   const NW_T* __restrict__ k_norm, float eps, bits16* __restrict__ k_cache,
                   bits16* __restrict__ v_cache, long long k_stride_slot, long long k_stride_head,
                   long long k_stride_pos, long long v_stride_slot, long long v_stride_head, long long v_stride_pos,
                   int max_seq, int num_heads, int group, float scale_log2, float* __restrict__ part,
                   float* __restrict__ ml, int* __restrict__ counter, signed char* __restrict__ xq,
                   float* __restrict__ sx, int* __restrict__ sumx, int zero_input, int prefetch,
                   long long* __restrict__ stamps)
{
    STAMP(0);
#if STAMPS
    if (threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        stamps[(blockIdx.y * gridDim.x + blockIdx.x) * 8 + 7] = (long long)t;
    }
#endif
    const int kvh = blockIdx.x, split = blockIdx.y, ns = gridDim.y, nkv = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // the step's inputs are copied in before the graph (or the step) starts: readable before the PDL wait
    const int pos = pos_ptr[0];
    const long long slot = slot_ptr[0];
    const int cached = min(pos, max_seq);                  // keys read from the cache
    const int keys = cached + (pos < max_seq ? 1 : 0);     // and the row's own key, where the cache has its place
    const int per = (keys + ns - 1) / ns;
    const int start = min(split * per, keys), end = min(start + per, keys);
    const bool owner = start <= cached && cached < end;    // this block scores the row's own key and writes K/V
    const bits16* kbase = k_cache + slot * k_stride_slot + kvh * k_stride_head;
    const bits16* vbase = v_cache + slot * v_stride_slot + kvh * v_stride_head;
    if (prefetch) {  // the split's cached rows into L2 while the previous kernel finishes (L2 is coherent)
        constexpr int LINES = D * 2 / 128;                 // 128-byte lines a row
        const int rows = max(min(end, cached) - start, 0);
        for (int i = threadIdx.x; i < rows * LINES; i += WARPS * 32) {
            const long long key = start + i / LINES, off = (i % LINES) * 64;
            asm volatile("prefetch.global.L2 [%0];" :: "l"(kbase + key * k_stride_pos + off));
            asm volatile("prefetch.global.L2 [%0];" :: "l"(vbase + key * v_stride_pos + off));
        }
    }
    // the rotary angles of this lane's dims (the same for every head): dim i pairs with i + D/2
    const bool first = lane < 16;
    float rc[DPL], rs[DPL];
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
        float sn, cs;
        sincosf((float)pos * inv_freq[lane * DPL + j - (first ? 0 : D / 2)], &sn, &cs);
        rs[j] = sn;
        rc[j] = cs;
    }
#if HAS_NORM
    float qw[DPL], kw[DPL];                                // the q/k norm weights of this lane's dims (constants)
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
        qw[j] = norm_weight(q_norm, lane * DPL + j);
        kw[j] = norm_weight(k_norm, lane * DPL + j);
    }
#endif
#if USE_PDL
#if TRIGGER == 0
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    STAMP(1);
    __shared__ float qs[GP][D];                            // the group's queries, rounded, times scale·log2(e)
    __shared__ unsigned own[2][D / 2];                     // the row's own key and value in the cache's format
    // tasks: the row's k and v (the owner block only), then the group's q heads; padded heads are zeros
    for (int task = warp + (owner ? 0 : 2); task < GP + 2; task += WARPS) {
        const int h = task - 2;                            // q head of the group (task >= 2)
        if (h >= group) {
#pragma unroll
            for (int j = 0; j < DPL; ++j) qs[h][lane * DPL + j] = 0.f;
            continue;
        }
        const int head = task == 0 ? num_heads + kvh : task == 1 ? num_heads + nkv + kvh : kvh * group + h;
        const float* src = qkv + (long long)head * D + lane * DPL;
        float a[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) a[j] = src[j];
        if (task != 1) {                                   // q or k: RMSNorm over the head, then rotary
#if HAS_NORM
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < DPL; ++j) ss += a[j] * a[j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            const float rstd = 1.f / sqrtf(ss / (float)D + eps);
#pragma unroll
            for (int j = 0; j < DPL; ++j) a[j] = a[j] * rstd * (task == 0 ? kw[j] : qw[j]);
#endif
#pragma unroll
            for (int j = 0; j < DPL; ++j) {
                const float b = __shfl_xor_sync(0xffffffffu, a[j], 16);
                a[j] = first ? a[j] * rc[j] - b * rs[j] : a[j] * rc[j] + b * rs[j];
            }
        }
        if (task >= 2) {
#pragma unroll
            for (int j = 0; j < DPL; ++j) qs[h][lane * DPL + j] = half_to_float(float_to_half(a[j])) * scale_log2;
        } else {
            unsigned w[DPL / 2];                           // rounded as the cache holds it
#pragma unroll
            for (int j = 0; j < DPL / 2; ++j) {
                w[j] = (unsigned)float_to_half(a[2 * j]) | ((unsigned)float_to_half(a[2 * j + 1]) << 16);
                own[task][lane * (DPL / 2) + j] = w[j];
            }
            if (pos < max_seq) {
                bits16* dst = task == 0 ? k_cache + slot * k_stride_slot + kvh * k_stride_head + pos * k_stride_pos
                                        : v_cache + slot * v_stride_slot + kvh * v_stride_head + pos * v_stride_pos;
                store_row(dst + lane * DPL, w);
            }
        }
    }
    __syncthreads();
    STAMP(2);

    float q[GP][DPL];
#pragma unroll
    for (int h = 0; h < GP; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) q[h][j] = qs[h][lane * DPL + j];
    const int pair = lane & (P - 1), ph = pair / U, pu = pair % U;  // the (head, key) whose score this lane keeps
    float m_run = NEG_INF, l_run = 0.f;                    // of head ph
    float acc[GP][DPL];
#pragma unroll
    for (int h = 0; h < GP; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
    for (int k0 = start + warp * U; k0 < end; k0 += WARPS * U) {
        Row kr[U], vr[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {                      // every row of the chunk requested first
            const int key = k0 + u;
            if (key < cached && key < end) {
                kr[u] = load_row(kbase + key * k_stride_pos + lane * DPL);
                vr[u] = load_row(vbase + key * v_stride_pos + lane * DPL);
            } else if (key == cached && key < end) {       // the row's own key (not read back from the cache)
#pragma unroll
                for (int j = 0; j < DPL / 2; ++j) {
                    kr[u].w[j] = own[0][lane * (DPL / 2) + j];
                    vr[u].w[j] = own[1][lane * (DPL / 2) + j];
                }
            } else {
#pragma unroll
                for (int j = 0; j < DPL / 2; ++j) kr[u].w[j] = vr[u].w[j] = 0u;
            }
        }
        float sp[P];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[DPL];
#pragma unroll
            for (int j = 0; j < DPL; ++j) kf[j] = row_value(kr[u], j);
#pragma unroll
            for (int h = 0; h < GP; ++h) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < DPL; ++j) dot += q[h][j] * kf[j];
                sp[h * U + u] = dot;
            }
        }
        // reduce-scatter: after the halving steps lane l holds pair (l & (P-1)) summed over P lanes ...
        if constexpr (P >= 32) reduce_stage<16>(sp, lane);
        if constexpr (P >= 16) reduce_stage<8>(sp, lane);
        if constexpr (P >= 8) reduce_stage<4>(sp, lane);
        if constexpr (P >= 4) reduce_stage<2>(sp, lane);
        if constexpr (P >= 2) reduce_stage<1>(sp, lane);
        float s = sp[0];
#pragma unroll
        for (int o = P; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);  // ... then over all 32
        if (k0 + pu >= end) s = NEG_INF;
        float cmax = s;
#pragma unroll
        for (int o = 1; o < U; o <<= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, o));
        const float m_new = fmaxf(m_run, cmax);
        const float base = m_new == NEG_INF ? 0.f : m_new;
        const float alpha = exp2f(m_run - base);
        const float p = exp2f(s - base);
        float psum = p;
#pragma unroll
        for (int o = 1; o < U; o <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
        l_run = l_run * alpha + psum;
        m_run = m_new;
        const float pv = half_to_float(float_to_half(p));  // p in the values' dtype for p·v, as the Triton kernel
#pragma unroll
        for (int h = 0; h < GP; ++h) {
            const float ah = __shfl_sync(0xffffffffu, alpha, h * U);
#pragma unroll
            for (int j = 0; j < DPL; ++j) acc[h][j] *= ah;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float v[DPL];
#pragma unroll
            for (int j = 0; j < DPL; ++j) v[j] = row_value(vr[u], j);
#pragma unroll
            for (int h = 0; h < GP; ++h) {
                const float pk = __shfl_sync(0xffffffffu, pv, h * U + u);
#pragma unroll
                for (int j = 0; j < DPL; ++j) acc[h][j] += pk * v[j];
            }
        }
    }

    // the block's partial: the warps' (max, sum, output) merged per head, then written for the combine
    __shared__ float wm[WARPS][GP], wl[WARPS][GP];
    __shared__ float wacc[WARPS][GP][D];
#if CLUSTER
    __shared__ float cpart[GP][D], cml[GP][2];            // this block's partial, read by the cluster's blocks
#endif
    if (lane < P && pu == 0) {
        wm[warp][ph] = m_run;
        wl[warp][ph] = l_run;
    }
#pragma unroll
    for (int h = 0; h < GP; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) wacc[warp][h][lane * DPL + j] = acc[h][j];
    __syncthreads();
    STAMP(3);
    for (int h = warp; h < group; h += WARPS) {
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, wm[w][h]);
        const float base = mx == NEG_INF ? 0.f : mx;
        float total = 0.f, o[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) o[j] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = exp2f(wm[w][h] - base);
            total += wl[w][h] * f;
#pragma unroll
            for (int j = 0; j < DPL; ++j) o[j] += wacc[w][h][lane * DPL + j] * f;
        }
#if CLUSTER
#pragma unroll
        for (int j = 0; j < DPL; ++j) cpart[h][lane * DPL + j] = o[j];
        if (lane == 0) {
            cml[h][0] = mx;
            cml[h][1] = total;
        }
#else
        const long long at = ((long long)kvh * ns + split) * GP + h;
#pragma unroll
        for (int j = 0; j < DPL; ++j) part[at * D + lane * DPL + j] = o[j];
        if (lane == 0) {
            ml[at * 2] = mx;
            ml[at * 2 + 1] = total;
        }
#endif
    }
#if !COMBINE  // o_proj's product combines the splits after its PDL wait (this grid's writes are visible then)
#if USE_PDL && TRIGGER == 1
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    STAMP(6);
    return;
#endif
#if CLUSTER
    cluster_sync();                                        // every split's partial is in its block's shared memory
    STAMP(4);
    STAMP(5);
    // block r of the cluster combines head r (group <= splits): its 8 warps read one split each
    const int ch = split, sub = warp;
    constexpr int STRIDE = WARPS;
#define PART_ML(s, h, k) cluster_load(&cml[h][k], s)
#define PART_ROW(s, h) cluster_part(&cpart[h][lane * DPL], s)
#else
#if FENCE == 0
    __threadfence();
#endif
    __syncthreads();
#if USE_PDL && TRIGGER == 1
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    STAMP(4);
    __shared__ int last;
    if (threadIdx.x == 0) {
#if FENCE == 0
        last = atomicAdd(counter + kvh, 1) == ns - 1;
#else
        int prev;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counter + kvh) : "memory");
        last = prev == ns - 1;
#endif
    }
    __syncthreads();
    STAMP(5);
#if STAMPS
    if (!last && threadIdx.x == 0) stamps[(blockIdx.y * gridDim.x + blockIdx.x) * 8 + 6] = 0;
#endif
    if (!last) return;
#if FENCE == 0
    __threadfence();
#endif

    const int ch = warp / WPH, sub = warp % WPH;
    constexpr int STRIDE = WPH;
#define PART_ML(s, h, k) __ldcg(ml + (((long long)kvh * ns + (s)) * GP + (h)) * 2 + (k))
#define PART_ROW(s, h) load_part(part + (((long long)kvh * ns + (s)) * GP + (h)) * D + lane * DPL)
#endif
    // the last block of this kv head: the splits combined, rounded to the cache's dtype, int8 per head (group D).
    // STRIDE warps a head: each sums every STRIDE-th split (all its loads in flight), then the first adds the others'
    float total = 0.f;
    if (ch < group) {
        float ms = NEG_INF, ls = 0.f;                    // lane s < ns: split s's max and sum
        if (lane < ns) {
            ms = PART_ML(lane, ch, 0);
            ls = PART_ML(lane, ch, 1);
        }
        float mx = ms;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float base = mx == NEG_INF ? 0.f : mx;
        const float f = lane < ns ? exp2f(ms - base) : 0.f;
        total = ls * f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        float o[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) o[j] = 0.f;
#pragma unroll 16
        for (int s = sub; s < ns; s += STRIDE) {
            const float fs = __shfl_sync(0xffffffffu, f, s);
            const Part pv = PART_ROW(s, ch);
#pragma unroll
            for (int j = 0; j < DPL; ++j) o[j] += pv.v[j] * fs;
        }
#pragma unroll
        for (int j = 0; j < DPL; ++j) wacc[warp][0][lane * DPL + j] = o[j];
    }
    __syncthreads();
    if (ch < group && sub == 0) {
        float o[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            o[j] = 0.f;
#pragma unroll
            for (int w = 0; w < STRIDE; ++w) o[j] += wacc[warp + w][0][lane * DPL + j];
        }
        total = total > 0.f ? total : 1.f;
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            o[j] = half_to_float(float_to_half(o[j] / total));
            amax = fmaxf(amax, fabsf(o[j]));
        }
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, sh));
        const float scale = amax / 127.f;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        int qsum = 0;
        unsigned packed[(DPL + 3) / 4] = {};
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int c = (int)fminf(fmaxf(floorf(o[j] * inv + 0.5f), -127.f), 127.f);
            packed[j / 4] |= (unsigned)(c & 255) << (8 * (j % 4));
            qsum += c;
        }
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, sh);
        const int hg = kvh * group + ch;
        signed char* dst = xq + (long long)hg * D + lane * DPL;
#if DPL == 8
        *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
#elif DPL == 4
        *reinterpret_cast<unsigned*>(dst) = packed[0];
#else
        *reinterpret_cast<unsigned short*>(dst) = (unsigned short)packed[0];
#endif
        if (lane == 0) {
            sx[hg] = scale;
            sumx[hg] = qsum;
        }
    }
#if CLUSTER
    cluster_sync();                                        // no block leaves while another reads its shared memory
    if (zero_input && split == 0) {  // the split-K q/k/v buffer left at zero for the next step's product
#else
    if (zero_input) {  // the split-K q/k/v buffer left at zero for the next step's product
#endif
        for (int i = threadIdx.x; i < group * D; i += WARPS * 32) qkv[(long long)kvh * group * D + i] = 0.f;
        for (int i = threadIdx.x; i < D; i += WARPS * 32) {
            qkv[(long long)(num_heads + kvh) * D + i] = 0.f;
            qkv[(long long)(num_heads + nkv + kvh) * D + i] = 0.f;
        }
    }
#if !CLUSTER
    if (threadIdx.x == 0) counter[kvh] = 0;                // ready for the next launch
#endif
    STAMP(6);
}
